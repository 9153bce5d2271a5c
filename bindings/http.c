/*
 * http.c — module moonbox.http: the HTTP client (runtime/http_client.c) as calls that park the
 * calling task.
 *
 * Ownership: a whole-body request belongs to the task that waits for it (its park operation):
 * the continuation frees it after building the response, the abort hook frees it when the task
 * is cancelled. A streamed response belongs to its Response userdata: close/__close/__gc free
 * it; a task waiting in read() is only recorded as the waiter, never as an owner. The curl
 * notify callback wakes the waiter and nothing else.
 */
#include "mb.h"

#include "http_client.h"
#include "output_event.h"
#include "sse.h"

#include <curl/curl.h>
#include <stdlib.h>
#include <string.h>

#define RESPONSE_MT "moonbox.http.Response"
#define CLIENT_KEY  "moonbox.http.client"

#define DEFAULT_MAX_BODY   (256u * 1024 * 1024)
#define DEFAULT_STREAM_BUF (64u * 1024)
#define DEFAULT_MAX_EVENT  (16u * 1024 * 1024)

/* An in-flight request and the task waiting on it. */
typedef struct http_op {
    http_request *req;
    mb_task *waiter;
    int stream;
    int closed;
    int sse_ready;
    sse_parser sse;
    lua_Integer qhead, qtail; /* read_event's queue: items qhead+1 .. qtail of the table */
    struct out_queue *outq;   /* read_output's queue, made on first use */
    char method[16];
    char url[512];
} http_op;

/* read_output's queue of decoded events: their bytes back to back in one buffer that is reused
 * (reset whenever the queue runs empty), items taken from `head` on, never shifted. */
typedef struct out_item {
    int kind;                  /* OUTPUT_STDOUT / OUTPUT_STDERR, or 0: another event, raw */
    size_t off, len;           /* the payload (decoded output bytes, or the raw data) in bytes */
    size_t name_off, name_len; /* the event name, for kind 0 */
} out_item;

typedef struct out_queue {
    char *bytes;
    size_t len, cap;
    out_item *items;
    size_t n, cap_items, head;
    int failed; /* out of memory: reported as a malformed stream */
} out_queue;

/* ---- the client ------------------------------------------------------------------------------ */

static int client_gc(lua_State *L)
{
    http_client **pc = (http_client **)lua_touserdata(L, 1);
    if (*pc) http_client_free(*pc);
    *pc = NULL;
    return 0;
}

/* The runtime's one HTTP client, created on first use and freed when the state closes. */
static http_client *get_client(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, CLIENT_KEY);
    http_client **pc = (http_client **)lua_touserdata(L, -1);
    lua_pop(L, 1);
    if (pc && *pc) return *pc;
    char err[256];
    http_client *c = http_client_new(mb_runtime_get(L)->loop, err, sizeof err);
    if (!c) luaL_error(L, "moonbox.http: %s", err);
    pc = (http_client **)lua_newuserdatauv(L, sizeof *pc, 0);
    *pc = c;
    lua_createtable(L, 0, 1);
    lua_pushcfunction(L, client_gc);
    lua_setfield(L, -2, "__gc");
    lua_setmetatable(L, -2);
    lua_setfield(L, LUA_REGISTRYINDEX, CLIENT_KEY);
    return c;
}

/* ---- building a request from a Lua table --------------------------------------------------- */

static double opt_seconds(lua_State *L, int t, const char *k)
{
    double v = 0;
    if (lua_getfield(L, t, k) != LUA_TNIL) {
        if (!lua_isnumber(L, -1)) luaL_error(L, "http: option '%s' must be a number of seconds", k);
        v = lua_tonumber(L, -1);
        if (v < 0 || v != v) luaL_error(L, "http: option '%s' must be >= 0", k);
    }
    lua_pop(L, 1);
    return v;
}

static const char *opt_string(lua_State *L, int t, const char *k)
{
    const char *s = NULL;
    int type = lua_getfield(L, t, k);
    if (type != LUA_TNIL) {
        if (type != LUA_TSTRING) luaL_error(L, "http: option '%s' must be a string", k);
        s = lua_tostring(L, -1);
    }
    lua_pop(L, 1); /* the string stays alive: it is referenced by the options table */
    return s;
}

/* Copies src into dst (n bytes), cut to fit and NUL-terminated (snprintf "%s", minus the
 * format parsing: this runs twice per request). */
static void copy_cut(char *dst, size_t n, const char *src)
{
    size_t len = strnlen(src, n - 1);
    memcpy(dst, src, len);
    dst[len] = '\0';
}

static int valid_header_text(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] == '\r' || s[i] == '\n' || s[i] == '\0') return 0;
    return 1;
}

/* The header lines of the request being started, "Name: value" each, NUL-terminated, back to
 * back; reused by every request (the lines are only read while http_request_start copies or
 * compares them, and one Lua state drives the client), so starting a request allocates nothing
 * for its headers once the buffers have grown. */
static struct {
    char *text;
    size_t len, cap;
    size_t *offs;
    const char **lines;
    size_t n, cap_n;
} g_hdr;

/* The ops of whole-body requests: a few finished ones kept for the next (like g_hdr, for the one
 * Lua state that drives the client), so a request allocates none. op_next hands out the op the
 * next request will use, zeroed, while it stays here: if reading the options raises, nothing
 * needs freeing; op_take then takes it once the request started. */
#define OPS_KEEP 16
static struct {
    http_op *spare[OPS_KEEP];
    int n;
    int closed; /* the state is closing (hdr_gc ran): ops are freed, not kept */
} g_ops;

