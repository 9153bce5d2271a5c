/*
 * mb.h — what every binding shares: the runtime (one libev loop + one Lua state), tasks, the
 * run queue, parking and waking, registry-ref accounting and structured errors.
 *
 * Invariants (docs/architecture.md, "Rules of the runtime core"):
 *  - Only the drain (the run queue's ev_prepare callback) resumes coroutines. libev, libcurl and
 *    libmicrohttpd callbacks never call Lua: they store results and call mb_task_wake() or
 *    mb_defer().
 *  - A task parks in exactly one operation at a time. Parking registers an abort hook; the hook
 *    stops that operation's I/O when the task is cancelled or its deadline fires, and is never
 *    called after the operation has woken the task normally.
 *  - Every registry reference is taken with mb_ref() and dropped with mb_unref(); the runtime
 *    counts them and the leak check fails a test run that ends with any left.
 */
#ifndef MB_H
#define MB_H

#include <stddef.h>
#include <stdint.h>

#include <ev.h>
#include <lauxlib.h>
#include <lua.h>

#define MB_VERSION "0.1.0"

typedef struct mb_runtime mb_runtime;
typedef struct mb_task mb_task;

/* Why a parked task was resumed. */
enum mb_wake_reason { MB_WAKE_NORMAL = 0, MB_WAKE_CANCEL, MB_WAKE_DEADLINE };

/* Task states. */
enum mb_task_state { MB_TASK_READY = 1, MB_TASK_RUNNING, MB_TASK_PARKED, MB_TASK_DONE };

typedef void (*mb_abort_fn)(mb_task *t, void *ud);
typedef void (*mb_defer_fn)(lua_State *L, void *ud);

#define MB_MAX_DEADLINES 32

/* A wait queue of parked tasks (intrusive through mb_task.wq_next/wq_prev). */
typedef struct mb_waitq {
    mb_task *head, *tail;
} mb_waitq;

struct mb_task {
    mb_runtime *rt;
    lua_State *co; /* the coroutine; anchored by ref */
    int ref;       /* registry ref to this task's userdata (which anchors co via uservalue) */
    uint64_t id;
    int state;       /* enum mb_task_state */
    int wake_reason; /* enum mb_wake_reason, valid while the continuation runs */
    int queued;      /* on the run queue */
    mb_task *rq_next;

    /* The operation the task is parked in. */
    mb_abort_fn abort;
    void *abort_ud;
    lua_KFunction k;
    lua_KContext kctx;

    /* Wait-queue membership (join, cond). */
    mb_waitq *wq;
    mb_task *wq_next, *wq_prev;

    /* Cancellation requested while not parked: delivered at the next park. */
    int cancel_pending;
    int cancel_delivered; /* a cancelled error was raised in it at least once */
    int deadline_pending; /* level index of a fired deadline not yet delivered, or -1 */

    /* Deadline stack: absolute ev_now() times; fired levels are no longer enforced. */
    double deadline_at[MB_MAX_DEADLINES];
    unsigned char deadline_fired[MB_MAX_DEADLINES];
    int ndeadlines;
    ev_timer deadline_timer;

    /* Used by task.sleep: a task sleeps in at most one place, so the timer lives here. */
    ev_timer sleep_timer;

    /* Result on completion. */
    int ok;       /* 1 returned normally, 0 raised */
    int observed; /* someone joined it or a scope owns its error */
    int reported; /* its unobserved failure was printed */
    mb_waitq joiners;
    uint64_t parent_id;

    /* Every live task, for shutdown. */
    mb_task *all_next, *all_prev;
};

struct mb_runtime {
    struct ev_loop *loop;
    lua_State *L; /* the main state */
    ev_prepare drain_watcher;
    ev_idle spin_watcher; /* keeps the poll from blocking while the run queue is not empty */
    mb_task *rq_head, *rq_tail;
    struct mb_deferred *dq_head, *dq_tail;
    mb_task *current;
    mb_task *all_head; /* live tasks (not DONE) */
    uint64_t next_task_id;
    long refs_live;  /* registry refs taken with mb_ref and not yet released */
    long tasks_live; /* tasks not yet freed */
    int in_drain;
    int run_depth;
    long unobserved_failures; /* tasks that died with an error nobody looked at */
    int closing;
    int extraspace_ok; /* LUA_EXTRASPACE of every thread was zeroed at birth */
};

/* ---- runtime ---------------------------------------------------------------------------- */

/* Returns the runtime of L's state, creating it on first use (on the default libev loop). */
mb_runtime *mb_runtime_get(lua_State *L);
/* Tears the runtime down before lua_close: cancels and releases live tasks; returns the number
 * of registry refs still live afterwards (the leak check's figure). */
long mb_runtime_shutdown(lua_State *L);

/* ---- registry refs ------------------------------------------------------------------------ */

/* Pops the value on top of L's stack into the registry and counts the ref. */
int mb_ref(lua_State *L);
/* Releases a ref taken with mb_ref; LUA_NOREF is ignored. */
void mb_unref(lua_State *L, int ref);

/* ---- tasks --------------------------------------------------------------------------------- */

/* The task running on coroutine L, or NULL (main thread, or a coroutine the user created). */
mb_task *mb_task_of(lua_State *L);

