/*
 * errors.c — structured errors (docs/architecture.md, rule 8) and recipe locations.
 *
 * An operational failure is a table with metatable "moonbox.Error" carrying op, code, message,
 * where (file:line of the nearest recipe frame), traceback, and whatever the raising layer knows
 * (status, request_id, retryable, sandbox_id, ...). tostring() gives one readable line. Lua code
 * makes them through moonbox.errors, C code through mb_error_new; both end up here. Also the
 * small helpers every binding shares to fill tables (mb_setfield_*) and make metatables
 * (mb_newclass).
 */
#include "mb.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define ERROR_MT "moonbox.Error"

/* A frame belongs to moonbox's own Lua library when its chunk comes from lua/moonbox/. */
static int is_library_source(const char *src)
{
    return src && src[0] == '@' && strstr(src, "/lua/moonbox/") != NULL;
}

int mb_where(lua_State *L, char *buf, size_t len)
{
    lua_Debug ar;
    const char *fallback = NULL;
    int fallback_line = 0;
    char fb[200];
    for (int level = 1; lua_getstack(L, level, &ar); level++) {
        if (!lua_getinfo(L, "Sl", &ar)) break;
        if (ar.currentline <= 0) continue; /* C function or no line info */
        if (!fallback) {
            snprintf(fb, sizeof fb, "%s", ar.short_src);
            fallback = fb;
            fallback_line = ar.currentline;
        }
        if (is_library_source(ar.source)) continue;
        snprintf(buf, len, "%s:%d", ar.short_src, ar.currentline);
        return 1;
    }
    /* No recipe frame on this stack: the task runs library code only (a reader task, a worker
     * of task.map) or the recipe's frame left by a tail call. The recipe line that spawned the
     * task (or its nearest ancestor) is then the place a person can act on. */
    if (mb_task_recipe_site(L, buf, len)) return 1;
    if (fallback)
        snprintf(buf, len, "%s:%d", fallback, fallback_line);
    else
        snprintf(buf, len, "?");
    return 0;
}

void mb_setfield_str(lua_State *L, int idx, const char *k, const char *v)
{
    idx = lua_absindex(L, idx);
    if (!v) return;
    lua_pushstring(L, v);
    lua_setfield(L, idx, k);
}

void mb_setfield_int(lua_State *L, int idx, const char *k, lua_Integer v)
{
    idx = lua_absindex(L, idx);
    lua_pushinteger(L, v);
    lua_setfield(L, idx, k);
}

void mb_setfield_bool(lua_State *L, int idx, const char *k, int v)
{
    idx = lua_absindex(L, idx);
    lua_pushboolean(L, v);
    lua_setfield(L, idx, k);
}

void mb_newclass_index(lua_State *L, const char *tname, const luaL_Reg *methods,
                       lua_CFunction index, const luaL_Reg *metamethods)
{
    if (luaL_newmetatable(L, tname)) {
        if (methods) {
            lua_newtable(L);
            luaL_setfuncs(L, methods, 0);
            if (index) lua_pushcclosure(L, index, 1);
            lua_setfield(L, -2, "__index");
        }
        if (metamethods) luaL_setfuncs(L, metamethods, 0);
    }
    lua_pop(L, 1);
}

void mb_newclass(lua_State *L, const char *tname, const luaL_Reg *methods,
                 const luaL_Reg *metamethods)
{
    mb_newclass_index(L, tname, methods, NULL, metamethods);
}

static void error_newv(lua_State *L, const char *op, const char *code, const char *fmt, va_list ap)
{
    char where[256];
    mb_where(L, where, sizeof where);
    lua_createtable(L, 0, 8);
    int e = lua_gettop(L);
    mb_setfield_str(L, e, "op", op);
    mb_setfield_str(L, e, "code", code);
    lua_pushvfstring(L, fmt, ap);
    lua_setfield(L, e, "message");
    mb_setfield_str(L, e, "where", where);
    luaL_traceback(L, L, NULL, 1);
    lua_setfield(L, e, "traceback");
    luaL_setmetatable(L, ERROR_MT);
}

