/*
 * http_server.c — the HTTP server: libmicrohttpd in external-event mode on a libev loop, a
 * router, bounded request bodies, and responses that may come later (see http_server.h).
 *
 * MHD runs with its own epoll set; the loop watches that one descriptor with an ev_io and keeps
 * one ev_timer armed from MHD_get_timeout after every MHD_run (0 when MHD has work queued, and
 * after every resume, so MHD is never called from inside its own callbacks). A request record is
 * made by the URI callback, routed when its headers are complete (so the body mode and limit
 * are known before any body byte), and, once complete, its connection is suspended and
 * on_request called. The answer is stored on the record and the connection resumed; MHD then
 * calls the access handler again, which queues it. A streamed answer is fed from a byte queue:
 * when the queue is empty the content reader suspends the connection and returns 0, the
 * documented way to wait for data in external mode; a write resumes it.
 *
 * Ownership: a record has one reference for MHD (taken by the URI callback, dropped on
 * NOTIFY_COMPLETED), one per outside holder (hs_request_retain) and one for a streamed response
 * object (dropped by MHD's free callback). Whoever drops the last one frees it.
 */
#include "http_server.h"

#include "host_fs.h"
#include "jsonq.h"

#include <microhttpd.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* Bytes read and dropped after a body passed its limit, or of a request refused by its
 * credentials, before the connection is cut: enough to answer 413 or 401 to a client that sent
 * a modest body without Expect: 100-continue (a reply to a connection whose unread bytes are
 * then dropped reaches the client as a reset, not as the reply), small enough that an endless
 * chunked upload cannot keep the server busy. */
#define HS_DISCARD_MAX    (1024u * 1024)
#define HS_STREAM_BLOCK   (64u * 1024)
#define HS_LISTEN_BACKLOG 1024u
#define HS_MAX_ALLOW      16

/* Where a request is in its life, as the access handler sees it. */
enum {
    PH_NEW,      /* made by the URI callback; headers not seen yet */
    PH_BODY,     /* routed; receiving the body */
    PH_REJECTED, /* answered before the handler (404, 405, 413, 500) */
    PH_HANDLER,  /* complete; suspended until the handler answers */
    PH_RESPONSE, /* the answer is queued with MHD */
    PH_DONE,     /* MHD has finished with it */
};

typedef struct hs_segment {
    char *text;
    size_t len;
    int capture; /* ":name": text is the name */
} hs_segment;

typedef struct hs_route {
    char *method; /* "*" matches any */
    hs_segment *segs;
    size_t nsegs;
    int rest; /* the pattern ends in '*' */
    int body_mode;
    size_t max_body;
    char *upload_dir;
    int auth;         /* enum hs_auth_mode */
    char *auth_scope; /* HS_AUTH_TOKEN: the scope tokens must be bound to */
    int handler_id;
    int space_check; /* HS_BODY_FILE: refuse a declared length that does not fit (507) */
    char *space_dir; /* and check the room of space_dir/<:id> too */
} hs_route;

/* A connect token: which sandbox (":id" capture) and scope it opens, until when. */
typedef struct hs_token {
    char *token, *id, *scope;
    double expires; /* ev_now() time */
    int used;       /* a request has passed the gate with it: it opens nothing more */
    struct hs_token *next;
} hs_token;

#define HS_TOKEN_BUCKETS 1024

struct hs_server {
    struct ev_loop *loop;
    struct MHD_Daemon *daemon;
    struct MHD_Daemon *daemon2; /* the same service on the second address, or NULL */
    ev_io io, io2;
    ev_timer timer;
    hs_route *routes;
    size_t nroutes, routes_cap;
    size_t max_body;
    char *upload_dir;
    hs_request_fn on_request;
    void *ud;
    hs_request *live; /* every record that still points at this server */
    char host[INET6_ADDRSTRLEN];
    int port;
    hs_stats stats;
    char *key;                          /* HS_AUTH_KEY's key, or NULL */
    hs_token *tokens[HS_TOKEN_BUCKETS]; /* HS_AUTH_TOKEN's tokens, chained by hash */
    size_t ntokens;
    int closing;
    int quiesced;
    int log_to_stderr;
    char lastlog[256];
};

typedef struct hs_span {
    const char *p;
    size_t n;
} hs_span;

struct hs_request {
    hs_server *srv;              /* NULL once the server closed */
    struct MHD_Connection *conn; /* NULL once MHD completed the request */
    hs_request *prev, *next;     /* srv->live */
    int refs;
    int mhd_ref; /* MHD's reference has not been dropped yet */
    int phase;
    int suspended; /* we suspended conn and have not resumed it */
    int state;     /* enum hs_request_state */
    hs_request_view view;

    char *target;
    char *path;
    char *method;
    const char *uri_end;    /* in MHD's buffer: where the raw target's C string ended */
    const char *bad_target; /* why the raw target is refused, or NULL */
    char remote[INET6_ADDRSTRLEN];
    hs_pair *headers;
    size_t nheaders;
    hs_pair captures[HS_MAX_CAPTURES + 1];
    size_t ncaptures;

    /* body */
    const hs_route *route; /* valid while receiving (routes live as long as the server) */
    size_t max_body;
    size_t received;
    size_t discarded;
    int too_large;
    int store_errno;
    unsigned deny_status; /* refused by its credentials: answered once the body is drained */
    char deny_msg[128];
    char *body;
    size_t body_cap;
    int body_fd;
    char *body_path;

    /* the answer */
    struct MHD_Response *pending;
    unsigned pending_status;
    int responded;
    int drop; /* answer by closing the connection without a reply (fault injection) */

    /* a streamed answer: bytes q[q_off .. q_off + q_len) wait for MHD */
    int streaming;
    char *q;
    size_t q_off, q_len, q_cap, q_bound;
    int q_ended, q_abort;

    hs_request_fn notify;
    void *notify_ud;
};

static long g_live_requests;

/* ---- small helpers ------------------------------------------------------------------------- */

static void hs_seterr(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    if (!err || errlen == 0) return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static char *hs_strndup(const char *s, size_t n)
{
    char *d = (char *)malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

static int hs_hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

void hs_query_each(const char *q, hs_query_fn fn, void *ud)
{
    while (*q) {
        size_t n = strcspn(q, "&");
        if (n > 0) {
            const char *eq = memchr(q, '=', n);
            size_t kn = eq ? (size_t)(eq - q) : n;
            const char *v = eq ? eq + 1 : q + n;
            size_t vn = eq ? n - kn - 1 : 0;
            fn(ud, q, kn, v, vn);
        }
        q += n;
        if (*q == '&') q++;
    }
}

size_t hs_percent_decode(const char *src, size_t n, char *out, int plus_is_space)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char c = src[i];
        if (c == '%' && i + 2 < n) {
            int hi = hs_hexval((unsigned char)src[i + 1]);
            int lo = hs_hexval((unsigned char)src[i + 2]);
            if (hi >= 0 && lo >= 0) {
                out[o++] = (char)(hi * 16 + lo);
                i += 2;
                continue;
            }
        }
        out[o++] = (plus_is_space && c == '+') ? ' ' : c;
    }
    out[o] = '\0';
    return o;
}

