/* store.h - SQLite for moonbox's own state: the ledger, schedules, the local backend's database.
 *
 * Owns one SQLite connection and the prepared statements made on it. A connection is opened the
 * same way every time: the file created with mode 0600 when missing (state holds secrets), WAL
 * journal, foreign_keys=ON, synchronous=NORMAL and a busy timeout. Statements are prepared once
 * per distinct SQL text and kept in a bounded LRU cache, so a query run in a loop is parsed once.
 *
 * A statement is lent out by store_prepare() and given back by store_release(); while lent it is
 * out of the cache, so two users of the same SQL text (a cursor still open while the same query
 * runs again) each get their own statement. store_close() finalizes every statement, lent or
 * cached: after it, no store_stmt pointer of that store may be used.
 *
 * Functions return STORE_OK (0), STORE_ROW / STORE_DONE from store_step(), or a negative
 * STORE_ERR_* class, with a readable message in the caller's buffer. Nothing here exits or
 * aborts. Single-threaded: one store belongs to one thread (the loop's). No Lua here: bindings/
 * wraps it as moonbox.store.
 */
#ifndef MOONBOX_STORE_H
#define MOONBOX_STORE_H

#include <stddef.h>
#include <stdint.h>

typedef struct store store;
typedef struct store_stmt store_stmt;

#define STORE_OK   0
#define STORE_ROW  1 /* store_step: a row is ready to be read */
#define STORE_DONE 2 /* store_step: the statement has run to completion */

#define STORE_ERR_CONSTRAINT (-1) /* SQLITE_CONSTRAINT and its extended codes */
#define STORE_ERR_BUSY       (-2) /* SQLITE_BUSY / SQLITE_LOCKED: another connection holds a lock */
#define STORE_ERR_SQLITE     (-3) /* any other SQLite failure (syntax, I/O, out of memory, ...) */
#define STORE_ERR_MISUSE     (-4) /* the caller's mistake: empty SQL, several statements, NUL */

#define STORE_DEFAULT_BUSY_TIMEOUT_MS 5000
#define STORE_DEFAULT_STATEMENT_CACHE 64

typedef struct store_options {
    int busy_timeout_ms; /* how long a statement waits for another connection's lock */
    int statement_cache; /* prepared statements kept for reuse; 0 disables the cache */
} store_options;

/* Column and parameter value types, mirroring SQLite's storage classes. */
typedef enum store_type {
    STORE_NULL = 0,
    STORE_INTEGER,
    STORE_REAL,
    STORE_TEXT,
    STORE_BLOB
} store_type;

/* One value going in (store_bind) or coming out (store_column). For TEXT and BLOB, p/len are
 * the bytes (not NUL-terminated as far as the caller may assume; embedded NULs are kept). */
typedef struct store_value {
    store_type type;
    int64_t i;
    double d;
    const char *p;
    size_t len;
} store_value;

/* Counters for tests and diagnostics. */
typedef struct store_stats {
    long cached;   /* statements in the cache now */
    long lent;     /* statements lent out and not yet released */
    long prepares; /* statements compiled since open (cache misses) */
    long hits;     /* store_prepare calls served from the cache */
} store_stats;

/* Fills opts with the defaults above. */
void store_options_init(store_options *opts);

/* Opens (creating when missing) the database at path, or a private in-memory database for
 * ":memory:", and applies the connection settings described at the top of this file. A missing
 * file is created with mode 0600 before SQLite sees it; the -wal and -shm files SQLite adds
 * later take the database file's mode. A relative path starting with "file:" is still a plain
 * file name (SQLite would read it as a URI). opts may be NULL for the defaults. On success
 * stores the handle in *out and returns STORE_OK; on failure returns a STORE_ERR_* class, leaves
 * *out NULL and writes the reason into err. */
int store_open(store **out, const char *path, const store_options *opts, char *err, size_t errlen);

/* Finalizes every statement (cached or lent) and closes the connection; an open transaction is
 * rolled back by SQLite. db may be NULL. Never fails from the caller's point of view: a close
 * that SQLite refuses cannot happen once every statement is finalized. */
void store_close(store *db);

/* Runs a script of zero or more statements, with no parameters, each to completion; rows are
 * discarded. Stops at the first failing statement: the ones before it stay applied (wrap the
 * script in a transaction to make it all or nothing) and *failed_at, when not NULL, receives the
 * byte offset in sql where the failing statement starts. Statements are not cached. */
int store_exec(store *db, const char *sql, size_t len, size_t *failed_at, char *err, size_t errlen);

/* Lends out a prepared statement for exactly one SQL statement: from the cache when the same text
 * was prepared before (O(cache size) hash compares; a hash table would save a few dozen integer
 * compares per call, noise next to sqlite3_step), else compiled now. Text holding no statement,
 * more than one statement, or a NUL byte is STORE_ERR_MISUSE. The statement must go back
 * through store_release() (or die with store_close()). */
int store_prepare(store *db, const char *sql, size_t len, store_stmt **out, char *err,
                  size_t errlen);

/* Resets the statement, clears its bindings and puts it back at the front of the cache,
 * finalizing the least recently used statement when the cache is over its bound (or this one,
 * when an equal statement was cached while it was lent out). s may be NULL. */
void store_release(store_stmt *s);

/* Number of the highest parameter index (SQLite numbers parameters from 1). */
int store_param_count(store_stmt *s);
/* Name of parameter idx including its prefix (":a", "@a", "$a", "?3"), or NULL for a plain "?". */
const char *store_param_name(store_stmt *s, int idx);

/* Binds v to parameter idx (1-based). TEXT and BLOB bytes are copied, so the caller's buffer
 * need not outlive the call. */
int store_bind(store_stmt *s, int idx, const store_value *v, char *err, size_t errlen);

/* Runs the statement to its next row: STORE_ROW, STORE_DONE, or a STORE_ERR_* class. After an
 * error the statement must be released; stepping it again is not meaningful. */
int store_step(store_stmt *s, char *err, size_t errlen);

/* Shape and values of the current row (valid after STORE_ROW until the next step/release). */
int store_column_count(store_stmt *s);
const char *store_column_name(store_stmt *s, int i);
/* Fills v with column i of the current row. TEXT/BLOB pointers stay valid until the next step,
 * reset or release of s. */
void store_column(store_stmt *s, int i, store_value *v);

/* The SQL text the statement was prepared from (as given, not NUL-terminated) and its length. */
const char *store_stmt_sql(store_stmt *s, size_t *len);

/* Rows changed by the most recent INSERT/UPDATE/DELETE, the connection's total changed rows
 * since open, and the rowid of its most recent successful INSERT. */
int64_t store_changes(store *db);
int64_t store_total_changes(store *db);
int64_t store_last_insert_rowid(store *db);

/* Non-zero while a transaction is open on the connection (BEGIN without COMMIT/ROLLBACK yet). */
int store_in_transaction(store *db);

/* SQLite's extended result code of the most recent failure reported by this store. */
int store_last_sqlite_code(store *db);

/* Copies the current statistics into *st. */
void store_get_stats(store *db, store_stats *st);

/* Writes a one-line excerpt of sql into buf: runs of whitespace become one space, leading
 * whitespace is dropped, and at most max_chars characters are kept (cut on a UTF-8 character
 * boundary) with "..." appended when something was cut. buf is always NUL-terminated. */
void store_sql_excerpt(const char *sql, size_t len, size_t max_chars, char *buf, size_t buflen);

#endif
