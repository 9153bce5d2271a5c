/*
 * http_client.c — libcurl's multi interface on a libev loop (docs/architecture.md, rules 6 and 7).
 *
 * curl tells us which sockets to watch (socket callback → one ev_io each, attached with
 * curl_multi_assign) and when to call it back (timer callback → one ev_timer; a timeout of 0 is
 * armed as a 0 s timer, never acted on inside curl's callback). After every
 * curl_multi_socket_action we drain curl_multi_info_read and then deliver the events that
 * curl's write/header callbacks recorded on each request: notify callbacks therefore never run
 * inside curl. Easy handles are pooled, and keep their options for the next request that asks
 * for the same ("handle reuse"); connections live in the multi handle's cache, so keep-alive and
 * HTTP/2 multiplexing are reused across requests.
 *
 * Streaming bodies go through a per-request buffer bounded by stream_buffer: when a write would
 * overflow it, the write callback returns CURL_WRITEFUNC_PAUSE (curl keeps the bytes and offers
 * them again after unpausing), so memory per transfer is at most the bound plus one chunk.
 */
#include "http_client.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <curl/curl.h>

#define EASY_POOL_MAX 64
#define CACHE_MIN     16 /* connections kept however few requests ever ran at once */
#define REQ_POOL_MAX  64
#define REQ_KEEP_BUF  (256 * 1024) /* a body buffer larger than this is not kept for reuse */
#define ORIGINS_MAX   32

/* What a server's connection was seen to speak (see "connection use" below). */
typedef struct origin_memo {
    char origin[128]; /* "scheme://host:port", lower-cased */
    int multiplexed;  /* the last response from it came over HTTP/2 or later */
} origin_memo;

typedef struct sock_watch {
    ev_io io;
    struct http_client *c;
} sock_watch;

/* What a plain request (see "handle reuse" below) set on an easy handle, so that the next plain
 * request asking for the same options can leave them in place. */
typedef struct easy_setup {
    int reusable;                     /* the handle carries exactly these options, nothing else */
    const struct http_request *owner; /* the request PRIVATE and the callbacks' data point at */
    const struct curl_slist *headers; /* the list CURLOPT_HTTPHEADER points at */
    long connect_timeout_ms, timeout_ms, idle_timeout_ms;
    int tls, no_proxy, has_encoding;
    char method[16], encoding[32], ca[256], cadir[256];
} easy_setup;

/* An easy handle and what is set on it; pooled by the client, lent to one request at a time. */
typedef struct pooled_easy {
    CURL *curl;
    int dirty;   /* options were set since curl_easy_init or curl_easy_reset */
    int has_url; /* url is the CURLOPT_URL the handle has (easy_set_url) */
    char *url;
    size_t url_cap;
    easy_setup setup;
} pooled_easy;

struct http_client {
    struct ev_loop *loop;
    CURLM *multi;
    ev_timer timer;
    int refs;    /* 1 while the owner holds it + 1 per request not yet freed */
    int closing; /* the owner called http_client_free */
    pooled_easy *pool[EASY_POOL_MAX];
    int npool;
    /* Finished requests kept for reuse with their buffers and header list (see req_alloc). */
    struct http_request *spare[REQ_POOL_MAX];
    int nspare;
    /* The connection cache (see cache_fit): requests in curl now, and the cache's size. */
    long inflight;
    long maxconnects;
    http_request *pending; /* requests with events to deliver */
    origin_memo origins[ORIGINS_MAX];
    int norigins, next_origin;
};

typedef struct header {
    size_t name_off, name_len, value_off, value_len;
} header;

struct http_request {
    http_client *c;
    pooled_easy *pe; /* the easy handle lent to this request while it runs */
    CURL *easy;      /* pe->curl */
    char *body_copy;
    FILE *in_file;
    FILE *out_file;
    http_notify_fn notify;
    void *ud;
    int stream;
    size_t stream_cap;
    size_t max_body;

    long status;
    int headers_done;
    int done;
    int paused;
    int in_multi;
    enum http_result result;
    char errbuf[CURL_ERROR_SIZE];
    char message[512];

    /* Connection use (see "connection use" below). */
    char origin[128];
    size_t body_len, body_off; /* no_resend: body_copy's size, and the bytes handed to curl */
    int http_version;
    char primary_ip[48]; /* the address the connection went to */
    struct curl_slist *resolve;

    /* Headers of the current response: text in hbuf[0..hlen), spans in hdrs[0..nhdrs). */
    size_t hlen, nhdrs;

    /* Body: memory mode uses buf[0..len); stream mode buf[off..len). */
    size_t len, off;
    size_t peak;
    unsigned long pauses;

    int events; /* recorded by curl callbacks, delivered after socket_action */
    http_request *next_pending;
    int is_pending;

    /* Kept from one request to the next by the request pool, with their capacities (req_alloc
     * zeroes everything above headers_out and nothing from it on). */
    struct curl_slist *headers_out;
    char *hbuf;
    size_t hcap;
    header *hdrs;
    size_t chdrs;
    char *buf;
    size_t cap;
};

static void deliver_pending(http_client *c);
static void check_done(http_client *c);
static void req_destroy(http_request *r);
static void easy_destroy(pooled_easy *pe);
static void origin_learn(http_client *c, http_request *r, CURL *easy);
static void redact_userinfo(char *s);
static void multi_connection_use(CURLM *multi);

/* ---- results ------------------------------------------------------------------------------- */

const char *http_result_code(enum http_result res)
{
    switch (res) {
    case HTTP_OK:
        return "ok";
    case HTTP_ERR_CONNECT:
        return "connect_failed";
    case HTTP_ERR_DNS:
        return "dns_failed";
    case HTTP_ERR_TIMEOUT:
        return "timeout";
    case HTTP_ERR_RESET:
        return "connection_reset";
    case HTTP_ERR_MALFORMED:
        return "malformed_response";
    case HTTP_ERR_TLS:
        return "tls_failed";
    case HTTP_ERR_TOO_LARGE:
        return "body_too_large";
    case HTTP_ERR_FILE:
        return "file_error";
    case HTTP_ERR_BAD_URL:
        return "bad_url";
    case HTTP_ERR_CANCELLED:
        return "cancelled";
    default:
        return "transport_error";
    }
}

int http_result_retryable(enum http_result res)
{
    return res == HTTP_ERR_CONNECT || res == HTTP_ERR_TIMEOUT || res == HTTP_ERR_RESET ||
           res == HTTP_ERR_DNS;
}

