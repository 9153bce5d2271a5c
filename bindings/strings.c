/*
 * strings.c — module moonbox.strings: byte-level text work that is too slow in Lua on the hot
 * path of exec output (every byte a sandbox prints passes through json_quote on its way into
 * an SSE event).
 */
#include "mb.h"

#include <string.h>

/* Length of the valid UTF-8 sequence at s[0..n), or 0 when it is invalid (overlong forms,
 * surrogates and code points above U+10FFFF are invalid, as in RFC 3629). */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    if (c < 0xC2) return 0;
    if (c < 0xE0) return (n >= 2 && (s[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c < 0xF0) {
        if (n < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && s[1] < 0xA0) return 0;  /* overlong */
        if (c == 0xED && s[1] >= 0xA0) return 0; /* surrogate */
        return 3;
    }
    if (c < 0xF5) {
        if (n < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80)
            return 0;
        if (c == 0xF0 && s[1] < 0x90) return 0;  /* overlong */
        if (c == 0xF4 && s[1] >= 0x90) return 0; /* above U+10FFFF */
        return 4;
    }
    return 0;
}

/* strings.json_quote(s) -> s as a JSON string literal (with the quotes): '"' and '\' and
 * control characters escaped, and every byte that is not part of valid UTF-8 replaced by
 * U+FFFD, in one pass. Does not yield. */
static int l_json_quote(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    luaL_Buffer b;
    static const char hex[] = "0123456789abcdef";
    luaL_buffinitsize(L, &b, n + n / 8 + 2);
    luaL_addchar(&b, '"');
    size_t i = 0;
    while (i < n) {
        /* Copy the run of bytes that need nothing. */
        size_t j = i;
        while (j < n && s[j] >= 0x20 && s[j] < 0x80 && s[j] != '"' && s[j] != '\\')
            j++;
        if (j > i) luaL_addlstring(&b, (const char *)s + i, j - i);
        i = j;
        if (i >= n) break;
        unsigned c = s[i];
        if (c >= 0x80) {
            size_t k = utf8_seq(s + i, n - i);
            if (k) {
                luaL_addlstring(&b, (const char *)s + i, k);
                i += k;
            } else {
                luaL_addstring(&b, "\xEF\xBF\xBD");
                i++;
            }
            continue;
        }
        switch (c) {
        case '"':
            luaL_addstring(&b, "\\\"");
            break;
        case '\\':
            luaL_addstring(&b, "\\\\");
            break;
        case '\n':
            luaL_addstring(&b, "\\n");
            break;
        case '\r':
            luaL_addstring(&b, "\\r");
            break;
        case '\t':
            luaL_addstring(&b, "\\t");
            break;
        case '\b':
            luaL_addstring(&b, "\\b");
            break;
        case '\f':
            luaL_addstring(&b, "\\f");
            break;
        default: {
            char esc[7] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15], 0};
            luaL_addlstring(&b, esc, 6);
        }
        }
        i++;
    }
    luaL_addchar(&b, '"');
    luaL_pushresult(&b);
    return 1;
}

/* strings.utf8_valid(s) -> boolean: whether s is entirely valid UTF-8. Does not yield. */
static int l_utf8_valid(lua_State *L)
{
    size_t n;
    const unsigned char *s = (const unsigned char *)luaL_checklstring(L, 1, &n);
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t k = utf8_seq(s + i, n - i);
        if (!k) {
            lua_pushboolean(L, 0);
            return 1;
        }
        i += k;
    }
    lua_pushboolean(L, 1);
    return 1;
}

int luaopen_moonbox_strings(lua_State *L)
{
    static const luaL_Reg funcs[] = {
        {"json_quote", l_json_quote},
        {"utf8_valid", l_utf8_valid},
        {NULL, NULL},
    };
    luaL_newlib(L, funcs);
    return 1;
}
