/*
 * httpd.c — module moonbox.httpd: the HTTP server (runtime/http_server.c) with every request
 * handled by its own task.
 *
 * The runtime calls on_request from inside MHD; it only retains the request and defers
 * dispatch, which (in Lua context, from the drain) builds the req table and the res userdata
 * and spawns handler_main(handler, req, res) as a task. handler_main runs the handler under a
 * yieldable pcall, turns a return value, an error or silence into an answer, and then finishes
 * the response. Ownership: an open Server anchors itself with one registry ref (released by
 * close); the res userdata owns the handler side's reference on its request (released when the
 * handler finishes, or by __gc if the task never ran); a task parked in w:write is recorded
 * as the waiter only, and the request's notify callback wakes it and does nothing else.
 */
#include "mb.h"

#include "http_server.h"
#include "sse_write.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define SERVER_MT   "moonbox.httpd.Server"
#define REQUEST_MT  "moonbox.httpd.Request"
#define RESPONSE_MT "moonbox.httpd.Response"
#define WRITER_MT   "moonbox.httpd.Writer"

/* Uservalue slots of a Server userdata. */
#define SRV_UV_HANDLERS 1 /* route handler functions, by handler id */
#define SRV_UV_TASKS    2 /* running handler tasks: Task -> res userdata */
#define SRV_UV_LOG      3 /* the log function, or nil for io.stderr */

#define DEFAULT_TEXT_TYPE "text/plain; charset=utf-8"
#define DEFAULT_FILE_TYPE "application/octet-stream"

typedef struct hd_server {
    hs_server *hs; /* NULL once closed */
    mb_runtime *rt;
    int anchor; /* registry ref to this userdata while open */
    int nhandlers;
    int port;
    char host[64];
    hs_stats final; /* the counts at close, for stats() afterwards */
} hd_server;

/* How far a handler got in answering. */
enum { RES_OPEN, RES_SENT, RES_STREAMING, RES_CLOSED };

typedef struct hd_response {
    hs_request *req; /* the handler side's reference; NULL once finished */
    mb_task *waiter; /* a task parked in w:write until the queue drains */
    int state;
    int started; /* handler_main has begun (a task cancelled before that never finishes it) */
} hd_response;

typedef struct hd_writer {
    hd_response *res; /* anchored by the writer's uservalue */
} hd_writer;

typedef struct dispatch_ctx {
    hs_request *r;
    int owned; /* the res userdata has taken over the reference */
} dispatch_ctx;

/* ---- helpers ------------------------------------------------------------------------------ */

/* Pushes moonbox.core's function `name`, loading the module if nothing has yet. */
static void push_core_fn(lua_State *L, const char *name)
{
    luaL_requiref(L, "moonbox.core", luaopen_moonbox_core, 0);
    lua_getfield(L, -1, name);
    lua_remove(L, -2);
}

static void push_decoded(lua_State *L, const char *s, size_t n, int plus_is_space)
{
    luaL_Buffer b;
    char *out = luaL_buffinitsize(L, &b, n + 1);
    size_t m = hs_percent_decode(s, n, out, plus_is_space);
    luaL_pushresultsize(&b, m);
}

/* Pushes s with every byte mapped through map (tolower, toupper). */
static void push_mapped(lua_State *L, const char *s, int (*map)(int))
{
    luaL_Buffer b;
    size_t n = strlen(s);
    char *out = luaL_buffinitsize(L, &b, n);
    for (size_t i = 0; i < n; i++)
        out[i] = (char)map((unsigned char)s[i]);
    luaL_pushresultsize(&b, n);
}

static void push_lower(lua_State *L, const char *s)
{
    push_mapped(L, s, tolower);
}

/* params[key] = value unless already set (the table is on top of the stack). */
static void query_first(void *ud, const char *k, size_t kn, const char *v, size_t vn)
{
    lua_State *L = (lua_State *)ud;
    push_decoded(L, k, kn, 1);
    lua_pushvalue(L, -1);
    if (lua_rawget(L, -3) != LUA_TNIL) {
        lua_pop(L, 2);
        return;
    }
    lua_pop(L, 1);
    push_decoded(L, v, vn, 1);
    lua_rawset(L, -3);
}

typedef struct query_all_ctx {
    lua_State *L;
    const char *name;
    size_t len;
    lua_Integer n;
} query_all_ctx;

/* Appends value to the array on top of the stack when the decoded key is ctx->name. */
static void query_collect(void *ud, const char *k, size_t kn, const char *v, size_t vn)
{
    query_all_ctx *c = (query_all_ctx *)ud;
    lua_State *L = c->L;
    push_decoded(L, k, kn, 1);
    size_t dn;
    const char *d = lua_tolstring(L, -1, &dn);
    int same = dn == c->len && memcmp(d, c->name, dn) == 0;
    lua_pop(L, 1);
    if (!same) return;
    push_decoded(L, v, vn, 1);
    lua_rawseti(L, -2, ++c->n);
}

/* Builds the response header array from the optional table at idx ({Name = "v"} or
 * {Name = {"v1", "v2"}}), adding Content-Type: default_type when the table has none. Leaves
 * one scratch userdata on the stack that owns the array and anchors converted strings. Raises
 * on misuse (non-string names, values that are not strings or numbers, embedded NULs). */
static hs_pair *build_headers(lua_State *L, int idx, const char *default_type, size_t *out_n)
{
    size_t count = 1;
    idx = lua_absindex(L, idx);
    int given = !lua_isnoneornil(L, idx); /* before idx may name the scratch values below */
    if (given) {
        luaL_checktype(L, idx, LUA_TTABLE);
        lua_pushnil(L);
        while (lua_next(L, idx)) {
            count += lua_istable(L, -1) ? lua_rawlen(L, -1) : 1;
            lua_pop(L, 1);
        }
    }
    hs_pair *h = (hs_pair *)lua_newuserdatauv(L, count * sizeof *h, 1);
    lua_newtable(L);
    lua_pushvalue(L, -1);
    lua_setiuservalue(L, -3, 1);
    int anchor = lua_gettop(L);
    lua_Integer na = 0;
    size_t k = 0;
    int has_type = 0;
    if (given) {
        lua_pushnil(L);
        while (lua_next(L, idx)) {
            if (lua_type(L, -2) != LUA_TSTRING)
                luaL_error(L, "response header names must be strings, got %s",
                           luaL_typename(L, -2));
            size_t nl;
            const char *name = lua_tolstring(L, -2, &nl);
            if (strlen(name) != nl) luaL_error(L, "response header name contains a NUL byte");
            if (strcasecmp(name, "Content-Type") == 0) has_type = 1;
            int many = lua_istable(L, -1);
            lua_Integer nv = many ? (lua_Integer)lua_rawlen(L, -1) : 1;
            for (lua_Integer i = 1; i <= nv; i++) {
                if (many)
                    lua_rawgeti(L, -1, i);
                else
                    lua_pushvalue(L, -1);
                int t = lua_type(L, -1);
                if (t != LUA_TSTRING && t != LUA_TNUMBER)
                    luaL_error(L, "response header '%s' must be a string or number, got %s", name,
                               luaL_typename(L, -1));
                size_t vl;
                const char *value = lua_tolstring(L, -1, &vl);
                if (strlen(value) != vl)
                    luaL_error(L, "response header '%s' contains a NUL byte", name);
                lua_rawseti(L, anchor, ++na); /* keeps value alive with the scratch userdata */
                h[k].name = name;
                h[k].value = value;
                k++;
            }
            lua_pop(L, 1);
        }
    }
    if (!has_type && default_type) {
        h[k].name = "Content-Type";
        h[k].value = default_type;
        k++;
    }
    lua_settop(L, anchor - 1);
    *out_n = k;
    return h;
}