static enum http_result map_curl(CURLcode cc)
{
    switch (cc) {
    case CURLE_OK:
        return HTTP_OK;
    case CURLE_COULDNT_CONNECT:
        return HTTP_ERR_CONNECT;
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
        return HTTP_ERR_DNS;
    case CURLE_OPERATION_TIMEDOUT:
        return HTTP_ERR_TIMEOUT;
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SEND_FAIL_REWIND: /* a no_resend request that libcurl wanted to send again */
        return HTTP_ERR_RESET;
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_BAD_CONTENT_ENCODING:
    case CURLE_UNSUPPORTED_PROTOCOL:
        return HTTP_ERR_MALFORMED;
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_CACERT_BADFILE:
        return HTTP_ERR_TLS;
    case CURLE_URL_MALFORMAT:
        return HTTP_ERR_BAD_URL;
    case CURLE_READ_ERROR:
    case CURLE_FILE_COULDNT_READ_FILE:
        return HTTP_ERR_FILE;
    default:
        return HTTP_ERR_OTHER;
    }
}

/* ---- libev glue ------------------------------------------------------------------------------ */

static void after_action(http_client *c)
{
    check_done(c);
    deliver_pending(c);
}

static void io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    sock_watch *sw = (sock_watch *)w;
    http_client *c = sw->c;
    int running = 0;
    int flags =
        ((revents & EV_READ) ? CURL_CSELECT_IN : 0) | ((revents & EV_WRITE) ? CURL_CSELECT_OUT : 0);
    (void)loop;
    /* sw may be freed inside socket_action (CURL_POLL_REMOVE); do not touch it after. */
    curl_multi_socket_action(c->multi, w->fd, flags, &running);
    after_action(c);
}

static void timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    http_client *c = (http_client *)w->data;
    int running = 0;
    (void)loop;
    (void)revents;
    curl_multi_socket_action(c->multi, CURL_SOCKET_TIMEOUT, 0, &running);
    after_action(c);
}

/* curl's socket callback: keep one ev_io per socket in step with what curl wants. */
static int sock_cb(CURL *easy, curl_socket_t s, int what, void *clientp, void *socketp)
{
    http_client *c = (http_client *)clientp;
    sock_watch *sw = (sock_watch *)socketp;
    (void)easy;
    if (what == CURL_POLL_REMOVE) {
        if (sw) {
            ev_io_stop(c->loop, &sw->io);
            free(sw);
            curl_multi_assign(c->multi, s, NULL);
        }
        return 0;
    }
    int ev = ((what & CURL_POLL_IN) ? EV_READ : 0) | ((what & CURL_POLL_OUT) ? EV_WRITE : 0);
    if (!sw) {
        sw = (sock_watch *)calloc(1, sizeof *sw);
        if (!sw) return -1;
        sw->c = c;
        ev_io_init(&sw->io, io_cb, s, ev);
        curl_multi_assign(c->multi, s, sw);
    } else {
        ev_io_stop(c->loop, &sw->io);
        ev_io_set(&sw->io, s, ev);
    }
    ev_io_start(c->loop, &sw->io);
    return 0;
}

/* curl's timer callback: only (re)arms the ev_timer; curl is called back from the loop. */
static int multi_timer_cb(CURLM *multi, long timeout_ms, void *clientp)
{
    http_client *c = (http_client *)clientp;
    (void)multi;
    ev_timer_stop(c->loop, &c->timer);
    if (timeout_ms >= 0) {
        ev_timer_set(&c->timer, timeout_ms / 1000.0, 0.);
        ev_timer_start(c->loop, &c->timer);
    }
    return 0;
}

http_client *http_client_new(struct ev_loop *loop, char *err, size_t errlen)
{
    static int global_done;
    if (!global_done) {
        CURLcode cc = curl_global_init(CURL_GLOBAL_DEFAULT);
        if (cc != CURLE_OK) {
            snprintf(err, errlen, "libcurl global init failed: %s", curl_easy_strerror(cc));
            return NULL;
        }
        global_done = 1;
    }
    http_client *c = (http_client *)calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->loop = loop;
    c->refs = 1;
    c->multi = curl_multi_init();
    if (!c->multi) {
        free(c);
        snprintf(err, errlen, "curl_multi_init failed");
        return NULL;
    }
    ev_timer_init(&c->timer, timer_cb, 0., 0.);
    c->timer.data = c;
    curl_multi_setopt(c->multi, CURLMOPT_SOCKETFUNCTION, sock_cb);
    curl_multi_setopt(c->multi, CURLMOPT_SOCKETDATA, c);
    curl_multi_setopt(c->multi, CURLMOPT_TIMERFUNCTION, multi_timer_cb);
    curl_multi_setopt(c->multi, CURLMOPT_TIMERDATA, c);
    curl_multi_setopt(c->multi, CURLMOPT_PIPELINING, (long)CURLPIPE_MULTIPLEX);
    c->maxconnects = CACHE_MIN;
    curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, c->maxconnects);
    multi_connection_use(c->multi);
    return c;
}

static void client_release(http_client *c)
{
    if (--c->refs > 0) return;
    ev_timer_stop(c->loop, &c->timer);
    for (int i = 0; i < c->npool; i++)
        easy_destroy(c->pool[i]);
    for (int i = 0; i < c->nspare; i++)
        req_destroy(c->spare[i]);
    /* Socket callbacks (CURL_POLL_REMOVE) may run here; sock_cb tolerates them. */
    curl_multi_cleanup(c->multi);
    ev_timer_stop(c->loop, &c->timer);
    free(c);
}

void http_client_free(http_client *c)
{
    if (!c || c->closing) return;
    c->closing = 1;
    client_release(c);
}

/* ---- request callbacks (run inside curl: record only) ---------------------------------------- */

static void mark_pending(http_request *r, int events)
{
    r->events |= events;
    if (!r->is_pending) {
        r->is_pending = 1;
        r->next_pending = r->c->pending;
        r->c->pending = r;
    }
}

static int grow(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 1024;
    while (n < need)
        n *= 2;
    char *p = (char *)realloc(*buf, n);
    if (!p) return -1;
    *buf = p;
    *cap = n;
    return 0;
}