/* Frees g_hdr's buffers and the kept ops; the __gc of a registry sentinel made by
 * luaopen_moonbox_http, so they go when the state closes (before the module itself may be
 * unloaded). */
static int hdr_gc(lua_State *L)
{
    (void)L;
    free(g_hdr.text);
    free(g_hdr.offs);
    free(g_hdr.lines);
    memset(&g_hdr, 0, sizeof g_hdr);
    while (g_ops.n > 0)
        free(g_ops.spare[--g_ops.n]);
    g_ops.closed = 1;
    return 0;
}

/* Appends a line made of a, sep and b (each with its length) to g_hdr; raises when out of
 * memory. */
static void hdr_append(lua_State *L, const char *a, size_t al, const char *sep, size_t sl,
                       const char *b, size_t bl)
{
    size_t need = al + sl + bl + 1;
    if (need > g_hdr.cap - g_hdr.len) {
        size_t cap = g_hdr.cap ? g_hdr.cap : 1024;
        while (cap - g_hdr.len < need)
            cap *= 2;
        char *t = (char *)realloc(g_hdr.text, cap);
        if (!t) luaL_error(L, "http: out of memory building request headers");
        g_hdr.text = t;
        g_hdr.cap = cap;
    }
    if (g_hdr.n + 1 >= g_hdr.cap_n) {
        size_t c = g_hdr.cap_n ? g_hdr.cap_n * 2 : 16;
        size_t *o = (size_t *)realloc(g_hdr.offs, c * sizeof *o);
        if (!o) luaL_error(L, "http: out of memory building request headers");
        g_hdr.offs = o;
        const char **l = (const char **)realloc(g_hdr.lines, c * sizeof *l);
        if (!l) luaL_error(L, "http: out of memory building request headers");
        g_hdr.lines = l;
        g_hdr.cap_n = c;
    }
    g_hdr.offs[g_hdr.n++] = g_hdr.len;
    char *p = g_hdr.text + g_hdr.len;
    memcpy(p, a, al);
    memcpy(p + al, sep, sl);
    memcpy(p + al + sl, b, bl);
    p[al + sl + bl] = '\0';
    g_hdr.len += need;
}

/* Collects opts.headers ({name = value} or {"Name: value"}) into a NULL-terminated array of
 * lines valid until the next call (NULL when there are none). Rejects CR/LF (header
 * injection). Leaves the stack as it found it. */
static const char **collect_headers(lua_State *L, int t)
{
    g_hdr.len = g_hdr.n = 0;
    int type = lua_getfield(L, t, "headers");
    if (type == LUA_TNIL) {
        lua_pop(L, 1);
        return NULL;
    }
    if (type != LUA_TTABLE) luaL_error(L, "http: option 'headers' must be a table");
    int h = lua_gettop(L);
    lua_pushnil(L);
    while (lua_next(L, h)) {
        size_t kl = 0, vl = 0;
        if (lua_type(L, -2) == LUA_TNUMBER) {
            const char *line = luaL_tolstring(L, -1, &vl);
            if (!valid_header_text(line, vl) || !memchr(line, ':', vl))
                luaL_error(L, "http: header line %q is not 'Name: value'", line);
            hdr_append(L, line, vl, "", 0, "", 0);
        } else {
            const char *k = lua_tolstring(L, -2, &kl);
            const char *v = luaL_tolstring(L, -1, &vl);
            if (!k || !valid_header_text(k, kl) || !valid_header_text(v, vl))
                luaL_error(L, "http: header %s contains a line break or NUL", k ? k : "?");
            hdr_append(L, k, kl, ": ", 2, v, vl);
        }
        lua_pop(L, 2); /* the tolstring result and the value */
    }
    lua_pop(L, 1);
    if (g_hdr.n == 0) return NULL;
    for (size_t i = 0; i < g_hdr.n; i++)
        g_hdr.lines[i] = g_hdr.text + g_hdr.offs[i];
    g_hdr.lines[g_hdr.n] = NULL;
    return g_hdr.lines;
}

/* Collects opts.resolve ({"host:port:address", ...}: CURLOPT_RESOLVE) into a NULL-terminated
 * array left on the stack (the strings stay in opts); NULL when the option is absent. */
static const char **collect_resolve(lua_State *L, int t)
{
    if (lua_getfield(L, t, "resolve") == LUA_TNIL) return NULL;
    if (!lua_istable(L, -1)) luaL_error(L, "http: option 'resolve' must be a list of strings");
    int list = lua_gettop(L);
    lua_Integer n = luaL_len(L, list);
    const char **arr = (const char **)lua_newuserdatauv(L, sizeof(char *) * (size_t)(n + 1), 0);
    for (lua_Integer i = 1; i <= n; i++) {
        lua_rawgeti(L, list, i);
        size_t len;
        const char *line = lua_tolstring(L, -1, &len);
        if (!line || !valid_header_text(line, len) || !strchr(line, ':'))
            luaL_error(L, "http: resolve entry %d must be 'host:port:address'", (int)i);
        arr[i - 1] = line; /* anchored by the list, which stays on the stack */
        lua_pop(L, 1);
    }
    arr[n] = NULL;
    return arr;
}

static void notify_cb(http_request *r, void *ud, int events)
{
    http_op *op = (http_op *)ud;
    (void)r;
    /* A whole-body request only cares about the end; a stream about every byte. */
    if (op->waiter && (op->stream || (events & HTTP_EV_DONE))) mb_task_wake(op->waiter);
}

