/*
 * task.c — the scheduler: tasks as Lua coroutines on one libev loop, and the module
 * moonbox.core that exposes its primitives (spawn, join, cancel, sleep, deadlines, conds, run).
 *
 * One place resumes coroutines: drain_cb, an ev_prepare watcher that empties the run queue
 * before the loop polls. Everything else (libev/libcurl/MHD callbacks, cancel, deadlines) only
 * marks a task ready and queues it. A task body runs under a protected call made *inside* its
 * coroutine (task_entry), so an error or a cancellation unwinds `<close>` variables in a context
 * that can still yield; lua_resume never sees a Lua error except on memory exhaustion.
 *
 * This file owns tasks, parking, the drain, core.run, shutdown and the registry-ref leak
 * check. The scheduler's other concerns are beside it, sharing task_internal.h: deadlines and
 * sleep (task_deadline.c), conditions (task_cond.c), signals (task_signal.c), process facts
 * such as stats and isatty (task_facts.c). The higher-level API (scope, all, race, map,
 * semaphore) is Lua, in lua/moonbox/task.lua, built only on what these files export.
 */
#include "mb.h"
#include "task_internal.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TASK_MT "moonbox.Task"
#define RT_KEY  "moonbox.runtime"

/* Uservalue slots of a task userdata. */
#define UV_THREAD 1
#define UV_DATA   2

/* Resumes per drain wave: new wake-ups beyond this wait one poll, so I/O is never starved. */
#define DRAIN_BATCH_MAX 4096

typedef struct mb_deferred {
    mb_defer_fn fn;
    void *ud;
    struct mb_deferred *next;
} mb_deferred;

/* The process's runtime: libev's default loop (needed for child watchers) is one per process,
 * so there is one runtime, found here without a registry look-up. */
static mb_runtime *g_rt;

static void drain_cb(struct ev_loop *loop, ev_prepare *w, int revents);
static void spin_cb(struct ev_loop *loop, ev_idle *w, int revents);

/* ---- runtime -------------------------------------------------------------------------------- */

/* Returns the runtime of L's state (kept in the registry under RT_KEY), creating it on first
 * use: on libev's default loop, with the drain watcher started but unref'd (so that it alone
 * never keeps the loop alive and a deadlock is detected), the spin watcher ready, SIGPIPE
 * ignored, and, when LUA_EXTRASPACE was not zeroed by mb_main_state, the weak moonbox.threads
 * table through which tasks are found instead. Leaves the stack as it was. Raises (luaL_error)
 * if memory or the default loop cannot be had; nothing is kept then. Never yields. */
mb_runtime *mb_runtime_get(lua_State *L)
{
    mb_runtime *rt;
    lua_getfield(L, LUA_REGISTRYINDEX, RT_KEY);
    rt = (mb_runtime *)lua_touserdata(L, -1);
    lua_pop(L, 1);
    if (rt) return rt;

    rt = (mb_runtime *)calloc(1, sizeof *rt);
    if (!rt) luaL_error(L, "moonbox: out of memory creating the runtime");
    rt->loop = ev_default_loop(EVFLAG_AUTO);
    if (!rt->loop) {
        free(rt);
        luaL_error(L, "moonbox: libev could not create its default loop (is LIBEV_FLAGS set?)");
    }
    lua_State *main;
    lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);
    main = lua_tothread(L, -1);
    lua_pop(L, 1);
    rt->L = main;
    /* Only the moonbox binary zeroes LUA_EXTRASPACE before any coroutine exists (mb_main_state);
     * loaded into plain lua5.4, coroutines made before this point hold garbage there, so tasks
     * are then found through a weak registry table instead. */
    lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.extraspace_zeroed");
    rt->extraspace_ok = lua_toboolean(L, -1);
    lua_pop(L, 1);
    if (!rt->extraspace_ok) {
        lua_newtable(L);
        lua_createtable(L, 0, 1);
        lua_pushliteral(L, "k");
        lua_setfield(L, -2, "__mode");
        lua_setmetatable(L, -2);
        lua_setfield(L, LUA_REGISTRYINDEX, "moonbox.threads");
    }
    rt->next_task_id = 1;
    ev_prepare_init(&rt->drain_watcher, drain_cb);
    rt->drain_watcher.data = rt;
    ev_prepare_start(rt->loop, &rt->drain_watcher);
    ev_unref(rt->loop); /* the drain alone must not keep the loop alive (deadlock detection) */
    ev_idle_init(&rt->spin_watcher, spin_cb);
    rt->spin_watcher.data = rt;
    /* A peer that closes a socket must give EPIPE, not kill the process. */
    signal(SIGPIPE, SIG_IGN);
    lua_pushlightuserdata(L, rt);
    lua_setfield(L, LUA_REGISTRYINDEX, RT_KEY);
    g_rt = rt;
    return rt;
}

/* ---- registry refs ----------------------------------------------------------------------------
 */

int mb_ref(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    int ref = luaL_ref(L, LUA_REGISTRYINDEX);
    if (ref != LUA_NOREF && ref != LUA_REFNIL) rt->refs_live++;
    return ref;
}

void mb_unref(lua_State *L, int ref)
{
    if (ref == LUA_NOREF || ref == LUA_REFNIL) return;
    mb_runtime *rt = mb_runtime_get(L);
    luaL_unref(L, LUA_REGISTRYINDEX, ref);
    rt->refs_live--;
}

/* ---- run queue ---------------------------------------------------------------------------------
 */

static void rq_push(mb_runtime *rt, mb_task *t)
{
    if (t->queued) return;
    t->queued = 1;
    t->rq_next = NULL;
    if (rt->rq_tail)
        rt->rq_tail->rq_next = t;
    else
        rt->rq_head = t;
    rt->rq_tail = t;
    if (!ev_is_active(&rt->spin_watcher)) ev_idle_start(rt->loop, &rt->spin_watcher);
}