/* CURLOPT_HEADERFUNCTION: one header line of request ud (without its CR LF). A status line
 * starts a new response (after a 1xx or a redirect) and forgets the previous headers; the empty
 * line after a final status queues HTTP_EV_HEADERS; any other line is stored lower-cased by
 * name in r->hbuf/r->hdrs. Returns n to go on, 0 (curl aborts the transfer, reported as a
 * write error) when memory runs out. Runs inside curl_multi_socket_action, never calls Lua. */
static size_t header_cb(char *data, size_t size, size_t nitems, void *ud)
{
    http_request *r = (http_request *)ud;
    size_t n = size * nitems;
    size_t end = n;
    while (end > 0 && (data[end - 1] == '\r' || data[end - 1] == '\n'))
        end--;
    if (n >= 5 && memcmp(data, "HTTP/", 5) == 0) {
        /* A new response (after 1xx or a redirect): forget the previous one's headers. */
        r->nhdrs = 0;
        r->hlen = 0;
        const char *p = memchr(data, ' ', end), *e = data + end;
        long status = 0; /* the digits after the version (strtol was a tenth of this callback) */
        if (p) {
            while (p < e && *p == ' ')
                p++;
            for (int d = 0; d < 5 && p < e && isdigit((unsigned char)*p); d++, p++)
                status = status * 10 + (*p - '0');
        }
        r->status = status;
        return n;
    }
    if (end == 0) {
        if (r->status >= 200 || r->status == 0) {
            r->headers_done = 1;
            mark_pending(r, HTTP_EV_HEADERS);
        }
        return n;
    }
    const char *colon = memchr(data, ':', end);
    if (!colon) return n; /* a folded or malformed line: ignore it, as browsers do */
    size_t name_len = (size_t)(colon - data);
    const char *v = colon + 1;
    while (v < data + end && (*v == ' ' || *v == '\t'))
        v++;
    size_t value_len = (size_t)(data + end - v);
    if (grow(&r->hbuf, &r->hcap, r->hlen + name_len + value_len) < 0) return 0;
    if (r->nhdrs == r->chdrs) {
        size_t nc = r->chdrs ? r->chdrs * 2 : 16;
        header *h = (header *)realloc(r->hdrs, nc * sizeof *h);
        if (!h) return 0;
        r->hdrs = h;
        r->chdrs = nc;
    }
    header *h = &r->hdrs[r->nhdrs++];
    h->name_off = r->hlen;
    h->name_len = name_len;
    for (size_t i = 0; i < name_len; i++) { /* ASCII only, as HTTP names are: no locale */
        unsigned char ch = (unsigned char)data[i];
        r->hbuf[r->hlen + i] = (char)((unsigned)(ch - 'A') < 26u ? ch + 32 : ch);
    }
    r->hlen += name_len;
    h->value_off = r->hlen;
    h->value_len = value_len;
    memcpy(r->hbuf + r->hlen, v, value_len);
    r->hlen += value_len;
    return n;
}

/* CURLOPT_WRITEFUNCTION: n body bytes of request ud, into one of three sinks: the output file
 * (a short write sets HTTP_ERR_FILE), the stream buffer (backpressure: returns
 * CURL_WRITEFUNC_PAUSE while a non-empty buffer would exceed stream_cap; queues HTTP_EV_DATA),
 * or the whole-body buffer (above max_body sets HTTP_ERR_TOO_LARGE). The first byte also marks
 * the headers done. Returns n, the pause value, or 0 to abort with r->result/r->message set
 * (0 alone, on out of memory, becomes curl's write error). Never calls Lua. */
static size_t write_cb(char *data, size_t size, size_t nmemb, void *ud)
{
    http_request *r = (http_request *)ud;
    size_t n = size * nmemb;
    if (!r->headers_done) {
        r->headers_done = 1;
        mark_pending(r, HTTP_EV_HEADERS);
    }
    if (r->out_file) {
        if (fwrite(data, 1, n, r->out_file) != n) {
            r->result = HTTP_ERR_FILE;
            snprintf(r->message, sizeof r->message, "writing the response body to a file: %s",
                     strerror(errno));
            return 0;
        }
        return n;
    }
    if (r->stream) {
        size_t held = r->len - r->off;
        /* Accept into an empty buffer whatever its size, so a chunk larger than the bound
         * cannot stall the transfer; otherwise pause at the bound. */
        if (held > 0 && held + n > r->stream_cap) {
            if (!r->paused) r->pauses++;
            r->paused = 1;
            return CURL_WRITEFUNC_PAUSE;
        }
        if (r->off > 0) {
            memmove(r->buf, r->buf + r->off, held);
            r->len = held;
            r->off = 0;
        }
        if (grow(&r->buf, &r->cap, r->len + n) < 0) return 0;
        memcpy(r->buf + r->len, data, n);
        r->len += n;
        if (r->len > r->peak) r->peak = r->len;
        mark_pending(r, HTTP_EV_DATA);
        return n;
    }
    if (r->max_body && r->len + n > r->max_body) {
        r->result = HTTP_ERR_TOO_LARGE;
        snprintf(r->message, sizeof r->message, "response body exceeds %zu bytes", r->max_body);
        return 0;
    }
    if (grow(&r->buf, &r->cap, r->len + n) < 0) return 0;
    memcpy(r->buf + r->len, data, n);
    r->len += n;
    return n;
}

static size_t read_cb(char *buffer, size_t size, size_t nitems, void *ud)
{
    http_request *r = (http_request *)ud;
    size_t n = fread(buffer, 1, size * nitems, r->in_file);
    if (n == 0 && ferror(r->in_file)) return CURL_READFUNC_ABORT;
    return n;
}

/* ---- the connection cache ------------------------------------------------------------------ */

/* Grows the multi handle's connection cache to the most requests ever in flight at once (never
 * below CACHE_MIN, never shrinking). libcurl's default cache is 4x the easy handles in the multi
 * handle at the moment a transfer ends; with handles leaving as they finish it shrinks under a
 * steady load and closes connections the next request then reopens (10,000 GETs at 64 in
 * flight opened 640-790 connections instead of 64). A cache the size of the peak concurrency
 * keeps one idle connection for every request that can come back. Called whenever a request
 * joins the multi handle. */
static void cache_fit(http_client *c)
{
    if (c->inflight <= c->maxconnects) return;
    c->maxconnects = c->inflight;
    curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, c->maxconnects);
}

static void request_left_multi(http_request *r)
{
    r->in_multi = 0;
    r->c->inflight--;
}