static int check_status(lua_State *L, int idx)
{
    lua_Integer st = luaL_checkinteger(L, idx);
    if (st < 100 || st > 999) luaL_argerror(L, idx, "HTTP status must be 100..999");
    return (int)st;
}

/* Raises the structured error a writer gets when its request has no connection any more. */
static int raise_gone(lua_State *L, const char *op, hs_request *r)
{
    const hs_request_view *v = hs_request_get_view(r);
    int server = hs_request_state(r) == HS_GONE_SERVER;
    mb_error_new(L, op, "client_gone", "%s (%s %s)",
                 server ? "the server was closed under the request" : "the client has gone away",
                 v->method ? v->method : "?", v->path ? v->path : "?");
    mb_setfield_str(L, -1, "method", v->method);
    mb_setfield_str(L, -1, "path", v->path);
    return lua_error(L);
}

/* ---- responses ------------------------------------------------------------------------------- */

static void res_notify(hs_request *r, void *ud)
{
    hd_response *res = (hd_response *)ud;
    (void)r;
    if (res->waiter) {
        mb_task *t = res->waiter;
        res->waiter = NULL;
        mb_task_wake(t);
    }
}

/* Ends the handler side of a request: closes a stream left open (breaking it when the handler
 * failed), removes the body file unless moved, and drops the reference. */
static void finish_response(hd_response *res, int ok)
{
    hs_request *r = res->req;
    if (!r) return;
    if (res->state == RES_STREAMING) {
        hs_request_stream_close(r, !ok);
        res->state = RES_CLOSED;
    }
    hs_request_set_notify(r, NULL, NULL);
    hs_request_discard_body_file(r);
    res->req = NULL;
    res_notify(r, res);
    hs_request_release(r);
}

static hd_response *check_res(lua_State *L, int idx)
{
    return (hd_response *)luaL_checkudata(L, idx, RESPONSE_MT);
}

/* Checks that res can still answer: raises when its handler has finished or it answered. */
static hs_request *res_answerable(lua_State *L, hd_response *res, const char *what)
{
    if (!res->req) luaL_error(L, "%s: the request's handler has already finished", what);
    if (res->state != RES_OPEN) luaL_error(L, "%s: a response was already sent", what);
    return res->req;
}

static int answer_result(lua_State *L, hd_response *res, int rc, const char *err, const char *what)
{
    if (rc == HS_OK || rc == HS_ERR_GONE) {
        res->state = RES_SENT;
        lua_pushboolean(L, rc == HS_OK);
        return 1;
    }
    return luaL_error(L, "%s: %s", what, err);
}

/* res:send(status, body, headers) -> true, or false when the client (or server) has gone.
 * status: integer 100..999; body: string or nil; headers: {Name = value | {values...}}, with
 * Content-Type defaulting to text/plain; charset=utf-8 for a non-empty body. Raises when a
 * response was already sent, the handler has finished, or an argument is malformed. Does not
 * yield: the answer is sent as the loop runs on. */
static int res_send(lua_State *L)
{
    hd_response *res = check_res(L, 1);
    hs_request *r = res_answerable(L, res, "res:send");
    int status = check_status(L, 2);
    size_t blen = 0;
    const char *body = "";
    if (!lua_isnoneornil(L, 3)) {
        if (lua_type(L, 3) != LUA_TSTRING)
            return luaL_typeerror(L, 3, "string or nil (the response body)");
        body = lua_tolstring(L, 3, &blen);
    }
    size_t nh;
    hs_pair *h = build_headers(L, 4, blen ? DEFAULT_TEXT_TYPE : NULL, &nh);
    char err[256];
    int rc = hs_request_respond(r, (unsigned)status, h, nh, body, blen, err, sizeof err);
    return answer_result(L, res, rc, err, "res:send");
}

/* res:drop() -> true, or false when the client has gone: answers by closing the connection
 * without a reply, as a response lost on the way would look to the client (fault injection).
 * Raises when a response was already sent. Does not yield. */
static int res_drop(lua_State *L)
{
    hd_response *res = check_res(L, 1);
    hs_request *r = res_answerable(L, res, "res:drop");
    char err[256];
    int rc = hs_request_drop(r, err, sizeof err);
    return answer_result(L, res, rc, err, "res:drop");
}

/* res:send_file(status, path, headers) -> true, or false when the client has gone. Sends the
 * file's bytes (sendfile; the file is opened now, so a later rename or unlink does not matter)
 * with Content-Type defaulting to application/octet-stream. Raises a structured error (op
 * "res:send_file", code "not_found" or "file_error") when the file cannot be opened or is not
 * a regular file — nothing is sent then, so the handler may answer otherwise — and raises on
 * misuse as res:send. Does not yield. */
static int res_send_file(lua_State *L)
{
    hd_response *res = check_res(L, 1);
    hs_request *r = res_answerable(L, res, "res:send_file");
    int status = check_status(L, 2);
    const char *path = luaL_checkstring(L, 3);
    size_t nh;
    hs_pair *h = build_headers(L, 4, DEFAULT_FILE_TYPE, &nh);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        return mb_error_raise(L, "res:send_file", e == ENOENT ? "not_found" : "file_error",
                              "cannot open %s: %s", path, strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return mb_error_raise(L, "res:send_file", "file_error", "%s is not a regular file", path);
    }
    char err[256];
    int rc = hs_request_respond_fd(r, (unsigned)status, h, nh, fd, (uint64_t)st.st_size, err,
                                   sizeof err);
    return answer_result(L, res, rc, err, "res:send_file");
}

/* res:stream(status, headers, opts) -> Writer. Starts a response of unknown length (chunked on
 * HTTP/1.1) whose body is what the writer writes; Content-Type defaults to text/plain;
 * charset=utf-8 (use text/event-stream for SSE). opts.buffer: bytes queued before w:write waits
 * (default 64 KiB). The stream ends with w:close() or when the handler returns (broken off if
 * the handler raised). Raises on misuse as res:send. Does not yield. */
static int res_stream(lua_State *L)
{
    hd_response *res = check_res(L, 1);
    hs_request *r = res_answerable(L, res, "res:stream");
    int status = check_status(L, 2);
    lua_Integer bound = 0;
    if (!lua_isnoneornil(L, 4)) {
        luaL_checktype(L, 4, LUA_TTABLE);
        lua_getfield(L, 4, "buffer");
        if (!lua_isnil(L, -1)) {
            bound = luaL_checkinteger(L, -1);
            if (bound < 1) luaL_error(L, "res:stream: opts.buffer must be a positive byte count");
        }
        lua_pop(L, 1);
    }
    size_t nh;
    hs_pair *h = build_headers(L, 3, DEFAULT_TEXT_TYPE, &nh);
    char err[256];
    int rc = hs_request_stream_open(r, (unsigned)status, h, nh, (size_t)bound, err, sizeof err);
    if (rc != HS_OK && rc != HS_ERR_GONE) return luaL_error(L, "res:stream: %s", err);
    res->state = RES_STREAMING;
    hd_writer *w = (hd_writer *)lua_newuserdatauv(L, sizeof *w, 1);
    w->res = res;
    lua_pushvalue(L, 1);
    lua_setiuservalue(L, -2, 1);
    luaL_setmetatable(L, WRITER_MT);
    return 1;
}