static mb_task *rq_pop(mb_runtime *rt)
{
    mb_task *t = rt->rq_head;
    if (!t) return NULL;
    rt->rq_head = t->rq_next;
    if (!rt->rq_head) rt->rq_tail = NULL;
    t->queued = 0;
    t->rq_next = NULL;
    return t;
}

void mb_defer(mb_runtime *rt, mb_defer_fn fn, void *ud)
{
    mb_deferred *d = (mb_deferred *)malloc(sizeof *d);
    if (!d) {
        /* Without memory we cannot queue; running it later is impossible, so drop loudly. */
        fprintf(stderr, "moonbox: out of memory queueing deferred work\n");
        return;
    }
    d->fn = fn;
    d->ud = ud;
    d->next = NULL;
    if (rt->dq_tail)
        rt->dq_tail->next = d;
    else
        rt->dq_head = d;
    rt->dq_tail = d;
    if (!ev_is_active(&rt->spin_watcher)) ev_idle_start(rt->loop, &rt->spin_watcher);
}

/* ---- wait queues --------------------------------------------------------------------------------
 */

void mb_waitq_push(mb_waitq *q, mb_task *t)
{
    t->wq = q;
    t->wq_next = NULL;
    t->wq_prev = q->tail;
    if (q->tail)
        q->tail->wq_next = t;
    else
        q->head = t;
    q->tail = t;
}

void mb_waitq_remove(mb_task *t)
{
    mb_waitq *q = t->wq;
    if (!q) return;
    if (t->wq_prev)
        t->wq_prev->wq_next = t->wq_next;
    else
        q->head = t->wq_next;
    if (t->wq_next)
        t->wq_next->wq_prev = t->wq_prev;
    else
        q->tail = t->wq_prev;
    t->wq = NULL;
    t->wq_next = t->wq_prev = NULL;
}

int mb_waitq_wake_one(mb_waitq *q)
{
    mb_task *t = q->head;
    if (!t) return 0;
    mb_waitq_remove(t);
    mb_task_wake(t);
    return 1;
}

void mb_waitq_wake_all(mb_waitq *q)
{
    while (mb_waitq_wake_one(q)) {
    }
}

void mbt_abort_waitq(mb_task *t, void *ud)
{
    (void)ud;
    mb_waitq_remove(t);
}

/* ---- task objects -------------------------------------------------------------------------- */

/* Records (or, with t NULL, forgets) which task runs on coroutine co. */
static void set_task_of(mb_runtime *rt, lua_State *co, mb_task *t)
{
    if (rt->extraspace_ok) {
        *(mb_task **)lua_getextraspace(co) = t;
        return;
    }
    lua_State *L = rt->L;
    lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.threads");
    lua_pushthread(co);
    lua_xmove(co, L, 1);
    if (t)
        lua_pushlightuserdata(L, t);
    else
        lua_pushnil(L);
    lua_rawset(L, -3);
    lua_pop(L, 1);
}

mb_task *mb_task_of(lua_State *L)
{
    if (g_rt && g_rt->extraspace_ok) return *(mb_task **)lua_getextraspace(L);
    mb_runtime *rt = mb_runtime_get(L);
    if (rt->extraspace_ok) return *(mb_task **)lua_getextraspace(L);
    lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.threads");
    lua_pushthread(L);
    lua_rawget(L, -2);
    mb_task *t = (mb_task *)lua_touserdata(L, -1);
    lua_pop(L, 2);
    return t;
}

static mb_task *check_task(lua_State *L, int idx)
{
    return (mb_task *)luaL_checkudata(L, idx, TASK_MT);
}

/* Pushes the data table (uservalue 2) of the task whose userdata is at idx. */
static void push_task_data(lua_State *L, int idx)
{
    lua_getiuservalue(L, idx, UV_DATA);
}

/* Pushes the userdata of a live task (one that still holds its ref). */
static void push_task(lua_State *L, mb_task *t)
{
    lua_rawgeti(L, LUA_REGISTRYINDEX, t->ref);
}

mb_task *mb_task_check_yieldable(lua_State *L, const char *what)
{
    mb_task *t = mb_task_of(L);
    if (t && t->co == L && lua_isyieldable(L)) return t;
    char where[256];
    mb_where(L, where, sizeof where);
    if (!t && lua_pushthread(L)) {
        lua_pop(L, 1);
        return (mb_task *)(intptr_t)luaL_error(
            L,
            "%s: not inside a task (%s). Wrap the code in task.spawn or run it with "
            "`moonbox run`, which runs the whole recipe as a task",
            what, where);
    }
    lua_pop(L, 1);
    if (!t) {
        return (mb_task *)(intptr_t)luaL_error(
            L,
            "%s: called inside a coroutine created with coroutine.create/wrap (%s); moonbox "
            "calls can only wait in a task: use task.spawn instead of a raw coroutine",
            what, where);
    }
    return (mb_task *)(intptr_t)luaL_error(
        L,
        "%s cannot wait here (%s): this place cannot yield. Unsupported places: module top "
        "level while being loaded by require, table.sort comparators, string.gsub callbacks, "
        "__gc, __tostring and other metamethods called from C, and callbacks of C libraries. "
        "Move the call into the recipe body or a function called from it",
        what, where);
}

