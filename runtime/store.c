/* store.c - one SQLite connection with moonbox's settings and a bounded prepared-statement cache.
 *
 * Every statement of a store sits in exactly one of two lists: the cache (most recently used
 * first, bounded by statement_cache) or the lent list (handed out by store_prepare and not yet
 * released). Keeping lent statements on a list is what lets store_close finalize everything,
 * even a cursor a Lua loop abandoned, and so close the connection for real.
 *
 * Errors are classified into the few STORE_ERR_* classes callers act on (constraint, busy,
 * other); the SQLite extended code of the last failure stays available for diagnostics.
 */
#include "store.h"

#include "jsonq.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sqlite3.h>

typedef struct stmt_list {
    store_stmt *head, *tail;
    long n;
} stmt_list;

struct store_stmt {
    store *owner;
    sqlite3_stmt *stmt;
    char *sql; /* copy of the text: the cache key */
    size_t len;
    uint64_t hash;
    store_stmt *prev, *next; /* links in the owner's cache or lent list */
};

struct store {
    sqlite3 *db;
    stmt_list cache; /* most recently released first */
    stmt_list lent;
    int cache_cap;
    long prepares;
    long hits;
    int last_code;
};

static void set_err(char *err, size_t errlen, const char *msg)
{
    if (err && errlen) snprintf(err, errlen, "%s", msg);
}

static int classify(int rc)
{
    switch (rc & 0xff) {
    case SQLITE_CONSTRAINT:
        return STORE_ERR_CONSTRAINT;
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
        return STORE_ERR_BUSY;
    case SQLITE_MISUSE:
        return STORE_ERR_MISUSE;
    default:
        return STORE_ERR_SQLITE;
    }
}

/* Records a failure SQLite reported on the connection and returns its class. */
static int fail_sqlite(store *db, int rc, char *err, size_t errlen)
{
    db->last_code = rc;
    set_err(err, errlen, sqlite3_errmsg(db->db));
    return classify(rc);
}

static int fail_misuse(store *db, char *err, size_t errlen, const char *msg)
{
    db->last_code = SQLITE_MISUSE;
    set_err(err, errlen, msg);
    return STORE_ERR_MISUSE;
}

/* FNV-1a: cheap, and the cache compares length and bytes after a hash match anyway. */
static uint64_t sql_hash(const char *s, size_t len)
{
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ULL;
    }
    return h;
}

static void list_unlink(stmt_list *l, store_stmt *s)
{
    if (s->prev)
        s->prev->next = s->next;
    else
        l->head = s->next;
    if (s->next)
        s->next->prev = s->prev;
    else
        l->tail = s->prev;
    s->prev = s->next = NULL;
    l->n--;
}

static void list_push_front(stmt_list *l, store_stmt *s)
{
    s->prev = NULL;
    s->next = l->head;
    if (l->head)
        l->head->prev = s;
    else
        l->tail = s;
    l->head = s;
    l->n++;
}

static store_stmt *list_find(stmt_list *l, uint64_t hash, const char *sql, size_t len)
{
    for (store_stmt *s = l->head; s; s = s->next)
        if (s->hash == hash && s->len == len && memcmp(s->sql, sql, len) == 0) return s;
    return NULL;
}

static void stmt_free(store_stmt *s)
{
    sqlite3_finalize(s->stmt);
    free(s->sql);
    free(s);
}

void store_options_init(store_options *opts)
{
    opts->busy_timeout_ms = STORE_DEFAULT_BUSY_TIMEOUT_MS;
    opts->statement_cache = STORE_DEFAULT_STATEMENT_CACHE;
}

/* SQLite creates a missing file with mode 0644 minus the umask, and changing the umask is
 * process-wide; creating the file ourselves first is the only way to get 0600 without a window
 * in which the state is readable by others. */
static int create_private_file(const char *path, char *err, size_t errlen)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        set_err(err, errlen, strerror(errno));
        return STORE_ERR_SQLITE;
    }
    close(fd);
    return STORE_OK;
}