/* The options start_op reads, in the order it reads them; a bit each in options_present. */
static const char *const option_names[] = {
    "url",           "method",          "headers",         "body",    "body_file",
    "output_file",   "accept_encoding", "connect_timeout", "timeout", "idle_timeout",
    "fresh_connect", "no_resend",       "resolve",         "buffer",  "max_body",
};
enum {
    OPT_METHOD = 1 << 1,
    OPT_HEADERS = 1 << 2,
    OPT_BODY = 1 << 3,
    OPT_BODY_FILE = 1 << 4,
    OPT_OUTPUT_FILE = 1 << 5,
    OPT_ACCEPT_ENCODING = 1 << 6,
    OPT_CONNECT_TIMEOUT = 1 << 7,
    OPT_TIMEOUT = 1 << 8,
    OPT_IDLE_TIMEOUT = 1 << 9,
    OPT_FRESH_CONNECT = 1 << 10,
    OPT_NO_RESEND = 1 << 11,
    OPT_RESOLVE = 1 << 12,
    OPT_BUFFER = 1 << 13,
    OPT_MAX_BODY = 1 << 14,
};

/* Which of option_names the table at t has (bit i for option_names[i]): one pass over its
 * keys instead of a look-up per option, most of them absent in most requests. Every bit when
 * the table has a metatable (its __index may supply any option). */
static unsigned options_present(lua_State *L, int t)
{
    if (lua_getmetatable(L, t)) {
        lua_pop(L, 1);
        return ~0u;
    }
    unsigned bits = 0;
    lua_pushnil(L);
    while (lua_next(L, t)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TSTRING) continue;
        size_t n;
        const char *k = lua_tolstring(L, -1, &n);
        for (size_t i = 0; i < sizeof option_names / sizeof option_names[0]; i++)
            if (strncmp(k, option_names[i], n + 1) == 0) {
                bits |= 1u << i;
                break;
            }
    }
    return bits;
}

/* Starts the request described by the options table at index 1 (url required; method, headers,
 * body or body_file, output_file, accept_encoding, the three timeouts in seconds,
 * fresh_connect, no_resend, resolve, buffer, max_body) on the state's client, with op as the
 * notify target and stream selecting streamed delivery. Returns op with op->req set, or NULL
 * with a structured error (op "http.request", code "request_failed", naming method and url and
 * http_request_start's err text) pushed for the caller to raise. Raises a plain error at once
 * for misuse (missing url, options of the wrong type). The stack is back at its height on entry
 * either way (plus the error on NULL). Does not yield: only the transfer runs on the loop. */
static http_op *start_op(lua_State *L, http_op *op, int stream)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    unsigned has = options_present(L, 1);
    http_request_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.url = opt_string(L, 1, "url");
    if (!spec.url) luaL_error(L, "http: option 'url' is required");
    if (has & OPT_METHOD) spec.method = opt_string(L, 1, "method");
    int top = lua_gettop(L);
    if (has & OPT_HEADERS) spec.headers = collect_headers(L, 1);
    if ((has & OPT_BODY) && lua_getfield(L, 1, "body") != LUA_TNIL) {
        if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "http: option 'body' must be a string");
        spec.body = lua_tolstring(L, -1, &spec.body_len);
        spec.has_body = 1;
    }
    if (has & OPT_BODY) lua_pop(L, 1);
    if (has & OPT_BODY_FILE) spec.body_file = opt_string(L, 1, "body_file");
    if (has & OPT_OUTPUT_FILE) spec.output_file = opt_string(L, 1, "output_file");
    if (has & OPT_ACCEPT_ENCODING) spec.accept_encoding = opt_string(L, 1, "accept_encoding");
    if (has & OPT_CONNECT_TIMEOUT)
        spec.connect_timeout_ms = (long)(opt_seconds(L, 1, "connect_timeout") * 1000);
    if (has & OPT_TIMEOUT) spec.timeout_ms = (long)(opt_seconds(L, 1, "timeout") * 1000);
    if (has & OPT_IDLE_TIMEOUT)
        spec.idle_timeout_ms = (long)(opt_seconds(L, 1, "idle_timeout") * 1000);
    if (has & OPT_FRESH_CONNECT) {
        lua_getfield(L, 1, "fresh_connect");
        spec.fresh_connect = lua_toboolean(L, -1);
        lua_pop(L, 1);
    }
    if (has & OPT_NO_RESEND) {
        if (lua_getfield(L, 1, "no_resend") == LUA_TSTRING) {
            if (strcmp(lua_tostring(L, -1), "reuse") != 0)
                luaL_error(L, "http: option 'no_resend' must be true, false or \"reuse\"");
            spec.no_resend = HTTP_NO_RESEND_REUSE;
        } else {
            spec.no_resend = lua_toboolean(L, -1) ? HTTP_NO_RESEND : 0;
        }
        lua_pop(L, 1);
    }
    /* left on the stack above top until the start */
    if (has & OPT_RESOLVE) spec.resolve = collect_resolve(L, 1);
    spec.stream = stream;
    if (has & OPT_BUFFER) {
        if (lua_getfield(L, 1, "buffer") != LUA_TNIL)
            spec.stream_buffer = (size_t)luaL_checkinteger(L, -1);
        lua_pop(L, 1);
    }
    spec.max_body = DEFAULT_MAX_BODY;
    if (has & OPT_MAX_BODY) {
        if (lua_getfield(L, 1, "max_body") != LUA_TNIL)
            spec.max_body = (size_t)luaL_checkinteger(L, -1);
        lua_pop(L, 1);
    }

    copy_cut(op->method, sizeof op->method, spec.method ? spec.method : "GET");
    copy_cut(op->url, sizeof op->url, spec.url);
    op->stream = stream;
    char err[512];
    op->req = http_request_start(get_client(L), &spec, notify_cb, op, err, sizeof err);
    lua_settop(L, top);
    if (!op->req) {
        mb_error_new(L, "http.request", "request_failed", "%s %s: %s", op->method, op->url, err);
        return NULL;
    }
    return op;
}