int mb_task_recipe_site(lua_State *L, char *buf, size_t len)
{
    mb_task *t = mb_task_of(L);
    if (!t || t->ref == LUA_NOREF) return 0;
    int top = lua_gettop(L);
    push_task(L, t);
    push_task_data(L, -1);
    int found = 0;
    if (lua_getfield(L, -1, "site_recipe") != LUA_TNIL && lua_toboolean(L, -1) &&
        lua_getfield(L, -2, "site") == LUA_TSTRING) {
        snprintf(buf, len, "%s", lua_tostring(L, -1));
        found = 1;
    }
    lua_settop(L, top);
    return found;
}

/* ---- cancellation and deadline errors -------------------------------------------------------- */

static int raise_cancelled(lua_State *L, mb_task *t)
{
    t->cancel_delivered = 1;
    mb_error_new(L, "task", "cancelled", "task %I was cancelled", (lua_Integer)t->id);
    mb_setfield_int(L, -1, "task_id", (lua_Integer)t->id);
    return lua_error(L);
}

static int raise_deadline(lua_State *L, mb_task *t, int level)
{
    mb_error_new(L, "task.timeout", "deadline", "deadline of timeout level %d expired in task %I",
                 level + 1, (lua_Integer)t->id);
    mb_setfield_int(L, -1, "level", level + 1);
    mb_setfield_int(L, -1, "task_id", (lua_Integer)t->id);
    mb_setfield_bool(L, -1, "retryable", 1);
    return lua_error(L);
}

/* ---- parking --------------------------------------------------------------------------------- */

int mbt_park_k(lua_State *L, int status, lua_KContext ctx)
{
    mb_task *t = (mb_task *)ctx;
    int reason = t->wake_reason;
    lua_KFunction k = t->k;
    lua_KContext kctx = t->kctx;
    (void)status;
    t->wake_reason = MB_WAKE_NORMAL;
    t->k = NULL;
    t->abort = NULL;
    if (reason == MB_WAKE_CANCEL) return raise_cancelled(L, t);
    if (reason == MB_WAKE_DEADLINE) {
        int level = t->deadline_pending;
        t->deadline_pending = -1;
        return raise_deadline(L, t, level);
    }
    return k(L, LUA_YIELD, kctx);
}

int mb_task_park(lua_State *L, mb_task *t, mb_abort_fn abort, void *abort_ud, lua_KContext kctx,
                 lua_KFunction k)
{
    if (t->cancel_pending) {
        t->cancel_pending = 0;
        if (abort) abort(t, abort_ud);
        return raise_cancelled(L, t);
    }
    if (t->deadline_pending >= 0) {
        int level = t->deadline_pending;
        t->deadline_pending = -1;
        if (abort) abort(t, abort_ud);
        return raise_deadline(L, t, level);
    }
    t->abort = abort;
    t->abort_ud = abort_ud;
    t->k = k;
    t->kctx = kctx;
    t->state = MB_TASK_PARKED;
    return lua_yieldk(L, 0, (lua_KContext)t, mbt_park_k);
}

void mb_task_wake(mb_task *t)
{
    if (t->state != MB_TASK_PARKED) return;
    t->abort = NULL;
    t->state = MB_TASK_READY;
    rq_push(t->rt, t);
}

/* Interrupts a parked task: runs its abort hook and queues it with the given reason. */
void mbt_interrupt(mb_task *t, int reason)
{
    mb_abort_fn abort = t->abort;
    void *ud = t->abort_ud;
    t->abort = NULL;
    if (abort) abort(t, ud);
    mb_waitq_remove(t);
    t->wake_reason = reason;
    t->state = MB_TASK_READY;
    rq_push(t->rt, t);
}

void mb_task_cancel(mb_task *t)
{
    if (t->state == MB_TASK_DONE) return;
    if (t->state == MB_TASK_PARKED)
        mbt_interrupt(t, MB_WAKE_CANCEL);
    else
        t->cancel_pending = 1;
}

/* ---- task lifecycle ------------------------------------------------------------------------- */

static void all_link(mb_runtime *rt, mb_task *t)
{
    t->all_prev = NULL;
    t->all_next = rt->all_head;
    if (rt->all_head) rt->all_head->all_prev = t;
    rt->all_head = t;
}

static void all_unlink(mb_runtime *rt, mb_task *t)
{
    if (t->all_prev)
        t->all_prev->all_next = t->all_next;
    else if (rt->all_head == t)
        rt->all_head = t->all_next;
    if (t->all_next) t->all_next->all_prev = t->all_prev;
    t->all_next = t->all_prev = NULL;
}

/* Message handler of every protected call moonbox makes inside a task: it keeps the error value
 * unchanged and records, once per error value, the traceback at the point it was raised, so a
 * re-raise further up (task.timeout, scope, join) still reports the original place. */
static int l_msgh(lua_State *L)
{
    mb_task *t = mb_task_of(L);
    if (lua_istable(L, 1) && luaL_getmetafield(L, 1, "__name") != LUA_TNIL) {
        int is_err =
            lua_type(L, -1) == LUA_TSTRING && strcmp(lua_tostring(L, -1), "moonbox.Error") == 0;
        lua_pop(L, 1);
        if (is_err) {
            if (lua_getfield(L, 1, "traceback") == LUA_TNIL) {
                luaL_traceback(L, L, NULL, 1);
                lua_setfield(L, 1, "traceback");
            }
            lua_pop(L, 1);
            lua_settop(L, 1);
            return 1;
        }
    }
    if (t && t->ref != LUA_NOREF) {
        push_task(L, t);
        push_task_data(L, -1); /* err, ud, data */
        lua_getfield(L, -1, "tb_err");
        int same = lua_rawequal(L, -1, 1);
        lua_pop(L, 1);
        if (!same) {
            lua_pushvalue(L, 1);
            lua_setfield(L, -2, "tb_err");
            const char *msg = lua_tostring(L, 1);
            if (!msg) msg = luaL_typename(L, 1);
            luaL_traceback(L, L, msg, 1);
            lua_setfield(L, -2, "tb");
        }
    }
    lua_settop(L, 1);
    return 1;
}

