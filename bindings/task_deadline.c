/*
 * task_deadline.c — time for tasks: deadlines (task.timeout's levels and their one timer per
 * task), sleeping, and the loop's clocks, as moonbox.core's sleep, deadline_push, deadline_pop,
 * remaining, now and time.
 *
 * Part of the scheduler (bindings/task.c owns tasks, parking and the drain; mb.h states the
 * invariants). An expired deadline only marks the task and interrupts it if parked: the task
 * raises the deadline error itself when it next runs (task.c's park continuation).
 */
#include "mb.h"
#include "task_internal.h"

/* ---- deadlines ------------------------------------------------------------------------------- */

static void deadline_rearm(mb_task *t)
{
    struct ev_loop *loop = t->rt->loop;
    double next = -1;
    ev_timer_stop(loop, &t->deadline_timer);
    for (int i = 0; i < t->ndeadlines; i++)
        if (!t->deadline_fired[i] && (next < 0 || t->deadline_at[i] < next))
            next = t->deadline_at[i];
    if (next < 0) return;
    double after = next - ev_now(loop);
    ev_timer_set(&t->deadline_timer, after > 0 ? after : 0, 0);
    ev_timer_start(loop, &t->deadline_timer);
}

void mbt_deadline_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    mb_task *t = (mb_task *)w->data;
    double now = ev_now(loop);
    int level = -1;
    (void)revents;
    for (int i = 0; i < t->ndeadlines; i++) {
        if (!t->deadline_fired[i] && t->deadline_at[i] <= now + 1e-9) {
            t->deadline_fired[i] = 1;
            if (level < 0) level = i; /* the outermost expired level owns the expiry */
        }
    }
    if (level >= 0 && t->state != MB_TASK_DONE) {
        t->deadline_pending = level;
        if (t->state == MB_TASK_PARKED) mbt_interrupt(t, MB_WAKE_DEADLINE);
    }
    deadline_rearm(t);
}

double mb_task_remaining(mb_task *t)
{
    double best = -1;
    if (!t) return -1;
    for (int i = 0; i < t->ndeadlines; i++)
        if (!t->deadline_fired[i] && (best < 0 || t->deadline_at[i] < best))
            best = t->deadline_at[i];
    if (best < 0) return -1;
    double left = best - ev_now(t->rt->loop);
    return left > 0 ? left : 0;
}

void mbt_deadline_stop(mb_task *t)
{
    ev_timer_stop(t->rt->loop, &t->deadline_timer);
}

/* ---- sleep, yield, deadlines ------------------------------------------------------------------
 */

static void sleep_timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    mb_task_wake((mb_task *)w->data);
}

static void sleep_abort(mb_task *t, void *ud)
{
    (void)ud;
    ev_timer_stop(t->rt->loop, &t->sleep_timer);
}

static int sleep_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)L;
    (void)status;
    (void)ctx;
    return 0;
}

/* core.sleep(seconds): waits that long (0 lets every other ready task run first) [yields]. */
static int l_sleep(lua_State *L)
{
    double secs = luaL_checknumber(L, 1);
    mb_task *t = mb_task_check_yieldable(L, "task.sleep");
    if (secs != secs || secs < 0) return luaL_argerror(L, 1, "expected a number of seconds >= 0");
    if (secs == 0) {
        /* Park and queue ourselves at once: everything already ready runs first. */
        if (t->cancel_pending || t->deadline_pending >= 0)
            return mb_task_park(L, t, NULL, NULL, 0, sleep_k);
        t->state = MB_TASK_PARKED;
        t->abort = NULL;
        t->k = sleep_k;
        t->kctx = 0;
        mb_task_wake(t);
        return lua_yieldk(L, 0, (lua_KContext)t, mbt_park_k);
    }
    ev_timer_stop(t->rt->loop, &t->sleep_timer);
    ev_timer_init(&t->sleep_timer, sleep_timer_cb, secs, 0);
    t->sleep_timer.data = t;
    ev_timer_start(t->rt->loop, &t->sleep_timer);
    return mb_task_park(L, t, sleep_abort, NULL, 0, sleep_k);
}

/* core.deadline_push(seconds) -> level: the current task must finish what follows within
 * seconds, or within what an enclosing deadline leaves, whichever is smaller. */
static int l_deadline_push(lua_State *L)
{
    double secs = luaL_checknumber(L, 1);
    mb_task *t = mb_task_check_yieldable(L, "task.timeout");
    if (secs != secs || secs < 0) return luaL_argerror(L, 1, "expected seconds >= 0");
    if (t->ndeadlines >= MB_MAX_DEADLINES)
        return luaL_error(L, "task.timeout: more than %d nested timeouts", MB_MAX_DEADLINES);
    double at = ev_now(t->rt->loop) + secs;
    for (int i = 0; i < t->ndeadlines; i++)
        if (!t->deadline_fired[i] && t->deadline_at[i] < at) at = t->deadline_at[i];
    t->deadline_at[t->ndeadlines] = at;
    t->deadline_fired[t->ndeadlines] = 0;
    t->ndeadlines++;
    mbt_deadline_stop(t);
    deadline_rearm(t);
    lua_pushinteger(L, t->ndeadlines);
    return 1;
}

/* core.deadline_pop(level): removes the innermost deadline, which must be `level`. */
static int l_deadline_pop(lua_State *L)
{
    lua_Integer level = luaL_checkinteger(L, 1);
    mb_task *t = mb_task_of(L);
    if (!t) return luaL_error(L, "task.timeout: not inside a task");
    if (level != t->ndeadlines)
        return luaL_error(L, "task.timeout: deadline levels popped out of order (%d, top %d)",
                          (int)level, t->ndeadlines);
    t->ndeadlines--;
    if (t->deadline_pending == t->ndeadlines) t->deadline_pending = -1;
    mbt_deadline_stop(t);
    deadline_rearm(t);
    return 0;
}

/* core.remaining() -> seconds left before the nearest deadline, or nil. */
static int l_remaining(lua_State *L)
{
    double r = mb_task_remaining(mb_task_of(L));
    if (r < 0) return 0;
    lua_pushnumber(L, r);
    return 1;
}

/* core.now() -> the loop's monotonic clock in seconds. */
static int l_now(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    lua_pushnumber(L, ev_now(rt->loop));
    return 1;
}

/* core.time() -> wall clock seconds since the epoch (with fraction). */
static int l_time(lua_State *L)
{
    lua_pushnumber(L, ev_time());
    return 1;
}

void mbt_open_deadlines(lua_State *L)
{
    static const luaL_Reg funcs[] = {
        {"sleep", l_sleep},
        {"deadline_push", l_deadline_push},
        {"deadline_pop", l_deadline_pop},
        {"remaining", l_remaining},
        {"now", l_now},
        {"time", l_time},
        {NULL, NULL},
    };
    luaL_setfuncs(L, funcs, 0);
}