/* Pushes a structured error for a failed transfer. */
static void push_transfer_error(lua_State *L, http_op *op)
{
    enum http_result res = http_request_result(op->req);
    mb_error_new(L, "http.request", http_result_code(res), "%s %s: %s", op->method, op->url,
                 http_request_error(op->req));
    mb_setfield_bool(L, -1, "retryable", http_result_retryable(res));
    mb_setfield_str(L, -1, "method", op->method);
    mb_setfield_str(L, -1, "url", op->url);
    if (http_request_status(op->req) > 0)
        mb_setfield_int(L, -1, "status", http_request_status(op->req));
}

/* Whether a header before the i-th has the same name (only asked for the first HDR_CACHE: beyond
 * them the table itself is asked, as a quadratic scan would cost more). */
static int header_seen(http_request *r, size_t i, const char *name, size_t nl)
{
    for (size_t j = 0; j < i; j++) {
        const char *n, *v;
        size_t l, vl;
        http_request_header(r, j, &n, &l, &v, &vl);
        if (l == nl && memcmp(n, name, nl) == 0) return 1;
    }
    return 0;
}

/* push_headers' strings of the last response: the name and value of header i at 2i+1 and 2i+2
 * of a table in the registry (under &hdr_cache_key), for the first HDR_CACHE headers. The
 * responses of one client mostly repeat each other's headers; their strings are then taken from
 * here instead of Lua hashing and looking up each one again. */
#define HDR_CACHE 32
static const char hdr_cache_key = 0;

/* Pushes the string s (n bytes): the one in slot of the table at index cache when it has the
 * same bytes, else a new one, which is stored there. */
static void push_cached(lua_State *L, int cache, int slot, const char *s, size_t n)
{
    if (lua_rawgeti(L, cache, slot) == LUA_TSTRING) {
        size_t cl;
        const char *cs = lua_tolstring(L, -1, &cl);
        if (cl == n && memcmp(cs, s, n) == 0) return;
    }
    lua_pop(L, 1);
    lua_pushlstring(L, s, n);
    lua_pushvalue(L, -1);
    lua_rawseti(L, cache, slot);
}

/* Pushes {name = value} of the response headers (repeated names joined with ", "). */
static void push_headers(lua_State *L, http_request *r)
{
    size_t n = http_request_header_count(r);
    if (lua_rawgetp(L, LUA_REGISTRYINDEX, &hdr_cache_key) != LUA_TTABLE) {
        lua_pop(L, 1);
        lua_createtable(L, 2 * HDR_CACHE, 0);
        lua_pushvalue(L, -1);
        lua_rawsetp(L, LUA_REGISTRYINDEX, &hdr_cache_key);
    }
    int cache = lua_gettop(L);
    lua_createtable(L, 0, (int)n);
    for (size_t i = 0; i < n; i++) {
        const char *name, *value;
        size_t nl, vl;
        http_request_header(r, i, &name, &nl, &value, &vl);
        if (i < HDR_CACHE)
            push_cached(L, cache, (int)(2 * i + 1), name, nl);
        else
            lua_pushlstring(L, name, nl);
        if (i < HDR_CACHE && !header_seen(r, i, name, nl)) {
            push_cached(L, cache, (int)(2 * i + 2), value, vl);
        } else {
            lua_pushvalue(L, -1);
            if (lua_rawget(L, -3) == LUA_TSTRING) {
                lua_pushliteral(L, ", ");
                lua_pushlstring(L, value, vl);
                lua_concat(L, 3);
            } else {
                lua_pop(L, 1);
                lua_pushlstring(L, value, vl);
            }
        }
        lua_rawset(L, -3);
    }
    lua_remove(L, cache);
}

/* ---- http.request ---------------------------------------------------------------------------- */

/* The op the next request will use (still kept in g_ops), zeroed; raises when out of memory. */
static http_op *op_next(lua_State *L)
{
    if (g_ops.n == 0) {
        http_op *op = (http_op *)malloc(sizeof *op);
        if (!op) luaL_error(L, "http.request: out of memory");
        g_ops.spare[g_ops.n++] = op;
    }
    http_op *op = g_ops.spare[g_ops.n - 1];
    memset(op, 0, sizeof *op);
    return op;
}

/* Takes the op op_next handed out. */
static void op_take(void)
{
    g_ops.n--;
}

/* Gives a finished op back (or frees it when enough are kept). */
static void op_release(http_op *op)
{
    if (g_ops.n < OPS_KEEP && !g_ops.closed)
        g_ops.spare[g_ops.n++] = op;
    else
        free(op);
}

static void whole_abort(mb_task *t, void *ud)
{
    http_op *op = (http_op *)ud;
    (void)t;
    http_request_free(op->req);
    op_release(op);
}