static int entry_finish(lua_State *L, int status, lua_KContext ctx)
{
    (void)ctx;
    if (status == LUA_OK || status == LUA_YIELD) {
        lua_pushboolean(L, 1);
        lua_replace(L, 1);
        return lua_gettop(L);
    }
    lua_pushboolean(L, 0);
    lua_replace(L, 1);
    return 2;
}

/* The coroutine's main function: stack is fn, args... It calls fn under a yieldable pcall whose
 * message handler records the traceback, and returns (true, results...) or (false, err). */
static int task_entry(lua_State *L)
{
    mb_task *t = mb_task_of(L);
    int n = lua_gettop(L);
    if (t->cancel_pending) { /* cancelled before it ever ran: do not start the body */
        t->cancel_pending = 0;
        t->cancel_delivered = 1;
        lua_settop(L, 0);
        lua_pushboolean(L, 0);
        mb_error_new(L, "task", "cancelled", "task %I was cancelled before it started",
                     (lua_Integer)t->id);
        mb_setfield_int(L, -1, "task_id", (lua_Integer)t->id);
        return 2;
    }
    lua_pushcfunction(L, l_msgh);
    lua_insert(L, 1);
    int status = lua_pcallk(L, n - 1, LUA_MULTRET, 1, 0, entry_finish);
    return entry_finish(L, status, 0);
}

/* Finishes a task whose coroutine returned (ok, ...) (status LUA_OK, nres values on co) or died
 * (the error on co): stores results{n=} or err (plus tb, tb_err for a death) in its data table,
 * marks it done, stops its deadline and sleep timers, leaves any wait queue, wakes its joiners,
 * frees its coroutine and releases its ref. A failure nobody observed is remembered in
 * moonbox.unobserved, unless it is the "cancelled" error of a cancel it was sent. Breaks the
 * loop once so the driver re-checks. Leaves L's stack as it was; never raises except on out of
 * memory. Called from the drain on the main thread. */
static void task_complete(mb_runtime *rt, mb_task *t, int status, int nres)
{
    lua_State *L = rt->L;
    lua_State *co = t->co;
    int top = lua_gettop(L);
    push_task(L, t);
    int ud = lua_gettop(L);
    push_task_data(L, ud);
    int data = lua_gettop(L);

    if (status == LUA_OK) {
        /* co stack: ok, results... */
        int ok = lua_toboolean(co, -nres);
        lua_createtable(L, nres > 0 ? nres - 1 : 0, 1);
        int res = lua_gettop(L);
        lua_xmove(co, L, nres); /* ok, r1..rn on L */
        for (int i = nres - 1; i >= 1; i--)
            lua_rawseti(L, res, i);
        lua_pop(L, 1); /* the ok flag */
        lua_pushinteger(L, nres - 1);
        lua_setfield(L, res, "n");
        t->ok = ok;
        if (ok) {
            lua_setfield(L, data, "results");
        } else {
            lua_rawgeti(L, res, 1);
            lua_setfield(L, data, "err");
            lua_pop(L, 1);
        }
    } else {
        /* The body's pcall itself failed (memory, or an error in the handler). */
        const char *msg = lua_tostring(co, -1);
        luaL_traceback(L, co, msg ? msg : "(error object is not a string)", 0);
        lua_setfield(L, data, "tb");
        lua_xmove(co, L, 1);
        lua_pushvalue(L, -1);
        lua_setfield(L, data, "tb_err");
        lua_setfield(L, data, "err");
        t->ok = 0;
    }
    t->state = MB_TASK_DONE;
    mbt_deadline_stop(t);
    if (ev_is_active(&t->sleep_timer)) ev_timer_stop(rt->loop, &t->sleep_timer);
    mb_waitq_remove(t);
    mb_waitq_wake_all(&t->joiners);
    all_unlink(rt, t);
    rt->tasks_live--;
    lua_resetthread(co); /* the body already unwound inside its pcall; this frees the stack */
    lua_pushnil(L);
    lua_setiuservalue(L, ud, UV_THREAD);
    set_task_of(rt, co, NULL);
    t->co = NULL;
    if (!t->ok && !t->observed && t->cancel_delivered) {
        /* It ended by the cancellation it was sent: that is what cancelling asks for, not a
         * failure anybody must hear about. */
        lua_getfield(L, data, "err");
        if (lua_istable(L, -1)) {
            lua_getfield(L, -1, "code");
            if (lua_isstring(L, -1) && strcmp(lua_tostring(L, -1), "cancelled") == 0)
                t->observed = 1;
            lua_pop(L, 1);
        }
        lua_pop(L, 1);
    }
    if (!t->ok && !t->observed) {
        /* Remember it until someone joins it or the run ends (reported then, or by __gc). */
        lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.unobserved");
        lua_pushvalue(L, ud);
        lua_pushboolean(L, 1);
        lua_rawset(L, -3);
        lua_pop(L, 1);
    }
    int ref = t->ref;
    t->ref = LUA_NOREF;
    mb_unref(L, ref);
    lua_settop(L, top);
    /* Whoever drives the loop (task.run, shutdown) waits for some task to finish and checks
     * after each ev_run(ONCE): return to it now rather than blocking in the next poll, which
     * may have nothing to wake it. */
    ev_break(rt->loop, EVBREAK_ONE);
}