/* ---- completion -------------------------------------------------------------------------- */

/* Takes r's easy handle back into the pool (options left in place: easy_take resets them unless
 * the next request can use them, see "handle reuse"), or frees it when the pool is full or the
 * client is closing. */
static void pool_put(http_client *c, http_request *r)
{
    pooled_easy *pe = r->pe;
    r->pe = NULL;
    r->easy = NULL;
    if (c->npool < EASY_POOL_MAX && !c->closing)
        c->pool[c->npool++] = pe;
    else
        easy_destroy(pe);
}

/* Drains curl_multi_info_read after every socket action: for each finished transfer, records
 * the status code, maps a curl failure to an HTTP_ERR_* result with a message (userinfo
 * redacted; a connection lost after sending says it was not re-sent), takes the easy handle out
 * of the multi handle back to the pool, closes the request's files (a failed close of the
 * output is HTTP_ERR_FILE) and queues HTTP_EV_DONE | HTTP_EV_HEADERS for delivery. Never calls
 * Lua or a notify callback itself (deliver_pending does, outside curl). */
static void check_done(http_client *c)
{
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(c->multi, &left))) {
        if (msg->msg != CURLMSG_DONE) continue;
        http_request *r = NULL;
        CURL *easy = msg->easy_handle;
        CURLcode cc = msg->data.result;
        curl_easy_getinfo(easy, CURLINFO_PRIVATE, (char **)&r);
        if (!r) continue;
        long code = 0, connects = 0;
        curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &code);
        if (code) r->status = code;
        origin_learn(c, r, easy);
        /* A handle whose transfer failed or opened a connection (which every one of curl's
         * silent retries does, counting them in state only curl_easy_reset clears) is reset
         * before it is used again. */
        curl_easy_getinfo(easy, CURLINFO_NUM_CONNECTS, &connects);
        if (cc != CURLE_OK || connects > 0) r->pe->setup.reusable = 0;
        if (r->result == HTTP_OK && cc != CURLE_OK) {
            r->result = map_curl(cc);
            if (cc == CURLE_SEND_FAIL_REWIND)
                snprintf(r->message, sizeof r->message,
                         "the connection closed after the request was sent and before any "
                         "answer; it was not sent again");
            else
                snprintf(r->message, sizeof r->message, "%s",
                         r->errbuf[0] ? r->errbuf : curl_easy_strerror(cc));
            redact_userinfo(r->message);
        }
        curl_multi_remove_handle(c->multi, easy);
        request_left_multi(r);
        pool_put(c, r);
        if (r->out_file) {
            if (fclose(r->out_file) != 0 && r->result == HTTP_OK) {
                r->result = HTTP_ERR_FILE;
                snprintf(r->message, sizeof r->message, "closing the output file: %s",
                         strerror(errno));
            }
            r->out_file = NULL;
        }
        if (r->in_file) {
            fclose(r->in_file);
            r->in_file = NULL;
        }
        r->done = 1;
        r->headers_done = 1;
        mark_pending(r, HTTP_EV_DONE | HTTP_EV_HEADERS);
    }
}

static void deliver_pending(http_client *c)
{
    while (c->pending) {
        http_request *r = c->pending;
        c->pending = r->next_pending;
        r->next_pending = NULL;
        r->is_pending = 0;
        int ev = r->events;
        r->events = 0;
        if (ev && r->notify) r->notify(r, r->ud, ev);
    }
}

/* ---- the request pool ------------------------------------------------------------------------ */

/* Frees a request struct and everything it keeps. */
static void req_destroy(http_request *r)
{
    curl_slist_free_all(r->headers_out);
    free(r->hbuf);
    free(r->hdrs);
    free(r->buf);
    free(r);
}

/* Returns a zeroed request, reusing a finished one when there is one: its header, header-span
 * and body buffers keep their capacity (lengths 0), and its header list is kept for
 * set_headers to compare with. A steady stream of similar requests thus allocates none of
 * these. NULL when out of memory. */
static http_request *req_alloc(http_client *c)
{
    if (c->nspare == 0) return (http_request *)calloc(1, sizeof(http_request));
    http_request *r = c->spare[--c->nspare];
    memset(r, 0, offsetof(http_request, headers_out));
    return r;
}

/* Keeps a finished request for req_alloc (its per-transfer resources already released), or
 * frees it when the pool is full or the client is closing. */
static void req_recycle(http_client *c, http_request *r)
{
    if (c->closing || c->nspare == REQ_POOL_MAX) {
        req_destroy(r);
        return;
    }
    if (r->cap > REQ_KEEP_BUF) {
        free(r->buf);
        r->buf = NULL;
        r->cap = 0;
    }
    c->spare[c->nspare++] = r;
}

/* The Expect line a request's headers start with, or NULL for none. A body in memory of more
 * than EXPECT_ASK bytes asks first ("Expect: 100-continue"): such a body is a control-plane
 * request over the usual 1 MiB limit, and a server that refuses it (413 before reading it, as
 * moonbox local does) is then heard instead of resetting a connection still being written to.
 * Any other body goes at once ("Expect:" stops curl from asking and waiting up to a second for
 * an answer, which a large upload from a file would otherwise do). */
#define EXPECT_ASK (1024u * 1024)
static const char *expect_line(const http_request_spec *spec)
{
    if (spec->body_file) return "Expect:";
    if (!spec->has_body) return NULL;
    return spec->body_len > EXPECT_ASK ? "Expect: 100-continue" : "Expect:";
}

/* Points r->headers_out at the request's header list: the expect line (expect_line) when there
 * is one, then the lines of `headers`; NULL when that is nothing. Reuses the list r already
 * holds (from the request it was before) when it has exactly those lines. Returns 0, or -1 when
 * out of memory. */
static int set_headers(http_request *r, const char *const *headers, const char *expect)
{
    const struct curl_slist *n = r->headers_out;
    const char *const *h = headers;
    const char *e = expect;
    for (; n; n = n->next) {
        const char *want = e ? e : h && *h ? *h : NULL;
        if (!want || strcmp(n->data, want) != 0) break;
        if (e)
            e = NULL;
        else
            h++;
    }
    if (!n && !e && (!h || !*h)) return 0;
    curl_slist_free_all(r->headers_out);
    r->headers_out = NULL;
    struct curl_slist *tail = NULL;
    if (expect && !(tail = r->headers_out = curl_slist_append(NULL, expect))) return -1;
    for (h = headers; h && *h; h++) {
        struct curl_slist *l = curl_slist_append(tail, *h);
        if (!l) return -1;
        if (!tail) r->headers_out = l;
        tail = tail ? tail->next : l;
    }
    return 0;
}