/* res:sent() -> boolean: whether an answer (or a stream) was started. */
static int res_sent(lua_State *L)
{
    lua_pushboolean(L, check_res(L, 1)->state != RES_OPEN);
    return 1;
}

/* A handler task that never ran (cancelled before its first resume) still owns its request:
 * the collector gives it back, answering 500 if the connection still waits. */
static int res_gc(lua_State *L)
{
    hd_response *res = (hd_response *)lua_touserdata(L, 1);
    if (!res->req) return 0;
    if (res->state == RES_OPEN) {
        static const char body[] = "{\"message\":\"the request's handler was lost\"}";
        hs_pair h = {"Content-Type", "application/json"};
        char err[128];
        hs_request_respond(res->req, 500, &h, 1, body, sizeof body - 1, err, sizeof err);
        res->state = RES_SENT;
    }
    finish_response(res, 0);
    return 0;
}

/* ---- writers -----------------------------------------------------------------------------------
 */

static hd_writer *check_writer(lua_State *L, int idx)
{
    return (hd_writer *)luaL_checkudata(L, idx, WRITER_MT);
}

static void writer_abort(mb_task *t, void *ud)
{
    hd_response *res = (hd_response *)ud;
    (void)t;
    res->waiter = NULL;
}

static int writer_wait(lua_State *L, hd_response *res, mb_task *t);

static int writer_wait_k(lua_State *L, int status, lua_KContext ctx)
{
    hd_writer *w = check_writer(L, 1);
    (void)status;
    (void)ctx;
    hs_request *r = w->res->req;
    if (!r) return luaL_error(L, "w:write: the request's handler finished while it waited");
    if (hs_request_state(r) != HS_LIVE) return raise_gone(L, "w:write", r);
    return writer_wait(L, w->res, mb_task_of(L));
}

/* Parks t while more than the stream's bound is queued. */
static int writer_wait(lua_State *L, hd_response *res, mb_task *t)
{
    hs_request *r = res->req;
    if (!r || hs_request_state(r) != HS_LIVE) return 0;
    if (hs_request_stream_pending(r) <= hs_request_stream_bound(r)) return 0;
    res->waiter = t;
    return mb_task_park(L, t, writer_abort, res, 0, writer_wait_k);
}

/* The live request under w's stream, or raises as w:write documents. */
static hs_request *writer_request(lua_State *L, hd_response *res, const char *what)
{
    if (res->state == RES_CLOSED) luaL_error(L, "%s: the stream is closed", what);
    hs_request *r = res->req;
    if (!r) luaL_error(L, "%s: the request's handler has already finished", what);
    if (hs_request_state(r) != HS_LIVE) raise_gone(L, what, r);
    return r;
}

/* Raises for a failed hs_request_stream_write/reserve. */
static int raise_stream_error(lua_State *L, const char *what, hs_request *r, int rc)
{
    if (rc == HS_ERR_NOMEM) return luaL_error(L, "%s: out of memory", what);
    return raise_gone(L, what, r);
}

/* Queues n bytes on w's stream, then waits for room. Raises as w:write documents. */
static int writer_put(lua_State *L, const char *what, const char *s, size_t n)
{
    hd_writer *w = check_writer(L, 1);
    hd_response *res = w->res;
    mb_task *t = mb_task_check_yieldable(L, what);
    hs_request *r = writer_request(L, res, what);
    int rc = hs_request_stream_write(r, s, n);
    if (rc != HS_OK) return raise_stream_error(L, what, r, rc);
    lua_settop(L, 1);
    return writer_wait(L, res, t);
}

/* w:write(chunk): queues chunk (a string) on the stream and returns once at most the stream's
 * buffer is queued, waiting while the client reads slower than the handler writes. Raises a
 * structured error with code "client_gone" (op "w:write", method, path) when the client
 * disconnected or the server closed; raises on misuse (stream closed, handler finished).
 * [yields] */
static int writer_write(lua_State *L)
{
    size_t n;
    const char *s = luaL_checklstring(L, 2, &n);
    return writer_put(L, "w:write", s, n);
}

/* w:sse(event, data, id): writes one Server-Sent Event: "event: NAME\n" (when event is not
 * nil), "id: ID\n" (when given), then "data: LINE\n" for each line of data (split at line
 * breaks) and a blank line. event and id must not contain line breaks. Raises and yields as
 * w:write. [yields] */
static int writer_sse(lua_State *L)
{
    check_writer(L, 1);
    size_t dn;
    const char *data = luaL_checklstring(L, 3, &dn);
    const char *event = luaL_optstring(L, 2, NULL);
    const char *id = luaL_optstring(L, 4, NULL);
    if (event && strpbrk(event, "\r\n")) return luaL_argerror(L, 2, "event name has a line break");
    if (id && strpbrk(id, "\r\n")) return luaL_argerror(L, 4, "id has a line break");
    luaL_Buffer b;
    char *p = luaL_buffinitsize(L, &b, sse_event_size(event, id, data, dn));
    luaL_pushresultsize(&b, sse_write_event(p, event, id, data, dn));
    size_t n;
    const char *s = lua_tolstring(L, -1, &n);
    return writer_put(L, "w:sse", s, n);
}

/* w:sse_output(stream, data): writes the SSE event an exec's output chunk travels in, exactly
 * what w:sse("output", json.encode({stream = stream, data = data})) writes (keys sorted, data
 * and stream quoted by runtime/jsonq.c: invalid UTF-8 becomes U+FFFD), built in one pass by
 * runtime/sse_write.c straight into the stream's queue: no intermediate Lua string or buffer.
 * Raises and yields as w:write. [yields] */
static int writer_sse_output(lua_State *L)
{
    hd_writer *w = check_writer(L, 1);
    size_t sn, dn;
    const unsigned char *stream = (const unsigned char *)luaL_checklstring(L, 2, &sn);
    const unsigned char *data = (const unsigned char *)luaL_checklstring(L, 3, &dn);
    mb_task *t = mb_task_check_yieldable(L, "w:sse_output");
    hs_request *r = writer_request(L, w->res, "w:sse_output");
    int rc;
    char *p = hs_request_stream_reserve(r, sse_output_bound(sn, dn), &rc);
    if (!p) return raise_stream_error(L, "w:sse_output", r, rc);
    hs_request_stream_commit(r, sse_write_output(p, stream, sn, data, dn));
    lua_settop(L, 1);
    return writer_wait(L, w->res, t);
}

/* w:comment(text): writes an SSE comment (": text\n" per line; ":\n" without text), which
 * clients ignore: a keep-alive that also makes the server notice a vanished client. Raises and
 * yields as w:write. [yields] */
static int writer_comment(lua_State *L)
{
    check_writer(L, 1);
    size_t tn = 0;
    const char *text = luaL_optlstring(L, 2, NULL, &tn);
    if (!text) tn = 0;
    luaL_Buffer b;
    char *p = luaL_buffinitsize(L, &b, sse_comment_size(text, tn));
    luaL_pushresultsize(&b, sse_write_comment(p, text, tn));
    size_t n;
    const char *s = lua_tolstring(L, -1, &n);
    return writer_put(L, "w:comment", s, n);
}

/* w:close(): ends the stream after what is queued. Idempotent; also w's __close. Does not
 * yield and does not raise when the client has gone. */