/* Resumes one task; only the drain calls this. */
static void task_resume(mb_runtime *rt, mb_task *t)
{
    lua_State *co = t->co;
    int nres = 0;
    mb_task *prev = rt->current;
    if (t->state == MB_TASK_DONE || !co) return;
    t->state = MB_TASK_RUNNING;
    rt->current = t;
    int nargs = lua_gettop(co) - (lua_status(co) == LUA_OK ? 1 : 0);
    if (lua_status(co) != LUA_OK) nargs = 0;
    int status = lua_resume(co, rt->L, nargs, &nres);
    rt->current = prev;
    if (status == LUA_YIELD) {
        if (t->state == MB_TASK_PARKED) return;
        /* A plain coroutine.yield at task level: treat it as task.yield(). */
        lua_pop(co, nres);
        t->state = MB_TASK_READY;
        rq_push(rt, t);
        return;
    }
    task_complete(rt, t, status, nres);
}

static void run_deferred(mb_runtime *rt)
{
    while (rt->dq_head) {
        mb_deferred *d = rt->dq_head;
        rt->dq_head = d->next;
        if (!rt->dq_head) rt->dq_tail = NULL;
        d->fn(rt->L, d->ud);
        free(d);
    }
}

static void drain_cb(struct ev_loop *loop, ev_prepare *w, int revents)
{
    mb_runtime *rt = (mb_runtime *)w->data;
    (void)loop;
    (void)revents;
    if (rt->in_drain) return;
    rt->in_drain = 1;
    run_deferred(rt);
    /* Resume what was queued when the wave began; later wake-ups wait for one poll. */
    mb_task *last = rt->rq_tail;
    int budget = DRAIN_BATCH_MAX;
    while (rt->rq_head && budget-- > 0) {
        mb_task *t = rq_pop(rt);
        int was_last = (t == last);
        task_resume(rt, t);
        if (was_last) break;
    }
    run_deferred(rt);
    if (!rt->rq_head && !rt->dq_head && ev_is_active(&rt->spin_watcher))
        ev_idle_stop(rt->loop, &rt->spin_watcher);
    rt->in_drain = 0;
}

static void spin_cb(struct ev_loop *loop, ev_idle *w, int revents)
{
    mb_runtime *rt = (mb_runtime *)w->data;
    (void)revents;
    if (!rt->rq_head && !rt->dq_head) ev_idle_stop(loop, w);
}

/* ---- Lua functions: tasks ---------------------------------------------------------------------
 */

/* core.spawn(fn, ...) -> Task. Creates a task running fn(...) on its own coroutine and queues
 * it to run in the next drain (it does not start here). The task's data table records its spawn
 * site and the spawn chain, and it inherits the spawning task's context table (task.set_context).
 * The task holds a registry ref to itself until it finishes. Pushes the Task; raises if fn is not
 * a function or the runtime is shutting down. Any thread; does not yield. */
static int l_spawn(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    luaL_checktype(L, 1, LUA_TFUNCTION);
    int nargs = lua_gettop(L) - 1;
    if (rt->closing) return luaL_error(L, "task.spawn: the runtime is shutting down");

    mb_task *t = (mb_task *)lua_newuserdatauv(L, sizeof(mb_task), 2);
    int ud = lua_gettop(L);
    memset(t, 0, sizeof *t);
    t->rt = rt;
    t->id = rt->next_task_id++;
    t->state = MB_TASK_READY;
    t->ref = LUA_NOREF;
    t->deadline_pending = -1;
    ev_timer_init(&t->deadline_timer, mbt_deadline_cb, 0, 0);
    t->deadline_timer.data = t;
    ev_timer_init(&t->sleep_timer, NULL, 0, 0);
    luaL_setmetatable(L, TASK_MT);

    lua_State *co = lua_newthread(L);
    lua_setiuservalue(L, ud, UV_THREAD);
    t->co = co;
    set_task_of(rt, co, t);

    /* data table: where it was spawned, by whom (the chain is what a traceback shows). */
    lua_createtable(L, 0, 8);
    int data = lua_gettop(L);
    char where[256];
    int recipe_site = mb_where(L, where, sizeof where);
    lua_pushstring(L, where);
    lua_setfield(L, data, "site");
    lua_pushboolean(L, recipe_site);
    lua_setfield(L, data, "site_recipe");
    mb_task *parent = mb_task_of(L);
    if (parent && parent->ref != LUA_NOREF) {
        t->parent_id = parent->id;
        push_task(L, parent);
        push_task_data(L, -1);
        lua_getfield(L, -1, "chain");
        lua_pushfstring(L, "task %I spawned at %s by\n  %s", (lua_Integer)t->id, where,
                        lua_tostring(L, -1) ? lua_tostring(L, -1) : "?");
        lua_setfield(L, data, "chain");
        lua_pop(L, 1);
        /* The task context (task.set_context) is inherited: the child shares the parent's
         * table, which set_context never changes in place (it copies on write). */
        lua_getfield(L, -1, "ctx");
        lua_setfield(L, data, "ctx");
        lua_pop(L, 2);
    } else {
        lua_pushfstring(L, "task %I spawned at %s", (lua_Integer)t->id, where);
        lua_setfield(L, data, "chain");
    }
    lua_pushvalue(L, data);
    lua_setiuservalue(L, ud, UV_DATA);
    lua_pop(L, 1);

    lua_pushcfunction(co, task_entry);
    lua_pushvalue(L, 1);
    lua_xmove(L, co, 1);
    for (int i = 0; i < nargs; i++)
        lua_pushvalue(L, 2 + i);
    lua_xmove(L, co, nargs);

    lua_pushvalue(L, ud);
    t->ref = mb_ref(L);
    rt->tasks_live++;
    all_link(rt, t);
    rq_push(rt, t);
    lua_settop(L, ud);
    return 1;
}