/* Copies src into dst (n bytes), cut to fit and NUL-terminated: snprintf's "%s" without its
 * format parsing, which showed in the per-request profile. */
static void copy_cut(char *dst, size_t n, const char *src)
{
    size_t len = strnlen(src, n - 1);
    memcpy(dst, src, len);
    dst[len] = '\0';
}

/* ---- connection use: HTTP/2, the CA bundle, no silent re-sends ------------------------------ */
/*
 * HTTP/2 where the server offers it (ALPN on TLS), and an https:// request waits for a connection
 * being set up rather than opening one more (CURLOPT_PIPEWAIT), so concurrent requests to one
 * server share one connection as streams. The environment's CA bundle (CURL_CA_BUNDLE,
 * SSL_CERT_FILE, SSL_CERT_DIR, as the curl tool reads them; libcurl itself does not) replaces the
 * built-in one. Proxies come from the environment (https_proxy, HTTPS_PROXY, http_proxy, no_proxy,
 * NO_PROXY), which libcurl reads itself while CURLOPT_PROXY is unset; it is set (to "", no proxy)
 * only for plain http:// to loopback, where moonbox local and the embedded backend listen.
 *
 * Re-sends. libcurl 7.88 sends a request again on a new connection, without telling, when it
 * went out on a reused connection and the connection failed before any byte of answer
 * (Curl_retry_request: "Connection died, retrying a fresh connect"), and when an HTTP/2 stream
 * is refused (REFUSED_STREAM, or above a GOAWAY's last stream). Over HTTP/2 that can re-send a
 * request the server has carried out (the TCP connection reset after the request went out).
 * A request with no_resend therefore hands curl its body through a read callback with no seek
 * callback: to send it again curl would have to rewind the body, cannot, and fails the transfer
 * (CURLE_SEND_FAIL_REWIND, reported as connection_reset) as soon as any body byte had gone out.
 * A request none of whose body left may still be repeated by curl, which is harmless: the server
 * cannot act on a request it has not received whole. On a server whose connections are not
 * multiplexed (HTTP/1.1, or plain http:// before anything is known) a no_resend request also
 * takes a connection of its own (CURLOPT_FRESH_CONNECT), which curl never retries: a stale
 * keep-alive connection would otherwise turn the usual harmless race into a failed request. A
 * no_resend request without a body always takes a connection of its own. HTTP_NO_RESEND_REUSE
 * skips the connection of its own (an exec start: a TLS handshake per command would cost more
 * than the rare stale keep-alive race, which then fails the request instead of re-sending it).
 */

/* Writes the lower-cased "scheme://authority" of url into out (empty when url has none). */
static void origin_of(const char *url, char *out, size_t n)
{
    const char *p = strstr(url, "://");
    size_t len = 0;
    if (p) {
        const char *end = p + 3;
        while (*end && *end != '/' && *end != '?' && *end != '#')
            end++;
        len = (size_t)(end - url);
    }
    if (len >= n) len = n - 1;
    for (size_t i = 0; i < len; i++)
        out[i] = (char)tolower((unsigned char)url[i]);
    out[len] = '\0';
}

/* Whether origin is plain http:// to this machine's loopback (localhost, 127.x, [::1]). */
static int origin_plain_loopback(const char *origin)
{
    if (strncmp(origin, "http://", 7) != 0) return 0;
    const char *h = origin + 7;
    const char *at = strchr(h, '@');
    if (at) h = at + 1;
    size_t n = strcspn(h, ":");
    if (*h == '[') return strncmp(h, "[::1]", 5) == 0;
    if (n == 9 && strncmp(h, "localhost", 9) == 0) return 1;
    if (n < 7 || strncmp(h, "127.", 4) != 0) return 0;
    for (size_t i = 0; i < n; i++)
        if (!isdigit((unsigned char)h[i]) && h[i] != '.') return 0;
    return 1;
}

/* 1: the origin's last answer came over a multiplexed protocol; 0: over HTTP/1.x; -1: unknown. */
static int origin_multiplexed(const http_client *c, const char *origin)
{
    for (int i = 0; i < c->norigins; i++)
        if (strcmp(c->origins[i].origin, origin) == 0) return c->origins[i].multiplexed;
    return -1;
}

/* Records the HTTP version a finished transfer used, for r and for its origin. */
static void origin_learn(http_client *c, http_request *r, CURL *easy)
{
    long v = 0;
    char *ip = NULL;
    if (curl_easy_getinfo(easy, CURLINFO_PRIMARY_IP, &ip) == CURLE_OK && ip)
        copy_cut(r->primary_ip, sizeof r->primary_ip, ip);
    if (curl_easy_getinfo(easy, CURLINFO_HTTP_VERSION, &v) != CURLE_OK || v == 0) return;
    r->http_version = v == CURL_HTTP_VERSION_1_0   ? 10
                      : v == CURL_HTTP_VERSION_1_1 ? 11
                      : v == CURL_HTTP_VERSION_2_0 ? 20
                                                   : 30;
    if (!r->origin[0]) return;
    int mux = r->http_version >= 20;
    for (int i = 0; i < c->norigins; i++)
        if (strcmp(c->origins[i].origin, r->origin) == 0) {
            c->origins[i].multiplexed = mux;
            return;
        }
    int slot = c->norigins < ORIGINS_MAX ? c->norigins++ : c->next_origin++ % ORIGINS_MAX;
    snprintf(c->origins[slot].origin, sizeof c->origins[slot].origin, "%s", r->origin);
    c->origins[slot].multiplexed = mux;
}

/* Replaces the user:password of any "scheme://user:password@" in s by "***" (proxy URLs come
 * from the environment and may carry credentials; messages must not). */
static void redact_userinfo(char *s)
{
    char *p = s;
    while ((p = strstr(p, "://"))) {
        char *start = p + 3, *q = start;
        while (*q && *q != '@' && *q != '/' && *q != ' ')
            q++;
        if (*q == '@') {
            memmove(start + 3, q, strlen(q) + 1);
            memcpy(start, "***", 3);
        }
        p = start;
    }
}