static int writer_close(lua_State *L)
{
    hd_writer *w = check_writer(L, 1);
    hd_response *res = w->res;
    if (res->state == RES_STREAMING && res->req) hs_request_stream_close(res->req, 0);
    if (res->state == RES_STREAMING) res->state = RES_CLOSED;
    return 0;
}

/* w:pending() -> bytes queued and not yet taken by the connection. */
static int writer_pending(lua_State *L)
{
    hd_writer *w = check_writer(L, 1);
    lua_pushinteger(L, w->res->req ? (lua_Integer)hs_request_stream_pending(w->res->req) : 0);
    return 1;
}

/* ---- handler tasks ------------------------------------------------------------------------ */

/* Message handler of the handler's pcall: keeps the error, and stores its traceback (the one a
 * structured error carries, else the stack here) in upvalue 1 for handler_done. */
static int handler_msgh(lua_State *L)
{
    if (lua_istable(L, 1) && lua_getfield(L, 1, "traceback") == LUA_TSTRING) {
        lua_replace(L, lua_upvalueindex(1));
    } else {
        lua_settop(L, 1);
        const char *msg = lua_tostring(L, 1);
        luaL_traceback(L, L, msg ? msg : luaL_typename(L, 1), 1);
        lua_replace(L, lua_upvalueindex(1));
    }
    lua_settop(L, 1);
    return 1;
}

/* Writes line to the server's log function (srv opts.log), or to io.stderr. */
static void log_line(lua_State *L, int srv, const char *line)
{
    int top = lua_gettop(L);
    if (lua_getiuservalue(L, srv, SRV_UV_LOG) == LUA_TFUNCTION) {
        lua_pushstring(L, line);
        if (lua_pcall(L, 1, 0, 0) == LUA_OK) {
            lua_settop(L, top);
            return;
        }
    }
    lua_settop(L, top);
    lua_getglobal(L, "io");
    if (lua_istable(L, -1) && lua_getfield(L, -1, "stderr") != LUA_TNIL) {
        lua_getfield(L, -1, "write");
        lua_insert(L, -2);
        lua_pushstring(L, line);
        if (lua_pcall(L, 2, 0, 0) == LUA_OK) {
            lua_settop(L, top);
            return;
        }
    }
    lua_settop(L, top);
    fputs(line, stderr);
}

/* The error's code when it is a structured error (a table with a string code), else NULL. The
 * string stays valid while the error is on the stack. */
static const char *error_code(lua_State *L, int idx)
{
    const char *code = NULL;
    if (lua_istable(L, idx)) {
        lua_getfield(L, idx, "code");
        if (lua_type(L, -1) == LUA_TSTRING) code = lua_tostring(L, -1);
        lua_pop(L, 1); /* the table keeps the string alive */
    }
    return code;
}

/* report_failure(res, srv, err, tb): logs a handler's failure as runtime's policy says
 * (hs_failure_log: not a vanished client, not a cancellation) and answers it if nothing was sent
 * yet (hs_request_respond_failure: 500 {"message": ...}, 503 when cancelled). Runs protected: a
 * failing __tostring must not cost the answer. */
static int report_failure(lua_State *L)
{
    hd_response *res = (hd_response *)lua_touserdata(L, 1);
    hs_request *r = res->req;
    const hs_request_view *v = hs_request_get_view(r);
    const char *code = error_code(L, 3);
    const char *msg;
    if (lua_istable(L, 3) && lua_getfield(L, 3, "message") == LUA_TSTRING) {
        msg = lua_tostring(L, -1);
    } else {
        msg = luaL_tolstring(L, 3, NULL);
    }
    int log = hs_failure_log(code);
    if (log == HS_LOG_NO_RESPONSE) {
        lua_pushfstring(L,
                        "moonbox httpd: handler for %s %s returned without responding; "
                        "answered 500\n",
                        v->method, v->path);
        log_line(L, 2, lua_tostring(L, -1));
    } else if (log == HS_LOG_FAILURE) {
        const char *full = luaL_tolstring(L, 3, NULL);
        const char *tb = lua_tostring(L, 4);
        lua_pushfstring(L, "moonbox httpd: handler for %s %s failed: %s\n%s%s", v->method, v->path,
                        full, tb ? tb : "", tb ? "\n" : "");
        log_line(L, 2, lua_tostring(L, -1));
    }
    if (res->state == RES_OPEN) {
        char err[128];
        hs_request_respond_failure(r, code, msg, strlen(msg), err, sizeof err);
        res->state = RES_SENT;
    }
    return 0;
}

/* The end of handler_main, called directly or as its pcallk continuation: answer from the
 * handler's outcome, then finish. Stack: handler, req, res, msgh, then the handler's results
 * (ok) or its error (not ok). If the handler returned values and has not responded they are
 * sent as res:send(status, headers, body) would; if it returned nothing (or a nil first value)
 * and did not respond, that is a "no_response" failure. A failure (raised, unusable results, no
 * response) goes through report_failure (log line plus an error answer); if even that fails the
 * client gets a plain 500. Then the response is finished, the task is dropped from the server's
 * task table and the stack is emptied. Never raises and returns 0; does not yield itself. */
static int handler_done(lua_State *L, int status, lua_KContext ctx)
{
    hd_response *res = (hd_response *)lua_touserdata(L, 3);
    int ok = status == LUA_OK || status == LUA_YIELD;
    (void)ctx;
    lua_getiuservalue(L, 3, 1); /* the server userdata */
    int srv = lua_gettop(L);
    if (ok && res->req) {
        int nres = srv - 5;
        if (res->state == RES_OPEN && nres >= 1 && !lua_isnil(L, 5)) {
            lua_pushcfunction(L, res_send);
            lua_pushvalue(L, 3);
            for (int i = 0; i < 3; i++)
                if (i < nres)
                    lua_pushvalue(L, 5 + i);
                else
                    lua_pushnil(L);
            if (lua_pcall(L, 4, 0, 0) != LUA_OK) ok = 0; /* the returned values were unusable */
        } else if (res->state == RES_OPEN) {
            ok = 0;
            mb_error_new(L, "httpd", "no_response", "handler did not respond");
        }
        if (!ok) lua_pushnil(L); /* no traceback: the message says it all */
    } else if (!ok) {
        lua_pushvalue(L, srv - 1); /* the error */
        lua_getupvalue(L, 4, 1);   /* its traceback */
    }
    if (!ok && res->req) {
        int e = lua_gettop(L) - 1;
        lua_pushcfunction(L, report_failure);
        lua_pushlightuserdata(L, res);
        lua_pushvalue(L, srv);
        lua_pushvalue(L, e);
        lua_pushvalue(L, e + 1);
        if (lua_pcall(L, 4, 0, 0) != LUA_OK) lua_pop(L, 1);
    }
    if (res->req && res->state == RES_OPEN) {
        /* report_failure itself failed: the client must still get an answer. */
        static const char body[] = "{\"message\":\"internal error\"}";
        hs_pair h = {"Content-Type", "application/json"};
        char err[128];
        hs_request_respond(res->req, 500, &h, 1, body, sizeof body - 1, err, sizeof err);
        res->state = RES_SENT;
    }
    finish_response(res, ok);
    mb_task *t = mb_task_of(L);
    if (t && t->ref != LUA_NOREF) {
        lua_getiuservalue(L, srv, SRV_UV_TASKS);
        lua_rawgeti(L, LUA_REGISTRYINDEX, t->ref);
        lua_pushnil(L);
        lua_rawset(L, -3);
    }
    lua_settop(L, 0);
    return 0;
}