/* store.h has the caller's contract. Here: a missing file is made 0600 first
 * (create_private_file), a "file:" path is prefixed with "./" so SQLite never reads it as a URI,
 * the connection is opened without SQLite's mutex (one thread uses it), with extended result
 * codes and the busy timeout, and the pragmas (WAL, foreign keys, synchronous=NORMAL) run at
 * once: that first read is where "file is not a database" shows. Returns STORE_OK with *out, or
 * MISUSE (empty path) / the SQLite class (classify) with SQLite's message in err (at most errlen
 * bytes) and the connection closed. Blocks on the file (SQLite is synchronous), briefly. */
int store_open(store **out, const char *path, const store_options *opts, char *err, size_t errlen)
{
    store_options defaults;
    char *name = NULL;
    sqlite3 *h = NULL;
    int rc;

    *out = NULL;
    if (!opts) {
        store_options_init(&defaults);
        opts = &defaults;
    }
    if (!path || !*path) {
        set_err(err, errlen, "the path is empty");
        return STORE_ERR_MISUSE;
    }
    int in_memory = strcmp(path, ":memory:") == 0;
    if (!in_memory) {
        rc = create_private_file(path, err, errlen);
        if (rc != STORE_OK) return rc;
    }
    /* Debian's SQLite is built with URI file names on, so "file:x" would be parsed as a URI;
     * "./file:x" names the same file and is never a URI. */
    size_t plen = strlen(path);
    name = malloc(plen + 3);
    if (!name) {
        set_err(err, errlen, "out of memory");
        return STORE_ERR_SQLITE;
    }
    if (strncmp(path, "file:", 5) == 0)
        snprintf(name, plen + 3, "./%s", path);
    else
        memcpy(name, path, plen + 1);

    rc = sqlite3_open_v2(name, &h, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                         NULL);
    free(name);
    if (rc != SQLITE_OK) {
        set_err(err, errlen, h ? sqlite3_errmsg(h) : sqlite3_errstr(rc));
        sqlite3_close(h);
        return classify(rc);
    }
    sqlite3_extended_result_codes(h, 1);
    sqlite3_busy_timeout(h, opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : 0);
    /* journal_mode answers "memory" for :memory: and keeps the old mode where WAL is impossible;
     * both are fine, so its answer is not checked. The first pragma is also the first read of the
     * file, which is where "file is not a database" shows up. */
    rc = sqlite3_exec(h,
                      "PRAGMA journal_mode=WAL; PRAGMA foreign_keys=ON; PRAGMA synchronous=NORMAL;",
                      NULL, NULL, NULL);
    if (rc != SQLITE_OK) {
        set_err(err, errlen, sqlite3_errmsg(h));
        sqlite3_close(h);
        return classify(rc);
    }

    store *db = calloc(1, sizeof *db);
    if (!db) {
        sqlite3_close(h);
        set_err(err, errlen, "out of memory");
        return STORE_ERR_SQLITE;
    }
    db->db = h;
    db->cache_cap = opts->statement_cache > 0 ? opts->statement_cache : 0;
    *out = db;
    return STORE_OK;
}

void store_close(store *db)
{
    if (!db) return;
    while (db->cache.head) {
        store_stmt *s = db->cache.head;
        list_unlink(&db->cache, s);
        stmt_free(s);
    }
    while (db->lent.head) {
        store_stmt *s = db->lent.head;
        list_unlink(&db->lent, s);
        stmt_free(s);
    }
    sqlite3_close(db->db);
    free(db);
}

int store_exec(store *db, const char *sql, size_t len, size_t *failed_at, char *err, size_t errlen)
{
    const char *p = sql, *end = sql + len;
    if (failed_at) *failed_at = 0;
    if (len > INT_MAX) return fail_misuse(db, err, errlen, "the SQL text is too long");
    if (memchr(sql, '\0', len))
        return fail_misuse(db, err, errlen, "the SQL text contains a NUL byte");
    while (p < end) {
        sqlite3_stmt *st = NULL;
        const char *tail = NULL;
        int rc = sqlite3_prepare_v2(db->db, p, (int)(end - p), &st, &tail);
        if (failed_at) *failed_at = (size_t)(p - sql);
        if (rc != SQLITE_OK) return fail_sqlite(db, rc, err, errlen);
        if (!st) break; /* only whitespace and comments were left */
        while ((rc = sqlite3_step(st)) == SQLITE_ROW)
            ;
        if (rc != SQLITE_DONE) {
            rc = fail_sqlite(db, rc, err, errlen);
            sqlite3_finalize(st);
            return rc;
        }
        sqlite3_finalize(st);
        p = tail;
    }
    if (failed_at) *failed_at = 0;
    return STORE_OK;
}