/* The read callback of a no_resend body: body_copy, once; no seek callback exists. */
static size_t body_once_cb(char *buffer, size_t size, size_t nitems, void *ud)
{
    http_request *r = (http_request *)ud;
    size_t left = r->body_len - r->body_off, n = size * nitems;
    if (n > left) n = left;
    memcpy(buffer, r->body_copy + r->body_off, n);
    r->body_off += n;
    return n;
}

/* The multi handle's part: as many streams on one connection as the server allows (libcurl's
 * own cap is 100, below a 100-sandbox fan-out plus its other requests). */
static void multi_connection_use(CURLM *multi)
{
    curl_multi_setopt(multi, CURLMOPT_MAX_CONCURRENT_STREAMS, 1000L);
}

/* The choices of this section that depend on the origin and the environment, made once per
 * request (the environment is read every time: a recipe may change it between requests). */
typedef struct conn_choice {
    int tls;                /* https://: HTTP/2 by ALPN, PIPEWAIT */
    int no_proxy;           /* plain http:// to loopback */
    const char *ca, *cadir; /* the CA bundle and directory named by the environment, or NULL */
} conn_choice;

/* Sets r->origin from spec's URL and fills ch. */
static void connection_choose(http_request *r, const http_request_spec *spec, conn_choice *ch)
{
    origin_of(spec->url, r->origin, sizeof r->origin);
    ch->tls = strncmp(r->origin, "https://", 8) == 0;
    ch->no_proxy = origin_plain_loopback(r->origin);
    ch->ca = getenv("CURL_CA_BUNDLE");
    if (!ch->ca || !*ch->ca) ch->ca = getenv("SSL_CERT_FILE");
    if (ch->ca && !*ch->ca) ch->ca = NULL;
    ch->cadir = getenv("SSL_CERT_DIR");
    if (ch->cadir && !*ch->cadir) ch->cadir = NULL;
}

/* Applies what this section describes to e, as chosen in ch. Returns 0, or -1 with a message in
 * err. */
static int connection_use(http_client *c, http_request *r, CURL *e, const http_request_spec *spec,
                          const conn_choice *ch, char *err, size_t errlen)
{
    int tls = ch->tls;
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_2TLS);
    /* Only where HTTP/2 is possible: over plain http:// curl would learn that a connection does
     * not multiplex only from its first answer, and hold every other request until then. Over
     * TLS it knows at the handshake (ALPN). */
    if (tls) curl_easy_setopt(e, CURLOPT_PIPEWAIT, 1L);
    if (ch->ca) {
        curl_easy_setopt(e, CURLOPT_CAINFO, ch->ca);
        curl_easy_setopt(e, CURLOPT_PROXY_CAINFO, ch->ca);
    }
    if (ch->cadir) {
        curl_easy_setopt(e, CURLOPT_CAPATH, ch->cadir);
        curl_easy_setopt(e, CURLOPT_PROXY_CAPATH, ch->cadir);
    }
    for (const char *const *l = spec->resolve; l && *l; l++) {
        struct curl_slist *n = curl_slist_append(r->resolve, *l);
        if (!n) {
            snprintf(err, errlen, "out of memory building the resolve list");
            return -1;
        }
        r->resolve = n;
    }
    if (r->resolve) curl_easy_setopt(e, CURLOPT_RESOLVE, r->resolve);
    /* A local backend (plain HTTP on loopback) is never asked for through http_proxy: the
     * proxy's loopback is not ours. An empty CURLOPT_PROXY overrides the environment; the empty
     * CURLOPT_NOPROXY beside it only spares curl reading no_proxy and NO_PROXY for every
     * transfer (with no proxy there is nothing for them to exempt). */
    if (ch->no_proxy) {
        curl_easy_setopt(e, CURLOPT_PROXY, "");
        curl_easy_setopt(e, CURLOPT_NOPROXY, "");
    }
    if (spec->no_resend == HTTP_NO_RESEND) {
        int mux = origin_multiplexed(c, r->origin);
        int body = (spec->has_body && spec->body_len > 0) || spec->body_file;
        if (!body || mux == 0 || (mux < 0 && !tls)) curl_easy_setopt(e, CURLOPT_FRESH_CONNECT, 1L);
    }
    return 0;
}

/* Sets r->body_copy (already filled, len bytes) as the request body of e. */
static void set_body(http_request *r, CURL *e, const http_request_spec *spec, const char *method)
{
    if (spec->no_resend && spec->body_len > 0) {
        r->body_len = spec->body_len;
        curl_easy_setopt(e, CURLOPT_POST, 1L);
        curl_easy_setopt(e, CURLOPT_READFUNCTION, body_once_cb);
        curl_easy_setopt(e, CURLOPT_READDATA, r);
    } else {
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, r->body_copy);
    }
    curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)spec->body_len);
    if (strcmp(method, "POST") != 0) curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
}

/* ---- handle reuse -------------------------------------------------------------------------- */
/*
 * Setting up a handle is most of what starting a request costs in C: curl_easy_reset and some
 * twenty options, several copied by curl. A *plain* request (no body, no fresh connection, no
 * no_resend, no resolve list: a GET, HEAD or DELETE as the API client makes them) records on
 * its handle what it set (easy_setup), and the next plain request that asks for the same
 * method, timeouts, encoding, connection choices and CA files keeps all of it and sets only its
 * URL (when it is another URL), plus the pointers to itself when the handle last served another
 * request struct, plus the header list when it is another list. Any other request resets the handle
 * and sets everything (easy_setup_all), as does a plain one after a failed transfer, an aborted
 * one, or one that opened a connection (curl counts its silent retries on the handle until a reset;
 * every retry opens a connection, so a kept handle never carries a count). libcurl supports reusing
 * a handle this way; it is what a curl_easy_perform loop does.
 */

/* Takes a handle from the pool, or a new one; NULL when out of memory. */
static pooled_easy *easy_take(http_client *c)
{
    if (c->npool > 0) return c->pool[--c->npool];
    pooled_easy *pe = (pooled_easy *)calloc(1, sizeof *pe);
    if (!pe) return NULL;
    pe->curl = curl_easy_init();
    if (!pe->curl) {
        free(pe);
        return NULL;
    }
    return pe;
}

static void easy_destroy(pooled_easy *pe)
{
    curl_easy_cleanup(pe->curl);
    free(pe->url);
    free(pe);
}