/* The body of every handler task: handler_main(handler, req, res). Never raises: a failure of
 * the handler is logged and answered here. */
static int handler_main(lua_State *L)
{
    lua_settop(L, 3);
    hd_response *res = (hd_response *)lua_touserdata(L, 3);
    res->started = 1;
    lua_pushnil(L);
    lua_pushcclosure(L, handler_msgh, 1);
    lua_pushvalue(L, 1);
    lua_pushvalue(L, 2);
    lua_pushvalue(L, 3);
    int status = lua_pcallk(L, 2, LUA_MULTRET, 4, 0, handler_done);
    return handler_done(L, status, 0);
}

/* Pushes the req table for r, with the REQUEST_MT metatable: method, path (percent-decoded),
 * target, query, remote, remote_port, params (first value of each query key), headers
 * (lower-cased names, repeated ones joined with ", "), captures, and body (memory mode; r's
 * copy is freed once pushed) or body_file and body_size (file mode). Pushes exactly one value;
 * raises only on out of memory. */
static void push_request(lua_State *L, hs_request *r)
{
    const hs_request_view *v = hs_request_get_view(r);
    lua_createtable(L, 0, 14);
    int t = lua_gettop(L);
    mb_setfield_str(L, t, "method", v->method);
    push_decoded(L, v->path, strlen(v->path), 0);
    lua_setfield(L, t, "path");
    mb_setfield_str(L, t, "target", v->target);
    mb_setfield_str(L, t, "query", v->query);
    mb_setfield_str(L, t, "remote", v->remote);
    mb_setfield_int(L, t, "remote_port", v->remote_port);

    lua_newtable(L);
    hs_query_each(v->query, query_first, L);
    lua_setfield(L, t, "params");

    lua_createtable(L, 0, (int)v->nheaders);
    for (size_t i = 0; i < v->nheaders; i++) {
        push_lower(L, v->headers[i].name);
        lua_pushvalue(L, -1);
        if (lua_rawget(L, -3) == LUA_TSTRING) { /* repeated: join as HTTP allows */
            lua_pushliteral(L, ", ");
            lua_pushstring(L, v->headers[i].value);
            lua_concat(L, 3);
        } else {
            lua_pop(L, 1);
            lua_pushstring(L, v->headers[i].value);
        }
        lua_rawset(L, -3);
    }
    lua_setfield(L, t, "headers");

    lua_createtable(L, 0, (int)v->ncaptures);
    for (size_t i = 0; i < v->ncaptures; i++) {
        lua_pushstring(L, v->captures[i].value);
        lua_setfield(L, -2, v->captures[i].name);
    }
    lua_setfield(L, t, "captures");

    if (v->body_mode == HS_BODY_MEMORY) {
        lua_pushlstring(L, v->body ? v->body : "", v->body_len);
        lua_setfield(L, t, "body");
        hs_request_drop_body(r);
    } else if (v->body_mode == HS_BODY_FILE && v->body_file) {
        mb_setfield_str(L, t, "body_file", v->body_file);
        mb_setfield_int(L, t, "body_size", (lua_Integer)v->body_file_size);
    }
    luaL_setmetatable(L, REQUEST_MT);
}

/* Called under lua_pcall from dispatch with ctx as light userdata at 1: makes res (which from
 * then on owns ctx->r: ctx->owned is set so the caller must not answer r itself) and req for
 * ctx->r, and spawns the route's handler as a task running handler_main(handler, req, res),
 * named "httpd METHOD PATH", marked observed and recorded in the server's task table so close
 * can cancel it. Returns 0 results; raises only on out of memory, leaving r to the caller if it
 * raised before res existed. */
static int dispatch_protected(lua_State *L)
{
    dispatch_ctx *ctx = (dispatch_ctx *)lua_touserdata(L, 1);
    hs_request *r = ctx->r;
    hd_server *hd = (hd_server *)hs_request_server_ud(r);
    const hs_request_view *v = hs_request_get_view(r);

    hd_response *res = (hd_response *)lua_newuserdatauv(L, sizeof *res, 1);
    int res_idx = lua_gettop(L);
    memset(res, 0, sizeof *res);
    res->req = r;
    res->state = RES_OPEN;
    luaL_setmetatable(L, RESPONSE_MT);
    ctx->owned = 1;
    hs_request_set_notify(r, res_notify, res);

    lua_rawgeti(L, LUA_REGISTRYINDEX, hd->anchor);
    int srv_idx = lua_gettop(L);
    lua_pushvalue(L, srv_idx);
    lua_setiuservalue(L, res_idx, 1);

    push_request(L, r);
    int req_idx = lua_gettop(L);

    push_core_fn(L, "spawn");
    lua_pushcfunction(L, handler_main);
    lua_getiuservalue(L, srv_idx, SRV_UV_HANDLERS);
    lua_rawgeti(L, -1, v->handler_id);
    lua_remove(L, -2);
    lua_pushvalue(L, req_idx);
    lua_pushvalue(L, res_idx);
    lua_call(L, 4, 1);
    int task_idx = lua_gettop(L);
    /* The wrapper never fails; a task cancelled before it started must not be reported. */
    ((mb_task *)lua_touserdata(L, task_idx))->observed = 1;

    lua_getiuservalue(L, srv_idx, SRV_UV_TASKS);
    lua_pushvalue(L, task_idx);
    lua_pushvalue(L, res_idx);
    lua_rawset(L, -3);
    lua_pop(L, 1);

    push_core_fn(L, "data");
    lua_pushvalue(L, task_idx);
    lua_call(L, 1, 1);
    lua_pushfstring(L, "httpd %s %s", v->method, v->path);
    lua_setfield(L, -2, "name");
    return 0;
}

/* Deferred from on_request: runs in the drain, in Lua context. */
static void dispatch(lua_State *L, void *ud)
{
    hs_request *r = (hs_request *)ud;
    hd_server *hd = (hd_server *)hs_request_server_ud(r);
    if (!hd || hd->rt->closing) {
        static const char body[] = "{\"message\":\"the server is shutting down\"}";
        hs_pair h = {"Content-Type", "application/json"};
        char err[128];
        hs_request_respond(r, 503, &h, 1, body, sizeof body - 1, err, sizeof err);
        hs_request_release(r);
        return;
    }
    dispatch_ctx ctx = {r, 0};
    int top = lua_gettop(L);
    lua_pushcfunction(L, dispatch_protected);
    lua_pushlightuserdata(L, &ctx);
    if (lua_pcall(L, 1, 0, 0) != LUA_OK) {
        fprintf(stderr, "moonbox httpd: cannot start a handler: %s\n", lua_tostring(L, -1));
        if (!ctx.owned) {
            static const char body[] = "{\"message\":\"cannot start a handler\"}";
            hs_pair h = {"Content-Type", "application/json"};
            char err[128];
            hs_request_respond(r, 500, &h, 1, body, sizeof body - 1, err, sizeof err);
            hs_request_release(r);
        }
    }
    lua_settop(L, top);
}

/* The runtime's on_request: inside MHD, so only keep the request and queue its dispatch. */
static void on_request(hs_request *r, void *ud)
{
    hd_server *hd = (hd_server *)ud;
    hs_request_retain(r);
    mb_defer(hd->rt, dispatch, r);
}

