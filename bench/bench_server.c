/*
 * bench_server.c — the loopback HTTP server every benchmark client talks to: libmicrohttpd with
 * its own epoll thread, answering every request with a fixed small body ("ok\n") and keep-alive.
 * It is a fixed point outside the measured processes, so each client's CPU and memory are its
 * own. Usage: bench_server PORT_FILE (writes the chosen port there, then serves until killed).
 * GET /_conns answers the number of connections accepted so far, not counting the one asking,
 * and starts the count again: how many connections a client needed for its requests.
 * GET /_exec?mib=N answers an exec stream as Render sends it: N MiB of `yes`-style output in
 * 64 KiB `output` events (JSON-escaped once, at start-up), then `exit` — the client side of the
 * exec output path at full speed, with no sandbox and no backend behind it.
 */
#include <microhttpd.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct MHD_Response *g_ok;
static char *g_event; /* one 64 KiB output event, SSE-framed */
static size_t g_event_len;

#define EXEC_CHUNK (64 * 1024)

static void build_event(void)
{
    static const char line[] = "0123456789abcdefghijklmnopqrstuvwxyz\n";
    static const char head[] = "event: output\ndata: {\"stream\":\"stdout\",\"data\":\"";
    static const char tail[] = "\"}\n\n";
    g_event = malloc(sizeof head + 2 * EXEC_CHUNK + sizeof tail);
    size_t n = 0;
    memcpy(g_event, head, sizeof head - 1);
    n = sizeof head - 1;
    for (size_t i = 0; i < EXEC_CHUNK; i++) {
        char c = line[i % (sizeof line - 1)];
        if (c == '\n') {
            g_event[n++] = '\\';
            g_event[n++] = 'n';
        } else {
            g_event[n++] = c;
        }
    }
    memcpy(g_event + n, tail, sizeof tail - 1);
    g_event_len = n + sizeof tail - 1;
}

typedef struct exec_stream {
    long events_left;
    size_t off; /* into the current event, or into the exit event once events_left is 0 */
} exec_stream;

static ssize_t exec_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    static const char exit_ev[] = "event: exit\ndata: {\"exit_code\":0}\n\n";
    exec_stream *st = cls;
    (void)pos;
    size_t n = 0;
    while (n < max) {
        const char *src = st->events_left > 0 ? g_event : exit_ev;
        size_t len = st->events_left > 0 ? g_event_len : sizeof exit_ev - 1;
        if (st->events_left == 0 && st->off == len) break;
        size_t k = len - st->off < max - n ? len - st->off : max - n;
        memcpy(buf + n, src + st->off, k);
        n += k;
        st->off += k;
        if (st->off == len && st->events_left > 0) {
            st->events_left--;
            st->off = 0;
        }
    }
    return n > 0 ? (ssize_t)n : MHD_CONTENT_READER_END_OF_STREAM;
}
static atomic_long g_conns;

static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode code)
{
    (void)cls;
    (void)conn;
    (void)socket_ctx;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) atomic_fetch_add(&g_conns, 1);
}

static enum MHD_Result answer(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_data_size, void **con_cls)
{
    (void)cls;
    (void)method;
    (void)version;
    (void)upload_data;
    if (*upload_data_size) { /* discard request bodies */
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (!*con_cls) { /* first call: headers only */
        *con_cls = (void *)1;
        return MHD_YES;
    }
    if (strcmp(url, "/_exec") == 0) {
        const char *mib = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "mib");
        exec_stream *st = calloc(1, sizeof *st);
        st->events_left = (mib ? atol(mib) : 1) * 1024 * 1024 / EXEC_CHUNK;
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 256 * 1024, exec_reader, st, free);
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        return ret;
    }
    if (strcmp(url, "/_conns") == 0) {
        char text[32];
        long n = atomic_exchange(&g_conns, 0) - 1; /* the asker, counted already, is not */
        int len = snprintf(text, sizeof text, "%ld\n", n);
        struct MHD_Response *r =
            MHD_create_response_from_buffer((size_t)len, text, MHD_RESPMEM_MUST_COPY);
        enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        return ret;
    }
    return MHD_queue_response(conn, MHD_HTTP_OK, g_ok);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: bench_server PORT_FILE\n");
        return 2;
    }
    static const char body[] = "ok\n";
    build_event();
    g_ok = MHD_create_response_from_buffer(sizeof body - 1, (void *)body, MHD_RESPMEM_PERSISTENT);
    MHD_add_response_header(g_ok, "Content-Type", "text/plain");
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL, 0, NULL, NULL, answer, NULL,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned int)4000, MHD_OPTION_LISTEN_BACKLOG_SIZE,
        (unsigned int)4096, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)60,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, NULL, MHD_OPTION_END);
    if (!d) {
        fprintf(stderr, "bench_server: cannot start\n");
        return 1;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    FILE *f = fopen(argv[1], "w");
    if (!f) return 1;
    fprintf(f, "%u\n", (unsigned)info->port);
    fclose(f);
    for (;;)
        pause();
}
