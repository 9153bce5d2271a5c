/*
 * strings.c — module moonbox.strings: byte-level text work that is too slow in Lua on the hot
 * path of exec output (every byte a sandbox prints passes through json_quote on its way into
 * an SSE event).
 */
#include "mb.h"

#include <stdlib.h>
#include <string.h>

#include "jsonq.h"

/* The scratch buffer json_quote writes into, kept between calls (exec output comes in chunks of
 * the same size, so after the first one nothing is allocated). Larger strings go through a
 * luaL_Buffer, which Lua frees even when pushing the result raises. Lua runs on one thread. */
#define SCRATCH_KEEP (4u << 20)
static char *scratch;
static size_t scratch_cap;

/* strings.json_quote(s) -> s as a JSON string literal (with the quotes): '"' and '\' and
 * control characters escaped, and every byte that is not part of valid UTF-8 replaced by
 * U+FFFD, in one pass (runtime/jsonq.c). Does not yield. */
static int l_json_quote(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    size_t need = JSONQ_BOUND(n);
    if (need <= SCRATCH_KEEP) {
        if (need > scratch_cap) {
            char *p = (char *)realloc(scratch, need);
            if (!p) return luaL_error(L, "strings.json_quote: out of memory");
            scratch = p;
            scratch_cap = need;
        }
        lua_pushlstring(L, scratch, jsonq_quote(scratch, s, n));
        return 1;
    }
    luaL_Buffer b;
    char *p = luaL_buffinitsize(L, &b, need);
    luaL_pushresultsize(&b, jsonq_quote(p, s, n));
    return 1;
}

/* strings.utf8_valid(s) -> boolean: whether s is entirely valid UTF-8. Does not yield. */
static int l_utf8_valid(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    lua_pushboolean(L, jsonq_utf8_valid(s, n));
    return 1;
}

/* strings.utf8_cut(s[, max]) -> n: the length of the longest prefix of s, at most max bytes
 * (default #s), that does not end inside a UTF-8 sequence (runtime/jsonq.c's one boundary
 * rule). With max omitted it splits off an incomplete sequence at the end. Does not yield. */
static int l_utf8_cut(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    lua_Integer max = luaL_optinteger(L, 2, (lua_Integer)n);
    luaL_argcheck(L, max >= 0, 2, "max must not be negative");
    lua_pushinteger(L, (lua_Integer)jsonq_utf8_cut(s, n, (size_t)max));
    return 1;
}

int luaopen_moonbox_strings(lua_State *L)
{
    static const luaL_Reg funcs[] = {
        {"json_quote", l_json_quote},
        {"utf8_valid", l_utf8_valid},
        {"utf8_cut", l_utf8_cut},
        {NULL, NULL},
    };
    luaL_newlib(L, funcs);
    return 1;
}
