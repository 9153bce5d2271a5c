/* pg.c - one PostgreSQL connection on the libev loop (see pg.h for the contract). */
#include "pg.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct pg_conn {
    struct ev_loop *loop;
    PGconn *conn;
    int state;   /* enum pg_state */
    int polling; /* connect: what PQconnectPoll last asked for */
    int flushed; /* query: everything sent */
    ev_io io;
    int io_fd; /* the fd io is set up for, or -1 */
    ev_timer timer;
    pg_done_fn done;
    void *ud;
    PGresult *result;
    char err[512];
};

static void set_error(pg_conn *c, const char *msg)
{
    snprintf(c->err, sizeof c->err, "%s", msg && *msg ? msg : "the connection failed");
    size_t n = strlen(c->err); /* libpq ends its messages with a newline */
    while (n > 0 && (c->err[n - 1] == '\n' || c->err[n - 1] == ' '))
        c->err[--n] = '\0';
}

static void stop_watchers(pg_conn *c)
{
    if (c->io_fd >= 0) ev_io_stop(c->loop, &c->io);
    ev_timer_stop(c->loop, &c->timer);
}

/* Watches the connection's socket for events (EV_READ / EV_WRITE). */
static void watch(pg_conn *c, int events)
{
    int fd = PQsocket(c->conn);
    if (c->io_fd >= 0) ev_io_stop(c->loop, &c->io);
    c->io_fd = fd;
    if (fd < 0) return;
    ev_io_set(&c->io, fd, events);
    ev_io_start(c->loop, &c->io);
}

/* The operation ended: stop watching and tell the owner once. */
static void finish(pg_conn *c, int state)
{
    stop_watchers(c);
    c->state = state;
    pg_done_fn done = c->done;
    c->done = NULL;
    if (done) done(c, c->ud);
}

static void fail(pg_conn *c, const char *msg)
{
    set_error(c, msg);
    finish(c, PG_BROKEN);
}

static void connect_step(pg_conn *c)
{
    PostgresPollingStatusType st = PQconnectPoll(c->conn);
    switch (st) {
    case PGRES_POLLING_READING:
        watch(c, EV_READ);
        break;
    case PGRES_POLLING_WRITING:
        watch(c, EV_WRITE);
        break;
    case PGRES_POLLING_OK:
        if (PQsetnonblocking(c->conn, 1) != 0) {
            fail(c, PQerrorMessage(c->conn));
            return;
        }
        finish(c, PG_READY);
        break;
    default:
        fail(c, PQerrorMessage(c->conn));
        break;
    }
}

/* Reads what the server sent; ends the query when its last result is in. */
static void query_read(pg_conn *c)
{
    if (!PQconsumeInput(c->conn)) {
        fail(c, PQerrorMessage(c->conn));
        return;
    }
    while (!PQisBusy(c->conn)) {
        PGresult *r = PQgetResult(c->conn);
        if (!r) {
            finish(c, PQstatus(c->conn) == CONNECTION_OK ? PG_READY : PG_BROKEN);
            return;
        }
        /* Keep the first error, else the last result. */
        if (c->result && PQresultStatus(c->result) == PGRES_FATAL_ERROR) {
            PQclear(r);
        } else {
            if (c->result) PQclear(c->result);
            c->result = r;
        }
    }
    if (PQstatus(c->conn) != CONNECTION_OK) fail(c, PQerrorMessage(c->conn));
}

static void query_step(pg_conn *c, int revents)
{
    if (!c->flushed) {
        int f = PQflush(c->conn);
        if (f < 0) {
            fail(c, PQerrorMessage(c->conn));
            return;
        }
        if (f == 0) {
            c->flushed = 1;
            watch(c, EV_READ);
        }
        /* f == 1: keep waiting until it can write (and read what the server says meanwhile) */
    }
    if (revents & EV_READ) query_read(c);
}

static void io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    pg_conn *c = (pg_conn *)w->data;
    (void)loop;
    if (c->state == PG_CONNECTING)
        connect_step(c);
    else if (c->state == PG_BUSY)
        query_step(c, revents);
}

static void timer_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    pg_conn *c = (pg_conn *)w->data;
    (void)loop;
    (void)revents;
    if (c->state == PG_CONNECTING) fail(c, "the connect timed out");
}

