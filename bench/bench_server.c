/*
 * bench_server.c — the loopback HTTP server every benchmark client talks to: libmicrohttpd with
 * its own epoll thread, answering every request with a fixed small body ("ok\n") and keep-alive.
 * It is a fixed point outside the measured processes, so each client's CPU and memory are its
 * own. Usage: bench_server PORT_FILE (writes the chosen port there, then serves until killed).
 * GET /_conns answers the number of connections accepted so far, not counting the one asking,
 * and starts the count again: how many connections a client needed for its requests.
 */
#include <microhttpd.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct MHD_Response *g_ok;
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