/* core.current() -> Task|nil. */
static int l_current(lua_State *L)
{
    mb_task *t = mb_task_of(L);
    if (!t || t->ref == LUA_NOREF) {
        lua_pushnil(L);
        return 1;
    }
    push_task(L, t);
    return 1;
}

/* core.cancel(task): requests cancellation. Does not yield. */
static int l_cancel(lua_State *L)
{
    mb_task *t = check_task(L, 1);
    mb_task_cancel(t);
    return 0;
}

static int push_results(lua_State *L, int ud)
{
    mb_task *t = (mb_task *)lua_touserdata(L, ud);
    push_task_data(L, ud);
    int data = lua_gettop(L);
    if (t->ok) {
        lua_pushboolean(L, 1);
        lua_getfield(L, data, "results");
        int res = lua_gettop(L);
        lua_getfield(L, res, "n");
        int n = (int)lua_tointeger(L, -1);
        lua_pop(L, 1);
        luaL_checkstack(L, n, "too many results");
        for (int i = 1; i <= n; i++)
            lua_rawgeti(L, res, i);
        lua_remove(L, res);
        lua_remove(L, data);
        return n + 1;
    }
    lua_pushboolean(L, 0);
    lua_getfield(L, data, "err");
    lua_remove(L, data);
    return 2;
}

static int join_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)status;
    (void)ctx;
    mb_task *t = check_task(L, 1);
    if (t->state != MB_TASK_DONE) { /* spurious: wait again */
        mb_task *self = mb_task_of(L);
        mb_waitq_push(&t->joiners, self);
        return mb_task_park(L, self, mbt_abort_waitq, NULL, 0, join_k);
    }
    t->observed = 1;
    return push_results(L, 1);
}

/* core.join(task) -> true, results... | false, err. Waits for the task to finish [yields]. */
static int l_join(lua_State *L)
{
    mb_task *t = check_task(L, 1);
    lua_settop(L, 1);
    if (t->state == MB_TASK_DONE) {
        t->observed = 1;
        return push_results(L, 1);
    }
    mb_task *self = mb_task_check_yieldable(L, "task.join");
    if (self == t)
        return luaL_error(L, "task.join: a task cannot join itself (task %d)", (int)t->id);
    mb_waitq_push(&t->joiners, self);
    return mb_task_park(L, self, mbt_abort_waitq, NULL, 0, join_k);
}

/* core.result(task) -> nil (running) | true, results... | false, err. Marks it observed. */
static int l_result(lua_State *L)
{
    mb_task *t = check_task(L, 1);
    lua_settop(L, 1);
    if (t->state != MB_TASK_DONE) return 0;
    t->observed = 1;
    return push_results(L, 1);
}

/* core.observe(task): marks its failure as handled by someone (a scope). */
static int l_observe(lua_State *L)
{
    check_task(L, 1)->observed = 1;
    return 0;
}

/* core.status(task) -> "ready"|"running"|"waiting"|"done"|"failed". */
static int l_status(lua_State *L)
{
    mb_task *t = check_task(L, 1);
    const char *s = "ready";
    switch (t->state) {
    case MB_TASK_RUNNING:
        s = "running";
        break;
    case MB_TASK_PARKED:
        s = "waiting";
        break;
    case MB_TASK_DONE:
        s = t->ok ? "done" : "failed";
        break;
    default:
        break;
    }
    lua_pushstring(L, s);
    return 1;
}

/* core.id(task) -> integer. */
static int l_id(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)check_task(L, 1)->id);
    return 1;
}

/* core.data(task) -> the task's data table (site, site_recipe, chain, name, err, tb, ...).
 * site is where the task was spawned; site_recipe says whether that is a recipe location (the
 * fallback of mb_where for errors made where no recipe frame is on the stack). */
static int l_data(lua_State *L)
{
    check_task(L, 1);
    push_task_data(L, 1);
    return 1;
}

/* core.set_traceback(err, tb): makes the current task's message handler keep tb as the
 * traceback of err when err is raised again (used when re-raising a child's error). */
static int l_set_traceback(lua_State *L)
{
    mb_task *t = mb_task_of(L);
    luaL_checkany(L, 1);
    luaL_checktype(L, 2, LUA_TSTRING);
    if (!t || t->ref == LUA_NOREF) return 0;
    push_task(L, t);
    push_task_data(L, -1);
    lua_pushvalue(L, 1);
    lua_setfield(L, -2, "tb_err");
    lua_pushvalue(L, 2);
    lua_setfield(L, -2, "tb");
    return 0;
}

/* core.traceback_of(err) -> the traceback recorded for err in the current task, or nil. */
static int l_traceback_of(lua_State *L)
{
    mb_task *t = mb_task_of(L);
    luaL_checkany(L, 1);
    if (lua_istable(L, 1)) {
        lua_getfield(L, 1, "traceback");
        if (!lua_isnil(L, -1)) return 1;
        lua_pop(L, 1);
    }
    if (!t || t->ref == LUA_NOREF) return 0;
    push_task(L, t);
    push_task_data(L, -1);
    lua_getfield(L, -1, "tb_err");
    if (!lua_rawequal(L, -1, 1)) return 0;
    lua_getfield(L, -2, "tb");
    return 1;
}

static int task_tostring(lua_State *L)
{
    mb_task *t = check_task(L, 1);
    push_task_data(L, 1);
    lua_getfield(L, -1, "name");
    const char *name = lua_tostring(L, -1);
    lua_getfield(L, -2, "site");
    const char *site = lua_tostring(L, -1);
    l_status(L);
    const char *st = lua_tostring(L, -1);
    if (name)
        lua_pushfstring(L, "Task %I '%s' (%s, spawned at %s)", (lua_Integer)t->id, name, st,
                        site ? site : "?");
    else
        lua_pushfstring(L, "Task %I (%s, spawned at %s)", (lua_Integer)t->id, st,
                        site ? site : "?");
    return 1;
}