/* ---- requests ----------------------------------------------------------------------------------
 */

/* req:query_param(name) -> the first value of query parameter name (decoded), or nil. */
static int req_query_param(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checkstring(L, 2);
    lua_getfield(L, 1, "params");
    if (!lua_istable(L, -1)) return 0;
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);
    return 1;
}

/* req:query_all(name) -> array of every value of query parameter name, in order ({} if none):
 * for repeated keys such as ?status=a&status=b. */
static int req_query_all(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    query_all_ctx c;
    c.name = luaL_checklstring(L, 2, &c.len);
    c.n = 0;
    c.L = L;
    lua_getfield(L, 1, "query");
    const char *q = lua_tostring(L, -1);
    lua_newtable(L);
    if (q) hs_query_each(q, query_collect, &c);
    return 1;
}

/* req:header(name) -> the request header's value (case-insensitive name; repeated headers
 * joined with ", "), or nil. */
static int req_header(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    const char *name = luaL_checkstring(L, 2);
    lua_getfield(L, 1, "headers");
    if (!lua_istable(L, -1)) return 0;
    push_lower(L, name);
    lua_rawget(L, -2);
    return 1;
}

/* ---- servers ------------------------------------------------------------------------------------
 */

static hd_server *check_server(lua_State *L, int idx)
{
    return (hd_server *)luaL_checkudata(L, idx, SERVER_MT);
}

static hd_server *check_open(lua_State *L, int idx, const char *what)
{
    hd_server *hd = check_server(L, idx);
    if (!hd->hs) luaL_error(L, "%s: the server is closed", what);
    return hd;
}

static size_t opt_size(lua_State *L, int t, const char *key, size_t dflt, const char *what)
{
    size_t v = dflt;
    lua_getfield(L, t, key);
    if (!lua_isnil(L, -1)) {
        int isnum;
        lua_Integer n = lua_tointegerx(L, -1, &isnum);
        if (!isnum || n < 1) luaL_error(L, "%s: %s must be a positive integer", what, key);
        v = (size_t)n;
    }
    lua_pop(L, 1);
    return v;
}

static const char *opt_string(lua_State *L, int t, const char *key, const char *what)
{
    const char *s = NULL;
    lua_getfield(L, t, key);
    if (!lua_isnil(L, -1)) {
        if (lua_type(L, -1) != LUA_TSTRING) luaL_error(L, "%s: %s must be a string", what, key);
        s = lua_tostring(L, -1); /* anchored by the options table */
    }
    lua_pop(L, 1);
    return s;
}

/* srv:route(method, pattern, handler, opts) -> srv. Adds a route, tried in the order added.
 * method: "GET", "POST", ... (upper-cased) or "*" for any; a GET route also answers HEAD.
 * pattern: "/literal/:name" plus an optional final segment "*" — ":name" captures one
 * non-empty segment, the final "*" captures the rest (possibly empty) as captures.rest.
 * handler(req, res) runs as its own task per request. opts.body: "memory" (default: req.body, a
 * string), "file" (req.body_file, a 0600 temporary file in opts.upload_dir or the server's, removed
 * when the handler returns unless it moved it) or "none" (the body is read and dropped);
 * opts.max_body: bytes (default the server's); a larger body is answered 413 without reaching the
 * handler. opts.auth: "none" (default), "key" (Authorization: Bearer <srv:set_key's key>) or
 * "token" (a bearer token given to srv:token_put for opts.scope and this request's ":id"); a
 * request without them is answered 401 (403 for a token of another id or scope, or one used
 * already: a token lets one request in) by the server,
 * before any of its body is kept, and never reaches the handler. opts.space (a "file" route):
 * true, or a directory D: a declared Content-Length that does not fit in the upload
 * directory's free space (or, with D, in the room of D/<its ":id">: free space and its btrfs
 * quota) is answered 507 before any of the body is read, and a body that runs out of space
 * while stored is 507 too (runtime/http_server.c). Raises on a malformed pattern or option, or
 * when the server is closed. Does not yield.
 */
static int srv_route(lua_State *L)
{
    hd_server *hd = check_open(L, 1, "srv:route");
    const char *method = luaL_checkstring(L, 2);
    const char *pattern = luaL_checkstring(L, 3);
    luaL_checktype(L, 4, LUA_TFUNCTION);
    int mode = HS_BODY_MEMORY, auth = HS_AUTH_NONE;
    size_t max_body = 0;
    const char *dir = NULL, *scope = NULL, *space_dir = NULL;
    int space = 0;
    if (!lua_isnoneornil(L, 5)) {
        luaL_checktype(L, 5, LUA_TTABLE);
        const char *body = opt_string(L, 5, "body", "srv:route");
        if (body && strcmp(body, "memory") == 0)
            mode = HS_BODY_MEMORY;
        else if (body && strcmp(body, "file") == 0)
            mode = HS_BODY_FILE;
        else if (body && strcmp(body, "none") == 0)
            mode = HS_BODY_NONE;
        else if (body)
            return luaL_error(L,
                              "srv:route: body must be \"memory\", \"file\" or \"none\", not "
                              "\"%s\"",
                              body);
        max_body = opt_size(L, 5, "max_body", 0, "srv:route");
        dir = opt_string(L, 5, "upload_dir", "srv:route");
        const char *a = opt_string(L, 5, "auth", "srv:route");
        if (a && strcmp(a, "key") == 0)
            auth = HS_AUTH_KEY;
        else if (a && strcmp(a, "token") == 0)
            auth = HS_AUTH_TOKEN;
        else if (a && strcmp(a, "none") != 0)
            return luaL_error(
                L, "srv:route: auth must be \"none\", \"key\" or \"token\", not \"%s\"", a);
        scope = opt_string(L, 5, "scope", "srv:route");
        if (auth == HS_AUTH_TOKEN && !scope)
            return luaL_error(L, "srv:route: auth = \"token\" needs a scope");
        lua_getfield(L, 5, "space");
        if (lua_type(L, -1) == LUA_TSTRING)
            space = 1, space_dir = lua_tostring(L, -1); /* stays referenced by opts */
        else if (!lua_isnil(L, -1))
            space = lua_toboolean(L, -1);
        lua_pop(L, 1);
        if (space && mode != HS_BODY_FILE)
            return luaL_error(L, "srv:route: opts.space needs body = \"file\"");
    }
    push_mapped(L, method, toupper);
    const char *umethod = lua_tostring(L, -1);
    char err[256];
    int id = hd->nhandlers + 1;
    int rc = hs_server_add_route(hd->hs, umethod, pattern, mode, max_body, dir, auth, scope, id,
                                 err, sizeof err);
    if (rc != HS_OK) return luaL_error(L, "srv:route: %s", err);
    if (space && hs_server_route_space(hd->hs, space_dir) != HS_OK)
        return luaL_error(L, "srv:route: out of memory");
    hd->nhandlers = id;
    lua_getiuservalue(L, 1, SRV_UV_HANDLERS);
    lua_pushvalue(L, 4);
    lua_rawseti(L, -2, id);
    lua_settop(L, 1);
    return 1;
}

/* Closes hd: the runtime side, then (when cancel) the handler tasks still running, except the
 * caller's own task; then the anchor. */
