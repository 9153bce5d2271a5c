/*
 * task_facts.c — process facts moonbox.core reports: the scheduler's counts (stats, refs),
 * whether a descriptor is a terminal (isatty), the libev version.
 *
 * Read-only: nothing here changes a task or the loop. Part of moonbox.core, registered by
 * bindings/task.c; the registry-ref leak check that uses refs stays with the scheduler there.
 */
#include "mb.h"
#include "task_internal.h"

#include <unistd.h>

/* core.stats() -> {tasks, refs, queued}. */
static int l_stats(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    int q = 0;
    for (mb_task *t = rt->rq_head; t; t = t->rq_next)
        q++;
    lua_createtable(L, 0, 4);
    mb_setfield_int(L, -1, "tasks", rt->tasks_live);
    mb_setfield_int(L, -1, "refs", rt->refs_live);
    mb_setfield_int(L, -1, "queued", q);
    mb_setfield_int(L, -1, "unobserved_failures", rt->unobserved_failures);
    return 1;
}

/* core.refs() -> the number of registry refs held by moonbox right now. */
static int l_refs(lua_State *L)
{
    lua_pushinteger(L, mb_runtime_get(L)->refs_live);
    return 1;
}

/* core.isatty(fd) -> whether file descriptor fd (0, 1, 2, ...) is a terminal. */
static int l_isatty(lua_State *L)
{
    lua_pushboolean(L, isatty((int)luaL_checkinteger(L, 1)) == 1);
    return 1;
}

/* core.libev_version() -> "4.33". */
static int l_libev_version(lua_State *L)
{
    lua_pushfstring(L, "%d.%d", ev_version_major(), ev_version_minor());
    return 1;
}

void mbt_open_facts(lua_State *L)
{
    static const luaL_Reg funcs[] = {
        {"stats", l_stats},   {"refs", l_refs}, {"libev_version", l_libev_version},
        {"isatty", l_isatty}, {NULL, NULL},
    };
    luaL_setfuncs(L, funcs, 0);
}
