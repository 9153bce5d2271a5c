/*
 * task_signal.c — signals: moonbox.core's signal_cancel, signal_restore and signal_received.
 * While enabled, SIGINT or SIGTERM cancels the task core.run drives (the program unwinds
 * through its guards); a second SIGINT exits at once with status 130.
 *
 * Part of the scheduler (bindings/task.c; mb.h states the invariants). The ev_signal callback
 * only cancels the root task, which the drain then resumes with the cancellation.
 */
#include "mb.h"
#include "task_internal.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

static const char *g_signal_got; /* name of the first signal received, or NULL */
static int g_signal_count;
static ev_signal g_sig_watchers[2];
static const struct {
    const char *name;
    int num;
} g_signals[2] = {{"INT", SIGINT}, {"TERM", SIGTERM}};

static void signal_cb(struct ev_loop *loop, ev_signal *w, int revents)
{
    (void)loop;
    (void)revents;
    int i = (int)(w - g_sig_watchers);
    g_signal_count++;
    if (g_signal_got && g_signal_count > 1 && g_signals[i].num == SIGINT) {
        /* Second Ctrl-C: the user wants out now; the ledger (moonbox reap) cleans up. */
        static const char msg[] = "moonbox: second SIGINT, exiting without unwinding\n";
        ssize_t r = write(2, msg, sizeof msg - 1);
        (void)r;
        _exit(130);
    }
    if (!g_signal_got) g_signal_got = g_signals[i].name;
    mb_task *root = mbt_root();
    if (root) mb_task_cancel(root);
}

/* core.signal_cancel({"INT","TERM"}) -> token: until signal_restore, those signals cancel the
 * task core.run drives; a second SIGINT exits at once with status 130. */
static int l_signal_cancel(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    luaL_checktype(L, 1, LUA_TTABLE);
    g_signal_got = NULL;
    g_signal_count = 0;
    lua_Integer n = luaL_len(L, 1);
    for (lua_Integer k = 1; k <= n; k++) {
        lua_geti(L, 1, k);
        const char *name = luaL_checkstring(L, -1);
        for (int i = 0; i < 2; i++) {
            if (strcmp(name, g_signals[i].name) == 0 && !ev_is_active(&g_sig_watchers[i])) {
                ev_signal_init(&g_sig_watchers[i], signal_cb, g_signals[i].num);
                ev_signal_start(rt->loop, &g_sig_watchers[i]);
                ev_unref(rt->loop);
            }
        }
        lua_pop(L, 1);
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* core.signal_restore(token): stops the watchers signal_cancel started. */
static int l_signal_restore(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    for (int i = 0; i < 2; i++) {
        if (ev_is_active(&g_sig_watchers[i])) {
            ev_ref(rt->loop);
            ev_signal_stop(rt->loop, &g_sig_watchers[i]);
        }
    }
    return 0;
}

/* core.signal_received() -> "INT"|"TERM"|nil. */
static int l_signal_received(lua_State *L)
{
    if (!g_signal_got) return 0;
    lua_pushstring(L, g_signal_got);
    return 1;
}

void mbt_open_signals(lua_State *L)
{
    static const luaL_Reg funcs[] = {
        {"signal_cancel", l_signal_cancel},
        {"signal_restore", l_signal_restore},
        {"signal_received", l_signal_received},
        {NULL, NULL},
    };
    luaL_setfuncs(L, funcs, 0);
}