/* Pushes the traceback recorded for a finished task's error (or nil). */
static void push_task_traceback(lua_State *L, int ud)
{
    push_task_data(L, ud);
    lua_getfield(L, -1, "err");
    lua_getfield(L, -2, "tb_err");
    if (lua_rawequal(L, -1, -2)) {
        lua_getfield(L, -3, "tb");
    } else if (lua_istable(L, -2)) {
        lua_getfield(L, -2, "traceback");
    } else {
        lua_pushnil(L);
    }
    lua_replace(L, -4);
    lua_pop(L, 2);
}

/* Prints a failed task's error with its traceback and spawn chain to stderr. */
static void report_unobserved(lua_State *L, int ud)
{
    mb_task *t = (mb_task *)lua_touserdata(L, ud);
    if (t->reported || t->observed || t->ok || t->state != MB_TASK_DONE) return;
    t->reported = 1;
    t->rt->unobserved_failures++;
    int top = lua_gettop(L);
    push_task_data(L, ud);
    lua_getfield(L, -1, "err");
    const char *msg = luaL_tolstring(L, -1, NULL);
    push_task_traceback(L, ud);
    const char *tb = lua_tostring(L, -1);
    lua_getfield(L, top + 1, "chain");
    const char *chain = lua_tostring(L, -1);
    fprintf(stderr, "moonbox: unhandled error in task %llu (nothing joined it): %s\n%s%s%s\n",
            (unsigned long long)t->id, msg, tb ? tb : "", tb ? "\n" : "", chain ? chain : "");
    lua_settop(L, top);
}

static int task_gc(lua_State *L)
{
    mb_task *t = (mb_task *)lua_touserdata(L, 1);
    if (t->state == MB_TASK_DONE) report_unobserved(L, 1);
    return 0;
}

/* core.report_unobserved() -> n: prints every failed task nobody joined; returns how many. */
static int l_report_unobserved(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    long before = rt->unobserved_failures;
    lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.unobserved");
    int tab = lua_gettop(L);
    lua_pushnil(L);
    while (lua_next(L, tab)) {
        lua_pop(L, 1);
        report_unobserved(L, lua_gettop(L));
    }
    lua_pushinteger(L, rt->unobserved_failures - before);
    return 1;
}

static mb_task *g_root; /* the task core.run is driving (signals cancel it) */

mb_task *mbt_root(void)
{
    return g_root;
}

/* ---- running the loop -------------------------------------------------------------------- */

/* core.run(fn, ...) -> results of fn: runs fn as a task and drives the loop until it finishes;
 * re-raises its error. Only from outside any task (it is the loop's driver). */
static int l_run(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    luaL_checktype(L, 1, LUA_TFUNCTION);
    if (mb_task_of(L) || rt->run_depth > 0 || rt->in_drain)
        return luaL_error(L, "task.run: the loop is already running (call it only from the main "
                             "program, not from inside a task)");
    int n = lua_gettop(L);
    lua_pushcfunction(L, l_spawn);
    lua_insert(L, 1);
    lua_call(L, n, 1);
    int ud = lua_gettop(L);
    mb_task *t = (mb_task *)lua_touserdata(L, ud);
    rt->run_depth++;
    mb_task *saved_root = g_root;
    g_root = t;
    while (t->state != MB_TASK_DONE) {
        if (!ev_run(rt->loop, EVRUN_ONCE) && t->state != MB_TASK_DONE && !rt->rq_head &&
            !rt->dq_head) {
            /* Nothing can wake anyone: report where the root task waits instead of hanging. */
            rt->run_depth--;
            g_root = saved_root;
            lua_rawgeti(L, LUA_REGISTRYINDEX, t->ref);
            lua_getiuservalue(L, -1, UV_THREAD);
            lua_State *co = lua_tothread(L, -1);
            luaL_traceback(L, co, NULL, 0);
            mb_task_cancel(t);
            return luaL_error(L, "moonbox: deadlock: task %d waits and nothing can wake it\n%s",
                              (int)t->id, lua_tostring(L, -1));
        }
    }
    rt->run_depth--;
    g_root = saved_root;
    t->observed = 1;
    int nres = push_results(L, ud);
    if (!lua_toboolean(L, ud + 1)) {
        /* Attach the task's traceback to a plain error so the caller sees where it failed. */
        push_task_data(L, ud);
        lua_getfield(L, -1, "tb_err");
        int same = lua_rawequal(L, -1, ud + 2);
        lua_getfield(L, -2, "tb");
        if (same && lua_type(L, ud + 2) == LUA_TSTRING && lua_isstring(L, -1)) {
            lua_pushvalue(L, -1);
            return lua_error(L);
        }
        lua_settop(L, ud + 2);
        return lua_error(L);
    }
    return nres - 1;
}

/* Tears the runtime down before lua_close (main, after the CLI returned): marks it closing (no
 * more spawns), cancels every live task and runs the loop for at most 5 s while they unwind
 * (their guards may yield); a task still alive then is dropped with a line on stderr, its abort
 * hook called but its closers not run, and its ref released. Runs the deferred callbacks last.
 * Returns the number of registry refs still live (the leak check's figure), 0 without a runtime;
 * does nothing but return that figure when called from inside core.run or the drain. Blocks the
 * calling thread for up to those 5 s; call only from outside any task. */