/* Returns the current task or raises a clear error naming why this call cannot yield here.
 * `what` names the calling function in the message (e.g. "task.sleep"). */
mb_task *mb_task_check_yieldable(lua_State *L, const char *what);

/* Parks the current task: records the abort hook, then yields with lua_yieldk. When the task is
 * woken normally, k(L, LUA_YIELD, kctx) runs; when it is woken by cancellation or a deadline, the
 * abort hook has already run and the matching error is raised instead of calling k.
 * Never returns (like lua_yieldk). A pending cancellation is delivered immediately. */
int mb_task_park(lua_State *L, mb_task *t, mb_abort_fn abort, void *abort_ud, lua_KContext kctx,
                 lua_KFunction k);

/* Makes a parked task runnable (from any C callback). Ignored unless the task is parked. */
void mb_task_wake(mb_task *t);

/* Requests cancellation: a parked task gets its abort hook run and is queued to raise
 * Cancelled; a running/ready task raises it at its next park. Ignored for finished tasks. */
void mb_task_cancel(mb_task *t);

/* Queues fn(L, ud) to run in the drain, in Lua context on the main thread (not yieldable). */
void mb_defer(mb_runtime *rt, mb_defer_fn fn, void *ud);

/* Copies the recipe site of the task running on L into buf and returns 1, or returns 0 when
 * there is none. The site is where the recipe spawned the task (or, through a chain of tasks
 * spawned by moonbox's library, its nearest ancestor's); moonbox run and the REPL set their root
 * tasks' site from Lua (fields site and site_recipe of core.data(task)). */
int mb_task_recipe_site(lua_State *L, char *buf, size_t len);

/* Seconds left before the current task's nearest deadline, or -1 when none applies. */
double mb_task_remaining(mb_task *t);

/* ---- wait queues --------------------------------------------------------------------------- */

void mb_waitq_push(mb_waitq *q, mb_task *t);
void mb_waitq_remove(mb_task *t);
/* Wakes the first waiter; returns 1 if one was woken. */
int mb_waitq_wake_one(mb_waitq *q);
void mb_waitq_wake_all(mb_waitq *q);

/* ---- errors -------------------------------------------------------------------------------- */

/* Pushes a new structured error (metatable "moonbox.Error") with op, code, message and the
 * location of the nearest recipe (non-library) frame; the caller may add fields. */
void mb_error_new(lua_State *L, const char *op, const char *code, const char *fmt, ...);
/* mb_error_new + lua_error. */
int mb_error_raise(lua_State *L, const char *op, const char *code, const char *fmt, ...);
/* Sets t[k] = v on the table at index idx for the common field types. */
void mb_setfield_str(lua_State *L, int idx, const char *k, const char *v);
void mb_setfield_int(lua_State *L, int idx, const char *k, lua_Integer v);
void mb_setfield_bool(lua_State *L, int idx, const char *k, int v);
/* Makes the metatable tname once per state (luaL_newmetatable): `methods` (NULL: none) become
 * its __index table, `metamethods` ({"__gc", f}, ...; NULL: none) its fields. Leaves the stack as
 * it was; does nothing when tname exists already. Raises only on out of memory. */
void mb_newclass(lua_State *L, const char *tname, const luaL_Reg *methods,
                 const luaL_Reg *metamethods);
/* mb_newclass whose __index is the function `index`, called with the methods table as its
 * upvalue 1 (for objects that also answer fields). */
void mb_newclass_index(lua_State *L, const char *tname, const luaL_Reg *methods,
                       lua_CFunction index, const luaL_Reg *metamethods);
/* Writes "file:line" of the nearest stack frame outside moonbox's own library into buf; when the
 * stack has none, the recipe site of the current task (mb_task_recipe_site). Returns 1 when buf
 * names a recipe location, 0 when it fell back to the innermost library frame (or "?"). */
int mb_where(lua_State *L, char *buf, size_t len);
/* Installs the error metatable; called by luaopen_moonbox_core. */
void mb_errors_open(lua_State *L);

/* ---- module openers ------------------------------------------------------------------------ */

int luaopen_moonbox_archive(lua_State *L);
int luaopen_moonbox_core(lua_State *L);
int luaopen_moonbox_cron(lua_State *L);
int luaopen_moonbox_http(lua_State *L);
int luaopen_moonbox_httpd(lua_State *L);
int luaopen_moonbox_lineedit(lua_State *L);
int luaopen_moonbox_pg(lua_State *L);
int luaopen_moonbox_proc(lua_State *L);
int luaopen_moonbox_sse(lua_State *L);
int luaopen_moonbox_store(lua_State *L);
int luaopen_moonbox_strings(lua_State *L);
int luaopen_moonbox_sys(lua_State *L);
int luaopen_moonbox_timer(lua_State *L);

/* Creates the moonbox binary's Lua state: LUA_EXTRASPACE is zeroed before any coroutine exists
 * (so task lookup is one load), standard libraries opened, C modules preloaded. */
lua_State *mb_main_state(void);

/* Pushes {event=, data=, id=?, retry=?} for a parsed Server-Sent Event (an sse_event *; the
 * type stays in runtime/sse.h). Shared by moonbox.sse and http's response:read_event. */
void mb_push_sse_event(lua_State *L, const void *event);

/* Registers every C module above in package.preload. */
void mb_preload_modules(lua_State *L);

#endif
