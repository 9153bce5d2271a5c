/*
 * modules.c — the list of moonbox's C modules, for two hosts: the moonbox binary (which puts
 * them in package.preload) and plain lua5.4, which loads the shared library moonbox.so and finds
 * each luaopen_moonbox_* through its all-in-one C loader.
 */
#include "mb.h"

#include <lualib.h>

static const luaL_Reg c_modules[] = {
    {"moonbox.core", luaopen_moonbox_core},
    {"moonbox.http", luaopen_moonbox_http},
    {"moonbox.httpd", luaopen_moonbox_httpd},
    {"moonbox.proc", luaopen_moonbox_proc},
    {"moonbox.sse", luaopen_moonbox_sse},
    {"moonbox.store", luaopen_moonbox_store},
    {"moonbox.strings", luaopen_moonbox_strings},
    {"moonbox.timer", luaopen_moonbox_timer},
    {"moonbox.lineedit", luaopen_moonbox_lineedit},
    {"moonbox.cron", luaopen_moonbox_cron},
    {"moonbox.sys", luaopen_moonbox_sys},
    {"moonbox.pg", luaopen_moonbox_pg},
    {NULL, NULL},
};

void mb_preload_modules(lua_State *L)
{
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    for (const luaL_Reg *m = c_modules; m->name; m++) {
        lua_pushcfunction(L, m->func);
        lua_setfield(L, -2, m->name);
    }
    lua_pop(L, 1);
}

lua_State *mb_main_state(void)
{
    lua_State *L = luaL_newstate();
    if (!L) return NULL;
    /* Coroutines copy the main thread's extra space when created: zero it first. */
    *(mb_task **)lua_getextraspace(L) = NULL;
    lua_pushboolean(L, 1);
    lua_setfield(L, LUA_REGISTRYINDEX, "moonbox.extraspace_zeroed");
    luaL_openlibs(L);
    mb_preload_modules(L);
    return L;
}