/* A token character of RFC 9110 (header names and methods). */
static int hs_is_tchar(int c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

static void hs_notify(hs_request *r)
{
    if (r->notify) r->notify(r, r->notify_ud);
}

/* Makes MHD look at the server again on the loop's next turn (never from inside MHD). */
static void hs_kick(hs_server *s)
{
    if (!s || s->closing) return;
    ev_timer_stop(s->loop, &s->timer);
    ev_timer_set(&s->timer, 0., 0.);
    ev_timer_start(s->loop, &s->timer);
}

/* Resumes the connection if we suspended it, so MHD picks up a new answer or new stream bytes. */
static void hs_wake_conn(hs_request *r)
{
    if (r->conn && r->suspended && r->srv && !r->srv->closing) {
        r->suspended = 0;
        MHD_resume_connection(r->conn);
        hs_kick(r->srv);
    }
}

static void hs_body_file_remove(hs_request *r)
{
    if (r->body_fd >= 0) close(r->body_fd);
    r->body_fd = -1;
    if (r->body_path) {
        unlink(r->body_path);
        free(r->body_path);
        r->body_path = NULL;
    }
    r->view.body_file = NULL;
}

static void hs_unlink_live(hs_request *r)
{
    hs_server *s = r->srv;
    if (!s) return;
    if (r->prev)
        r->prev->next = r->next;
    else
        s->live = r->next;
    if (r->next) r->next->prev = r->prev;
    r->prev = r->next = NULL;
    r->srv = NULL;
}

/* ---- requests: lifetime ---------------------------------------------------------------------- */

void hs_request_retain(hs_request *r)
{
    r->refs++;
}

void hs_request_release(hs_request *r)
{
    if (--r->refs > 0) return;
    hs_body_file_remove(r);
    hs_unlink_live(r);
    free(r->body);
    free(r->q);
    free(r->target);
    free(r->path);
    free(r->method);
    for (size_t i = 0; i < r->nheaders; i++) {
        free((char *)r->headers[i].name);
        free((char *)r->headers[i].value);
    }
    free(r->headers);
    for (size_t i = 0; i < r->ncaptures; i++)
        free((char *)r->captures[i].value);
    g_live_requests--;
    free(r);
}

const hs_request_view *hs_request_get_view(const hs_request *r)
{
    return &r->view;
}

int hs_request_state(const hs_request *r)
{
    return r->state;
}

void *hs_request_server_ud(const hs_request *r)
{
    return r->srv && !r->srv->closing ? r->srv->ud : NULL;
}

void hs_request_set_notify(hs_request *r, hs_request_fn fn, void *ud)
{
    r->notify = fn;
    r->notify_ud = ud;
}

void hs_request_drop_body(hs_request *r)
{
    free(r->body);
    r->body = NULL;
    r->body_cap = 0;
    r->view.body = NULL;
    r->view.body_len = 0;
}

void hs_request_discard_body_file(hs_request *r)
{
    hs_body_file_remove(r);
}

long hs_live_requests(void)
{
    return g_live_requests;
}

const char *hs_mhd_version(void)
{
    return MHD_get_version();
}

/* ---- routing ------------------------------------------------------------------------------- */

static void hs_route_free(hs_route *rt)
{
    for (size_t i = 0; i < rt->nsegs; i++)
        free(rt->segs[i].text);
    free(rt->segs);
    free(rt->method);
    free(rt->upload_dir);
    free(rt->auth_scope);
    free(rt->space_dir);
}

/* Parses pattern into rt's segments. Returns HS_OK or HS_ERR_INVALID/HS_ERR_NOMEM. */
static int hs_route_parse(hs_route *rt, const char *pattern, char *err, size_t errlen)
{
    if (pattern[0] != '/') {
        hs_seterr(err, errlen, "route pattern '%s' must start with '/'", pattern);
        return HS_ERR_INVALID;
    }
    size_t cap = 1;
    for (const char *p = pattern + 1; *p; p++)
        if (*p == '/') cap++;
    rt->segs = (hs_segment *)calloc(cap, sizeof *rt->segs);
    if (!rt->segs) return HS_ERR_NOMEM;
    size_t ncap = 0;
    const char *p = pattern + 1;
    for (;;) {
        size_t n = strcspn(p, "/");
        int last = p[n] == '\0';
        if (n == 1 && p[0] == '*') {
            if (!last) {
                hs_seterr(err, errlen, "route pattern '%s': '*' must be the last segment", pattern);
                return HS_ERR_INVALID;
            }
            rt->rest = 1;
            break;
        }
        hs_segment *sg = &rt->segs[rt->nsegs];
        if (n > 0 && p[0] == ':') {
            if (n == 1) {
                hs_seterr(err, errlen, "route pattern '%s': ':' needs a name", pattern);
                return HS_ERR_INVALID;
            }
            for (size_t i = 1; i < n; i++) {
                char c = p[i];
                if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '_')) {
                    hs_seterr(err, errlen,
                              "route pattern '%s': capture names use letters, digits and _",
                              pattern);
                    return HS_ERR_INVALID;
                }
            }
            if (++ncap > HS_MAX_CAPTURES) {
                hs_seterr(err, errlen, "route pattern '%s': more than %d captures", pattern,
                          HS_MAX_CAPTURES);
                return HS_ERR_INVALID;
            }
            sg->capture = 1;
            sg->text = hs_strndup(p + 1, n - 1);
            sg->len = n - 1;
        } else {
            if (memchr(p, '*', n)) {
                hs_seterr(err, errlen, "route pattern '%s': '*' must be a whole last segment",
                          pattern);
                return HS_ERR_INVALID;
            }
            sg->text = hs_strndup(p, n);
            sg->len = n;
        }
        if (!sg->text) return HS_ERR_NOMEM;
        rt->nsegs++;
        if (last) break;
        p += n + 1;
    }
    return HS_OK;
}

/* http_server.h has the caller's contract. Here: checks the auth mode (a token route needs a
 * scope), that method is "*" or an HTTP token, and the body mode before anything is
 * allocated; parses the pattern into segments (hs_route_parse) and copies method, upload_dir
 * and scope, so the caller's strings may go once this returns. Returns HS_OK, HS_ERR_INVALID
 * with a sentence in err (at most errlen bytes), or HS_ERR_NOMEM; on failure the route table is
 * as it was. Loop thread; does not block. */
int hs_server_add_route(hs_server *s, const char *method, const char *pattern, int body_mode,
                        size_t max_body, const char *upload_dir, int auth, const char *auth_scope,
                        int handler_id, char *err, size_t errlen)
{
    if (auth < HS_AUTH_NONE || auth > HS_AUTH_TOKEN || (auth == HS_AUTH_TOKEN && !auth_scope)) {
        hs_seterr(err, errlen, "unknown auth mode %d (a token route needs a scope)", auth);
        return HS_ERR_INVALID;
    }
    if (!method || !*method) {
        hs_seterr(err, errlen, "route method must not be empty");
        return HS_ERR_INVALID;
    }
    if (strcmp(method, "*") != 0)
        for (const char *m = method; *m; m++)
            if (!hs_is_tchar((unsigned char)*m)) {
                hs_seterr(err, errlen, "route method '%s' is not an HTTP method token", method);
                return HS_ERR_INVALID;
            }
    if (body_mode < HS_BODY_MEMORY || body_mode > HS_BODY_NONE) {
        hs_seterr(err, errlen, "unknown body mode %d", body_mode);
        return HS_ERR_INVALID;
    }
    if (s->nroutes == s->routes_cap) {
        size_t cap = s->routes_cap ? s->routes_cap * 2 : 8;
        hs_route *nr = (hs_route *)realloc(s->routes, cap * sizeof *nr);
        if (!nr) return HS_ERR_NOMEM;
        s->routes = nr;
        s->routes_cap = cap;
    }
    hs_route rt;
    memset(&rt, 0, sizeof rt);
    int rc = hs_route_parse(&rt, pattern, err, errlen);
    rt.method = strdup(method);
    rt.upload_dir = upload_dir ? strdup(upload_dir) : NULL;
    rt.auth_scope = auth_scope ? strdup(auth_scope) : NULL;
    if (rc == HS_OK &&
        (!rt.method || (upload_dir && !rt.upload_dir) || (auth_scope && !rt.auth_scope)))
        rc = HS_ERR_NOMEM;
    if (rc != HS_OK) {
        if (rc == HS_ERR_NOMEM) hs_seterr(err, errlen, "out of memory adding a route");
        hs_route_free(&rt);
        return rc;
    }
    rt.body_mode = body_mode;
    rt.max_body = max_body ? max_body : s->max_body;
    rt.auth = auth;
    rt.handler_id = handler_id;
    s->routes[s->nroutes++] = rt;
    return HS_OK;
}

int hs_server_route_space(hs_server *s, const char *space_dir)
{
    if (s->nroutes == 0 || s->routes[s->nroutes - 1].body_mode != HS_BODY_FILE)
        return HS_ERR_INVALID;
    hs_route *rt = &s->routes[s->nroutes - 1];
    char *d = space_dir ? strdup(space_dir) : NULL;
    if (space_dir && !d) return HS_ERR_NOMEM;
    free(rt->space_dir);
    rt->space_dir = d;
    rt->space_check = 1;
    return HS_OK;
}

/* Whether a file body of declared bytes fits where it goes (hs_server_route_space): the upload
 * directory's free space, then the room of the sandbox its ":id" names. 0, or 507 with msg
 * (no host path in it). */
static unsigned hs_space_refusal(hs_server *s, const hs_route *rt, hs_request *r,
                                 unsigned long long declared, char *msg, size_t cap)
{
    const char *dir = rt->upload_dir ? rt->upload_dir : s->upload_dir;
    uint64_t room;
    if (host_fs_room(dir, &room) == 0 && declared > room) {
        snprintf(msg, cap,
                 "the upload of %llu bytes does not fit: the backend has %llu bytes of disk left "
                 "for uploads; nothing was read",
                 declared, (unsigned long long)room);
        return 507;
    }
    const char *id = NULL;
    for (size_t i = 0; i < r->ncaptures; i++)
        if (strcmp(r->captures[i].name, "id") == 0) id = r->captures[i].value;
    if (!rt->space_dir || !id || strchr(id, '/') || id[0] == '.') return 0;
    char path[PATH_MAX];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", rt->space_dir, id) >= sizeof path) return 0;
    if (host_fs_room(path, &room) == 0 && declared > room) {
        snprintf(msg, cap,
                 "the upload of %llu bytes does not fit: sandbox %s has %llu bytes of its disk "
                 "left; nothing was read",
                 declared, id, (unsigned long long)room);
        return 507;
    }
    return 0;
}

/* ---- authentication before the body ------------------------------------------------------------
 */

static unsigned hs_token_hash(const char *t)
{
    unsigned h = 2166136261u;
    for (; *t; t++)
        h = (h ^ (unsigned char)*t) * 16777619u;
    return h % HS_TOKEN_BUCKETS;
}

static void hs_token_free(hs_token *t)
{
    free(t->token);
    free(t->id);
    free(t->scope);
    free(t);
}

int hs_server_set_key(hs_server *s, const char *key)
{
    char *k = key ? strdup(key) : NULL;
    if (key && !k) return HS_ERR_NOMEM;
    free(s->key);
    s->key = k;
    return HS_OK;
}

void hs_server_token_drop(hs_server *s, const char *token)
{
    hs_token **pp = &s->tokens[hs_token_hash(token)];
    for (; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->token, token) == 0) {
            hs_token *t = *pp;
            *pp = t->next;
            hs_token_free(t);
            s->ntokens--;
            return;
        }
}

