/*
 * strings.c — module moonbox.strings: byte-level text work that is too slow in Lua on the hot
 * path of exec output (every byte a sandbox prints passes through json_quote on its way into
 * an SSE event).
 */
#include "mb.h"

#include <stdint.h>
#include <stdio.h>
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

/* strings.digest(s) -> 16 hex digits: the 64-bit FNV-1a hash of s. For telling one request
 * body from another in a run's journal (moonbox.durable), not for security: equal inputs give
 * equal digests, and a changed body almost certainly a changed one. Does not yield. */
static int l_digest(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ull;
    }
    char out[17];
    snprintf(out, sizeof out, "%016llx", (unsigned long long)h);
    lua_pushlstring(L, out, 16);
    return 1;
}

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* strings.base64(s) -> s in base64 (RFC 4648, with padding). Does not yield. */
static int l_base64(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    luaL_Buffer b;
    char *p = luaL_buffinitsize(L, &b, (n + 2) / 3 * 4 + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16;
        if (i + 1 < n) v |= (uint32_t)s[i + 1] << 8;
        if (i + 2 < n) v |= s[i + 2];
        p[o++] = B64[(v >> 18) & 63];
        p[o++] = B64[(v >> 12) & 63];
        p[o++] = i + 1 < n ? B64[(v >> 6) & 63] : '=';
        p[o++] = i + 2 < n ? B64[v & 63] : '=';
    }
    luaL_pushresultsize(&b, o);
    return 1;
}

/* strings.unbase64(s) -> the bytes s encodes, or nil and a message when s is not base64 of
 * whole groups (padding included). Does not yield. */
static int l_unbase64(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    if (n % 4 != 0) {
        lua_pushnil(L);
        lua_pushliteral(L, "base64 text must come in groups of 4 characters");
        return 2;
    }
    luaL_Buffer b;
    char *p = luaL_buffinitsize(L, &b, n / 4 * 3 + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        uint32_t v = 0;
        int pad = 0;
        for (int k = 0; k < 4; k++) {
            unsigned char c = s[i + k];
            const char *at = c ? strchr(B64, c) : NULL;
            if (c == '=' && i + 4 == n && k >= 2) {
                pad++;
                v <<= 6;
                continue;
            }
            if (!at || pad) {
                lua_pushnil(L);
                lua_pushliteral(L, "not base64");
                return 2;
            }
            v = (v << 6) | (uint32_t)(at - B64);
        }
        p[o++] = (char)(v >> 16);
        if (pad < 2) p[o++] = (char)(v >> 8);
        if (pad < 1) p[o++] = (char)v;
    }
    luaL_pushresultsize(&b, o);
    return 1;
}

int luaopen_moonbox_strings(lua_State *L)
{
    static const luaL_Reg funcs[] = {
        {"json_quote", l_json_quote},
        {"utf8_valid", l_utf8_valid},
        {"utf8_cut", l_utf8_cut},
        {"digest", l_digest},
        {"base64", l_base64},
        {"unbase64", l_unbase64},
        {NULL, NULL},
    };
    luaL_newlib(L, funcs);
    return 1;
}