static void ignore_notice(void *arg, const char *message)
{
    (void)arg;
    (void)message;
}

pg_conn *pg_conn_start(struct ev_loop *loop, const char *conninfo, pg_done_fn done, void *ud)
{
    pg_conn *c = (pg_conn *)calloc(1, sizeof *c);
    if (!c) return NULL;
    c->loop = loop;
    c->io_fd = -1;
    c->done = done;
    c->ud = ud;
    ev_init(&c->io, io_cb);
    c->io.data = c;
    ev_timer_init(&c->timer, timer_cb, PG_CONNECT_TIMEOUT, 0);
    c->timer.data = c;
    c->state = PG_CONNECTING;
    c->conn = PQconnectStart(conninfo);
    if (!c->conn) {
        free(c);
        return NULL;
    }
    /* Server notices (e.g. "already exists, skipping") are not errors: nothing prints them. */
    PQsetNoticeProcessor(c->conn, ignore_notice, NULL);
    if (PQstatus(c->conn) == CONNECTION_BAD) {
        set_error(c, PQerrorMessage(c->conn));
        c->state = PG_BROKEN;
        c->done = NULL;
        done(c, ud);
        return c;
    }
    ev_timer_start(loop, &c->timer);
    /* Until the socket says otherwise, it is ready to be written (libpq's documented start). */
    watch(c, EV_WRITE);
    if (c->io_fd < 0) fail(c, PQerrorMessage(c->conn));
    return c;
}

int pg_conn_send(pg_conn *c, const char *sql, int nparams, const char *const *values,
                 pg_done_fn done, void *ud)
{
    if (c->state != PG_READY) {
        if (!c->err[0]) set_error(c, "the connection is not ready");
        return -1;
    }
    if (c->result) {
        PQclear(c->result);
        c->result = NULL;
    }
    if (!PQsendQueryParams(c->conn, sql, nparams, NULL, values, NULL, NULL, 0)) {
        set_error(c, PQerrorMessage(c->conn));
        c->state = PG_BROKEN;
        return -1;
    }
    c->done = done;
    c->ud = ud;
    c->flushed = 0;
    c->state = PG_BUSY;
    watch(c, EV_READ | EV_WRITE);
    return 0;
}

PGresult *pg_conn_take_result(pg_conn *c)
{
    PGresult *r = c->result;
    c->result = NULL;
    return r;
}

int pg_conn_state(const pg_conn *c)
{
    return c->state;
}

const char *pg_conn_error(const pg_conn *c)
{
    return c->err;
}

void pg_conn_wait(pg_conn *c)
{
    while (c->state == PG_CONNECTING || c->state == PG_BUSY) {
        int fd = PQsocket(c->conn);
        if (fd < 0) {
            fail(c, PQerrorMessage(c->conn));
            return;
        }
        int events = c->io_fd >= 0 ? c->io.events : EV_READ;
        struct pollfd p = {.fd = fd, .events = 0};
        if (events & EV_READ) p.events |= POLLIN;
        if (events & EV_WRITE) p.events |= POLLOUT;
        int n = poll(&p, 1, c->state == PG_CONNECTING ? (int)(PG_CONNECT_TIMEOUT * 1000) : -1);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            fail(c, n == 0 ? "the connect timed out" : strerror(errno));
            return;
        }
        int revents = 0;
        if (p.revents & (POLLIN | POLLERR | POLLHUP)) revents |= EV_READ;
        if (p.revents & POLLOUT) revents |= EV_WRITE;
        io_cb(c->loop, &c->io, revents);
    }
}

void pg_conn_abandon(pg_conn *c)
{
    stop_watchers(c);
    c->done = NULL;
    if (c->state != PG_BROKEN) set_error(c, "the operation was abandoned");
    c->state = PG_BROKEN;
    /* Close at once: the server sees the socket close and stops working for us (a cancel
     * request would be a blocking connect of its own). */
    if (c->conn) PQfinish(c->conn);
    c->conn = NULL;
    c->io_fd = -1;
}

void pg_conn_free(pg_conn *c)
{
    if (!c) return;
    stop_watchers(c);
    if (c->result) PQclear(c->result);
    if (c->conn) PQfinish(c->conn);
    free(c);
}