/* Sets CURLOPT_URL unless the handle has exactly this URL already: curl starts every transfer
 * from the URL set, so a request polling one URL need not have curl copy it each time. */
static void easy_set_url(pooled_easy *pe, const char *url)
{
    if (pe->has_url && strcmp(pe->url, url) == 0) return;
    curl_easy_setopt(pe->curl, CURLOPT_URL, url);
    size_t n = strlen(url) + 1;
    pe->has_url = 0;
    if (n > pe->url_cap) {
        char *p = (char *)realloc(pe->url, n);
        if (!p) return; /* not remembered: the next request sets its URL again */
        pe->url = p;
        pe->url_cap = n;
    }
    memcpy(pe->url, url, n);
    pe->has_url = 1;
}

/* The options that point at the request: its struct for the callbacks, its error buffer. */
static void easy_point_at(CURL *e, http_request *r)
{
    curl_easy_setopt(e, CURLOPT_PRIVATE, (char *)r);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, r->errbuf);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, r);
}

/* Whether s (or NULL) fits a setup field of n bytes; a request whose strings do not is not
 * recorded (nothing is cut). */
static int setup_fits(const char *s, size_t n)
{
    return !s || strlen(s) < n;
}

/* Whether spec is a plain request whose setup fits in an easy_setup. */
static int setup_plain(const http_request_spec *spec, const char *method, const conn_choice *ch)
{
    const easy_setup *s = NULL;
    return !spec->has_body && !spec->body_file && !spec->fresh_connect && !spec->no_resend &&
           !spec->resolve && setup_fits(method, sizeof s->method) &&
           setup_fits(spec->accept_encoding, sizeof s->encoding) &&
           setup_fits(ch->ca, sizeof s->ca) && setup_fits(ch->cadir, sizeof s->cadir);
}

static int setup_same_str(const char *field, const char *s)
{
    return strcmp(field, s ? s : "") == 0;
}

/* Whether the handle's recorded setup is what the plain request spec would set. */
static int setup_matches(const easy_setup *s, const http_request_spec *spec, const char *method,
                         const conn_choice *ch)
{
    return s->reusable && s->connect_timeout_ms == spec->connect_timeout_ms &&
           s->timeout_ms == spec->timeout_ms && s->idle_timeout_ms == spec->idle_timeout_ms &&
           s->tls == ch->tls && s->no_proxy == ch->no_proxy &&
           s->has_encoding == (spec->accept_encoding != NULL) &&
           setup_same_str(s->method, method) &&
           setup_same_str(s->encoding, spec->accept_encoding) && setup_same_str(s->ca, ch->ca) &&
           setup_same_str(s->cadir, ch->cadir);
}

/* Records what easy_setup_all set for the plain request spec (setup_plain said it fits). */
static void setup_record(easy_setup *s, const http_request_spec *spec, const char *method,
                         const conn_choice *ch)
{
    s->reusable = 1;
    s->connect_timeout_ms = spec->connect_timeout_ms;
    s->timeout_ms = spec->timeout_ms;
    s->idle_timeout_ms = spec->idle_timeout_ms;
    s->tls = ch->tls;
    s->no_proxy = ch->no_proxy;
    s->has_encoding = spec->accept_encoding != NULL;
    copy_cut(s->method, sizeof s->method, method);
    copy_cut(s->encoding, sizeof s->encoding, spec->accept_encoding ? spec->accept_encoding : "");
    copy_cut(s->ca, sizeof s->ca, ch->ca ? ch->ca : "");
    copy_cut(s->cadir, sizeof s->cadir, ch->cadir ? ch->cadir : "");
}

/* Sets every option of request r on the clean handle e except the header list: URL,
 * callbacks, timeouts, idle cut-off, encoding, the connection rule (fresh_connect, no_resend,
 * resolve: connection_use as chosen in ch) and the body (none, a copy in memory, or streamed
 * from body_file; an empty POST, PUT or PATCH still sends Content-Length: 0). Returns 0, or -1
 * with a message in err (what it allocated stays on r for http_request_free). */
static int easy_setup_all(http_client *c, http_request *r, CURL *e, const http_request_spec *spec,
                          const char *method, const conn_choice *ch, char *err, size_t errlen)
{
    easy_set_url(r->pe, spec->url);
    easy_point_at(e, r);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, header_cb);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, write_cb);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    if (spec->connect_timeout_ms > 0)
        curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, spec->connect_timeout_ms);
    if (spec->timeout_ms > 0) curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, spec->timeout_ms);
    if (spec->idle_timeout_ms > 0) {
        curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
        curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, (spec->idle_timeout_ms + 999) / 1000);
    }
    if (spec->accept_encoding) curl_easy_setopt(e, CURLOPT_ACCEPT_ENCODING, spec->accept_encoding);
    /* libcurl silently re-sends a request, POSTs included, when a reused keep-alive connection
     * dies before any reply byte. A request that must never be sent twice (a create) asks for
     * a connection of its own, which curl does not retry. */
    if (spec->fresh_connect) curl_easy_setopt(e, CURLOPT_FRESH_CONNECT, 1L);
    if (connection_use(c, r, e, spec, ch, err, errlen) < 0) return -1;

    if (strcmp(method, "HEAD") == 0) {
        curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    } else if (spec->body_file) {
        r->in_file = fopen(spec->body_file, "rb");
        if (!r->in_file) {
            snprintf(err, errlen, "cannot open request body file %s: %s", spec->body_file,
                     strerror(errno));
            return -1;
        }
        fseek(r->in_file, 0, SEEK_END);
        long size = ftell(r->in_file);
        fseek(r->in_file, 0, SEEK_SET);
        curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
        curl_easy_setopt(e, CURLOPT_READFUNCTION, read_cb);
        curl_easy_setopt(e, CURLOPT_READDATA, r);
        curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t)size);
        curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
    } else if (spec->has_body) {
        r->body_copy = (char *)malloc(spec->body_len ? spec->body_len : 1);
        if (!r->body_copy) {
            snprintf(err, errlen, "out of memory copying the request body");
            return -1;
        }
        memcpy(r->body_copy, spec->body, spec->body_len);
        set_body(r, e, spec, method);
    } else if (strcmp(method, "GET") != 0) {
        curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
        if (strcmp(method, "POST") == 0 || strcmp(method, "PUT") == 0 ||
            strcmp(method, "PATCH") == 0) {
            /* An empty body still needs Content-Length: 0 for many servers. */
            curl_easy_setopt(e, CURLOPT_POSTFIELDS, "");
            curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)0);
        }
    }
    return 0;
}