/* Compiles a statement the cache did not have. The rest of the text after the first statement
 * is compiled too (and thrown away) to tell "one statement and a comment" from "two statements",
 * which sqlite3_prepare alone silently truncates to the first; that cost is paid once per
 * distinct text because the result is cached. */
static int stmt_compile(store *db, const char *sql, size_t len, uint64_t hash, store_stmt **out,
                        char *err, size_t errlen)
{
    sqlite3_stmt *st = NULL, *extra = NULL;
    const char *tail = NULL;
    if (memchr(sql, '\0', len))
        return fail_misuse(db, err, errlen, "the SQL text contains a NUL byte");
    int rc = sqlite3_prepare_v3(db->db, sql, (int)len,
                                db->cache_cap > 0 ? SQLITE_PREPARE_PERSISTENT : 0, &st, &tail);
    if (rc != SQLITE_OK) return fail_sqlite(db, rc, err, errlen);
    if (!st) return fail_misuse(db, err, errlen, "the SQL text holds no statement");
    size_t rest = len - (size_t)(tail - sql);
    if (rest > 0) {
        rc = sqlite3_prepare_v2(db->db, tail, (int)rest, &extra, NULL);
        if (rc != SQLITE_OK || extra) {
            sqlite3_finalize(extra);
            sqlite3_finalize(st);
            return fail_misuse(db, err, errlen,
                               "the SQL text holds more than one statement; run scripts with exec");
        }
    }
    store_stmt *s = calloc(1, sizeof *s);
    char *copy = malloc(len + 1);
    if (!s || !copy) {
        free(s);
        free(copy);
        sqlite3_finalize(st);
        db->last_code = SQLITE_NOMEM;
        set_err(err, errlen, "out of memory");
        return STORE_ERR_SQLITE;
    }
    memcpy(copy, sql, len);
    copy[len] = '\0';
    s->owner = db;
    s->stmt = st;
    s->sql = copy;
    s->len = len;
    s->hash = hash;
    db->prepares++;
    *out = s;
    return STORE_OK;
}

int store_prepare(store *db, const char *sql, size_t len, store_stmt **out, char *err,
                  size_t errlen)
{
    *out = NULL;
    if (len > INT_MAX) return fail_misuse(db, err, errlen, "the SQL text is too long");
    uint64_t hash = sql_hash(sql, len);
    store_stmt *s = list_find(&db->cache, hash, sql, len);
    if (s) {
        list_unlink(&db->cache, s);
        db->hits++;
    } else {
        int rc = stmt_compile(db, sql, len, hash, &s, err, errlen);
        if (rc != STORE_OK) return rc;
    }
    list_push_front(&db->lent, s);
    *out = s;
    return STORE_OK;
}

void store_release(store_stmt *s)
{
    if (!s) return;
    store *db = s->owner;
    sqlite3_reset(s->stmt);
    sqlite3_clear_bindings(s->stmt);
    list_unlink(&db->lent, s);
    if (db->cache_cap == 0 || list_find(&db->cache, s->hash, s->sql, s->len)) {
        stmt_free(s);
        return;
    }
    list_push_front(&db->cache, s);
    if (db->cache.n > db->cache_cap) {
        store_stmt *lru = db->cache.tail;
        list_unlink(&db->cache, lru);
        stmt_free(lru);
    }
}

int store_param_count(store_stmt *s)
{
    return sqlite3_bind_parameter_count(s->stmt);
}

const char *store_param_name(store_stmt *s, int idx)
{
    return sqlite3_bind_parameter_name(s->stmt, idx);
}

int store_bind(store_stmt *s, int idx, const store_value *v, char *err, size_t errlen)
{
    int rc;
    /* A NULL pointer would bind SQL NULL instead of an empty string or blob. */
    const char *p = v->p ? v->p : "";
    switch (v->type) {
    case STORE_INTEGER:
        rc = sqlite3_bind_int64(s->stmt, idx, v->i);
        break;
    case STORE_REAL:
        rc = sqlite3_bind_double(s->stmt, idx, v->d);
        break;
    case STORE_TEXT:
        rc = sqlite3_bind_text64(s->stmt, idx, p, v->len, SQLITE_TRANSIENT, SQLITE_UTF8);
        break;
    case STORE_BLOB:
        rc = sqlite3_bind_blob64(s->stmt, idx, p, v->len, SQLITE_TRANSIENT);
        break;
    default:
        rc = sqlite3_bind_null(s->stmt, idx);
        break;
    }
    if (rc == SQLITE_OK) return STORE_OK;
    return fail_sqlite(s->owner, rc, err, errlen);
}

