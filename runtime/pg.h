/* pg.h - one PostgreSQL connection (libpq) driven by the libev loop, never blocking it.
 *
 * Owns one PGconn from the start of its connect to its end, the ev_io watcher on its socket and
 * a connect timer. One operation runs at a time: the connect (PQconnectStart, then
 * PQconnectPoll whenever the socket is ready as it asked) or one query (PQsendQueryParams with
 * text parameters, flushed as the socket takes it, its results gathered with PQconsumeInput /
 * PQisBusy / PQgetResult). When the operation ends, the owner's done function is called once,
 * from the watcher callback; it only records and wakes (the owner decides what it means).
 *
 * A connection that fails or is abandoned in the middle of an operation is BROKEN: the owner
 * frees it and starts a new one (nothing here reconnects on its own). pg_conn_wait() runs the
 * current operation to its end with poll(2) instead of the loop, for the one place where no
 * task can wait (a process closing its database after its loop stopped).
 *
 * Single-threaded: call everything from the thread that runs the loop. No Lua here.
 */
#ifndef MOONBOX_PG_H
#define MOONBOX_PG_H

#include <ev.h>
#include <libpq-fe.h>

typedef struct pg_conn pg_conn;
typedef void (*pg_done_fn)(pg_conn *c, void *ud);

enum pg_state {
    PG_CONNECTING = 1, /* the connect is under way */
    PG_READY,          /* connected and idle */
    PG_BUSY,           /* a query is under way */
    PG_BROKEN,         /* failed or abandoned: only pg_conn_free remains */
};

#define PG_CONNECT_TIMEOUT 10.0 /* seconds a connect may take before it counts as failed */

/* Starts connecting with conninfo (a URL or key=value text) on loop; done(c, ud) runs when the
 * connect ends either way (see pg_conn_state). Returns NULL only when out of memory. */
pg_conn *pg_conn_start(struct ev_loop *loop, const char *conninfo, pg_done_fn done, void *ud);

/* Sends sql with nparams text parameters (NULL entries are SQL NULL); done(c, ud) runs when its
 * results are in. Returns 0, or -1 when the connection is not READY or the send failed (then the
 * connection is BROKEN and pg_conn_error says why). */
int pg_conn_send(pg_conn *c, const char *sql, int nparams, const char *const *values,
                 pg_done_fn done, void *ud);

/* The result of the query that ended (the last one the server sent, or its first error); the
 * caller owns it (PQclear). NULL when the connection broke before a result came. */
PGresult *pg_conn_take_result(pg_conn *c);

int pg_conn_state(const pg_conn *c);
/* Why the connection failed: libpq's text, or ours (timeout); "" when it did not. */
const char *pg_conn_error(const pg_conn *c);

/* Runs the current operation to its end with poll(2), not the loop (done still runs). */
void pg_conn_wait(pg_conn *c);

/* Stops the current operation: its done will not run; the connection is closed at once and
 * becomes BROKEN (only pg_conn_free remains). */
void pg_conn_abandon(pg_conn *c);

/* Closes the connection and frees everything. */
void pg_conn_free(pg_conn *c);

#endif