static int whole_k(lua_State *L, int status, lua_KContext ctx)
{
    http_op *op = (http_op *)ctx;
    (void)status;
    if (!http_request_done(op->req)) { /* woken for headers: keep waiting for the end */
        mb_task *t = mb_task_of(L);
        return mb_task_park(L, t, whole_abort, op, ctx, whole_k);
    }
    op->waiter = NULL;
    if (http_request_result(op->req) != HTTP_OK) {
        push_transfer_error(L, op);
        http_request_free(op->req);
        op_release(op);
        return lua_error(L);
    }
    lua_createtable(L, 0, 5); /* status, http_version, remote_ip, headers, body */
    mb_setfield_int(L, -1, "status", http_request_status(op->req));
    int hv = http_request_http_version(op->req);
    if (hv) {
        lua_pushstring(L, hv == 10 ? "1.0" : hv == 11 ? "1.1" : hv == 20 ? "2" : "3");
        lua_setfield(L, -2, "http_version");
    }
    const char *ip = http_request_primary_ip(op->req);
    if (*ip) mb_setfield_str(L, -1, "remote_ip", ip);
    push_headers(L, op->req);
    lua_setfield(L, -2, "headers");
    size_t len;
    const char *body = http_request_body(op->req, &len);
    lua_pushlstring(L, body, len);
    lua_setfield(L, -2, "body");
    http_request_free(op->req);
    op_release(op);
    return 1;
}

/* http.request(opts) -> {status, headers, body, http_version, remote_ip}. opts: url (required),
 * method
 * ("GET"), headers ({name=value} or {"Name: value"}), body (string) or body_file (path),
 * output_file (write the body there; body is then ""), timeout / connect_timeout / idle_timeout
 * (seconds), max_body (bytes kept in memory, default 256 MiB), accept_encoding ("gzip" to request
 * and decode compressed bodies), fresh_connect (true: a new connection, so libcurl can never
 * re-send the request on its own after a reused connection died), no_resend (true: the request must
 * not be carried out twice; libcurl is kept from sending it again without a connection of its own
 * where the server multiplexes, see http_client.c; "reuse": the same on any kept-alive connection),
 * resolve ({"host:port:address"}: pin a name to an address, e.g. "localhost:8120:[::1]").
 * http_version is "1.1", "2", ... Any HTTP status is a result, not an error. Raises a structured
 * error (op "http.request", code connect_failed | dns_failed | timeout | connection_reset |
 * malformed_response | tls_failed | body_too_large | file_error | bad_url | transport_error,
 * retryable, method, url) when the transfer itself fails. [yields] */
static int l_request(lua_State *L)
{
    mb_task *t = mb_task_check_yieldable(L, "http.request");
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_settop(L, 1);
    /* op stays in g_ops until the request started: a raise while reading the options, or a
     * request that cannot start, leaves nothing to free. */
    http_op *op = op_next(L);
    if (!start_op(L, op, 0)) return lua_error(L);
    op_take();
    op->waiter = t;
    return mb_task_park(L, t, whole_abort, op, (lua_KContext)op, whole_k);
}

/* ---- http.stream and Response ---------------------------------------------------------------- */

static http_op *check_response(lua_State *L, int idx)
{
    return (http_op *)luaL_checkudata(L, idx, RESPONSE_MT);
}

static void outq_free(out_queue *q)
{
    if (!q) return;
    free(q->bytes);
    free(q->items);
    free(q);
}

static void response_release(http_op *op)
{
    outq_free(op->outq);
    op->outq = NULL;
    if (op->req) {
        http_request_free(op->req);
        op->req = NULL;
    }
    if (op->sse_ready) {
        sse_parser_free(&op->sse);
        op->sse_ready = 0;
    }
    op->closed = 1;
}

static void stream_abort(mb_task *t, void *ud)
{
    http_op *op = (http_op *)ud;
    (void)t;
    op->waiter = NULL;
}

/* Cancelling the task that waits for the headers also ends the transfer. */
static void stream_open_abort(mb_task *t, void *ud)
{
    http_op *op = (http_op *)ud;
    (void)t;
    op->waiter = NULL;
    response_release(op);
}

static int stream_open_k(lua_State *L, int status, lua_KContext ctx)
{
    http_op *op = (http_op *)ctx;
    (void)status;
    /* stack: opts, response userdata */
    if (!http_request_headers_done(op->req) && !http_request_done(op->req))
        return mb_task_park(L, mb_task_of(L), stream_open_abort, op, ctx, stream_open_k);
    op->waiter = NULL;
    if (http_request_done(op->req) && http_request_result(op->req) != HTTP_OK) {
        push_transfer_error(L, op);
        response_release(op);
        return lua_error(L);
    }
    lua_settop(L, 2);
    lua_getiuservalue(L, 2, 1);
    mb_setfield_int(L, -1, "status", http_request_status(op->req));
    push_headers(L, op->req);
    lua_setfield(L, -2, "headers");
    lua_pop(L, 1);
    return 1;
}

/* http.stream(opts) -> Response, once the response headers have arrived. opts as for
 * http.request plus buffer (bytes buffered before the transfer pauses, default 64 KiB) and
 * max_event (largest SSE event read_event accepts, default 16 MiB). The body is read with
 * resp:read() or resp:read_event(); memory stays bounded however slowly it is read. Raises as
 * http.request when the transfer fails before the headers. [yields] */
