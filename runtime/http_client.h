/*
 * http_client.h — HTTP requests on libcurl's multi interface, driven by a libev loop.
 *
 * One http_client owns a curl multi handle (and so the connection cache: keep-alive and
 * HTTP/2 multiplexing are reused across requests) plus one ev_io per socket and one ev_timer.
 * A request either collects its body (in memory or into a file) or streams it through a
 * bounded buffer that pauses the transfer when the consumer falls behind. Completion and data
 * are reported through a notify callback that must only record and schedule (it runs inside
 * libev callbacks, never inside curl's own callbacks).
 */
#ifndef HTTP_CLIENT_H
#define HTTP_CLIENT_H

#include <stddef.h>

#include <ev.h>

typedef struct http_client http_client;
typedef struct http_request http_request;

/* What went wrong with a transfer, coarse enough to decide on a retry. */
enum http_result {
    HTTP_OK = 0,
    HTTP_ERR_CONNECT,   /* refused, unreachable */
    HTTP_ERR_DNS,       /* name did not resolve */
    HTTP_ERR_TIMEOUT,   /* connect, total or idle timeout */
    HTTP_ERR_RESET,     /* connection closed or reset mid-transfer, empty reply */
    HTTP_ERR_MALFORMED, /* the server's reply is not valid HTTP */
    HTTP_ERR_TLS,       /* handshake or verification failed */
    HTTP_ERR_TOO_LARGE, /* body exceeded max_body */
    HTTP_ERR_FILE,      /* body_file / output_file could not be read or written */
    HTTP_ERR_BAD_URL,
    HTTP_ERR_CANCELLED,
    HTTP_ERR_OTHER,
};

/* http_request_spec.no_resend: libcurl never sends the request again once its body went out;
 * NO_RESEND also takes a connection of its own where the server does not multiplex, REUSE
 * never does (a rare lost race with a closing keep-alive connection then fails the request). */
enum { HTTP_NO_RESEND = 1, HTTP_NO_RESEND_REUSE = 2 };

/* Events passed to the notify callback (a bit set). */
enum { HTTP_EV_HEADERS = 1, HTTP_EV_DATA = 2, HTTP_EV_DONE = 4 };

typedef void (*http_notify_fn)(http_request *r, void *ud, int events);

typedef struct http_request_spec {
    const char *method; /* "GET", "POST", ...; NULL = GET */
    const char *url;
    const char *const *headers; /* "Name: value" lines, NULL-terminated; may be NULL */
    const char *body;           /* copied; may contain NUL bytes */
    size_t body_len;
    int has_body;
    const char *body_file;   /* stream the request body from this file instead */
    const char *output_file; /* write the response body here instead of memory */
    long connect_timeout_ms; /* 0 = libcurl's default (300 s) */
    long timeout_ms;         /* whole transfer; 0 = none */
    long idle_timeout_ms;    /* abort when no byte moves for this long; 0 = none */
    int stream;              /* deliver the body through http_request_peek/consume */
    size_t stream_buffer;    /* stream mode: pause above this many buffered bytes */
    size_t max_body;         /* memory mode: fail with HTTP_ERR_TOO_LARGE above this; 0 = no cap */
    const char *accept_encoding; /* e.g. "gzip"; NULL = send none, no decoding */
    int fresh_connect;           /* never on a reused connection (see http_request_start) */
    int no_resend; /* HTTP_NO_RESEND*: must not be sent twice (http_client.c "re-sends") */
    const char *const *resolve; /* CURLOPT_RESOLVE lines "host:port:address"; may be NULL */
} http_request_spec;

/* Creates a client on loop. Returns NULL with a message in err on failure. */
http_client *http_client_new(struct ev_loop *loop, char *err, size_t errlen);

/* Releases the client once every request started on it has been freed. */
void http_client_free(http_client *c);

/* Starts a request. notify(r, ud, events) is called from the loop as headers, data and
 * completion arrive. Returns NULL with a message in err when the request cannot start. */
http_request *http_request_start(http_client *c, const http_request_spec *spec,
                                 http_notify_fn notify, void *ud, char *err, size_t errlen);

/* Frees a request; a running transfer is aborted first and notify is never called again. */
void http_request_free(http_request *r);

int http_request_done(const http_request *r);
int http_request_headers_done(const http_request *r);
enum http_result http_request_result(const http_request *r);
/* A readable message for a failed request (empty when it succeeded). */
const char *http_request_error(const http_request *r);
/* The machine name of a result: "connect_failed", "timeout", ... */
const char *http_result_code(enum http_result res);
int http_result_retryable(enum http_result res);

long http_request_status(const http_request *r);
/* The HTTP version the final response came in: 10, 11, 20, 30, or 0 when none came. */
int http_request_http_version(const http_request *r);
/* The address the transfer's connection went to (e.g. "::1"), or "" when none is known. */
const char *http_request_primary_ip(const http_request *r);
size_t http_request_header_count(const http_request *r);
/* The i-th response header of the final response; name is lower-cased. */
void http_request_header(const http_request *r, size_t i, const char **name, size_t *name_len,
                         const char **value, size_t *value_len);

/* Memory mode: the collected body. */
const char *http_request_body(const http_request *r, size_t *len);

/* Stream mode: the buffered bytes not yet consumed, and consuming them (which resumes a paused
 * transfer once the buffer is below half its bound). */
const char *http_request_peek(const http_request *r, size_t *len);
void http_request_consume(http_request *r, size_t n);

/* Stream mode statistics: the most bytes ever buffered and how many times the transfer paused. */
size_t http_request_peak_buffered(const http_request *r);
unsigned long http_request_pauses(const http_request *r);

#endif
