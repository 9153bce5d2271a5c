/*
 * http_server.h — an HTTP/1.1 server on libmicrohttpd, driven by a libev loop, with a router
 * and requests that wait, suspended, for an outside handler to answer them.
 *
 * The server calls back exactly once per complete request (cfg.on_request, from inside MHD's
 * processing, so the callback may only record and enqueue). The request then belongs jointly to
 * MHD and to whoever retained it; it is freed when both have let go, so a handler that outlives
 * its connection or its server never touches freed memory. Everything here runs on the loop's
 * thread; nothing is thread-safe and nothing calls back into the caller except through the two
 * function pointers (on_request, and a request's notify).
 */
#ifndef MB_HTTP_SERVER_H
#define MB_HTTP_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include <ev.h>

#define HS_DEFAULT_MAX_BODY       (1024u * 1024)
#define HS_DEFAULT_CONNECTION_MAX 4096u
#define HS_DEFAULT_HEADER_TIMEOUT 30u
#define HS_DEFAULT_IDLE_TIMEOUT   120u
#define HS_DEFAULT_STREAM_BUFFER  (64u * 1024)
#define HS_MAX_CAPTURES           16

typedef struct hs_server hs_server;
typedef struct hs_request hs_request;

/* What a route does with a request body. */
enum hs_body_mode {
    HS_BODY_MEMORY = 0, /* collected in memory up to max_body */
    HS_BODY_FILE,       /* streamed into a 0600 temporary file under the route's directory */
    HS_BODY_NONE,       /* read and dropped (still bounded by max_body) */
};

/* Who may send a route's requests, checked by the server itself as soon as the headers are in,
 * before a byte of the body is buffered or written anywhere: an unauthenticated request costs no
 * memory beyond its headers and is answered 401 (or 403) at once, or, when a body of up to 1 MiB
 * is already on its way (no Expect: 100-continue), once that body has been read and dropped, so
 * that the client reads the answer instead of a reset connection. */
enum hs_auth_mode {
    HS_AUTH_NONE = 0, /* anyone */
    HS_AUTH_KEY,      /* "Authorization: Bearer <the server's key>" (hs_server_set_key) */
    HS_AUTH_TOKEN,    /* "Authorization: Bearer <a token>" put with hs_server_token_put, bound
                       * to this route's scope and to the value of its ":id" capture */
};

/* Whether the other end of a request is still there. */
enum hs_request_state {
    HS_LIVE = 0,    /* the connection waits for (or is receiving) the response */
    HS_FINISHED,    /* the response was sent completely */
    HS_GONE_CLIENT, /* the client disconnected, timed out or the transfer failed */
    HS_GONE_SERVER, /* the server was closed under the request */
};

/* Status codes of the functions below; messages go into the caller's buffer. */
enum {
    HS_OK = 0,
    HS_ERR_GONE = -1,    /* the request has no connection any more: nothing was sent */
    HS_ERR_STATE = -2,   /* a response was already given, or no stream is open */
    HS_ERR_NOMEM = -3,   /* out of memory */
    HS_ERR_INVALID = -4, /* an argument is malformed (route pattern, header, status) */
    HS_ERR_SYSTEM = -5,  /* the OS refused (bind, epoll, ...) */
};

typedef void (*hs_request_fn)(hs_request *r, void *ud);

/* A name/value pair: request headers and captures, and response headers. */
typedef struct hs_pair {
    const char *name;
    const char *value;
} hs_pair;

typedef struct hs_config {
    const char *host;          /* numeric address or resolvable name; NULL = "127.0.0.1" */
    const char *also_host;     /* a second address served the same, on the same port; or NULL */
    int port;                  /* 0 = an ephemeral port (read it back with hs_server_port) */
    size_t max_body;           /* default body limit of routes; 0 = HS_DEFAULT_MAX_BODY */
    const char *upload_dir;    /* default directory of file-mode routes; NULL = "/tmp" */
    unsigned connection_limit; /* 0 = HS_DEFAULT_CONNECTION_MAX */
    unsigned idle_timeout;     /* seconds of client silence before MHD closes; 0 = default */
    hs_request_fn on_request;  /* a complete request waits for its handler (see above) */
    void *ud;                  /* given back by hs_request_server_ud */
} hs_config;

/* What the handler side may read of a request. Strings are NUL-terminated copies owned by the
 * request; body is set for memory mode until hs_request_drop_body. */