static int l_stream(lua_State *L)
{
    mb_task *t = mb_task_check_yieldable(L, "http.stream");
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_settop(L, 1);
    http_op *op = (http_op *)lua_newuserdatauv(L, sizeof *op, 1);
    memset(op, 0, sizeof *op);
    lua_newtable(L); /* fields: status, headers */
    lua_setiuservalue(L, 2, 1);
    luaL_setmetatable(L, RESPONSE_MT);
    size_t max_event = DEFAULT_MAX_EVENT;
    if (lua_getfield(L, 1, "max_event") != LUA_TNIL) max_event = (size_t)luaL_checkinteger(L, -1);
    lua_pop(L, 1);
    lua_pushvalue(L, 1);
    lua_insert(L, 1); /* opts, opts, ud: start_op reads index 1 */
    if (!start_op(L, op, 1)) {
        op->closed = 1;
        return lua_error(L);
    }
    lua_remove(L, 1); /* opts, ud */
    sse_parser_init(&op->sse, max_event, NULL, NULL);
    op->sse_ready = 1;
    op->waiter = t;
    return mb_task_park(L, t, stream_open_abort, op, (lua_KContext)op, stream_open_k);
}

/* What a reader of a streamed response has next (body_next). */
enum body_state { BODY_BYTES, BODY_END, BODY_WAIT };

/* The start of resp:read, read_event and read_output and of their continuations: the response
 * at index 1, no task waiting on it any more; raises if it was closed. */
static http_op *reader_enter(lua_State *L, const char *what)
{
    http_op *op = check_response(L, 1);
    op->waiter = NULL;
    if (op->closed) luaL_error(L, "%s: the response was closed", what);
    return op;
}

/* The step the readers share: the body bytes buffered now (BODY_BYTES, *data and *len: the
 * reader consumes them), the end of a body that arrived whole (BODY_END), or nothing yet with
 * the transfer still running (BODY_WAIT: the reader parks with reader_park). Raises the
 * transfer's structured error when it failed, with op->sse.fn reset first so that no later
 * feed calls into a stack that is gone. */
static enum body_state body_next(lua_State *L, http_op *op, const char **data, size_t *len)
{
    *data = http_request_peek(op->req, len);
    if (*len > 0) return BODY_BYTES;
    if (!http_request_done(op->req)) return BODY_WAIT;
    if (http_request_result(op->req) != HTTP_OK) {
        op->sse.fn = NULL;
        push_transfer_error(L, op);
        lua_error(L);
    }
    return BODY_END;
}

/* Parks the reading task until the transfer delivers more; k then runs again. [yields] */
static int reader_park(lua_State *L, http_op *op, lua_KFunction k)
{
    mb_task *t = mb_task_of(L);
    op->waiter = t;
    return mb_task_park(L, t, stream_abort, op, 0, k);
}

/* Raises malformed_response for the event stream of op, as reader `what`, because of `why`. */
static int raise_malformed(lua_State *L, http_op *op, const char *what, const char *why)
{
    mb_error_new(L, what, "malformed_response", "%s %s: event stream: %s", op->method, op->url,
                 why);
    return lua_error(L);
}

/* Runs reader k (read_k, read_event_k, read_output_k) on the response at index 1 for a task
 * that can wait. [yields] */
static int reader_start(lua_State *L, const char *what, lua_KFunction k)
{
    check_response(L, 1);
    mb_task_check_yieldable(L, what);
    lua_settop(L, 1);
    return k(L, LUA_OK, 0);
}

/* Returns 1 with a chunk pushed, or nil at the end; raises; parks while nothing is buffered. */
static int read_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)status;
    (void)ctx;
    http_op *op = reader_enter(L, "response:read");
    const char *data;
    size_t len;
    switch (body_next(L, op, &data, &len)) {
    case BODY_BYTES:
        lua_pushlstring(L, data, len);
        http_request_consume(op->req, len);
        return 1;
    case BODY_END:
        lua_pushnil(L);
        return 1;
    default:
        return reader_park(L, op, read_k);
    }
}

/* resp:read() -> the next chunk of the body (a string), or nil at its end. Raises the
 * transfer's structured error if it failed midway (e.g. connection_reset). [yields] */
static int resp_read(lua_State *L)
{
    return reader_start(L, "response:read", read_k);
}

typedef struct event_sink {
    lua_State *L;
    int queue;
    http_op *op;
} event_sink;

static int push_event(void *ud, const sse_event *ev)
{
    event_sink *s = (event_sink *)ud;
    lua_State *L = s->L;
    mb_push_sse_event(L, ev);
    lua_rawseti(L, s->queue, ++s->op->qtail);
    return 0;
}

/* Pops the first queued event onto the stack; returns 0 when the queue is empty. O(1): the
 * queue is read from its head index and restarts at 1 once empty. */
static int dequeue_event(lua_State *L, http_op *op, int queue)
{
    if (op->qhead == op->qtail) return 0;
    lua_Integer i = ++op->qhead;
    lua_rawgeti(L, queue, i);
    lua_pushnil(L);
    lua_rawseti(L, queue, i);
    if (op->qhead == op->qtail) op->qhead = op->qtail = 0;
    return 1;
}

/* The body of resp:read_event and its continuation after every park. Stack: 1 = the
 * response; the event queue lives in the response's user value as `events`. Returns one value
 * (the next queued event table, or nil once the body ended and the parser is finished, its
 * `finished` flag set so the end is reported once). Feeds whatever body bytes are buffered to
 * the SSE parser, which queues whole events through push_event; if none became whole and the
 * transfer is still running it parks the task (abort hook stream_abort) and comes back here.
 * Raises the transfer's structured error if it failed, "malformed_response" on bad framing,
 * and a plain error if the response was closed. op->sse.fn is NULL again on every exit so a
 * later feed never calls into a dead stack. [yields] */