int hs_server_token_put(hs_server *s, const char *token, const char *id, const char *scope,
                        double ttl)
{
    hs_server_token_drop(s, token);
    hs_token *t = (hs_token *)calloc(1, sizeof *t);
    if (!t) return HS_ERR_NOMEM;
    t->token = strdup(token);
    t->id = strdup(id);
    t->scope = strdup(scope);
    if (!t->token || !t->id || !t->scope) {
        hs_token_free(t);
        return HS_ERR_NOMEM;
    }
    t->expires = ev_now(s->loop) + ttl;
    unsigned h = hs_token_hash(token);
    t->next = s->tokens[h];
    s->tokens[h] = t;
    s->ntokens++;
    return HS_OK;
}

size_t hs_server_token_count(const hs_server *s)
{
    return s->ntokens;
}

/* Compares without stopping at the first difference: the time a wrong key takes says nothing
 * about the right one. */
static int hs_same_secret(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned char diff = (unsigned char)(la != lb);
    for (size_t i = 0; i < la; i++)
        diff |= (unsigned char)(a[i] ^ (i < lb ? b[i] : 0));
    return diff == 0;
}

/* The bearer token of r's Authorization header, or NULL. Points into r's header copy. */
static const char *hs_bearer(const hs_request *r, size_t *len)
{
    for (size_t i = 0; i < r->nheaders; i++) {
        if (strcasecmp(r->headers[i].name, "Authorization") != 0) continue;
        const char *v = r->headers[i].value;
        if (strncasecmp(v, "Bearer", 6) != 0 || (v[6] != ' ' && v[6] != '\t')) return NULL;
        v += 6;
        while (*v == ' ' || *v == '\t')
            v++;
        size_t n = 0;
        while (v[n] && v[n] != ' ' && v[n] != '\t')
            n++;
        for (size_t k = n; v[k]; k++)
            if (v[k] != ' ' && v[k] != '\t') return NULL;
        *len = n;
        return n ? v : NULL;
    }
    return NULL;
}

/* Checks route rt's auth for request r (headers and captures known, body not read). Returns 0,
 * or the status to answer with a message in msg. */
static unsigned hs_check_auth(hs_server *s, const hs_route *rt, hs_request *r, char *msg,
                              size_t len)
{
    if (rt->auth == HS_AUTH_NONE) return 0;
    size_t n = 0;
    const char *b = hs_bearer(r, &n);
    char tok[512];
    if (b && n < sizeof tok) {
        memcpy(tok, b, n);
        tok[n] = 0;
    } else {
        b = NULL;
    }
    if (rt->auth == HS_AUTH_KEY) {
        if (b && s->key && hs_same_secret(tok, s->key)) return 0;
        snprintf(msg, len, "unauthorized: send Authorization: Bearer <RENDER_API_KEY>");
        return MHD_HTTP_UNAUTHORIZED;
    }
    hs_token *t = NULL;
    if (b)
        for (t = s->tokens[hs_token_hash(tok)]; t; t = t->next)
            if (hs_same_secret(t->token, tok)) break;
    if (!t) {
        snprintf(msg, len, "invalid or missing connect token");
        return MHD_HTTP_UNAUTHORIZED;
    }
    if (t->expires < ev_now(s->loop)) {
        snprintf(msg, len, "connect token expired; mint a new one");
        return MHD_HTTP_UNAUTHORIZED;
    }
    const char *id = NULL;
    for (size_t i = 0; i < r->ncaptures; i++)
        if (strcmp(r->captures[i].name, "id") == 0) id = r->captures[i].value;
    if (!id || strcmp(id, t->id) != 0 || strcmp(rt->auth_scope, t->scope) != 0) {
        snprintf(msg, len, "this connect token is for another sandbox or operation");
        return MHD_HTTP_FORBIDDEN;
    }
    if (t->used) {
        snprintf(msg, len,
                 "this connect token was used already: a token opens its endpoint once; mint a "
                 "new one");
        return MHD_HTTP_FORBIDDEN;
    }
    /* Single use: the first request through the gate spends it, whatever the handler does. */
    t->used = 1;
    return 0;
}

/* Matches path against rt; on success fills caps (one per capture segment) and *rest. This is
 * O(segments); routes are tried in order, so a lookup is O(routes x segments). A trie would
 * make it O(segments), but route tables here hold tens of entries and the order-of-registration
 * rule it would complicate is the one users reason with. */
static int hs_route_match(const hs_route *rt, const char *path, hs_span *caps, hs_span *rest)
{
    if (path[0] != '/') return 0;
    const char *p = path + 1;
    int at_end = 0;
    size_t k = 0;
    for (size_t i = 0; i < rt->nsegs; i++) {
        if (at_end) return 0;
        size_t n = strcspn(p, "/");
        const hs_segment *sg = &rt->segs[i];
        if (sg->capture) {
            if (n == 0) return 0;
            caps[k].p = p;
            caps[k].n = n;
            k++;
        } else if (n != sg->len || memcmp(p, sg->text, n) != 0) {
            return 0;
        }
        if (p[n] == '/') {
            p += n + 1;
        } else {
            p += n;
            at_end = 1;
        }
    }
    if (rt->rest) {
        rest->p = p;
        rest->n = at_end ? 0 : strlen(p);
        return 1;
    }
    return at_end;
}

static int hs_method_matches(const char *route_method, const char *method)
{
    return strcmp(route_method, "*") == 0 || strcmp(route_method, method) == 0;
}

/* Finds the route for (method, path): the first whose pattern and method match; a HEAD request
 * falls back to the first GET route. When patterns match but no method does, *allow receives
 * the allowed methods ("GET, HEAD, POST") and NULL is returned. */
static const hs_route *hs_route_find(hs_server *s, const char *method, const char *path,
                                     hs_span *caps, hs_span *rest, char *allow, size_t allowlen,
                                     int *path_matched)
{
    const char *methods[HS_MAX_ALLOW];
    size_t nm = 0;
    const hs_route *head_fallback = NULL;
    hs_span fb_caps[HS_MAX_CAPTURES], fb_rest = {NULL, 0};
    int is_head = strcmp(method, "HEAD") == 0;
    *path_matched = 0;
    for (size_t i = 0; i < s->nroutes; i++) {
        const hs_route *rt = &s->routes[i];
        hs_span c[HS_MAX_CAPTURES], r = {NULL, 0};
        if (!hs_route_match(rt, path, c, &r)) continue;
        *path_matched = 1;
        if (hs_method_matches(rt->method, method)) {
            memcpy(caps, c, sizeof c);
            *rest = r;
            return rt;
        }
        if (is_head && !head_fallback && strcmp(rt->method, "GET") == 0) {
            head_fallback = rt;
            memcpy(fb_caps, c, sizeof c);
            fb_rest = r;
        }
        int seen = 0;
        for (size_t j = 0; j < nm; j++)
            if (strcmp(methods[j], rt->method) == 0) seen = 1;
        if (!seen && nm < HS_MAX_ALLOW) methods[nm++] = rt->method;
    }
    if (head_fallback) {
        memcpy(caps, fb_caps, sizeof fb_caps);
        *rest = fb_rest;
        return head_fallback;
    }
    allow[0] = '\0';
    size_t o = 0;
    for (size_t j = 0; j < nm; j++) {
        o += (size_t)snprintf(allow + o, o < allowlen ? allowlen - o : 0, "%s%s", j ? ", " : "",
                              methods[j]);
        if (strcmp(methods[j], "GET") == 0) {
            int has_head = 0;
            for (size_t k = 0; k < nm; k++)
                if (strcmp(methods[k], "HEAD") == 0) has_head = 1;
            if (!has_head)
                o += (size_t)snprintf(allow + o, o < allowlen ? allowlen - o : 0, ", HEAD");
        }
        if (o >= allowlen) break;
    }
    return NULL;
}

/* ---- requests: MHD side -------------------------------------------------------------------- */

/* MHD's URI callback: the request line has arrived. Makes the record (holding MHD's reference)
 * from the raw target, which MHD would otherwise hand out only percent-decoded. */
static void *hs_uri_cb(void *cls, const char *uri, struct MHD_Connection *conn)
{
    hs_server *s = (hs_server *)cls;
    hs_request *r = (hs_request *)calloc(1, sizeof *r);
    if (!r) return NULL;
    if (!uri) uri = "";
    size_t plen = strcspn(uri, "?");
    r->target = strdup(uri);
    r->path = hs_strndup(uri, plen);
    if (!r->target || !r->path) {
        free(r->target);
        free(r->path);
        free(r);
        return NULL;
    }
    r->uri_end = uri + strlen(uri);
    for (const char *c = uri; *c; c++)
        if ((unsigned char)*c <= 0x20 || *c == 0x7f) {
            r->bad_target = "the request target holds a space or a control byte";
            break;
        }
    r->srv = s;
    r->conn = conn;
    r->refs = 1;
    r->mhd_ref = 1;
    r->phase = PH_NEW;
    r->state = HS_LIVE;
    r->body_fd = -1;
    r->view.target = r->target;
    r->view.path = r->path;
    r->view.query = uri[plen] == '?' ? r->target + plen + 1 : "";
    r->next = s->live;
    if (s->live) s->live->prev = r;
    s->live = r;
    g_live_requests++;
    s->stats.active++;
    if (s->stats.active > s->stats.max_active) s->stats.max_active = s->stats.active;
    return r;
}

typedef struct hs_header_copy {
    hs_request *r;
    int failed;
} hs_header_copy;

