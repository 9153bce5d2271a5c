/*
 * sse.c — module moonbox.sse: the incremental Server-Sent Events parser (runtime/sse.c) for
 * Lua code that gets its bytes from elsewhere (a process, a file). http's response:read_event()
 * uses the same parser directly. Also the exec output decoder (runtime/output_event.c) that
 * response:read_output uses, so that it can be compared with the general JSON decoder.
 */
#include "mb.h"

#include "output_event.h"
#include "sse.h"

#define PARSER_MT "moonbox.sse.Parser"

typedef struct lparser {
    sse_parser p;
    int live;
} lparser;

void mb_push_sse_event(lua_State *L, const void *event)
{
    const sse_event *ev = (const sse_event *)event;
    lua_createtable(L, 0, 4);
    lua_pushlstring(L, ev->event, ev->event_len);
    lua_setfield(L, -2, "event");
    lua_pushlstring(L, ev->data, ev->data_len);
    lua_setfield(L, -2, "data");
    if (ev->id_len) {
        lua_pushlstring(L, ev->id, ev->id_len);
        lua_setfield(L, -2, "id");
    }
    if (ev->retry_ms >= 0) {
        lua_pushinteger(L, ev->retry_ms);
        lua_setfield(L, -2, "retry");
    }
}

static int collect(void *ud, const sse_event *ev)
{
    lua_State *L = (lua_State *)ud;
    mb_push_sse_event(L, ev);
    lua_rawseti(L, -2, (lua_Integer)luaL_len(L, -2) + 1);
    return 0;
}

/* sse.parser([max_event_bytes]) -> Parser. The limit (default 16 MiB) bounds one event and one
 * line. Does not yield. */
static int l_parser(lua_State *L)
{
    lua_Integer max = luaL_optinteger(L, 1, 16 * 1024 * 1024);
    luaL_argcheck(L, max > 0, 1, "the event size limit must be positive");
    lparser *lp = (lparser *)lua_newuserdatauv(L, sizeof *lp, 0);
    sse_parser_init(&lp->p, (size_t)max, collect, NULL);
    lp->live = 1;
    luaL_setmetatable(L, PARSER_MT);
    return 1;
}

static int finish_call(lua_State *L, lparser *lp, int rc)
{
    lp->p.ud = NULL;
    if (rc < 0) {
        return mb_error_raise(L, "sse.parse", "malformed_stream", "event stream: %s",
                              sse_parser_error(&lp->p));
    }
    return 1;
}

/* parser:feed(chunk) -> array of events ({event, data, id?, retry?}) completed by chunk.
 * Raises a structured error (code malformed_stream) when an event exceeds the limit. */
static int p_feed(lua_State *L)
{
    lparser *lp = (lparser *)luaL_checkudata(L, 1, PARSER_MT);
    size_t len;
    const char *chunk = luaL_checklstring(L, 2, &len);
    if (!lp->live) return luaL_error(L, "sse parser: already closed");
    lua_newtable(L);
    lp->p.ud = L;
    return finish_call(L, lp, sse_parser_feed(&lp->p, chunk, len));
}

/* parser:finish() -> array with the final event if the stream ended without a blank line. */
static int p_finish(lua_State *L)
{
    lparser *lp = (lparser *)luaL_checkudata(L, 1, PARSER_MT);
    if (!lp->live) return luaL_error(L, "sse parser: already closed");
    lua_newtable(L);
    lp->p.ud = L;
    return finish_call(L, lp, sse_parser_finish(&lp->p));
}

static int p_gc(lua_State *L)
{
    lparser *lp = (lparser *)luaL_checkudata(L, 1, PARSER_MT);
    if (lp->live) sse_parser_free(&lp->p);
    lp->live = 0;
    return 0;
}

/* sse.decode_output(data) -> stream, bytes when data is an output event's payload of the usual
 * shape ({"stream":"stdout"|"stderr","data":"..."}), else nil (decode it as JSON instead).
 * Does not yield. */
static int l_decode_output(lua_State *L)
{
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    luaL_Buffer b;
    char *out = luaL_buffinitsize(L, &b, n ? n : 1);
    size_t len = 0;
    int kind = output_event_decode(s, n, out, &len);
    if (kind == OUTPUT_NOT_SHAPE) {
        lua_pushnil(L);
        return 1;
    }
    luaL_pushresultsize(&b, len);
    lua_pushstring(L, kind == OUTPUT_STDOUT ? "stdout" : "stderr");
    lua_insert(L, -2);
    return 2;
}

int luaopen_moonbox_sse(lua_State *L)
{
    static const luaL_Reg methods[] = {
        {"feed", p_feed}, {"finish", p_finish}, {"close", p_gc}, {NULL, NULL}};
    static const luaL_Reg meta[] = {{"__gc", p_gc}, {"__close", p_gc}, {NULL, NULL}};
    mb_newclass(L, PARSER_MT, methods, meta);
    lua_newtable(L);
    lua_pushcfunction(L, l_parser);
    lua_setfield(L, -2, "parser");
    lua_pushcfunction(L, l_decode_output);
    lua_setfield(L, -2, "decode_output");
    return 1;
}