typedef struct hs_request_view {
    const char *method;
    const char *target; /* the raw request target, e.g. "/a%20b?x=1" */
    const char *path;   /* raw path, without the query */
    const char *query;  /* raw query after '?', or "" */
    const char *remote; /* client address, e.g. "127.0.0.1" */
    int remote_port;
    const hs_pair *headers; /* in arrival order, names as sent */
    size_t nheaders;
    const hs_pair *captures; /* ":name" segments (decoded), then "rest" for a trailing '*' */
    size_t ncaptures;
    int handler_id; /* of the matched route */
    int body_mode;  /* enum hs_body_mode */
    const char *body;
    size_t body_len;
    const char *body_file; /* file mode: the temporary file, or NULL once discarded */
    uint64_t body_file_size;
} hs_request_view;

typedef struct hs_stats {
    uint64_t requests;         /* requests routed since start */
    unsigned active;           /* requests in flight on connections now */
    unsigned max_active;       /* the most in flight at once */
    unsigned connections;      /* open connections now */
    size_t peak_body_bytes;    /* the largest in-memory body buffer allocated */
    uint64_t rejected_large;   /* 413 answers */
    uint64_t rejected_auth;    /* 401/403 answers given before the body */
    uint64_t rejected_framing; /* 400/501 answers to requests whose framing or bytes are refused */
} hs_stats;

/* ---- servers -------------------------------------------------------------------------------- */

/* Starts a server on loop: binds, listens, and watches MHD's epoll descriptor. Returns HS_OK
 * and *out, or an error code with a message in err (e.g. the address is in use). */
int hs_server_start(struct ev_loop *loop, const hs_config *cfg, hs_server **out, char *err,
                    size_t errlen);

/* Adds a route: method ("GET", ... or "*" for any), pattern (e.g. "/v1/items/:id": literal
 * segments, ":name" captures of one non-empty segment, and an optional final segment "*"
 * capturing the rest of the path as "rest"), body mode, max_body (0 = the server's) and upload_dir
 * (NULL = the server's), auth (enum hs_auth_mode) and, for HS_AUTH_TOKEN, the scope a token must
 * be bound to (e.g. "runs/stream"). Routes are tried in the order added. Returns HS_OK or
 * HS_ERR_INVALID/HS_ERR_NOMEM. */
int hs_server_add_route(hs_server *s, const char *method, const char *pattern, int body_mode,
                        size_t max_body, const char *upload_dir, int auth, const char *auth_scope,
                        int handler_id, char *err, size_t errlen);

/* Makes the last route added (a HS_BODY_FILE one) refuse, with 507 before a byte of its body is
 * read, a request whose declared Content-Length does not fit: in the upload directory's free
 * space, or (space_dir not NULL) in the room of space_dir/<its ":id" capture> (free space and,
 * on btrfs, that subvolume's quota: host_fs_room). A body that runs out of space while it is
 * stored is answered 507 too. HS_OK, HS_ERR_INVALID (no route, not a file route) or
 * HS_ERR_NOMEM. */
int hs_server_route_space(hs_server *s, const char *space_dir);

/* Sets (a copy of) the key HS_AUTH_KEY routes require; NULL lets nobody in. */
int hs_server_set_key(hs_server *s, const char *key);

/* Lets one request bearing token into HS_AUTH_TOKEN routes of scope whose ":id" capture is id,
 * for ttl seconds from now (after that they get 401 "expired" until the token is dropped). The
 * first request through the gate spends it: later ones get 403 "used already" (a request refused
 * for another id or scope does not). Putting a token again replaces it (unspent). O(1) average (a
 * hash table). HS_OK or HS_ERR_NOMEM. */
int hs_server_token_put(hs_server *s, const char *token, const char *id, const char *scope,
                        double ttl);
/* Forgets token (unknown tokens are ignored). */
void hs_server_token_drop(hs_server *s, const char *token);
/* Tokens held, for leak tests. */
size_t hs_server_token_count(const hs_server *s);

int hs_server_port(const hs_server *s);
const char *hs_server_host(const hs_server *s);
void hs_server_stats(const hs_server *s, hs_stats *out);

/* Stops accepting connections: the listening socket is closed, so new connections are refused;
 * connections already accepted are still served (including further requests on kept-alive
 * ones). Idempotent. */
void hs_server_quiesce(hs_server *s);

/* Stops accepting, resumes every suspended connection, stops MHD (which ends each request in
 * flight as HS_GONE_SERVER and notifies it), detaches the requests still retained elsewhere,
 * and frees the server. Must not be called from inside an on_request or notify callback. */
void hs_server_close(hs_server *s);

/* ---- requests ---------------------------------------------------------------------------------
 */

void hs_request_retain(hs_request *r);
/* Drops one reference; the last one frees the request (and removes its body file if still
 * owned). */
void hs_request_release(hs_request *r);

const hs_request_view *hs_request_get_view(const hs_request *r);
int hs_request_state(const hs_request *r);
/* The ud of the request's server, or NULL once that server is closing or closed. */
void *hs_request_server_ud(const hs_request *r);