static void server_close(lua_State *L, int idx, hd_server *hd, int cancel)
{
    if (!hd->hs) return;
    hs_server_stats(hd->hs, &hd->final);
    hs_server_close(hd->hs);
    hd->hs = NULL;
    hd->final.active = 0;
    hd->final.connections = 0;
    if (cancel) {
        mb_task *self = mb_task_of(L);
        lua_getiuservalue(L, idx, SRV_UV_TASKS);
        lua_pushnil(L);
        while (lua_next(L, -2)) {
            hd_response *res = (hd_response *)lua_touserdata(L, -1);
            mb_task *t = (mb_task *)lua_touserdata(L, -2);
            lua_pop(L, 1);
            if (res && !res->started) {
                finish_response(res, 0);
                lua_pushvalue(L, -1);
                lua_pushnil(L);
                lua_rawset(L, -4); /* clearing a visited key is allowed during lua_next */
            }
            if (t && t != self) mb_task_cancel(t);
        }
        lua_pop(L, 1);
    }
    int ref = hd->anchor;
    hd->anchor = LUA_NOREF;
    mb_unref(L, ref);
}

/* srv:close(): stops accepting, ends every request in flight (a client waiting for an answer
 * sees its connection closed; writers get "client_gone"), cancels the handler tasks still
 * running (not the caller's own), and frees the server. Idempotent; also __close. Does not
 * yield. */
static int srv_close(lua_State *L)
{
    hd_server *hd = check_server(L, 1);
    server_close(L, 1, hd, 1);
    return 0;
}

static int srv_shutdown_k(lua_State *L, int status, lua_KContext ctx)
{
    hd_server *hd = check_server(L, 1);
    (void)status;
    (void)ctx;
    if (!hd->hs) return 0; /* closed meanwhile */
    hs_stats st;
    hs_server_stats(hd->hs, &st);
    if (st.active == 0 || ev_now(hd->rt->loop) >= lua_tonumber(L, 2)) {
        server_close(L, 1, hd, 1);
        return 0;
    }
    /* Polling keeps this free of another wake-up path through the runtime; 10 ms is well
     * below what a graceful stop is measured in. */
    push_core_fn(L, "sleep");
    lua_pushnumber(L, 0.01);
    lua_callk(L, 1, 0, 0, srv_shutdown_k);
    return srv_shutdown_k(L, LUA_OK, 0);
}

/* srv:shutdown(grace): stops accepting connections at once (new ones are refused), waits until
 * no request is in flight or grace seconds (default 10) have passed, then closes as srv:close
 * does. Requests that arrive meanwhile on connections already open are still served. Call it
 * from a task other than a handler of this server: a handler's own request is in flight until
 * it returns. [yields] */
static int srv_shutdown(lua_State *L)
{
    hd_server *hd = check_server(L, 1);
    double grace = luaL_optnumber(L, 2, 10.0);
    if (grace != grace || grace < 0) return luaL_argerror(L, 2, "expected seconds >= 0");
    mb_task_check_yieldable(L, "srv:shutdown");
    if (!hd->hs) return 0;
    hs_server_quiesce(hd->hs);
    lua_settop(L, 1);
    lua_pushnumber(L, ev_now(hd->rt->loop) + grace);
    return srv_shutdown_k(L, LUA_OK, 0);
}

/* Only reached at lua_close for a server never closed (an open server is anchored). */
static int srv_gc(lua_State *L)
{
    hd_server *hd = (hd_server *)lua_touserdata(L, 1);
    server_close(L, 1, hd, 0);
    return 0;
}

/* srv:stats() -> {requests, active, max_concurrent, connections, handlers, peak_body_bytes,
 * rejected_large}: requests routed, requests in flight, the most in flight at once (also as
 * max_active), open connections, handler tasks running, the largest in-memory body buffer,
 * 413 answers. */