static int read_event_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)status;
    (void)ctx;
    http_op *op = reader_enter(L, "response:read_event");
    lua_getiuservalue(L, 1, 1);
    if (lua_getfield(L, -1, "events") == LUA_TNIL) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_pushvalue(L, -1);
        lua_setfield(L, -3, "events");
    }
    int queue = lua_gettop(L);
    if (dequeue_event(L, op, queue)) return 1;
    event_sink sink = {L, queue, op};
    op->sse.fn = push_event;
    op->sse.ud = &sink;
    const char *data;
    size_t len;
    int rc = 0;
    enum body_state st = body_next(L, op, &data, &len);
    if (st == BODY_BYTES) {
        rc = sse_parser_feed(&op->sse, data, len);
        http_request_consume(op->req, len);
    } else if (st == BODY_END) {
        lua_getfield(L, queue - 1, "finished");
        int finished = lua_toboolean(L, -1);
        lua_pop(L, 1);
        if (!finished) {
            rc = sse_parser_finish(&op->sse);
            lua_pushboolean(L, 1);
            lua_setfield(L, queue - 1, "finished");
        }
        if (rc == 0 && !dequeue_event(L, op, queue)) lua_pushnil(L);
        if (rc == 0) {
            op->sse.fn = NULL;
            return 1;
        }
    }
    op->sse.fn = NULL;
    if (rc < 0) return raise_malformed(L, op, "response:read_event", sse_parser_error(&op->sse));
    if (dequeue_event(L, op, queue)) return 1;
    lua_settop(L, 1);
    /* bytes consumed without a whole event: look again */
    if (st == BODY_BYTES) return read_event_k(L, LUA_OK, 0);
    return reader_park(L, op, read_event_k);
}

/* resp:read_event() -> {event=, data=, id=, retry=} for the next Server-Sent Event, or nil at
 * the end of the stream (a final event without a trailing blank line is still returned).
 * Raises a structured error for a failed transfer or malformed framing. [yields] */
static int resp_read_event(lua_State *L)
{
    return reader_start(L, "response:read_event", read_event_k);
}

/* ---- resp:read_output ---------------------------------------------------------------------- */

/* Makes room for `more` bytes and one item; 0 on success. */
static int outq_reserve(out_queue *q, size_t more)
{
    if (more > q->cap - q->len) {
        size_t cap = q->cap ? q->cap : 64 * 1024;
        while (cap - q->len < more)
            cap *= 2;
        char *b = (char *)realloc(q->bytes, cap);
        if (!b) return -1;
        q->bytes = b;
        q->cap = cap;
    }
    if (q->n == q->cap_items) {
        size_t c = q->cap_items ? q->cap_items * 2 : 16;
        out_item *it = (out_item *)realloc(q->items, c * sizeof *it);
        if (!it) return -1;
        q->items = it;
        q->cap_items = c;
    }
    return 0;
}

/* The parser's callback for read_output: an output event of the usual shape is decoded into
 * the queue's bytes (joined to the item before it when that one is output of the same stream
 * and nothing came between), any other event is queued raw. Never calls Lua. */
static int queue_output(void *ud, const sse_event *ev)
{
    out_queue *q = (out_queue *)ud;
    if (outq_reserve(q, ev->data_len + ev->event_len) != 0) {
        q->failed = 1;
        return 1; /* stops the parser; reported by the reader */
    }
    if (ev->event_len == 6 && memcmp(ev->event, "output", 6) == 0) {
        size_t len = 0;
        int kind = output_event_decode(ev->data, ev->data_len, q->bytes + q->len, &len);
        if (kind != OUTPUT_NOT_SHAPE) {
            out_item *last = q->n > q->head ? &q->items[q->n - 1] : NULL;
            if (last && last->kind == kind && last->off + last->len == q->len) {
                last->len += len;
            } else {
                q->items[q->n++] = (out_item){kind, q->len, len, 0, 0};
            }
            q->len += len;
            return 0;
        }
    }
    out_item *it = &q->items[q->n++];
    it->kind = 0;
    it->name_off = q->len;
    it->name_len = ev->event_len;
    memcpy(q->bytes + q->len, ev->event, ev->event_len);
    q->len += ev->event_len;
    it->off = q->len;
    it->len = ev->data_len;
    memcpy(q->bytes + q->len, ev->data, ev->data_len);
    q->len += ev->data_len;
    return 0;
}

/* Pushes the next queued item (3 values); returns 0 when the queue is empty. */
static int outq_pop(lua_State *L, out_queue *q)
{
    if (q->head == q->n) return 0;
    out_item *it = &q->items[q->head++];
    if (it->kind) {
        lua_pushliteral(L, "output");
        if (it->kind == OUTPUT_STDOUT)
            lua_pushliteral(L, "stdout");
        else
            lua_pushliteral(L, "stderr");
    } else {
        lua_pushlstring(L, q->bytes + it->name_off, it->name_len);
        lua_pushnil(L);
    }
    lua_pushlstring(L, q->bytes + it->off, it->len);
    if (q->head == q->n) q->head = q->n = q->len = 0; /* empty: the buffers start over */
    return 3;
}

/* The body of resp:read_output and its continuation after every park. Stack: 1 = the
 * response. Returns the 3 values of outq_pop (event, stream or nil, payload) for the next
 * queued item, or one nil at the end of the stream. Buffered body bytes go through the SSE
 * parser into op->outq (queue_output, which never calls Lua); at the end of the body the parser
 * is finished once (sse_ready 1 -> 2) so a trailing event is still delivered; with no bytes and
 * the transfer still running it parks the task (abort hook stream_abort). Raises the transfer's
 * structured error if it failed, "malformed_response" on bad framing or when the queue could
 * not grow (out of memory), and a plain error if the response was closed. [yields] */
