/*
 * timer.c — module moonbox.timer: waiting until a wall-clock time, for `moonbox schedule`.
 *
 * task.sleep is an ev_timer: it counts seconds on the monotonic clock, so a sleep of eight hours
 * armed before the system clock is stepped (NTP, a suspend and resume) ends eight monotonic
 * hours later, at the wrong wall time. A schedule fires at wall times, so it waits here on an
 * ev_periodic in absolute mode: libev re-checks it against the wall clock whenever the clock
 * jumps, and nothing wakes in between (no polling). The watcher lives in a userdata kept on the
 * waiting coroutine's stack, so it is freed with the wait; the abort hook stops it when the
 * task is cancelled or its deadline fires.
 */
#include "mb.h"

typedef struct wall_wait {
    ev_periodic w;
    mb_task *t;
} wall_wait;

static void wall_cb(struct ev_loop *loop, ev_periodic *w, int revents)
{
    (void)loop;
    (void)revents;
    mb_task_wake(((wall_wait *)w->data)->t);
}

static void wall_abort(mb_task *t, void *ud)
{
    ev_periodic_stop(t->rt->loop, &((wall_wait *)ud)->w);
}

static int wall_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)status;
    (void)ctx;
    lua_settop(L, 0);
    return 0;
}

/* timer.sleep_until(t): waits until the wall clock reads t (seconds since the epoch, with a
 * fraction); returns at once when t is not in the future. Raises "cancelled"/"deadline" where
 * it waits like every wait. [yields] */
static int l_sleep_until(lua_State *L)
{
    double at = luaL_checknumber(L, 1);
    mb_task *t = mb_task_check_yieldable(L, "timer.sleep_until");
    if (at != at) return luaL_argerror(L, 1, "expected a time, got NaN");
    if (at <= ev_time() && !t->cancel_pending && t->deadline_pending < 0) return 0;
    wall_wait *ww = (wall_wait *)lua_newuserdatauv(L, sizeof *ww, 0);
    ww->t = t;
    ev_periodic_init(&ww->w, wall_cb, at, 0, 0);
    ww->w.data = ww;
    ev_periodic_start(t->rt->loop, &ww->w);
    return mb_task_park(L, t, wall_abort, ww, 0, wall_k);
}

int luaopen_moonbox_timer(lua_State *L)
{
    static const luaL_Reg funcs[] = {
        {"sleep_until", l_sleep_until},
        {NULL, NULL},
    };
    luaL_newlib(L, funcs);
    return 1;
}