static enum MHD_Result hs_copy_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                      const char *value)
{
    hs_header_copy *hc = (hs_header_copy *)cls;
    hs_request *r = hc->r;
    (void)kind;
    char *k = strdup(key ? key : "");
    char *v = strdup(value ? value : "");
    if (!k || !v) {
        free(k);
        free(v);
        hc->failed = 1;
        return MHD_NO;
    }
    r->headers[r->nheaders].name = k;
    r->headers[r->nheaders].value = v;
    r->nheaders++;
    return MHD_YES;
}

/* ---- framing: what is refused before any handler ------------------------------------------- */

/* One header as MHD parsed it: pointers into its read buffer (0.9.75) or elsewhere. */
#define HS_MAX_HEADERS_CHECKED 256

typedef struct hs_raw_header {
    const char *k, *v;
    size_t kn, vn;
} hs_raw_header;

typedef struct hs_raw_headers {
    hs_raw_header *h;
    size_t n, cap;
} hs_raw_headers;

static enum MHD_Result hs_collect_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                         size_t key_size, const char *value, size_t value_size)
{
    hs_raw_headers *rh = (hs_raw_headers *)cls;
    (void)kind;
    if (rh->n < rh->cap) {
        rh->h[rh->n].k = key ? key : "";
        rh->h[rh->n].kn = key ? key_size : 0;
        rh->h[rh->n].v = value ? value : "";
        rh->h[rh->n].vn = value ? value_size : 0;
        rh->n++;
    }
    return MHD_YES;
}

/* value without the spaces and tabs around it, as (p, n). */
static void hs_trim(const char *v, size_t n, const char **p, size_t *len)
{
    while (n && (*v == ' ' || *v == '\t'))
        v++, n--;
    while (n && (v[n - 1] == ' ' || v[n - 1] == '\t'))
        n--;
    *p = v;
    *len = n;
}

static int hs_name_is(const hs_raw_header *h, const char *name)
{
    return h->kn == strlen(name) && strncasecmp(h->k, name, h->kn) == 0;
}

/* Whether the bytes [a, b) are all NUL, spaces or tabs, and how many NULs they hold. */
static int hs_only_gap(const char *a, const char *b, size_t *nuls)
{
    *nuls = 0;
    for (const char *c = a; c < b; c++) {
        if (*c == '\0')
            (*nuls)++;
        else if (*c != ' ' && *c != '\t')
            return 0;
    }
    return 1;
}

/* Checks the request's framing and header bytes before any handler sees it (RFC 9112 §6.1, §6.3;
 * docs/reference/httpd.md, "Framing"). MHD 0.9.75 hands header values over NUL-terminated, so a
 * NUL inside one would cut it short unseen: where the header block is still MHD's read buffer
 * (method .. method + header size, line ends and the colons overwritten with NULs), what lies
 * between one field's value and the next field's name must be line ends only. Returns 0, or the
 * status (400, 501) with a message in msg and Render's error code in *code. */
static unsigned hs_framing_fault(hs_request *r, struct MHD_Connection *conn, const char *method,
                                 const char *version, char *msg, size_t len, const char **code)
{
    *code = "invalid_request";
    if (r->bad_target) {
        snprintf(msg, len, "%s", r->bad_target);
        return MHD_HTTP_BAD_REQUEST;
    }
    /* The target's C string must end where MHD put the NUL before the version: an earlier end
     * is a NUL byte inside the target. */
    const union MHD_ConnectionInfo *hi =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    const char *blk = method, *blk_end = hi ? method + hi->header_size : NULL;
    int in_buffer = blk_end && version > blk && version < blk_end;
    if (in_buffer && r->uri_end && r->uri_end + 1 != version) {
        snprintf(msg, len, "the request target holds a NUL byte");
        return MHD_HTTP_BAD_REQUEST;
    }
    int n = MHD_get_connection_values_n(conn, MHD_HEADER_KIND, NULL, NULL);
    hs_raw_header hb[HS_MAX_HEADERS_CHECKED];
    hs_raw_headers rh = {hb, 0, HS_MAX_HEADERS_CHECKED};
    if (n > 0) MHD_get_connection_values_n(conn, MHD_HEADER_KIND, hs_collect_header, &rh);
    if (n > (int)rh.cap) {
        snprintf(msg, len, "the request has %d header fields, more than the %zu accepted", n,
                 rh.cap);
        return MHD_HTTP_REQUEST_HEADER_FIELDS_TOO_LARGE;
    }
    const char *prev_end = in_buffer ? version + strlen(version) : NULL;
    int ncl = 0, nte = 0, cl_bad = 0, nhost = 0;
    char te[256];
    size_t telen = 0;
    for (size_t i = 0; i < rh.n; i++) {
        const hs_raw_header *h = &rh.h[i];
        if (h->kn == 0) {
            snprintf(msg, len, "a header field has an empty name");
            return MHD_HTTP_BAD_REQUEST;
        }
        for (size_t k = 0; k < h->kn; k++)
            if (!hs_is_tchar((unsigned char)h->k[k])) {
                snprintf(msg, len, "header field name %.*s holds a byte a name may not hold",
                         (int)(h->kn > 64 ? 64 : h->kn), h->k);
                return MHD_HTTP_BAD_REQUEST;
            }
        for (size_t k = 0; k < h->vn; k++) {
            unsigned char c = (unsigned char)h->v[k];
            if ((c < 0x20 && c != '\t') || c == 0x7f) {
                snprintf(msg, len, "header field %.*s holds a control byte",
                         (int)(h->kn > 64 ? 64 : h->kn), h->k);
                return MHD_HTTP_BAD_REQUEST;
            }
        }
        if (in_buffer) {
            size_t nuls;
            int inside = h->k >= blk && h->k < blk_end && h->v >= blk && h->v <= blk_end;
            /* A folded line (obs-fold) makes MHD copy the field elsewhere or leaves its
             * continuation between this field and the one before. */
            if (!inside || !prev_end || !hs_only_gap(prev_end, h->k, &nuls) || nuls < 1 ||
                nuls > 2 || h->k[h->kn] != '\0' || !hs_only_gap(h->k + h->kn + 1, h->v, &nuls) ||
                nuls) {
                snprintf(msg, len,
                         "header field %.*s is malformed: a NUL byte, a bare CR or a folded "
                         "line (obs-fold) in the header block",
                         (int)(h->kn > 64 ? 64 : h->kn), h->k);
                return MHD_HTTP_BAD_REQUEST;
            }
            prev_end = h->v + h->vn;
        }
        if (hs_name_is(h, "Host")) {
            nhost++;
        } else if (hs_name_is(h, "Content-Length")) {
            ncl++;
            const char *p;
            size_t pn;
            hs_trim(h->v, h->vn, &p, &pn);
            if (pn == 0 || pn > 19) cl_bad = 1;
            for (size_t k = 0; k < pn; k++)
                if (p[k] < '0' || p[k] > '9') cl_bad = 1;
        } else if (hs_name_is(h, "Transfer-Encoding")) {
            nte++;
            if (telen + h->vn + 2 >= sizeof te) {
                snprintf(msg, len, "Transfer-Encoding is too long");
                return MHD_HTTP_BAD_REQUEST;
            }
            if (telen) te[telen++] = ',';
            memcpy(te + telen, h->v, h->vn);
            telen += h->vn;
        }
    }
    if (in_buffer && prev_end) {
        size_t nuls;
        if (!hs_only_gap(prev_end, blk_end, &nuls) || nuls > 4) {
            snprintf(msg, len,
                     "the header block is malformed: a NUL byte, a bare CR or a folded line "
                     "(obs-fold) after the last field");
            return MHD_HTTP_BAD_REQUEST;
        }
    }
    if (nhost > 1) {
        snprintf(msg, len,
                 "the request has %d Host fields; send exactly one (RFC 9112 section 3.2)", nhost);
        return MHD_HTTP_BAD_REQUEST;
    }
    if (ncl && nte) {
        snprintf(msg, len,
                 "the request has both Content-Length and Transfer-Encoding: its end is "
                 "ambiguous (RFC 9112 section 6.1); send one of them");
        return MHD_HTTP_BAD_REQUEST;
    }
    if (ncl > 1) {
        snprintf(msg, len, "the request has %d Content-Length fields; send exactly one", ncl);
        return MHD_HTTP_BAD_REQUEST;
    }
    if (cl_bad) {
        snprintf(msg, len, "Content-Length must be a decimal number of bytes");
        return MHD_HTTP_BAD_REQUEST;
    }
    if (nte) {
        /* The only coding accepted is chunked, alone: anything else is not implemented (501),
         * and chunked anywhere but last, or twice, leaves the end unknown (400). */
        te[telen] = '\0';
        int nchunked = 0, other = 0, last_chunked = 0;
        char *save = NULL;
        for (char *tok = strtok_r(te, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            const char *p;
            size_t pn;
            hs_trim(tok, strlen(tok), &p, &pn);
            if (pn == 0) continue;
            last_chunked = pn == 7 && strncasecmp(p, "chunked", 7) == 0;
            if (last_chunked)
                nchunked++;
            else
                other++;
        }
        if (other) {
            *code = "unsupported_transfer_coding";
            snprintf(msg, len,
                     "Transfer-Encoding names a coding this server does not implement: only "
                     "chunked is");
            return MHD_HTTP_NOT_IMPLEMENTED;
        }
        if (nchunked != 1 || !last_chunked) {
            snprintf(msg, len, "Transfer-Encoding must be chunked, once");
            return MHD_HTTP_BAD_REQUEST;
        }
    }
    return 0;
}

/* Whether the decoded capture v[0..n) holds a NUL or another control byte. */
static int hs_has_control(const char *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)v[i] < 0x20 || v[i] == 0x7f) return 1;
    return 0;
}