long mb_runtime_shutdown(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, RT_KEY);
    mb_runtime *rt = (mb_runtime *)lua_touserdata(L, -1);
    lua_pop(L, 1);
    if (!rt) return 0;
    if (rt->run_depth > 0 || rt->in_drain) return rt->refs_live;
    rt->closing = 1;
    /* Cancel what still runs and let it unwind (its guards may yield), within a bound. */
    for (mb_task *t = rt->all_head; t; t = t->all_next)
        mb_task_cancel(t);
    double until = ev_time() + 5.0;
    while (rt->all_head && ev_time() < until) {
        if (!ev_run(rt->loop, EVRUN_ONCE) && !rt->rq_head && !rt->dq_head) break;
    }
    /* Whatever still did not finish is released without running its closers. */
    while (rt->all_head) {
        mb_task *t = rt->all_head;
        fprintf(stderr, "moonbox: task %llu did not finish during shutdown; dropped\n",
                (unsigned long long)t->id);
        if (t->abort) t->abort(t, t->abort_ud);
        t->abort = NULL;
        mb_waitq_remove(t);
        mbt_deadline_stop(t);
        if (ev_is_active(&t->sleep_timer)) ev_timer_stop(rt->loop, &t->sleep_timer);
        all_unlink(rt, t);
        rt->tasks_live--;
        t->state = MB_TASK_DONE;
        t->ok = 0;
        t->observed = 1;
        if (t->co) {
            set_task_of(rt, t->co, NULL);
            t->co = NULL;
        }
        int ref = t->ref;
        t->ref = LUA_NOREF;
        mb_unref(L, ref);
    }
    run_deferred(rt);
    return rt->refs_live;
}

/* core.shutdown(): cancels every task still running and lets them unwind (at most 5 s). */
static int l_shutdown(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    if (mb_task_of(L) || rt->run_depth > 0) return luaL_error(L, "core.shutdown: inside a task");
    for (mb_task *t = rt->all_head; t; t = t->all_next)
        mb_task_cancel(t);
    double until = ev_time() + 5.0;
    while (rt->all_head && ev_time() < until) {
        if (!ev_run(rt->loop, EVRUN_ONCE) && !rt->rq_head && !rt->dq_head) break;
    }
    /* Tasks cancelled here ended as intended: their "cancelled" errors are not failures. */
    lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.unobserved");
    lua_pushnil(L);
    while (lua_next(L, -2)) {
        lua_pop(L, 1);
        mb_task *t = (mb_task *)lua_touserdata(L, -1);
        lua_getiuservalue(L, -1, UV_DATA);
        lua_getfield(L, -1, "err");
        if (lua_istable(L, -1)) {
            lua_getfield(L, -1, "code");
            if (lua_isstring(L, -1) && strcmp(lua_tostring(L, -1), "cancelled") == 0)
                t->observed = 1;
            lua_pop(L, 1);
        }
        lua_pop(L, 2);
    }
    lua_pop(L, 1);
    return 0;
}

/* core.leakcheck(on): makes the binary fail (status 3) if registry refs remain at exit. */
static int l_leakcheck(lua_State *L)
{
    lua_pushboolean(L, lua_toboolean(L, 1));
    lua_setfield(L, LUA_REGISTRYINDEX, "moonbox.leakcheck");
    return 0;
}

/* core.traceback(task) -> the traceback recorded for a finished task's error, or nil. */
static int l_task_traceback(lua_State *L)
{
    mb_task *t = check_task(L, 1);
    if (t->state != MB_TASK_DONE || t->ok) return 0;
    push_task_traceback(L, 1);
    return 1;
}

/* ---- module -------------------------------------------------------------------------------- */

/* core.where() -> "file:line" of the nearest recipe frame (the place an error made now would
 * name: the same rule as err.where), and whether it is a recipe's line (false: a library
 * line, or "?"). Does not yield. */
static int l_where(lua_State *L)
{
    char where[256];
    int recipe = mb_where(L, where, sizeof where);
    lua_pushstring(L, where);
    lua_pushboolean(L, recipe);
    return 2;
}

static const luaL_Reg core_funcs[] = {
    {"spawn", l_spawn},
    {"current", l_current},
    {"cancel", l_cancel},
    {"join", l_join},
    {"result", l_result},
    {"observe", l_observe},
    {"status", l_status},
    {"id", l_id},
    {"data", l_data},
    {"set_traceback", l_set_traceback},
    {"traceback_of", l_traceback_of},
    {"msgh", l_msgh},
    {"report_unobserved", l_report_unobserved},
    {"run", l_run},
    {"shutdown", l_shutdown},
    {"leakcheck", l_leakcheck},
    {"traceback", l_task_traceback},
    {"where", l_where},
    {NULL, NULL},
};

int luaopen_moonbox_core(lua_State *L)
{
    mb_runtime_get(L);
    mb_errors_open(L);

    static const luaL_Reg task_meta[] = {
        {"__tostring", task_tostring}, {"__gc", task_gc}, {NULL, NULL}};
    mb_newclass(L, TASK_MT, NULL, task_meta);

    lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.unobserved");
    if (lua_isnil(L, -1)) {
        lua_newtable(L);
        lua_newtable(L);
        lua_pushstring(L, "k");
        lua_setfield(L, -2, "__mode");
        lua_setmetatable(L, -2);
        lua_setfield(L, LUA_REGISTRYINDEX, "moonbox.unobserved");
    }
    lua_pop(L, 1);

    luaL_newlib(L, core_funcs);
    mbt_open_deadlines(L);
    mbt_open_conds(L);
    mbt_open_signals(L);
    mbt_open_facts(L);
    luaL_getmetatable(L, TASK_MT);
    lua_setfield(L, -2, "Task");
    luaL_getmetatable(L, "moonbox.Error");
    lua_setfield(L, -2, "Error");
    lua_pushstring(L, MB_VERSION);
    lua_setfield(L, -2, "version");
    return 1;
}