static int read_output_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)status;
    (void)ctx;
    http_op *op = reader_enter(L, "response:read_output");
    out_queue *q = op->outq;
    for (;;) {
        int n = outq_pop(L, q);
        if (n) return n;
        const char *data;
        size_t len;
        int rc = 0;
        op->sse.fn = queue_output;
        op->sse.ud = q;
        enum body_state st = body_next(L, op, &data, &len);
        if (st == BODY_BYTES) {
            rc = sse_parser_feed(&op->sse, data, len);
            http_request_consume(op->req, len);
        } else if (st == BODY_END && op->sse_ready == 1) {
            rc = sse_parser_finish(&op->sse);
            op->sse_ready = 2; /* finished: the next read ends the stream */
        } else {
            op->sse.fn = NULL;
            if (st == BODY_WAIT) return reader_park(L, op, read_output_k);
            if ((n = outq_pop(L, q))) return n;
            lua_pushnil(L);
            return 1;
        }
        op->sse.fn = NULL;
        if (rc != 0)
            return raise_malformed(L, op, "response:read_output",
                                   q->failed ? "out of memory queueing events"
                                             : sse_parser_error(&op->sse));
    }
}

/* resp:read_output() -> event, stream, payload for the next Server-Sent Event of an exec
 * stream, or nil at its end. For `output` events whose data has the usual shape
 * ({"stream":..., "data":"..."}) event is "output", stream "stdout" or "stderr" and payload the
 * decoded bytes, with consecutive output of one stream that arrived together joined into one
 * payload; for every other event stream is nil and payload is the raw data, for the caller to
 * decode. No table is built per event. Use either this or read_event on one response, not
 * both. Raises as read_event. [yields] */
static int resp_read_output(lua_State *L)
{
    http_op *op = check_response(L, 1);
    mb_task_check_yieldable(L, "response:read_output");
    lua_settop(L, 1);
    if (!op->outq && !op->closed) {
        op->outq = (out_queue *)calloc(1, sizeof *op->outq);
        if (!op->outq) return luaL_error(L, "response:read_output: out of memory");
    }
    return read_output_k(L, LUA_OK, 0);
}

/* resp:close(): aborts the transfer if it is still running; idempotent. */
static int resp_close(lua_State *L)
{
    http_op *op = check_response(L, 1);
    if (op->waiter) return luaL_error(L, "response:close: a task is still reading this response");
    response_release(op);
    return 0;
}

static int resp_gc(lua_State *L)
{
    http_op *op = (http_op *)lua_touserdata(L, 1);
    op->waiter = NULL;
    response_release(op);
    return 0;
}

/* resp:stats() -> {peak_buffered = bytes, pauses = n}: how far the buffer grew and how often
 * the transfer was paused for a slow reader. */
static int resp_stats(lua_State *L)
{
    http_op *op = check_response(L, 1);
    lua_createtable(L, 0, 2);
    if (op->req) {
        mb_setfield_int(L, -1, "peak_buffered", (lua_Integer)http_request_peak_buffered(op->req));
        mb_setfield_int(L, -1, "pauses", (lua_Integer)http_request_pauses(op->req));
    }
    return 1;
}

static int resp_index(lua_State *L)
{
    check_response(L, 1);
    lua_getiuservalue(L, 1, 1);
    lua_pushvalue(L, 2);
    if (lua_rawget(L, -2) != LUA_TNIL) return 1;
    lua_getmetatable(L, 1);
    lua_getfield(L, -1, "methods");
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);
    return 1;
}

/* http.curl_version() -> "7.88.1". */
static int l_curl_version(lua_State *L)
{
    lua_pushstring(L, curl_version_info(CURLVERSION_NOW)->version);
    return 1;
}

static const luaL_Reg funcs[] = {
    {"request", l_request},
    {"stream", l_stream},
    {"curl_version", l_curl_version},
    {NULL, NULL},
};

static const luaL_Reg resp_methods[] = {
    {"read", resp_read},   {"read_event", resp_read_event}, {"read_output", resp_read_output},
    {"close", resp_close}, {"stats", resp_stats},           {NULL, NULL},
};

int luaopen_moonbox_http(lua_State *L)
{
    mb_runtime_get(L);
    if (luaL_newmetatable(L, RESPONSE_MT)) {
        luaL_newlib(L, resp_methods);
        lua_setfield(L, -2, "methods");
        lua_pushcfunction(L, resp_index);
        lua_setfield(L, -2, "__index");
        lua_pushcfunction(L, resp_gc);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, resp_gc);
        lua_setfield(L, -2, "__close");
    }
    lua_pop(L, 1);
    if (lua_getfield(L, LUA_REGISTRYINDEX, "moonbox.http.scratch") == LUA_TNIL) {
        lua_newuserdatauv(L, 1, 0);
        lua_createtable(L, 0, 1);
        lua_pushcfunction(L, hdr_gc);
        lua_setfield(L, -2, "__gc");
        lua_setmetatable(L, -2);
        lua_setfield(L, LUA_REGISTRYINDEX, "moonbox.http.scratch");
        g_ops.closed = 0;
    }
    lua_pop(L, 1);
    luaL_newlib(L, funcs);
    return 1;
}