/* Queues an answer made here (not by the handler): JSON {"message": msg}, optionally one more
 * header. Only valid in the access handler with no answer queued yet. */
static enum MHD_Result hs_answer_now(hs_request *r, unsigned status, const char *msg,
                                     const char *hname, const char *hvalue)
{
    char body[512];
    size_t blen = jsonq_message(body, sizeof body, msg, strlen(msg));
    struct MHD_Response *resp = MHD_create_response_from_buffer(blen, body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (hname) MHD_add_response_header(resp, hname, hvalue);
    enum MHD_Result ret = MHD_queue_response(r->conn, status, resp);
    MHD_destroy_response(resp);
    r->phase = PH_REJECTED;
    r->responded = 1;
    hs_body_file_remove(r);
    hs_request_drop_body(r);
    return ret;
}

/* Queues a refusal of the request's framing: {"message", "code"} and Connection: close, so
 * that nothing after it on the connection is read as a request. First handler call only. */
static enum MHD_Result hs_answer_framing(hs_request *r, unsigned status, const char *code,
                                         const char *msg)
{
    char body[4096]; /* jsonq_message keeps msg whole when cap is six times its length */
    size_t blen = jsonq_message(body, sizeof body - 64, msg, strlen(msg));
    if (blen && body[blen - 1] == '}')
        blen = blen - 1 +
               (size_t)snprintf(body + blen - 1, sizeof body - blen + 1, ",\"code\":\"%s\"}", code);
    struct MHD_Response *resp = MHD_create_response_from_buffer(blen, body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ret = MHD_queue_response(r->conn, status, resp);
    MHD_destroy_response(resp);
    r->phase = PH_REJECTED;
    r->responded = 1;
    return ret;
}

/* Opens the 0600 temporary file a file-mode body goes to. Returns 0 or an errno value. */
static int hs_open_body_file(hs_request *r, const char *dir)
{
    size_t n = strlen(dir) + sizeof "/moonbox-upload-XXXXXX";
    char *path = (char *)malloc(n);
    if (!path) return ENOMEM;
    snprintf(path, n, "%s/moonbox-upload-XXXXXX", dir);
    int fd = mkostemp(path, O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        free(path);
        return e;
    }
    fchmod(fd, 0600);
    r->body_fd = fd;
    r->body_path = path;
    return 0;
}

/* Whether a refused request's body should be read and dropped before the answer: only when
 * one is coming (a length, or chunks), the client is not waiting for 100 Continue (it then never
 * sends the body), and a declared length is small enough to be worth draining. */
static int hs_body_to_drain(struct MHD_Connection *conn)
{
    const char *expect = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
    if (expect && strcasecmp(expect, "100-continue") == 0) return 0;
    const char *cl =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl) {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(cl, &end, 10);
        return *cl >= '0' && *cl <= '9' && *end == '\0' && errno == 0 && n > 0 &&
               n <= HS_DISCARD_MAX;
    }
    const char *te =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
    return te && strcasestr(te, "chunked") != NULL;
}

/* The first access-handler call: headers are complete. Copies what the handler will read,
 * routes, and decides the body's fate before any of it is read. */
static enum MHD_Result hs_begin(hs_server *s, hs_request *r, struct MHD_Connection *conn,
                                const char *method, const char *version)
{
    char msg[600];
    r->method = strdup(method ? method : "");
    int n = MHD_get_connection_values(conn, MHD_HEADER_KIND, NULL, NULL);
    if (n > 0) r->headers = (hs_pair *)calloc((size_t)n, sizeof *r->headers);
    if (!r->method || (n > 0 && !r->headers)) return MHD_NO;
    hs_header_copy hc = {r, 0};
    if (n > 0) MHD_get_connection_values(conn, MHD_HEADER_KIND, hs_copy_header, &hc);
    if (hc.failed) return MHD_NO;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ci && ci->client_addr) {
        const struct sockaddr *sa = ci->client_addr;
        if (sa->sa_family == AF_INET) {
            const struct sockaddr_in *in = (const struct sockaddr_in *)(const void *)sa;
            inet_ntop(AF_INET, &in->sin_addr, r->remote, sizeof r->remote);
            r->view.remote_port = ntohs(in->sin_port);
        } else if (sa->sa_family == AF_INET6) {
            const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)(const void *)sa;
            inet_ntop(AF_INET6, &in6->sin6_addr, r->remote, sizeof r->remote);
            r->view.remote_port = ntohs(in6->sin6_port);
        }
    }
    r->view.method = r->method;
    r->view.remote = r->remote;
    r->view.headers = r->headers;
    r->view.nheaders = r->nheaders;
    s->stats.requests++;
    const char *code;
    unsigned bad = hs_framing_fault(r, conn, method, version, msg, sizeof msg, &code);
    if (bad) {
        s->stats.rejected_framing++;
        return hs_answer_framing(r, bad, code, msg);
    }

    hs_span caps[HS_MAX_CAPTURES], rest = {NULL, 0};
    char allow[256];
    int path_matched;
    const hs_route *rt =
        hs_route_find(s, r->method, r->path, caps, &rest, allow, sizeof allow, &path_matched);
    if (!rt) {
        if (path_matched) {
            snprintf(msg, sizeof msg, "method %s is not allowed for %s", r->method, r->path);
            return hs_answer_now(r, MHD_HTTP_METHOD_NOT_ALLOWED, msg, MHD_HTTP_HEADER_ALLOW, allow);
        }
        snprintf(msg, sizeof msg, "no route for %s %s", r->method, r->path);
        return hs_answer_now(r, MHD_HTTP_NOT_FOUND, msg, NULL, NULL);
    }
    size_t k = 0;
    for (size_t i = 0; i < rt->nsegs; i++) {
        if (!rt->segs[i].capture) continue;
        char *v = (char *)malloc(caps[k].n + 1);
        if (!v) return MHD_NO;
        size_t vn = hs_percent_decode(caps[k].p, caps[k].n, v, 0);
        r->captures[r->ncaptures].name = rt->segs[i].text;
        r->captures[r->ncaptures].value = v;
        r->ncaptures++;
        k++;
        if (hs_has_control(v, vn)) {
            s->stats.rejected_framing++;
            snprintf(msg, sizeof msg, "path segment :%s holds a NUL or another control byte",
                     rt->segs[i].text);
            return hs_answer_framing(r, MHD_HTTP_BAD_REQUEST, "invalid_path", msg);
        }
    }
    if (rt->rest) {
        char *v = (char *)malloc(rest.n + 1);
        if (!v) return MHD_NO;
        size_t vn = hs_percent_decode(rest.p, rest.n, v, 0);
        r->captures[r->ncaptures].name = "rest";
        r->captures[r->ncaptures].value = v;
        r->ncaptures++;
        if (hs_has_control(v, vn)) {
            s->stats.rejected_framing++;
            return hs_answer_framing(r, MHD_HTTP_BAD_REQUEST, "invalid_path",
                                     "the path holds a NUL or another control byte");
        }
    }
    r->view.captures = r->captures;
    r->view.ncaptures = r->ncaptures;
    r->view.handler_id = rt->handler_id;
    r->view.body_mode = rt->body_mode;
    r->route = rt;
    r->max_body = rt->max_body;
    unsigned denied = hs_check_auth(s, rt, r, r->deny_msg, sizeof r->deny_msg);
    if (denied) {
        s->stats.rejected_auth++;
        if (!hs_body_to_drain(conn))
            return hs_answer_now(r, denied, r->deny_msg, MHD_HTTP_HEADER_CONNECTION, "close");
        /* Nothing of the body is kept: it is read and dropped (at most HS_DISCARD_MAX bytes),
         * then refused, so that the client, still sending, gets the answer and not a reset. */
        r->deny_status = denied;
        r->phase = PH_BODY;
        return MHD_YES;
    }

    /* A declared length above the limit is refused before a byte of it is read: a client that
     * sent Expect: 100-continue never sends the body at all. */
    const char *cl =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    unsigned long long declared = 0;
    int have_length = 0;
    if (cl && *cl >= '0' && *cl <= '9') {
        char *end;
        errno = 0;
        declared = strtoull(cl, &end, 10);
        have_length = (*end == '\0' && errno == 0);
        if (errno == ERANGE) declared = ULLONG_MAX, have_length = 1;
    }
    if (have_length && declared > r->max_body) {
        s->stats.rejected_large++;
        snprintf(msg, sizeof msg, "request body of %llu bytes exceeds the limit of %zu bytes",
                 declared, r->max_body);
        return hs_answer_now(r, MHD_HTTP_CONTENT_TOO_LARGE, msg, NULL, NULL);
    }
    if (have_length && rt->space_check) {
        unsigned full = hs_space_refusal(s, rt, r, declared, msg, sizeof msg);
        if (full) return hs_answer_now(r, full, msg, NULL, NULL);
    }
    if (rt->body_mode == HS_BODY_FILE) {
        const char *dir = rt->upload_dir ? rt->upload_dir : s->upload_dir;
        int e = hs_open_body_file(r, dir);
        if (e) {
            snprintf(msg, sizeof msg, "cannot store the request body in %s: %s", dir, strerror(e));
            snprintf(s->lastlog, sizeof s->lastlog, "%.200s", msg);
            return hs_answer_now(r, MHD_HTTP_INTERNAL_SERVER_ERROR, msg, NULL, NULL);
        }
    } else if (rt->body_mode == HS_BODY_MEMORY && have_length && declared > 0) {
        r->body = (char *)malloc((size_t)declared + 1);
        if (!r->body) return MHD_NO;
        r->body_cap = (size_t)declared + 1;
        if (r->body_cap > s->stats.peak_body_bytes) s->stats.peak_body_bytes = r->body_cap;
    }
    r->phase = PH_BODY;
    return MHD_YES;
}

