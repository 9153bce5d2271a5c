/*
 * modules.c — the list of moonbox's C modules built into the binary, which puts them in
 * package.preload. The modules that bring large libraries (moonbox.http: libcurl, moonbox.httpd:
 * libmicrohttpd, moonbox.store: SQLite, moonbox.pg: libpq, moonbox.lineedit: libedit,
 * moonbox.archive: libarchive)
 * are not here: they are lib/exe/moonbox/NAME.so, found through the binary's package.cpath by
 * the first require (CMakeLists.txt, moonbox_lazy_module). Plain lua5.4 loads the shared
 * library moonbox.so, which has them all, and finds each luaopen_moonbox_* through its
 * all-in-one C loader.
 */
#include "mb.h"

#include <lualib.h>

static const luaL_Reg c_modules[] = {
    {"moonbox.core", luaopen_moonbox_core},
    {"moonbox.proc", luaopen_moonbox_proc},
    {"moonbox.sse", luaopen_moonbox_sse},
    {"moonbox.strings", luaopen_moonbox_strings},
    {"moonbox.timer", luaopen_moonbox_timer},
    {"moonbox.cron", luaopen_moonbox_cron},
    {"moonbox.sys", luaopen_moonbox_sys},
#ifdef MOONBOX_SANITIZED
    /* Linked into a sanitized binary rather than loaded (see CMakeLists.txt). */
    {"moonbox.http", luaopen_moonbox_http},
    {"moonbox.httpd", luaopen_moonbox_httpd},
    {"moonbox.store", luaopen_moonbox_store},
    {"moonbox.lineedit", luaopen_moonbox_lineedit},
    {"moonbox.pg", luaopen_moonbox_pg},
#endif
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