static int srv_stats(lua_State *L)
{
    hd_server *hd = check_server(L, 1);
    hs_stats st = hd->final;
    if (hd->hs) hs_server_stats(hd->hs, &st);
    int handlers = 0;
    lua_getiuservalue(L, 1, SRV_UV_TASKS);
    lua_pushnil(L);
    while (lua_next(L, -2)) {
        handlers++;
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
    lua_createtable(L, 0, 8);
    mb_setfield_int(L, -1, "requests", (lua_Integer)st.requests);
    mb_setfield_int(L, -1, "active", st.active);
    mb_setfield_int(L, -1, "max_concurrent", st.max_active);
    mb_setfield_int(L, -1, "max_active", st.max_active);
    mb_setfield_int(L, -1, "connections", st.connections);
    mb_setfield_int(L, -1, "handlers", handlers);
    mb_setfield_int(L, -1, "peak_body_bytes", (lua_Integer)st.peak_body_bytes);
    mb_setfield_int(L, -1, "rejected_large", (lua_Integer)st.rejected_large);
    mb_setfield_int(L, -1, "rejected_auth", (lua_Integer)st.rejected_auth);
    mb_setfield_int(L, -1, "rejected_framing", (lua_Integer)st.rejected_framing);
    mb_setfield_int(L, -1, "tokens", hd->hs ? (lua_Integer)hs_server_token_count(hd->hs) : 0);
    return 1;
}

/* srv:set_key(key) -> srv. The bearer key routes with auth = "key" require (nil: nobody). The
 * server checks it when a request's headers are in, before reading its body. Does not yield. */
static int srv_set_key(lua_State *L)
{
    hd_server *hd = check_open(L, 1, "srv:set_key");
    const char *key = luaL_optstring(L, 2, NULL);
    if (hs_server_set_key(hd->hs, key) != HS_OK) return luaL_error(L, "srv:set_key: out of memory");
    lua_settop(L, 1);
    return 1;
}

/* srv:token_put(token, id, scope, ttl) -> srv. Lets one request bearing token into auth =
 * "token" routes of that scope whose ":id" capture is id, for ttl seconds (then 401 "expired"
 * until srv:token_drop); a second one gets 403 "used already". Does not yield. */
static int srv_token_put(lua_State *L)
{
    hd_server *hd = check_open(L, 1, "srv:token_put");
    const char *token = luaL_checkstring(L, 2), *id = luaL_checkstring(L, 3),
               *scope = luaL_checkstring(L, 4);
    double ttl = luaL_checknumber(L, 5);
    if (hs_server_token_put(hd->hs, token, id, scope, ttl) != HS_OK)
        return luaL_error(L, "srv:token_put: out of memory");
    lua_settop(L, 1);
    return 1;
}

/* srv:token_drop(token) -> srv. Forgets a token. Does not yield. */
static int srv_token_drop(lua_State *L)
{
    hd_server *hd = check_server(L, 1);
    const char *token = luaL_checkstring(L, 2);
    if (hd->hs) hs_server_token_drop(hd->hs, token);
    lua_settop(L, 1);
    return 1;
}

/* srv.port, srv.host, srv.url ("http://HOST:PORT"), srv.closed; anything else is a method (upvalue
 * 1). */
static int srv_index(lua_State *L)
{
    hd_server *hd = check_server(L, 1);
    const char *k = lua_tostring(L, 2);
    if (k && strcmp(k, "port") == 0) {
        lua_pushinteger(L, hd->port);
    } else if (k && strcmp(k, "host") == 0) {
        lua_pushstring(L, hd->host);
    } else if (k && strcmp(k, "url") == 0) {
        if (strchr(hd->host, ':'))
            lua_pushfstring(L, "http://[%s]:%d", hd->host, hd->port);
        else
            lua_pushfstring(L, "http://%s:%d", hd->host, hd->port);
    } else if (k && strcmp(k, "closed") == 0) {
        lua_pushboolean(L, hd->hs == NULL);
    } else {
        lua_pushvalue(L, 2);
        lua_rawget(L, lua_upvalueindex(1));
    }
    return 1;
}

static int srv_tostring(lua_State *L)
{
    hd_server *hd = check_server(L, 1);
    lua_pushfstring(L, "httpd.Server http://%s:%d (%s)", hd->host, hd->port,
                    hd->hs ? "open" : "closed");
    return 1;
}

/* httpd.listen(opts) -> Server. opts (all optional): host (default "127.0.0.1"; "0.0.0.0" or
 * "::" listen on every interface), also_host (a second address served the same on the same
 * port, e.g. "::1" beside "127.0.0.1"; an ephemeral port is chosen free on both), port (default 0:
 * an ephemeral port, see srv.port), max_body (default body limit of routes, 1 MiB), upload_dir
 * (default directory of file-mode bodies,
 * "/tmp"), connection_limit (default 4096), idle_timeout (seconds a silent client is kept,
 * default 120), log (function(line) receiving handler failures; default writes to io.stderr).
 * The server serves as the loop runs and stays open (and referenced) until srv:close().
 * Raises a structured error (op "httpd.listen", code "listen_failed") when it cannot listen,
 * and on malformed options. Does not yield. */
static int l_listen(lua_State *L)
{
    hs_config cfg;
    memset(&cfg, 0, sizeof cfg);
    lua_settop(L, 1);
    if (lua_isnil(L, 1)) {
        lua_newtable(L);
        lua_replace(L, 1);
    }
    luaL_checktype(L, 1, LUA_TTABLE);
    cfg.host = opt_string(L, 1, "host", "httpd.listen");
    cfg.also_host = opt_string(L, 1, "also_host", "httpd.listen");
    lua_getfield(L, 1, "port");
    if (!lua_isnil(L, -1)) {
        int isnum;
        lua_Integer p = lua_tointegerx(L, -1, &isnum);
        if (!isnum || p < 0 || p > 65535)
            return luaL_error(L, "httpd.listen: port must be an integer 0..65535");
        cfg.port = (int)p;
    }
    lua_pop(L, 1);
    cfg.max_body = opt_size(L, 1, "max_body", HS_DEFAULT_MAX_BODY, "httpd.listen");
    cfg.upload_dir = opt_string(L, 1, "upload_dir", "httpd.listen");
    cfg.connection_limit =
        (unsigned)opt_size(L, 1, "connection_limit", HS_DEFAULT_CONNECTION_MAX, "httpd.listen");
    cfg.idle_timeout =
        (unsigned)opt_size(L, 1, "idle_timeout", HS_DEFAULT_IDLE_TIMEOUT, "httpd.listen");
    lua_getfield(L, 1, "log");
    if (!lua_isnil(L, -1) && !lua_isfunction(L, -1))
        return luaL_error(L, "httpd.listen: log must be a function");
    int log_idx = lua_gettop(L);

    hd_server *hd = (hd_server *)lua_newuserdatauv(L, sizeof *hd, 3);
    int ud = lua_gettop(L);
    memset(hd, 0, sizeof *hd);
    hd->anchor = LUA_NOREF;
    hd->rt = mb_runtime_get(L);
    luaL_setmetatable(L, SERVER_MT);
    lua_newtable(L);
    lua_setiuservalue(L, ud, SRV_UV_HANDLERS);
    lua_newtable(L);
    lua_setiuservalue(L, ud, SRV_UV_TASKS);
    lua_pushvalue(L, log_idx);
    lua_setiuservalue(L, ud, SRV_UV_LOG);

    cfg.on_request = on_request;
    cfg.ud = hd;
    char err[384];
    hs_server *hs;
    if (hs_server_start(hd->rt->loop, &cfg, &hs, err, sizeof err) != HS_OK) {
        mb_error_new(L, "httpd.listen", "listen_failed", "%s", err);
        mb_setfield_str(L, -1, "host", cfg.host ? cfg.host : "127.0.0.1");
        mb_setfield_int(L, -1, "port", cfg.port);
        return lua_error(L);
    }
    hd->hs = hs;
    hd->port = hs_server_port(hs);
    snprintf(hd->host, sizeof hd->host, "%s", hs_server_host(hs));
    lua_pushvalue(L, ud);
    hd->anchor = mb_ref(L);
    lua_settop(L, ud);
    return 1;
}

/* httpd.live_requests() -> request records alive in this process (handlers running, answers
 * being sent, bodies arriving): a diagnostic for leak tests. */
static int l_live_requests(lua_State *L)
{
    lua_pushinteger(L, hs_live_requests());
    return 1;
}

/* httpd.mhd_version() -> libmicrohttpd's version, e.g. "0.9.75". */
static int l_mhd_version(lua_State *L)
{
    lua_pushstring(L, hs_mhd_version());
    return 1;
}

/* ---- module -------------------------------------------------------------------------------------
 */

static const luaL_Reg server_methods[] = {
    {"route", srv_route},         {"close", srv_close},
    {"shutdown", srv_shutdown},   {"set_key", srv_set_key},
    {"token_put", srv_token_put}, {"token_drop", srv_token_drop},
    {"stats", srv_stats},         {NULL, NULL},
};

static const luaL_Reg request_methods[] = {
    {"query_param", req_query_param},
    {"query_all", req_query_all},
    {"header", req_header},
    {NULL, NULL},
};

static const luaL_Reg response_methods[] = {
    {"send", res_send},     {"drop", res_drop}, {"send_file", res_send_file},
    {"stream", res_stream}, {"sent", res_sent}, {NULL, NULL},
};

static const luaL_Reg writer_methods[] = {
    {"write", writer_write},
    {"sse", writer_sse},
    {"sse_output", writer_sse_output},
    {"comment", writer_comment},
    {"close", writer_close},
    {"pending", writer_pending},
    {NULL, NULL},
};

static const luaL_Reg httpd_funcs[] = {
    {"listen", l_listen},
    {"live_requests", l_live_requests},
    {"mhd_version", l_mhd_version},
    {NULL, NULL},
};

/* require "moonbox.httpd": loads moonbox.core first (handlers run as its tasks), registers the
 * Server (methods, __close, __gc), Request, Response (__gc) and Writer (__close) metatables once
 * per state, and pushes the module table {listen, live_requests, mhd_version}. Raises only on
 * out of memory; never yields. */
int luaopen_moonbox_httpd(lua_State *L)
{
    luaL_requiref(L, "moonbox.core", luaopen_moonbox_core, 0);
    lua_pop(L, 1);
    static const luaL_Reg server_meta[] = {
        {"__close", srv_close}, {"__gc", srv_gc}, {"__tostring", srv_tostring}, {NULL, NULL}};
    static const luaL_Reg response_meta[] = {{"__gc", res_gc}, {NULL, NULL}};
    static const luaL_Reg writer_meta[] = {{"__close", writer_close}, {NULL, NULL}};
    mb_newclass_index(L, SERVER_MT, server_methods, srv_index, server_meta);
    mb_newclass(L, REQUEST_MT, request_methods, NULL);
    mb_newclass(L, RESPONSE_MT, response_methods, response_meta);
    mb_newclass(L, WRITER_MT, writer_methods, writer_meta);
    luaL_newlib(L, httpd_funcs);
    return 1;
}