/* Takes n body bytes. Past the limit, what was kept is freed and the rest only counted. */
static void hs_take_body(hs_server *s, hs_request *r, const char *data, size_t n)
{
    if (r->deny_status || r->too_large || r->store_errno) {
        r->discarded += n;
        return;
    }
    if (n > r->max_body - r->received) {
        r->too_large = 1;
        r->discarded += n;
        hs_request_drop_body(r);
        hs_body_file_remove(r);
        return;
    }
    if (r->view.body_mode == HS_BODY_MEMORY) {
        size_t need = r->received + n + 1;
        if (need > r->body_cap) {
            size_t cap = r->body_cap ? r->body_cap : 4096;
            while (cap < need)
                cap *= 2;
            if (cap > r->max_body + 1) cap = r->max_body + 1;
            char *nb = (char *)realloc(r->body, cap);
            if (!nb) {
                r->store_errno = ENOMEM;
                hs_request_drop_body(r);
                return;
            }
            r->body = nb;
            r->body_cap = cap;
            if (cap > s->stats.peak_body_bytes) s->stats.peak_body_bytes = cap;
        }
        memcpy(r->body + r->received, data, n);
    } else if (r->view.body_mode == HS_BODY_FILE) {
        size_t off = 0;
        while (off < n) {
            ssize_t w = write(r->body_fd, data + off, n - off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                r->store_errno = w < 0 ? errno : EIO;
                hs_body_file_remove(r);
                return;
            }
            off += (size_t)w;
        }
    }
    r->received += n;
}

/* The body is complete: answer 401/403/413/500 here, or suspend and hand the request over. */
static enum MHD_Result hs_complete(hs_server *s, hs_request *r, struct MHD_Connection *conn)
{
    char msg[300];
    if (r->deny_status)
        return hs_answer_now(r, r->deny_status, r->deny_msg, MHD_HTTP_HEADER_CONNECTION, "close");
    if (r->too_large) {
        s->stats.rejected_large++;
        snprintf(msg, sizeof msg, "request body exceeds the limit of %zu bytes", r->max_body);
        return hs_answer_now(r, MHD_HTTP_CONTENT_TOO_LARGE, msg, NULL, NULL);
    }
    if (r->store_errno == ENOSPC || r->store_errno == EDQUOT) {
        snprintf(msg, sizeof msg,
                 "the backend's disk is full: the request body could not be "
                 "stored; nothing was written");
        return hs_answer_now(r, 507, msg, NULL, NULL);
    }
    if (r->store_errno) {
        snprintf(msg, sizeof msg, "cannot store the request body: %s", strerror(r->store_errno));
        return hs_answer_now(r, MHD_HTTP_INTERNAL_SERVER_ERROR, msg, NULL, NULL);
    }
    if (r->view.body_mode == HS_BODY_FILE) {
        close(r->body_fd);
        r->body_fd = -1;
        r->view.body_file = r->body_path;
        r->view.body_file_size = r->received;
    } else if (r->view.body_mode == HS_BODY_MEMORY) {
        if (r->body) r->body[r->received] = '\0';
        r->view.body = r->body ? r->body : "";
        r->view.body_len = r->received;
    }
    r->route = NULL;
    r->phase = PH_HANDLER;
    MHD_suspend_connection(conn);
    r->suspended = 1;
    s->on_request(r, s->ud);
    return MHD_YES;
}

/* MHD's access handler: called when the headers are in, with each piece of body, once more when
 * the body is complete, and again after every resume while the handler has the request. */
static enum MHD_Result hs_access_cb(void *cls, struct MHD_Connection *conn, const char *url,
                                    const char *method, const char *version,
                                    const char *upload_data, size_t *upload_data_size,
                                    void **req_cls)
{
    hs_server *s = (hs_server *)cls;
    hs_request *r = (hs_request *)*req_cls;
    (void)url;
    if (!r) return MHD_NO; /* the URI callback ran out of memory */
    switch (r->phase) {
    case PH_NEW:
        return hs_begin(s, r, conn, method, version);
    case PH_BODY:
        if (*upload_data_size > 0) {
            hs_take_body(s, r, upload_data, *upload_data_size);
            *upload_data_size = 0;
            return r->discarded > HS_DISCARD_MAX ? MHD_NO : MHD_YES;
        }
        return hs_complete(s, r, conn);
    case PH_HANDLER:
        if (r->drop) {
            r->phase = PH_RESPONSE;
            return MHD_NO; /* MHD closes the connection: the client gets no reply at all */
        }
        if (r->pending) {
            struct MHD_Response *resp = r->pending;
            r->pending = NULL;
            r->phase = PH_RESPONSE;
            enum MHD_Result ret = MHD_queue_response(conn, r->pending_status, resp);
            MHD_destroy_response(resp);
            return ret;
        }
        /* Resumed without an answer (the server is closing): wait again. */
        MHD_suspend_connection(conn);
        r->suspended = 1;
        return MHD_YES;
    default:
        *upload_data_size = 0;
        return MHD_YES;
    }
}

/* MHD's completion callback: the request ended, sent, failed, or dropped at shutdown. */
static void hs_completed_cb(void *cls, struct MHD_Connection *conn, void **req_cls,
                            enum MHD_RequestTerminationCode toe)
{
    hs_server *s = (hs_server *)cls;
    hs_request *r = (hs_request *)*req_cls;
    (void)conn;
    if (!r) return;
    *req_cls = NULL;
    if (!r->mhd_ref) return;
    r->mhd_ref = 0;
    if (s->stats.active > 0) s->stats.active--;
    r->conn = NULL;
    r->suspended = 0;
    if (toe == MHD_REQUEST_TERMINATED_COMPLETED_OK)
        r->state = HS_FINISHED;
    else if (toe == MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN)
        r->state = HS_GONE_SERVER;
    else
        r->state = HS_GONE_CLIENT;
    if (r->phase < PH_HANDLER) hs_body_file_remove(r); /* never handed over */
    r->phase = PH_DONE;
    if (r->pending) {
        struct MHD_Response *resp = r->pending;
        r->pending = NULL;
        MHD_destroy_response(resp);
    }
    hs_notify(r);
    hs_request_release(r);
}

/* MHD's content reader for streamed answers: hands over queued bytes (telling the writer side
 * when the queue is back within its bound), ends the body when the stream was closed, and
 * otherwise suspends the connection and returns 0 until a write resumes it. */
static ssize_t hs_stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    hs_request *r = (hs_request *)cls;
    (void)pos;
    if (r->q_abort) return MHD_CONTENT_READER_END_WITH_ERROR;
    if (r->q_len > 0) {
        size_t n = r->q_len < max ? r->q_len : max;
        memcpy(buf, r->q + r->q_off, n);
        r->q_off += n;
        r->q_len -= n;
        if (r->q_len == 0) r->q_off = 0;
        if (r->q_len <= r->q_bound) hs_notify(r);
        return (ssize_t)n;
    }
    if (r->q_ended) return MHD_CONTENT_READER_END_OF_STREAM;
    if (r->conn && !r->suspended) {
        MHD_suspend_connection(r->conn);
        r->suspended = 1;
    }
    return 0;
}

static void hs_stream_free(void *cls)
{
    hs_request_release((hs_request *)cls);
}

/* ---- requests: answers ----------------------------------------------------------------------- */

static int hs_can_answer(hs_request *r, char *err, size_t errlen)
{
    if (r->responded) {
        hs_seterr(err, errlen, "a response was already sent for this request");
        return HS_ERR_STATE;
    }
    if (r->state != HS_LIVE || !r->conn || r->phase != PH_HANDLER) {
        hs_seterr(err, errlen, "%s",
                  r->state == HS_GONE_SERVER ? "the server was closed"
                                             : "the client has gone away");
        return HS_ERR_GONE;
    }
    return HS_OK;
}

static int hs_check_status(unsigned status, char *err, size_t errlen)
{
    if (status < 100 || status > 999) {
        hs_seterr(err, errlen, "status %u is not a valid HTTP status", status);
        return HS_ERR_INVALID;
    }
    return HS_OK;
}

/* Adds the caller's headers to resp. Content-Length and Transfer-Encoding are the server's to
 * set (MHD derives them from the body), so they are skipped. */