void mb_error_new(lua_State *L, const char *op, const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    error_newv(L, op, code, fmt, ap);
    va_end(ap);
}

int mb_error_raise(lua_State *L, const char *op, const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    error_newv(L, op, code, fmt, ap);
    va_end(ap);
    return lua_error(L);
}

/* Appends " [label value" or ", label value" for a field that is set. */
static void add_field(luaL_Buffer *b, lua_State *L, int e, const char *key, const char *label,
                      int *first)
{
    int type = lua_getfield(L, e, key);
    lua_pop(L, 1);
    if (type == LUA_TNIL) return;
    luaL_addstring(b, *first ? " [" : ", ");
    luaL_addstring(b, label);
    lua_getfield(L, e, key);
    luaL_tolstring(L, -1, NULL);
    lua_remove(L, -2);
    luaL_addvalue(b);
    *first = 0;
}

/* tostring(err): "where: op: message [status 404, code x, sandbox sbx-..., request ...]". */
static int error_tostring(lua_State *L)
{
    luaL_Buffer b;
    int e = 1;
    int first = 1;
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_buffinit(L, &b);
    if (lua_getfield(L, e, "where") == LUA_TSTRING) {
        luaL_addvalue(&b);
        luaL_addstring(&b, ": ");
    } else {
        lua_pop(L, 1);
    }
    if (lua_getfield(L, e, "op") == LUA_TSTRING) {
        luaL_addvalue(&b);
        luaL_addstring(&b, ": ");
    } else {
        lua_pop(L, 1);
    }
    if (lua_getfield(L, e, "message") != LUA_TNIL) {
        luaL_tolstring(L, -1, NULL);
        lua_remove(L, -2);
        luaL_addvalue(&b);
    } else {
        lua_pop(L, 1);
        luaL_addstring(&b, "error");
    }
    add_field(&b, L, e, "status", "status ", &first);
    add_field(&b, L, e, "code", "code ", &first);
    add_field(&b, L, e, "sandbox_id", "sandbox ", &first);
    add_field(&b, L, e, "snapshot_id", "snapshot ", &first);
    add_field(&b, L, e, "group_id", "group ", &first);
    add_field(&b, L, e, "exec_id", "exec ", &first);
    add_field(&b, L, e, "request_id", "request ", &first);
    if (!first) luaL_addstring(&b, "]");
    luaL_pushresult(&b);
    return 1;
}

/* moonbox.core.error(fields) -> err: makes a structured error from a table of fields (op, code,
 * message, ...); where and traceback are filled in when missing. Does not raise. */
static int l_error_new(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_settop(L, 1);
    if (lua_getfield(L, 1, "where") == LUA_TNIL) {
        char where[256];
        mb_where(L, where, sizeof where);
        mb_setfield_str(L, 1, "where", where);
    }
    lua_pop(L, 1);
    if (lua_getfield(L, 1, "traceback") == LUA_TNIL) {
        luaL_traceback(L, L, NULL, 1);
        lua_setfield(L, 1, "traceback");
    }
    lua_pop(L, 1);
    luaL_setmetatable(L, ERROR_MT);
    return 1;
}

/* moonbox.core.is_error(v) -> boolean: whether v is a structured moonbox error. */
static int l_is_error(lua_State *L)
{
    int is = 0;
    if (lua_istable(L, 1) && lua_getmetatable(L, 1)) {
        luaL_getmetatable(L, ERROR_MT);
        is = lua_rawequal(L, -1, -2);
        lua_pop(L, 2);
    }
    lua_pushboolean(L, is);
    return 1;
}

void mb_errors_open(lua_State *L)
{
    static const luaL_Reg methods[] = {{NULL, NULL}}; /* moonbox.errors adds them */
    static const luaL_Reg meta[] = {
        {"__tostring", error_tostring}, {"new", l_error_new}, {"is", l_is_error}, {NULL, NULL}};
    mb_newclass(L, ERROR_MT, methods, meta);
}