/* Registers fn(r, ud) to be called when the request's state changes (it ends, or its stream
 * queue drains to or below its bound). fn runs inside MHD processing or hs_server_close: it
 * may only record and enqueue. NULL unregisters. */
void hs_request_set_notify(hs_request *r, hs_request_fn fn, void *ud);

/* Frees an in-memory body once the handler side has copied it. */
void hs_request_drop_body(hs_request *r);
/* Removes the body file unless it is gone already (the handler may have moved it). */
void hs_request_discard_body_file(hs_request *r);

/* Answers with status, headers and a copy of body. The connection resumes on the loop's next
 * turn. HS_ERR_GONE when the client or server is gone, HS_ERR_STATE after a first answer,
 * HS_ERR_INVALID for a bad status or header. */
/* Answers by closing the connection without any reply (the client sees the connection end
 * before a status line), as a lost response would look; for fault injection. */
int hs_request_drop(hs_request *r, char *err, size_t errlen);

int hs_request_respond(hs_request *r, unsigned status, const hs_pair *headers, size_t nheaders,
                       const void *body, size_t len, char *err, size_t errlen);

/* The logging policy for a handler that failed, by its error code (NULL when the error was not
 * a structured one): HS_LOG_QUIET for "cancelled" (the server is closing) and "client_gone"
 * (nobody to tell), HS_LOG_NO_RESPONSE for "no_response" (one line, no traceback), else
 * HS_LOG_FAILURE (the error and its traceback). */
enum { HS_LOG_QUIET, HS_LOG_NO_RESPONSE, HS_LOG_FAILURE };
int hs_failure_log(const char *code);

/* The error-to-HTTP mapping for a handler that failed: the status for its error code (503 for
 * "cancelled": the server is going away; 500 for anything else, NULL included). */
unsigned hs_failure_status(const char *code);

/* Answers a failed handler: hs_failure_status(code) with the JSON body {"message": msg}, msg
 * quoted by runtime/jsonq.c (invalid UTF-8 becomes U+FFFD). Results as hs_request_respond. */
int hs_request_respond_failure(hs_request *r, const char *code, const char *msg, size_t n,
                               char *err, size_t errlen);

/* Answers with size bytes read from fd (a regular file), which the request owns from now on
 * whatever the result. */
int hs_request_respond_fd(hs_request *r, unsigned status, const hs_pair *headers, size_t nheaders,
                          int fd, uint64_t size, char *err, size_t errlen);

/* Answers with a body of unknown length fed by hs_request_stream_write (chunked encoding on
 * HTTP/1.1). bound is the byte count above which a writer should wait (0 = default). */
int hs_request_stream_open(hs_request *r, unsigned status, const hs_pair *headers, size_t nheaders,
                           size_t bound, char *err, size_t errlen);

/* Queues len bytes on the open stream (always all of them: the caller enforces the bound by
 * waiting while hs_request_stream_pending exceeds hs_request_stream_bound). HS_ERR_GONE once
 * the client or server is gone. */
int hs_request_stream_write(hs_request *r, const void *data, size_t len);

/* The zero-copy form of hs_request_stream_write: room for at most len bytes at the end of the
 * open stream's queue, which the caller fills and then queues with hs_request_stream_commit (n
 * <= len; before any other call on r). NULL with *rc = HS_ERR_STATE, HS_ERR_GONE or
 * HS_ERR_NOMEM as hs_request_stream_write returns them. */
char *hs_request_stream_reserve(hs_request *r, size_t len, int *rc);
void hs_request_stream_commit(hs_request *r, size_t n);
size_t hs_request_stream_pending(const hs_request *r);
size_t hs_request_stream_bound(const hs_request *r);

/* Ends the open stream: after the queued bytes (abort = 0), or at once, breaking the connection
 * so the client sees an incomplete response (abort = 1). Idempotent. */
void hs_request_stream_close(hs_request *r, int abort);

/* Decodes %XX escapes (and '+' as a space when plus_is_space) of src[0..n) into out, which must
 * hold n + 1 bytes; malformed escapes are kept literally. Returns the decoded length. */
size_t hs_percent_decode(const char *src, size_t n, char *out, int plus_is_space);

/* The query-string split: calls fn(ud, key, klen, value, vlen) for each key=value pair of a raw
 * (still percent-encoded) query string, in order; a pair without '=' has an empty value, and
 * empty pairs ("a&&b") are skipped. Decoding is the caller's (hs_percent_decode). */
typedef void (*hs_query_fn)(void *ud, const char *k, size_t kn, const char *v, size_t vn);
void hs_query_each(const char *q, hs_query_fn fn, void *ud);

/* Request records allocated in this process now (a diagnostic for leak tests). */
long hs_live_requests(void);

/* libmicrohttpd's version string. */
const char *hs_mhd_version(void);

#endif