static int hs_add_headers(struct MHD_Response *resp, const hs_pair *h, size_t n, char *err,
                          size_t errlen)
{
    for (size_t i = 0; i < n; i++) {
        const char *name = h[i].name, *value = h[i].value;
        if (!name || !*name || !value) {
            hs_seterr(err, errlen, "empty response header name or value");
            return HS_ERR_INVALID;
        }
        for (const char *p = name; *p; p++)
            if (!hs_is_tchar((unsigned char)*p)) {
                hs_seterr(err, errlen, "response header name '%s' is not a token", name);
                return HS_ERR_INVALID;
            }
        if (strpbrk(value, "\r\n")) {
            hs_seterr(err, errlen, "response header '%s' has a line break in its value", name);
            return HS_ERR_INVALID;
        }
        if (strcasecmp(name, "Content-Length") == 0 || strcasecmp(name, "Transfer-Encoding") == 0)
            continue;
        if (MHD_add_response_header(resp, name, value) != MHD_YES) {
            hs_seterr(err, errlen, "libmicrohttpd refused response header '%s'", name);
            return HS_ERR_INVALID;
        }
    }
    return HS_OK;
}

/* Stores resp as the answer (consuming it) and resumes the connection to send it. */
static int hs_set_answer(hs_request *r, unsigned status, struct MHD_Response *resp,
                         const hs_pair *h, size_t n, char *err, size_t errlen)
{
    int rc = hs_add_headers(resp, h, n, err, errlen);
    if (rc != HS_OK) {
        MHD_destroy_response(resp);
        return rc;
    }
    r->pending = resp;
    r->pending_status = status;
    r->responded = 1;
    hs_wake_conn(r);
    return HS_OK;
}

int hs_request_drop(hs_request *r, char *err, size_t errlen)
{
    int rc = hs_can_answer(r, err, errlen);
    if (rc != HS_OK) return rc;
    r->drop = 1;
    r->responded = 1;
    hs_wake_conn(r);
    return HS_OK;
}

int hs_request_respond(hs_request *r, unsigned status, const hs_pair *headers, size_t nheaders,
                       const void *body, size_t len, char *err, size_t errlen)
{
    int rc = hs_check_status(status, err, errlen);
    if (rc == HS_OK) rc = hs_can_answer(r, err, errlen);
    if (rc != HS_OK) return rc;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)(uintptr_t)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) {
        hs_seterr(err, errlen, "out of memory creating a response");
        return HS_ERR_NOMEM;
    }
    return hs_set_answer(r, status, resp, headers, nheaders, err, errlen);
}

int hs_request_respond_fd(hs_request *r, unsigned status, const hs_pair *headers, size_t nheaders,
                          int fd, uint64_t size, char *err, size_t errlen)
{
    int rc = hs_check_status(status, err, errlen);
    if (rc == HS_OK) rc = hs_can_answer(r, err, errlen);
    if (rc != HS_OK) {
        close(fd);
        return rc;
    }
    struct MHD_Response *resp = MHD_create_response_from_fd64(size, fd);
    if (!resp) {
        close(fd);
        hs_seterr(err, errlen, "libmicrohttpd cannot send this file (size %llu)",
                  (unsigned long long)size);
        return HS_ERR_NOMEM;
    }
    return hs_set_answer(r, status, resp, headers, nheaders, err, errlen);
}

int hs_failure_log(const char *code)
{
    if (!code) return HS_LOG_FAILURE;
    if (strcmp(code, "cancelled") == 0 || strcmp(code, "client_gone") == 0) return HS_LOG_QUIET;
    return strcmp(code, "no_response") == 0 ? HS_LOG_NO_RESPONSE : HS_LOG_FAILURE;
}

unsigned hs_failure_status(const char *code)
{
    return code && strcmp(code, "cancelled") == 0 ? 503 : 500;
}

int hs_request_respond_failure(hs_request *r, const char *code, const char *msg, size_t n,
                               char *err, size_t errlen)
{
    size_t cap = 16 + JSONQ_BOUND(n);
    char *body = (char *)malloc(cap);
    if (!body) {
        hs_seterr(err, errlen, "out of memory answering a failure");
        return HS_ERR_NOMEM;
    }
    size_t len = jsonq_message(body, cap, msg, n);
    hs_pair h = {"Content-Type", "application/json"};
    int rc = hs_request_respond(r, hs_failure_status(code), &h, 1, body, len, err, errlen);
    free(body);
    return rc;
}

int hs_request_stream_open(hs_request *r, unsigned status, const hs_pair *headers, size_t nheaders,
                           size_t bound, char *err, size_t errlen)
{
    int rc = hs_check_status(status, err, errlen);
    if (rc == HS_OK) rc = hs_can_answer(r, err, errlen);
    if (rc != HS_OK) return rc;
    struct MHD_Response *resp = MHD_create_response_from_callback(
        MHD_SIZE_UNKNOWN, HS_STREAM_BLOCK, hs_stream_read, r, hs_stream_free);
    if (!resp) {
        hs_seterr(err, errlen, "out of memory creating a response");
        return HS_ERR_NOMEM;
    }
    hs_request_retain(r); /* the response's, dropped by hs_stream_free */
    r->streaming = 1;
    r->q_bound = bound ? bound : HS_DEFAULT_STREAM_BUFFER;
    rc = hs_set_answer(r, status, resp, headers, nheaders, err, errlen);
    if (rc != HS_OK) r->streaming = 0;
    return rc;
}

char *hs_request_stream_reserve(hs_request *r, size_t len, int *rc)
{
    *rc = !r->streaming || r->q_ended ? HS_ERR_STATE : r->state != HS_LIVE ? HS_ERR_GONE : HS_OK;
    if (*rc != HS_OK) return NULL;
    if (r->q_off + r->q_len + len > r->q_cap) {
        if (r->q_len + len <= r->q_cap) {
            memmove(r->q, r->q + r->q_off, r->q_len);
        } else {
            size_t cap = r->q_cap ? r->q_cap : 4096;
            while (cap < r->q_len + len)
                cap *= 2;
            char *nq = (char *)malloc(cap);
            if (!nq) {
                *rc = HS_ERR_NOMEM;
                return NULL;
            }
            if (r->q_len) memcpy(nq, r->q + r->q_off, r->q_len);
            free(r->q);
            r->q = nq;
            r->q_cap = cap;
        }
        r->q_off = 0;
    }
    return r->q + r->q_off + r->q_len;
}

void hs_request_stream_commit(hs_request *r, size_t n)
{
    if (n == 0) return;
    r->q_len += n;
    hs_wake_conn(r);
}

int hs_request_stream_write(hs_request *r, const void *data, size_t len)
{
    int rc;
    if (len == 0) {
        if (!r->streaming || r->q_ended) return HS_ERR_STATE;
        return r->state != HS_LIVE ? HS_ERR_GONE : HS_OK;
    }
    char *p = hs_request_stream_reserve(r, len, &rc);
    if (!p) return rc;
    memcpy(p, data, len);
    hs_request_stream_commit(r, len);
    return HS_OK;
}

size_t hs_request_stream_pending(const hs_request *r)
{
    return r->q_len;
}

size_t hs_request_stream_bound(const hs_request *r)
{
    return r->q_bound;
}

void hs_request_stream_close(hs_request *r, int abort)
{
    if (!r->streaming || r->q_ended) return;
    r->q_ended = 1;
    r->q_abort = abort;
    hs_wake_conn(r);
}

/* ---- servers --------------------------------------------------------------------------------- */

/* MHD's logger. Its messages are about clients misbehaving or resources running out; a server
 * that printed them would let any client write to our stderr, so the last one is kept for
 * error reports and printed only when MOONBOX_HTTPD_LOG=1. */
static void hs_log_cb(void *cls, const char *fmt, va_list ap)
{
    hs_server *s = (hs_server *)cls;
    vsnprintf(s->lastlog, sizeof s->lastlog, fmt, ap);
    size_t n = strlen(s->lastlog);
    while (n > 0 && (s->lastlog[n - 1] == '\n' || s->lastlog[n - 1] == '\r'))
        s->lastlog[--n] = 0;
    if (s->log_to_stderr) fprintf(stderr, "moonbox httpd: %s\n", s->lastlog);
}

/* Lets MHD do all it can without blocking (accept, read, write, call back), then re-arms the
 * timer from MHD_get_timeout: 0 when MHD has more ready work than one run took, the nearest
 * connection timeout otherwise, and not at all when MHD needs no timer. */
static void hs_run(hs_server *s)
{
    MHD_UNSIGNED_LONG_LONG ms, ms2;
    MHD_run(s->daemon);
    if (s->daemon2) MHD_run(s->daemon2);
    ev_timer_stop(s->loop, &s->timer);
    int have = MHD_get_timeout(s->daemon, &ms) == MHD_YES;
    if (s->daemon2 && MHD_get_timeout(s->daemon2, &ms2) == MHD_YES && (!have || ms2 < ms)) {
        ms = ms2;
        have = 1;
    }
    if (have) {
        ev_timer_set(&s->timer, (double)ms / 1000.0, 0.);
        ev_timer_start(s->loop, &s->timer);
    }
}

static void hs_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)loop;
    (void)revents;
    hs_run((hs_server *)w->data);
}

static void hs_timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    (void)loop;
    (void)revents;
    hs_run((hs_server *)w->data);
}

static void hs_server_free(hs_server *s)
{
    for (size_t i = 0; i < HS_TOKEN_BUCKETS; i++)
        while (s->tokens[i]) {
            hs_token *t = s->tokens[i];
            s->tokens[i] = t->next;
            hs_token_free(t);
        }
    free(s->key);
    for (size_t i = 0; i < s->nroutes; i++)
        hs_route_free(&s->routes[i]);
    free(s->routes);
    free(s->upload_dir);
    free(s);
}