/* ---- requests -------------------------------------------------------------------------------- */

static void unlink_pending(http_request *r)
{
    if (!r->is_pending) return;
    http_request **pp = &r->c->pending;
    while (*pp && *pp != r)
        pp = &(*pp)->next_pending;
    if (*pp) *pp = r->next_pending;
    r->is_pending = 0;
}

/* Starts one request on client c as spec says (the spec's strings are copied or used before
 * this returns: the caller may free them): takes an easy handle from the pool, sets its
 * options (all of them with easy_setup_all, or only the URL and what changed when the handle
 * already carries this plain request's setup: "handle reuse"), the headers and the output file,
 * then adds it to the multi handle. Nothing is sent before the loop runs. notify(r, ud, events) is
 * later called from the loop (never from inside curl) with HTTP_EV_HEADERS, HTTP_EV_DATA and
 * HTTP_EV_DONE. Returns the request, owned by the caller until http_request_free; or NULL with
 * a one-line message in err (at most errlen bytes, NUL-terminated) and nothing left allocated
 * or registered. Does not block. */
http_request *http_request_start(http_client *c, const http_request_spec *spec,
                                 http_notify_fn notify, void *ud, char *err, size_t errlen)
{
    http_request *r = req_alloc(c);
    if (!r) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    r->c = c;
    c->refs++;
    r->notify = notify;
    r->ud = ud;
    r->stream = spec->stream;
    r->stream_cap = spec->stream_buffer ? spec->stream_buffer : 64 * 1024;
    r->max_body = spec->max_body;
    const char *method = spec->method ? spec->method : "GET";

    pooled_easy *pe = easy_take(c);
    if (!pe) {
        snprintf(err, errlen, "curl_easy_init failed");
        http_request_free(r);
        return NULL;
    }
    r->pe = pe;
    r->easy = pe->curl;
    CURL *e = r->easy;
    conn_choice ch;
    connection_choose(r, spec, &ch);
    int plain = setup_plain(spec, method, &ch);
    if (plain && setup_matches(&pe->setup, spec, method, &ch)) {
        easy_set_url(pe, spec->url);
        if (pe->setup.owner != r) easy_point_at(e, r);
    } else {
        if (pe->dirty) curl_easy_reset(e);
        pe->dirty = 1;
        pe->has_url = 0;
        pe->setup.reusable = 0;
        pe->setup.headers = NULL;
        if (easy_setup_all(c, r, e, spec, method, &ch, err, errlen) < 0) {
            http_request_free(r);
            return NULL;
        }
        if (plain) setup_record(&pe->setup, spec, method, &ch);
    }
    pe->setup.owner = r;

    if (set_headers(r, spec->headers, expect_line(spec)) != 0) {
        snprintf(err, errlen, "out of memory building request headers");
        http_request_free(r);
        return NULL;
    }
    if (pe->setup.headers != r->headers_out) {
        curl_easy_setopt(e, CURLOPT_HTTPHEADER, r->headers_out);
        pe->setup.headers = r->headers_out;
    }

    if (spec->output_file) {
        r->out_file = fopen(spec->output_file, "wb");
        if (!r->out_file) {
            snprintf(err, errlen, "cannot open output file %s: %s", spec->output_file,
                     strerror(errno));
            http_request_free(r);
            return NULL;
        }
    }

    CURLMcode mc = curl_multi_add_handle(c->multi, e);
    if (mc != CURLM_OK) {
        snprintf(err, errlen, "curl_multi_add_handle: %s", curl_multi_strerror(mc));
        http_request_free(r);
        return NULL;
    }
    r->in_multi = 1;
    c->inflight++;
    cache_fit(c);
    return r;
}

void http_request_free(http_request *r)
{
    if (!r) return;
    http_client *c = r->c;
    unlink_pending(r);
    if (r->pe) {
        if (r->in_multi) {
            curl_multi_remove_handle(c->multi, r->easy);
            request_left_multi(r);
            r->pe->setup.reusable = 0; /* aborted midway */
        }
        pool_put(c, r);
    }
    if (r->in_file) fclose(r->in_file);
    if (r->out_file) fclose(r->out_file);
    curl_slist_free_all(r->resolve);
    r->resolve = NULL;
    free(r->body_copy);
    req_recycle(c, r);
    client_release(c);
}

int http_request_done(const http_request *r)
{
    return r->done;
}

int http_request_headers_done(const http_request *r)
{
    return r->headers_done;
}

enum http_result http_request_result(const http_request *r)
{
    return r->result;
}

const char *http_request_error(const http_request *r)
{
    return r->message;
}

long http_request_status(const http_request *r)
{
    return r->status;
}

int http_request_http_version(const http_request *r)
{
    return r->http_version;
}

const char *http_request_primary_ip(const http_request *r)
{
    return r->primary_ip;
}

size_t http_request_header_count(const http_request *r)
{
    return r->nhdrs;
}

void http_request_header(const http_request *r, size_t i, const char **name, size_t *name_len,
                         const char **value, size_t *value_len)
{
    const header *h = &r->hdrs[i];
    *name = r->hbuf + h->name_off;
    *name_len = h->name_len;
    *value = r->hbuf + h->value_off;
    *value_len = h->value_len;
}

const char *http_request_body(const http_request *r, size_t *len)
{
    *len = r->len;
    return r->buf ? r->buf : "";
}

const char *http_request_peek(const http_request *r, size_t *len)
{
    *len = r->len - r->off;
    return r->buf ? r->buf + r->off : "";
}

void http_request_consume(http_request *r, size_t n)
{
    size_t held = r->len - r->off;
    if (n > held) n = held;
    r->off += n;
    if (r->off == r->len) r->off = r->len = 0;
    if (r->paused && r->len - r->off <= r->stream_cap / 2 && r->easy) {
        r->paused = 0;
        /* May call write_cb at once with the bytes curl held back; that only buffers. */
        curl_easy_pause(r->easy, CURLPAUSE_CONT);
        deliver_pending(r->c);
    }
}

size_t http_request_peak_buffered(const http_request *r)
{
    return r->peak;
}

unsigned long http_request_pauses(const http_request *r)
{
    return r->pauses;
}
