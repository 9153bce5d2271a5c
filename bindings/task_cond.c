/*
 * task_cond.c — conditions: moonbox.core's cond(), a FIFO wait queue of parked tasks
 * (cond:wait [yields], cond:signal, cond:broadcast, cond:waiting), the primitive lua/moonbox/
 * task.lua builds its channels and semaphores on.
 *
 * Part of the scheduler (bindings/task.c; mb.h states the invariants): waiting parks the task on
 * an mb_waitq; a signal only queues it, the drain resumes it.
 */
#include "mb.h"
#include "task_internal.h"

#include <string.h>

#define COND_MT "moonbox.Cond"

/* ---- conds --------------------------------------------------------------------------------- */

typedef struct mb_cond {
    mb_waitq q;
} mb_cond;

/* core.cond() -> Cond: a FIFO wait queue; cond:wait() [yields], cond:signal(), cond:broadcast(). */
static int l_cond(lua_State *L)
{
    mb_cond *c = (mb_cond *)lua_newuserdatauv(L, sizeof(mb_cond), 0);
    memset(c, 0, sizeof *c);
    luaL_setmetatable(L, COND_MT);
    return 1;
}

static int cond_wait_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)L;
    (void)status;
    (void)ctx;
    return 0;
}

static int cond_wait(lua_State *L)
{
    mb_cond *c = (mb_cond *)luaL_checkudata(L, 1, COND_MT);
    mb_task *t = mb_task_check_yieldable(L, "cond:wait");
    mb_waitq_push(&c->q, t);
    return mb_task_park(L, t, mbt_abort_waitq, NULL, 0, cond_wait_k);
}

static int cond_signal(lua_State *L)
{
    mb_cond *c = (mb_cond *)luaL_checkudata(L, 1, COND_MT);
    lua_pushboolean(L, mb_waitq_wake_one(&c->q));
    return 1;
}

static int cond_broadcast(lua_State *L)
{
    mb_cond *c = (mb_cond *)luaL_checkudata(L, 1, COND_MT);
    mb_waitq_wake_all(&c->q);
    return 0;
}

static int cond_waiting(lua_State *L)
{
    mb_cond *c = (mb_cond *)luaL_checkudata(L, 1, COND_MT);
    int n = 0;
    for (mb_task *t = c->q.head; t; t = t->wq_next)
        n++;
    lua_pushinteger(L, n);
    return 1;
}

static const luaL_Reg cond_methods[] = {
    {"wait", cond_wait},
    {"signal", cond_signal},
    {"broadcast", cond_broadcast},
    {"waiting", cond_waiting},
    {NULL, NULL},
};

void mbt_open_conds(lua_State *L)
{
    mb_newclass(L, COND_MT, cond_methods, NULL);
    lua_pushcfunction(L, l_cond);
    lua_setfield(L, -2, "cond");
}