/* Starts one MHD daemon for s listening on host:port (port 0: an ephemeral one) into *out, its
 * numeric address in shown. Returns HS_OK, or an error code with a message in err. */
static int hs_daemon_start(hs_server *s, const char *host, int port, unsigned limit, unsigned idle,
                           struct MHD_Daemon **out, char *shown, size_t shownlen, char *err,
                           size_t errlen)
{
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    int gai = getaddrinfo(host, NULL, &hints, &ai);
    if (gai != 0 || !ai) {
        hs_seterr(err, errlen, "cannot resolve listen address '%s': %s", host,
                  gai ? gai_strerror(gai) : "no address");
        return HS_ERR_INVALID;
    }
    struct sockaddr_storage addr;
    memset(&addr, 0, sizeof addr);
    memcpy(&addr, ai->ai_addr, ai->ai_addrlen);
    int family = ai->ai_family;
    freeaddrinfo(ai);
    unsigned int flags = MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    if (family == AF_INET6) {
        struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)&addr;
        in6->sin6_port = htons((uint16_t)port);
        inet_ntop(AF_INET6, &in6->sin6_addr, shown, (socklen_t)shownlen);
        flags |= MHD_USE_IPv6;
    } else {
        struct sockaddr_in *in = (struct sockaddr_in *)&addr;
        in->sin_port = htons((uint16_t)port);
        inet_ntop(AF_INET, &in->sin_addr, shown, (socklen_t)shownlen);
    }
    s->lastlog[0] = '\0';
    *out = MHD_start_daemon(
        flags, (uint16_t)port, NULL, NULL, hs_access_cb, s, MHD_OPTION_SOCK_ADDR,
        (struct sockaddr *)&addr, MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_CONNECTION_TIMEOUT,
        idle, MHD_OPTION_LISTEN_BACKLOG_SIZE, HS_LISTEN_BACKLOG, MHD_OPTION_NOTIFY_COMPLETED,
        hs_completed_cb, s, MHD_OPTION_URI_LOG_CALLBACK, hs_uri_cb, s, MHD_OPTION_EXTERNAL_LOGGER,
        hs_log_cb, s, MHD_OPTION_END);
    if (!*out) {
        hs_seterr(err, errlen, "cannot listen on %s port %d: %s", shown, port,
                  s->lastlog[0] ? s->lastlog : "libmicrohttpd refused to start");
        return HS_ERR_SYSTEM;
    }
    return HS_OK;
}

/* http_server.h has the caller's contract. Here: validates cfg (port range, a request
 * callback), raises the soft descriptor limit toward the hard one when the connection limit
 * needs it, starts libmicrohttpd on host (default 127.0.0.1) and, with also_host, a second
 * daemon on the same port (retrying up to 8 ephemeral ports when the second address has the
 * first's port taken), then watches each daemon's epoll descriptor with an ev_io and arms the
 * timer (hs_kick). Returns HS_OK with *out set; or HS_ERR_INVALID / HS_ERR_NOMEM /
 * HS_ERR_SYSTEM (e.g. the address is in use: the message names host and port) with a sentence
 * in err, *out NULL and nothing left listening. Loop thread; binds but never blocks. */
int hs_server_start(struct ev_loop *loop, const hs_config *cfg, hs_server **out, char *err,
                    size_t errlen)
{
    const char *host = cfg->host ? cfg->host : "127.0.0.1";
    *out = NULL;
    if (cfg->port < 0 || cfg->port > 65535) {
        hs_seterr(err, errlen, "port %d is out of range", cfg->port);
        return HS_ERR_INVALID;
    }
    if (!cfg->on_request) {
        hs_seterr(err, errlen, "no request callback");
        return HS_ERR_INVALID;
    }
    hs_server *s = (hs_server *)calloc(1, sizeof *s);
    if (!s) {
        hs_seterr(err, errlen, "out of memory");
        return HS_ERR_NOMEM;
    }
    s->loop = loop;
    s->max_body = cfg->max_body ? cfg->max_body : HS_DEFAULT_MAX_BODY;
    s->upload_dir = strdup(cfg->upload_dir ? cfg->upload_dir : "/tmp");
    s->on_request = cfg->on_request;
    s->ud = cfg->ud;
    const char *dbg = getenv("MOONBOX_HTTPD_LOG");
    s->log_to_stderr = dbg && strcmp(dbg, "1") == 0;
    if (!s->upload_dir) {
        hs_server_free(s);
        hs_seterr(err, errlen, "out of memory");
        return HS_ERR_NOMEM;
    }

    unsigned int limit = cfg->connection_limit ? cfg->connection_limit : HS_DEFAULT_CONNECTION_MAX;
    /* Each connection is a descriptor: let the process have as many as its hard limit allows
     * (the usual soft limit of 1024 would refuse clients long before the connection limit). */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max &&
        rl.rlim_cur < limit + 256u) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    unsigned int idle = cfg->idle_timeout ? cfg->idle_timeout : HS_DEFAULT_IDLE_TIMEOUT;
    /* With a second address on an ephemeral port, the port the first address got may be taken
     * on the second: try a few ports before giving up. */
    for (int attempt = 0;; attempt++) {
        int rc = hs_daemon_start(s, host, cfg->port, limit, idle, &s->daemon, s->host,
                                 sizeof s->host, err, errlen);
        if (rc != HS_OK) {
            hs_server_free(s);
            return rc;
        }
        if (!cfg->also_host) break;
        const union MHD_DaemonInfo *bp = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
        char shown[INET6_ADDRSTRLEN];
        rc = hs_daemon_start(s, cfg->also_host, bp ? bp->port : cfg->port, limit, idle, &s->daemon2,
                             shown, sizeof shown, err, errlen);
        if (rc == HS_OK) break;
        MHD_stop_daemon(s->daemon);
        s->daemon = NULL;
        if (cfg->port != 0 || attempt >= 8) {
            hs_server_free(s);
            return rc;
        }
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_EPOLL_FD);
    const union MHD_DaemonInfo *pi = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    const union MHD_DaemonInfo *di2 =
        s->daemon2 ? MHD_get_daemon_info(s->daemon2, MHD_DAEMON_INFO_EPOLL_FD) : NULL;
    if (!di || di->epoll_fd < 0 || !pi || (s->daemon2 && (!di2 || di2->epoll_fd < 0))) {
        MHD_stop_daemon(s->daemon);
        if (s->daemon2) MHD_stop_daemon(s->daemon2);
        hs_server_free(s);
        hs_seterr(err, errlen, "libmicrohttpd did not report its epoll descriptor or port");
        return HS_ERR_SYSTEM;
    }
    s->port = pi->port;
    ev_io_init(&s->io, hs_io_cb, di->epoll_fd, EV_READ);
    s->io.data = s;
    ev_io_start(loop, &s->io);
    if (s->daemon2) {
        ev_io_init(&s->io2, hs_io_cb, di2->epoll_fd, EV_READ);
        s->io2.data = s;
        ev_io_start(loop, &s->io2);
    }
    ev_timer_init(&s->timer, hs_timer_cb, 0., 0.);
    s->timer.data = s;
    hs_kick(s);
    *out = s;
    return HS_OK;
}

int hs_server_port(const hs_server *s)
{
    return s->port;
}

const char *hs_server_host(const hs_server *s)
{
    return s->host;
}

void hs_server_stats(const hs_server *s, hs_stats *out)
{
    *out = s->stats;
    const union MHD_DaemonInfo *ci =
        MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
    out->connections = ci ? ci->num_connections : 0;
    if (s->daemon2) {
        ci = MHD_get_daemon_info(s->daemon2, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
        out->connections += ci ? ci->num_connections : 0;
    }
}

void hs_server_quiesce(hs_server *s)
{
    if (s->quiesced) return;
    s->quiesced = 1;
    MHD_socket fd = MHD_quiesce_daemon(s->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
    if (s->daemon2) {
        fd = MHD_quiesce_daemon(s->daemon2);
        if (fd != MHD_INVALID_SOCKET) close(fd);
    }
    hs_kick(s);
}

void hs_server_close(hs_server *s)
{
    s->closing = 1;
    ev_io_stop(s->loop, &s->io);
    if (s->daemon2) ev_io_stop(s->loop, &s->io2);
    ev_timer_stop(s->loop, &s->timer);
    /* MHD must not be stopped with suspended connections; resumed ones it closes itself,
     * ending their requests as HS_GONE_SERVER through hs_completed_cb. */
    for (hs_request *r = s->live; r; r = r->next) {
        if (r->conn && r->suspended) {
            r->suspended = 0;
            MHD_resume_connection(r->conn);
        }
    }
    MHD_stop_daemon(s->daemon);
    s->daemon = NULL;
    if (s->daemon2) MHD_stop_daemon(s->daemon2);
    s->daemon2 = NULL;
    /* What is left is held by handlers (or, defensively, by MHD if it never reported an end). */
    while (s->live) {
        hs_request *r = s->live;
        hs_request_retain(r); /* destroying a stream answer below drops a reference */
        hs_unlink_live(r);
        r->conn = NULL;
        r->suspended = 0;
        if (r->pending) {
            struct MHD_Response *resp = r->pending;
            r->pending = NULL;
            MHD_destroy_response(resp);
        }
        if (r->state == HS_LIVE) r->state = HS_GONE_SERVER;
        hs_notify(r);
        if (r->mhd_ref) {
            r->mhd_ref = 0;
            hs_request_release(r);
        }
        hs_request_release(r);
    }
    hs_server_free(s);
}