int store_step(store_stmt *s, char *err, size_t errlen)
{
    int rc = sqlite3_step(s->stmt);
    if (rc == SQLITE_ROW) return STORE_ROW;
    if (rc == SQLITE_DONE) return STORE_DONE;
    return fail_sqlite(s->owner, rc, err, errlen);
}

int store_column_count(store_stmt *s)
{
    return sqlite3_column_count(s->stmt);
}

const char *store_column_name(store_stmt *s, int i)
{
    const char *name = sqlite3_column_name(s->stmt, i);
    return name ? name : "?";
}

void store_column(store_stmt *s, int i, store_value *v)
{
    memset(v, 0, sizeof *v);
    switch (sqlite3_column_type(s->stmt, i)) {
    case SQLITE_INTEGER:
        v->type = STORE_INTEGER;
        v->i = sqlite3_column_int64(s->stmt, i);
        break;
    case SQLITE_FLOAT:
        v->type = STORE_REAL;
        v->d = sqlite3_column_double(s->stmt, i);
        break;
    case SQLITE_TEXT:
        v->type = STORE_TEXT;
        /* The pointer first, then the size: the documented order that avoids a conversion. */
        v->p = (const char *)sqlite3_column_text(s->stmt, i);
        v->len = (size_t)sqlite3_column_bytes(s->stmt, i);
        break;
    case SQLITE_BLOB:
        v->type = STORE_BLOB;
        v->p = (const char *)sqlite3_column_blob(s->stmt, i);
        v->len = (size_t)sqlite3_column_bytes(s->stmt, i);
        break;
    default:
        v->type = STORE_NULL;
        break;
    }
    if ((v->type == STORE_TEXT || v->type == STORE_BLOB) && !v->p) {
        /* SQLite gives NULL for an empty BLOB (and for TEXT only when converting a non-UTF-8
         * database runs out of memory); callers get a valid empty string either way. */
        v->p = "";
        v->len = 0;
    }
}

const char *store_stmt_sql(store_stmt *s, size_t *len)
{
    if (len) *len = s->len;
    return s->sql;
}

int64_t store_changes(store *db)
{
    return (int64_t)sqlite3_changes64(db->db);
}

int64_t store_total_changes(store *db)
{
    return (int64_t)sqlite3_total_changes64(db->db);
}

int64_t store_last_insert_rowid(store *db)
{
    return (int64_t)sqlite3_last_insert_rowid(db->db);
}

int store_in_transaction(store *db)
{
    return !sqlite3_get_autocommit(db->db);
}

int store_last_sqlite_code(store *db)
{
    return db->last_code;
}

void store_get_stats(store *db, store_stats *st)
{
    st->cached = db->cache.n;
    st->lent = db->lent.n;
    st->prepares = db->prepares;
    st->hits = db->hits;
}

static int is_space(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

void store_sql_excerpt(const char *sql, size_t len, size_t max_chars, char *buf, size_t buflen)
{
    size_t o = 0, chars = 0;
    int space = 0, cut = 0;
    if (buflen < 4) {
        if (buflen) buf[0] = '\0';
        return;
    }
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)sql[i];
        if (is_space(c)) {
            space = o > 0;
            i++;
            continue;
        }
        size_t n = jsonq_utf8_seq((const unsigned char *)sql + i, len - i);
        if (n == 0) n = 1; /* not UTF-8: one byte at a time */
        /* Room for the pending space, the character, "..." and the terminating NUL. */
        if (chars + (size_t)space + 1 > max_chars || o + (size_t)space + n + 4 > buflen) {
            cut = 1;
            break;
        }
        if (space) {
            buf[o++] = ' ';
            chars++;
            space = 0;
        }
        memcpy(buf + o, sql + i, n);
        o += n;
        chars++;
        i += n;
    }
    if (cut) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
}
