/*
 * store.c — module moonbox.store: SQLite databases (runtime/store.c) for Lua, the place where
 * moonbox keeps its state (ledger, schedules, the local backend's database).
 *
 * Every call is synchronous: SQLite on a local file answers in microseconds, so nothing here
 * yields, and a transaction's function runs with yields refused, which keeps a write lock from
 * ever being held across a task wait. SQL is always a prepared statement with bound parameters;
 * nothing here builds SQL from values except the integer of PRAGMA user_version, which SQLite
 * cannot bind.
 *
 * Ownership: a Db userdata owns its store (closed by db:close, <close> or __gc). A statement lent
 * for one call (run/rows/row/value) is given back before the call returns, also when it raises,
 * because the work runs under lua_pcall; a cursor from db:each owns its statement until the loop
 * ends, breaks (to-be-closed value) or the cursor is collected. No registry references.
 */
#include "mb.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "store.h"

#define DB_MT     "moonbox.store.Db"
#define CURSOR_MT "moonbox.store.Cursor"
#define BLOB_MT   "moonbox.store.Blob"

#define ERRBUF       512
#define SQL_EXCERPT  120 /* characters of SQL quoted in error messages */
#define TX_SAVEPOINT "moonbox_tx"

typedef struct ldb {
    store *st; /* NULL once closed; uservalue 1 is the path, for messages */
} ldb;

typedef struct lcursor {
    store_stmt *stmt; /* NULL once finished; uservalue 1 is the Db, kept alive by the cursor */
} lcursor;

enum query_mode { Q_RUN, Q_ROWS, Q_ROW, Q_VALUE, Q_EACH };

/* What a protected query call shares with the function that started it: the statement it
 * borrowed, so that the caller can give it back when the call raises. */
typedef struct query {
    ldb *db;
    store_stmt *stmt;
    const char *what;
    enum query_mode mode;
} query;

/* Raises a plain (misuse) error prefixed with the recipe location, as lauxlib cannot locate a
 * C caller. */
static int misuse(lua_State *L, const char *fmt, ...)
{
    char where[256];
    va_list ap;
    mb_where(L, where, sizeof where);
    lua_pushstring(L, where);
    lua_pushliteral(L, ": ");
    va_start(ap, fmt);
    lua_pushvfstring(L, fmt, ap);
    va_end(ap);
    lua_concat(L, 3);
    return lua_error(L);
}

static const char *db_path(lua_State *L, int idx)
{
    lua_getiuservalue(L, idx, 1);
    const char *path = lua_tostring(L, -1);
    lua_pop(L, 1); /* the userdata keeps the string alive */
    return path ? path : "?";
}

/* Returns the open Db at index 1, or raises naming `what` and the path when it is closed. */
static ldb *check_db(lua_State *L, const char *what)
{
    ldb *db = (ldb *)luaL_checkudata(L, 1, DB_MT);
    if (!db->st)
        return (ldb *)(intptr_t)misuse(L, "%s: the database %s is closed", what, db_path(L, 1));
    return db;
}

/* Pushes the structured error (op "store") for a failure a runtime call returned: its code says
 * what a caller can do about it, its message quotes SQLite and the start of the SQL. dbidx is
 * the Db's stack index. */
static void push_store_error(lua_State *L, int dbidx, ldb *db, int rc, const char *err,
                             const char *sql, size_t len)
{
    char excerpt[4 * SQL_EXCERPT + 8];
    store_sql_excerpt(sql, len, SQL_EXCERPT, excerpt, sizeof excerpt);
    const char *code = rc == STORE_ERR_CONSTRAINT ? "constraint"
                       : rc == STORE_ERR_BUSY     ? "busy"
                                                  : "sqlite_error";
    int sqlite_code = db->st ? store_last_sqlite_code(db->st) : 0;
    const char *path = db_path(L, dbidx);
    mb_error_new(L, "store", code, "%s (SQL: %s)", err, excerpt);
    mb_setfield_str(L, -1, "sql", excerpt);
    mb_setfield_str(L, -1, "path", path);
    mb_setfield_int(L, -1, "sqlite_code", sqlite_code);
    mb_setfield_bool(L, -1, "retryable", rc == STORE_ERR_BUSY);
}

/* Raises the error a runtime call returned: a plain error for misuse (naming `what`), else the
 * structured error of push_store_error. */
static int raise_store_error(lua_State *L, int dbidx, ldb *db, int rc, const char *err,
                             const char *sql, size_t len, const char *what)
{
    if (rc == STORE_ERR_MISUSE) {
        char excerpt[4 * SQL_EXCERPT + 8];
        store_sql_excerpt(sql, len, SQL_EXCERPT, excerpt, sizeof excerpt);
        return misuse(L, "%s: %s (SQL: %s)", what, err, excerpt);
    }
    push_store_error(L, dbidx, db, rc, err, sql, len);
    return lua_error(L);
}

/* Runs one parameterless statement through the cache (transaction control, pragmas). */
static int run_simple(store *st, const char *sql, char *err, size_t errlen)
{
    store_stmt *s;
    int rc = store_prepare(st, sql, strlen(sql), &s, err, errlen);
    if (rc != STORE_OK) return rc;
    do
        rc = store_step(s, err, errlen);
    while (rc == STORE_ROW);
    store_release(s);
    return rc == STORE_DONE ? STORE_OK : rc;
}

/* ---- values --------------------------------------------------------------------------------- */

/* Binds the Lua value at idx to parameter n. `label` names the parameter in messages. Raises a
 * plain error for a type SQLite cannot store; runs no metamethods. */
static void bind_value(lua_State *L, store_stmt *s, int n, int idx, const char *what,
                       const char *label, ldb *db, int dbidx)
{
    store_value v;
    char err[ERRBUF];
    int popn = 0;
    memset(&v, 0, sizeof v);
    switch (lua_type(L, idx)) {
    case LUA_TNIL:
        v.type = STORE_NULL;
        break;
    case LUA_TBOOLEAN:
        v.type = STORE_INTEGER;
        v.i = lua_toboolean(L, idx);
        break;
    case LUA_TNUMBER:
        if (lua_isinteger(L, idx)) {
            v.type = STORE_INTEGER;
            v.i = (int64_t)lua_tointeger(L, idx);
        } else {
            v.type = STORE_REAL;
            v.d = (double)lua_tonumber(L, idx);
        }
        break;
    case LUA_TSTRING:
        v.type = STORE_TEXT;
        v.p = lua_tolstring(L, idx, &v.len);
        break;
    default:
        if (luaL_testudata(L, idx, BLOB_MT)) {
            lua_getiuservalue(L, idx, 1);
            v.type = STORE_BLOB;
            v.p = lua_tolstring(L, -1, &v.len);
            popn = 1;
            break;
        }
        misuse(L, "%s: %s is a %s; expected nil, boolean, number, string or store.blob(s)", what,
               label, luaL_typename(L, idx));
    }
    int rc = store_bind(s, n, &v, err, sizeof err);
    lua_pop(L, popn);
    if (rc != STORE_OK) {
        size_t len;
        const char *sql = store_stmt_sql(s, &len);
        raise_store_error(L, dbidx, db, rc, err, sql, len, what);
    }
}

/* Binds the values at stack indices first..last to the statement's parameters: positionally,
 * or by name from the fields of a table when that table is the only value. A missing field
 * binds NULL (a Lua table cannot hold nil); fields the statement does not name are ignored. */
static void bind_params(lua_State *L, store_stmt *s, int first, int last, const char *what, ldb *db,
                        int dbidx)
{
    int nparams = store_param_count(s);
    int nvalues = last - first + 1;
    char label[96];
    if (nvalues == 1 && lua_type(L, first) == LUA_TTABLE) {
        if (nparams == 0)
            misuse(L, "%s: a table of named values was given but the statement has no parameters",
                   what);
        for (int i = 1; i <= nparams; i++) {
            const char *name = store_param_name(s, i);
            if (!name || name[0] == '?')
                misuse(L,
                       "%s: a single table argument binds named parameters (:name, @name, $name) "
                       "but parameter %d is positional; pass positional values as arguments",
                       what, i);
            lua_pushstring(L, name + 1);
            lua_rawget(L, first);
            snprintf(label, sizeof label, "parameter %s", name);
            bind_value(L, s, i, lua_gettop(L), what, label, db, dbidx);
            lua_pop(L, 1);
        }
        return;
    }
    if (nvalues != nparams)
        misuse(L, "%s: the statement has %d parameter(s) but %d value(s) were given", what, nparams,
               nvalues);
    for (int i = 1; i <= nparams; i++) {
        snprintf(label, sizeof label, "parameter %d", i);
        bind_value(L, s, i, first + i - 1, what, label, db, dbidx);
    }
}

static void push_column(lua_State *L, store_stmt *s, int i)
{
    store_value v;
    store_column(s, i, &v);
    switch (v.type) {
    case STORE_INTEGER:
        lua_pushinteger(L, (lua_Integer)v.i);
        break;
    case STORE_REAL:
        lua_pushnumber(L, (lua_Number)v.d);
        break;
    case STORE_TEXT:
    case STORE_BLOB:
        lua_pushlstring(L, v.p, v.len);
        break;
    default:
        lua_pushnil(L);
        break;
    }
}

/* Pushes the current row as a table column name -> value; NULL columns are left out. `names`
 * is the stack index of the first of ncols column-name strings pushed by the caller, or 0 to
 * ask SQLite for each name. */
static void push_row(lua_State *L, store_stmt *s, int ncols, int names)
{
    lua_createtable(L, 0, ncols);
    for (int i = 0; i < ncols; i++) {
        push_column(L, s, i);
        if (lua_isnil(L, -1)) {
            lua_pop(L, 1);
            continue;
        }
        if (names)
            lua_pushvalue(L, names + i);
        else
            lua_pushstring(L, store_column_name(s, i));
        lua_insert(L, -2);
        lua_rawset(L, -3);
    }
}

/* ---- queries -------------------------------------------------------------------------------- */

/* The body of run/rows/row/value (and the prepare-and-bind half of each), called under
 * lua_pcall with the stack: query (light userdata), db, sql, values... Leaves its results on the
 * stack and gives the statement back before returning, except for Q_EACH, which leaves the bound
 * statement in q->stmt for the cursor. When it raises, the statement is still in q->stmt for the
 * caller to give back. */
static int query_protected(lua_State *L)
{
    query *q = (query *)lua_touserdata(L, 1);
    const int dbidx = 2;
    char err[ERRBUF];
    size_t len;
    const char *sql = lua_tolstring(L, 3, &len);
    int top = lua_gettop(L);
    int rc = store_prepare(q->db->st, sql, len, &q->stmt, err, sizeof err);
    if (rc != STORE_OK) return raise_store_error(L, dbidx, q->db, rc, err, sql, len, q->what);
    bind_params(L, q->stmt, 4, top, q->what, q->db, dbidx);
    if (q->mode == Q_EACH) return 0;
    int64_t before = store_total_changes(q->db->st);

    /* The shape of the result is read after the first step: a cached statement is recompiled
     * there when the schema changed since (SELECT * after ALTER TABLE gains a column). */
    int nresults = 1;
    rc = store_step(q->stmt, err, sizeof err);
    if (rc != STORE_ROW && rc != STORE_DONE)
        return raise_store_error(L, dbidx, q->db, rc, err, sql, len, q->what);
    int ncols = store_column_count(q->stmt);
    if (q->mode == Q_RUN) {
        while (rc == STORE_ROW)
            rc = store_step(q->stmt, err, sizeof err);
        if (rc != STORE_DONE) return raise_store_error(L, dbidx, q->db, rc, err, sql, len, q->what);
        /* sqlite3_changes keeps the count of the last INSERT/UPDATE/DELETE, so a statement that
         * changed nothing (DDL, SELECT) would report a stale figure without this check. */
        int64_t changes = store_total_changes(q->db->st) == before ? 0 : store_changes(q->db->st);
        lua_pushinteger(L, (lua_Integer)changes);
        lua_pushinteger(L, (lua_Integer)store_last_insert_rowid(q->db->st));
        nresults = 2;
    } else if (q->mode == Q_ROWS) {
        luaL_checkstack(L, ncols + 4, "too many columns");
        int names = lua_gettop(L) + 1;
        for (int i = 0; i < ncols; i++)
            lua_pushstring(L, store_column_name(q->stmt, i));
        lua_newtable(L);
        lua_Integer n = 0;
        while (rc == STORE_ROW) {
            push_row(L, q->stmt, ncols, names);
            lua_rawseti(L, -2, ++n);
            rc = store_step(q->stmt, err, sizeof err);
        }
        if (rc != STORE_DONE) return raise_store_error(L, dbidx, q->db, rc, err, sql, len, q->what);
    } else if (rc == STORE_ROW && q->mode == Q_ROW) {
        push_row(L, q->stmt, ncols, 0);
    } else if (rc == STORE_ROW && ncols > 0) {
        push_column(L, q->stmt, 0);
    } else {
        lua_pushnil(L);
    }
    store_release(q->stmt);
    q->stmt = NULL;
    return nresults;
}

/* Runs query_protected for the method `what` on the stack slots from base (the Db) to the top,
 * replacing them with its results, and gives the borrowed statement back when it raises (a bad
 * parameter, a constraint, out of memory) so that no statement stays half-run with a read
 * transaction open. Returns the number of results. */
static int protected_query(lua_State *L, int base, query *q)
{
    int n = lua_gettop(L) - base + 1;
    lua_pushcfunction(L, query_protected);
    lua_pushlightuserdata(L, q);
    lua_rotate(L, base, 2);
    if (lua_pcall(L, n + 1, LUA_MULTRET, 0) != LUA_OK) {
        if (q->stmt && q->db->st) store_release(q->stmt);
        q->stmt = NULL;
        lua_error(L);
    }
    return lua_gettop(L) - base + 1;
}

static int run_query(lua_State *L, enum query_mode mode, const char *what)
{
    ldb *db = check_db(L, what);
    luaL_checktype(L, 2, LUA_TSTRING);
    query q = {db, NULL, what, mode};
    return protected_query(L, 1, &q);
}

/* db:run(sql, ...) -> changes, last_insert_rowid. Runs one statement to completion, discarding
 * any rows. Parameters: positional `?` values as further arguments, or one table whose fields
 * bind `:name` / `@name` / `$name`. changes counts the rows this statement inserted, updated or
 * deleted (0 for statements that change no rows); last_insert_rowid is the connection's most
 * recent successful INSERT. Raises store errors (constraint, busy, sqlite_error) and plain errors
 * for misuse (wrong parameter count or type, several statements). Does not yield. */
static int db_run(lua_State *L)
{
    return run_query(L, Q_RUN, "db:run");
}

/* db:rows(sql, ...) -> array of rows, each a table column name -> value (NULL columns absent).
 * Parameters and errors as db:run. Does not yield. */
static int db_rows(lua_State *L)
{
    return run_query(L, Q_ROWS, "db:rows");
}

/* db:row(sql, ...) -> the first row, or nil when there is none. As db:rows otherwise. */
static int db_row(lua_State *L)
{
    return run_query(L, Q_ROW, "db:row");
}

/* db:value(sql, ...) -> the first column of the first row, or nil when there is no row or the
 * value is NULL. As db:rows otherwise. */
static int db_value(lua_State *L)
{
    return run_query(L, Q_VALUE, "db:value");
}

/* db:exec(sql) -> nothing. Runs a script of any number of statements without parameters (schema,
 * migrations), each to completion. Stops at the first failing statement, whose text the error
 * quotes; earlier statements stay applied unless the script runs inside db:tx. Raises store
 * errors; a plain error when parameters are passed. Does not yield. */
static int db_exec(lua_State *L)
{
    ldb *db = check_db(L, "db:exec");
    size_t len, failed_at;
    char err[ERRBUF];
    luaL_checktype(L, 2, LUA_TSTRING);
    const char *sql = lua_tolstring(L, 2, &len);
    if (lua_gettop(L) > 2)
        return misuse(L, "db:exec takes no parameters; bind values with db:run(sql, ...)");
    int rc = store_exec(db->st, sql, len, &failed_at, err, sizeof err);
    if (rc != STORE_OK)
        return raise_store_error(L, 1, db, rc, err, sql + failed_at, len - failed_at, "db:exec");
    return 0;
}

/* ---- cursors (db:each) --------------------------------------------------------------------- */

/* Gives a cursor's statement back; after store_close the statement is already gone. */
static void cursor_finish(lua_State *L, lcursor *c, int cidx)
{
    if (!c->stmt) return;
    lua_getiuservalue(L, cidx, 1);
    ldb *db = (ldb *)lua_touserdata(L, -1);
    lua_pop(L, 1);
    if (db && db->st) store_release(c->stmt);
    c->stmt = NULL;
}

static int cursor_close(lua_State *L)
{
    lcursor *c = (lcursor *)luaL_checkudata(L, 1, CURSOR_MT);
    cursor_finish(L, c, 1);
    return 0;
}

/* The iterator db:each returns: the next row, or nil at the end (which gives the statement
 * back at once). */
static int cursor_next(lua_State *L)
{
    int cidx = lua_upvalueindex(1);
    lcursor *c = (lcursor *)lua_touserdata(L, cidx);
    char err[ERRBUF];
    if (!c->stmt) return 0;
    lua_getiuservalue(L, cidx, 1);
    int dbidx = lua_gettop(L);
    ldb *db = (ldb *)lua_touserdata(L, dbidx);
    if (!db->st) {
        c->stmt = NULL; /* finalized by db:close */
        return misuse(L, "db:each: the database %s was closed during the loop", db_path(L, dbidx));
    }
    int rc = store_step(c->stmt, err, sizeof err);
    if (rc == STORE_ROW) {
        push_row(L, c->stmt, store_column_count(c->stmt), 0);
        return 1;
    }
    if (rc == STORE_DONE) {
        cursor_finish(L, c, cidx);
        return 0;
    }
    size_t len;
    const char *sql = store_stmt_sql(c->stmt, &len);
    lua_pushlstring(L, sql, len); /* the text outlives the statement it belongs to */
    sql = lua_tostring(L, -1);
    cursor_finish(L, c, cidx);
    return raise_store_error(L, dbidx, db, rc, err, sql, len, "db:each");
}

/* db:each(sql, ...) -> iterator, nil, nil, cursor: for use as `for row in db:each(sql, ...)`.
 * Each step returns the next row (as db:rows). The statement stays open between steps and is
 * given back when the loop ends, breaks or raises (the cursor is the loop's to-be-closed value),
 * or when an abandoned iterator is collected. The loop body may call anything, including task
 * functions that wait. Parameters and errors as db:rows; errors of later rows are raised by the
 * iterator. Does not yield. */
static int db_each(lua_State *L)
{
    ldb *db = check_db(L, "db:each");
    luaL_checktype(L, 2, LUA_TSTRING);
    /* The cursor exists before the statement is borrowed, so that no allocation can fail
     * between borrowing it and handing it to its owner. */
    lcursor *c = (lcursor *)lua_newuserdatauv(L, sizeof *c, 1);
    c->stmt = NULL;
    luaL_setmetatable(L, CURSOR_MT);
    lua_pushvalue(L, 1);
    lua_setiuservalue(L, -2, 1);
    lua_insert(L, 1);
    query q = {db, NULL, "db:each", Q_EACH};
    protected_query(L, 2, &q);
    c->stmt = q.stmt;
    lua_settop(L, 1);
    lua_pushvalue(L, 1);
    lua_pushcclosure(L, cursor_next, 1);
    lua_pushnil(L);
    lua_pushnil(L);
    lua_pushvalue(L, 1);
    return 4;
}

/* ---- transactions --------------------------------------------------------------------------- */

/* Undoes the transaction (or savepoint) db:tx opened, if SQLite has not already rolled it back
 * itself. A failure here is not reported: the error that caused the rollback matters more. */
static void tx_rollback(ldb *db, int nested)
{
    char err[ERRBUF];
    if (!db->st || !store_in_transaction(db->st)) return;
    if (nested) {
        if (run_simple(db->st, "ROLLBACK TO " TX_SAVEPOINT, err, sizeof err) == STORE_OK)
            run_simple(db->st, "RELEASE " TX_SAVEPOINT, err, sizeof err);
    } else {
        run_simple(db->st, "ROLLBACK", err, sizeof err);
    }
}

/* db:tx(fn, ...) -> the results of fn(...). Runs fn inside a transaction: BEGIN IMMEDIATE (the
 * write lock is taken up front, so a busy database fails here rather than halfway), COMMIT when
 * fn returns, ROLLBACK when it raises, re-raising fn's error value unchanged. Inside another
 * transaction it uses a savepoint instead, so an inner failure that is caught undoes only the
 * inner part. fn cannot wait: task functions called inside it raise "cannot wait here", which
 * rolls the transaction back, because a write lock held across a wait would stall every other
 * writer. Raises store errors from BEGIN/COMMIT (busy, constraint for deferred foreign keys) and
 * a plain error when fn closes the database. Does not yield. */
static int db_tx(lua_State *L)
{
    ldb *db = check_db(L, "db:tx");
    char err[ERRBUF];
    luaL_checktype(L, 2, LUA_TFUNCTION);
    int nested = store_in_transaction(db->st);
    const char *begin = nested ? "SAVEPOINT " TX_SAVEPOINT : "BEGIN IMMEDIATE";
    int rc = run_simple(db->st, begin, err, sizeof err);
    if (rc != STORE_OK) return raise_store_error(L, 1, db, rc, err, begin, strlen(begin), "db:tx");

    /* No continuation on purpose: that is what makes a yield inside fn an error. */
    if (lua_pcall(L, lua_gettop(L) - 2, LUA_MULTRET, 0) != LUA_OK) {
        tx_rollback(db, nested);
        return lua_error(L);
    }
    if (!db->st)
        return misuse(L,
                      "db:tx: the database %s was closed inside the transaction; its writes "
                      "were rolled back",
                      db_path(L, 1));
    const char *commit = nested ? "RELEASE " TX_SAVEPOINT : "COMMIT";
    rc = run_simple(db->st, commit, err, sizeof err);
    if (rc != STORE_OK) {
        /* The error is made before the rollback, which would replace SQLite's last code. */
        char msg[ERRBUF + 64];
        snprintf(msg, sizeof msg, "%s; the transaction was rolled back", err);
        push_store_error(L, 1, db, rc, msg, commit, strlen(commit));
        tx_rollback(db, nested);
        return lua_error(L);
    }
    return lua_gettop(L) - 1;
}

/* ---- migrations ----------------------------------------------------------------------------- */

static int read_user_version(ldb *db, lua_Integer *version, char *err, size_t errlen)
{
    store_stmt *s;
    store_value v;
    int rc = store_prepare(db->st, "PRAGMA user_version", 19, &s, err, errlen);
    if (rc != STORE_OK) return rc;
    rc = store_step(s, err, errlen);
    if (rc == STORE_ROW) {
        store_column(s, 0, &v);
        *version = (lua_Integer)v.i;
        rc = STORE_OK;
    }
    store_release(s);
    return rc;
}

/* Applies migration i (the value at stack index idx) inside the transaction already open, and
 * records it in user_version. A failing SQL script raises a store error naming the migration; a
 * failing function's error propagates unchanged. The caller rolls back. */
static void apply_migration(lua_State *L, ldb *db, lua_Integer i, int idx)
{
    char err[ERRBUF], pragma[64];
    if (lua_type(L, idx) == LUA_TFUNCTION) {
        lua_pushvalue(L, idx);
        lua_pushvalue(L, 1);
        lua_call(L, 1, 0);
        if (!db->st) misuse(L, "db:migrate: migration %d closed the database", (int)i);
    } else {
        size_t len, failed_at;
        const char *sql = lua_tolstring(L, idx, &len);
        int rc = store_exec(db->st, sql, len, &failed_at, err, sizeof err);
        if (rc == STORE_ERR_MISUSE)
            raise_store_error(L, 1, db, rc, err, sql + failed_at, len - failed_at, "db:migrate");
        if (rc != STORE_OK) {
            char msg[ERRBUF + 64];
            snprintf(msg, sizeof msg, "migration %d failed: %s", (int)i, err);
            push_store_error(L, 1, db, rc, msg, sql + failed_at, len - failed_at);
            mb_setfield_int(L, -1, "migration", i);
            lua_error(L);
        }
    }
    /* PRAGMA takes no bound parameters; i is an integer of ours, not a value from outside. */
    snprintf(pragma, sizeof pragma, "PRAGMA user_version = %d", (int)i);
    int rc = run_simple(db->st, pragma, err, sizeof err);
    if (rc != STORE_OK) raise_store_error(L, 1, db, rc, err, pragma, strlen(pragma), "db:migrate");
}

/* Runs apply_migration under lua_pcall: stack migration index (integer), Db, list. */
static int migration_protected(lua_State *L)
{
    lua_Integer i = lua_tointeger(L, 1);
    lua_remove(L, 1); /* Db at 1, list at 2, as apply_migration expects */
    ldb *db = (ldb *)lua_touserdata(L, 1);
    lua_rawgeti(L, 2, i);
    apply_migration(L, db, i, lua_gettop(L));
    return 0;
}

/* db:migrate(list) -> version. Brings the schema up to date: list is an ordered array of
 * migrations, each an SQL script (run as db:exec) or a function(db); migration i runs once, in
 * its own transaction, and sets PRAGMA user_version to i, so a database at version v gets
 * list[v+1..#list] and a second call (or process) does nothing. Returns the version afterwards
 * (#list). Scripts must not contain BEGIN/COMMIT. Raises a store error naming the migration when
 * one fails (earlier ones stay applied), a function migration's own error unchanged, code
 * "schema_too_new" when the database's version is above #list (written by a newer moonbox),
 * and a plain error inside a transaction or for a list entry of the wrong type. Does not yield. */
static int db_migrate(lua_State *L)
{
    ldb *db = check_db(L, "db:migrate");
    char err[ERRBUF];
    lua_Integer version;
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_settop(L, 2);
    if (store_in_transaction(db->st))
        return misuse(L, "db:migrate cannot run inside a transaction: each migration is one");
    lua_Integer n = (lua_Integer)lua_rawlen(L, 2);
    for (lua_Integer i = 1; i <= n; i++) {
        int t = lua_rawgeti(L, 2, i);
        lua_pop(L, 1);
        if (t != LUA_TSTRING && t != LUA_TFUNCTION)
            return misuse(L,
                          "db:migrate: migration %d is a %s; expected an SQL string or a "
                          "function(db)",
                          (int)i, lua_typename(L, t));
    }
    int rc = read_user_version(db, &version, err, sizeof err);
    if (rc != STORE_OK)
        return raise_store_error(L, 1, db, rc, err, "PRAGMA user_version", 19, "db:migrate");
    if (version > n) {
        mb_error_new(L, "store", "schema_too_new",
                     "database %s is at schema version %d but only %d migration(s) are known; "
                     "it was written by a newer program",
                     db_path(L, 1), (int)version, (int)n);
        mb_setfield_str(L, -1, "path", db_path(L, 1));
        mb_setfield_int(L, -1, "version", version);
        return lua_error(L);
    }
    for (lua_Integer i = version + 1; i <= n; i++) {
        static const char begin[] = "BEGIN IMMEDIATE";
        rc = run_simple(db->st, begin, err, sizeof err);
        if (rc != STORE_OK)
            return raise_store_error(L, 1, db, rc, err, begin, strlen(begin), "db:migrate");
        /* Another connection may have migrated while this one waited for the write lock. */
        rc = read_user_version(db, &version, err, sizeof err);
        if (rc != STORE_OK) {
            tx_rollback(db, 0);
            return raise_store_error(L, 1, db, rc, err, "PRAGMA user_version", 19, "db:migrate");
        }
        if (version >= i) {
            tx_rollback(db, 0);
            continue;
        }
        lua_pushcfunction(L, migration_protected);
        lua_pushinteger(L, i);
        lua_pushvalue(L, 1);
        lua_pushvalue(L, 2);
        if (lua_pcall(L, 3, 0, 0) != LUA_OK) {
            tx_rollback(db, 0);
            return lua_error(L);
        }
        if (!db->st) return misuse(L, "db:migrate: migration %d closed the database", (int)i);
        rc = run_simple(db->st, "COMMIT", err, sizeof err);
        if (rc != STORE_OK) {
            tx_rollback(db, 0);
            return raise_store_error(L, 1, db, rc, err, "COMMIT", 6, "db:migrate");
        }
    }
    rc = read_user_version(db, &version, err, sizeof err);
    if (rc != STORE_OK)
        return raise_store_error(L, 1, db, rc, err, "PRAGMA user_version", 19, "db:migrate");
    lua_pushinteger(L, version);
    return 1;
}

/* ---- the Db object -------------------------------------------------------------------------- */

/* db:close() -> nothing. Finalizes every statement (also those of unfinished db:each loops) and
 * closes the connection; an open transaction is rolled back. Idempotent; also run by <close> and
 * __gc. Any later use of db raises. Does not yield. */
static int db_close(lua_State *L)
{
    ldb *db = (ldb *)luaL_checkudata(L, 1, DB_MT);
    store_close(db->st);
    db->st = NULL;
    return 0;
}

/* db:stats() -> {cached, lent, prepares, hits}: statements in the cache, statements lent out
 * (open db:each loops), statements compiled since open, and cache hits. Does not yield. */
static int db_stats(lua_State *L)
{
    ldb *db = check_db(L, "db:stats");
    store_stats st;
    store_get_stats(db->st, &st);
    lua_createtable(L, 0, 4);
    mb_setfield_int(L, -1, "cached", st.cached);
    mb_setfield_int(L, -1, "lent", st.lent);
    mb_setfield_int(L, -1, "prepares", st.prepares);
    mb_setfield_int(L, -1, "hits", st.hits);
    return 1;
}

static int db_tostring(lua_State *L)
{
    ldb *db = (ldb *)luaL_checkudata(L, 1, DB_MT);
    lua_pushfstring(L, "store.Db(%s%s)", db_path(L, 1), db->st ? "" : ", closed");
    return 1;
}

/* Reads store.open's options table at idx into opts, rejecting unknown keys (a misspelt option
 * silently ignored would be a worse surprise than an error). */
static void read_open_options(lua_State *L, int idx, store_options *opts)
{
    store_options_init(opts);
    if (lua_isnoneornil(L, idx)) return;
    luaL_checktype(L, idx, LUA_TTABLE);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        const char *key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
        int *field = NULL;
        if (key && strcmp(key, "busy_timeout") == 0)
            field = &opts->busy_timeout_ms;
        else if (key && strcmp(key, "statement_cache") == 0)
            field = &opts->statement_cache;
        if (!field) {
            lua_pop(L, 1);
            misuse(L, "store.open: unknown option %s (known: busy_timeout, statement_cache)",
                   luaL_tolstring(L, -1, NULL));
        }
        int isint = 0;
        lua_Integer value = lua_type(L, -1) == LUA_TNUMBER ? lua_tointegerx(L, -1, &isint) : 0;
        if (!isint || value < 0 || value > INT32_MAX)
            misuse(L, "store.open: option %s must be a non-negative integer", key);
        *field = (int)value;
        lua_pop(L, 1);
    }
}

/* store.open(path [, opts]) -> Db. Opens the SQLite database at path, creating the file with
 * mode 0600 when missing (":memory:" gives a private in-memory database). The connection uses
 * WAL, foreign_keys=ON and synchronous=NORMAL. opts.busy_timeout: milliseconds a statement
 * waits for another connection's lock before raising "busy" (default 5000; the wait blocks the
 * loop). opts.statement_cache: prepared statements kept for reuse (default 64, 0 disables).
 * Raises a structured error (op "store.open", code "open_failed") naming the path and SQLite's
 * reason; plain errors for bad arguments. Does not yield. */
static int l_open(lua_State *L)
{
    size_t len;
    char err[ERRBUF];
    store_options opts;
    luaL_checktype(L, 1, LUA_TSTRING);
    const char *path = lua_tolstring(L, 1, &len);
    luaL_argcheck(L, len > 0 && strlen(path) == len, 1, "a non-empty path without NUL bytes");
    read_open_options(L, 2, &opts);
    /* The userdata comes first so that a failed allocation cannot strand an open store. */
    ldb *db = (ldb *)lua_newuserdatauv(L, sizeof *db, 1);
    db->st = NULL;
    luaL_setmetatable(L, DB_MT);
    lua_pushvalue(L, 1);
    lua_setiuservalue(L, -2, 1);
    int rc = store_open(&db->st, path, &opts, err, sizeof err);
    if (rc != STORE_OK) {
        mb_error_new(L, "store.open", "open_failed", "cannot open database %s: %s", path, err);
        mb_setfield_str(L, -1, "path", path);
        return lua_error(L);
    }
    return 1;
}

/* store.blob(s) -> a value that binds s as a BLOB instead of TEXT. Use it for bytes that are not
 * text (NUL bytes, invalid UTF-8, compressed data), so SQL functions treat them as bytes. Rows
 * return BLOBs as plain Lua strings. Does not yield. */
static int l_blob(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TSTRING);
    lua_newuserdatauv(L, 0, 1);
    luaL_setmetatable(L, BLOB_MT);
    lua_pushvalue(L, 1);
    lua_setiuservalue(L, -2, 1);
    return 1;
}

static int blob_tostring(lua_State *L)
{
    lua_getiuservalue(L, 1, 1);
    lua_pushfstring(L, "store.blob(%d bytes)", (int)lua_rawlen(L, -1));
    return 1;
}

int luaopen_moonbox_store(lua_State *L)
{
    static const luaL_Reg db_methods[] = {
        {"exec", db_exec},   {"run", db_run},     {"rows", db_rows}, {"row", db_row},
        {"value", db_value}, {"each", db_each},   {"tx", db_tx},     {"migrate", db_migrate},
        {"close", db_close}, {"stats", db_stats}, {NULL, NULL},
    };
    static const luaL_Reg db_meta[] = {
        {"__close", db_close}, {"__gc", db_close}, {"__tostring", db_tostring}, {NULL, NULL}};
    static const luaL_Reg cursor_meta[] = {
        {"__close", cursor_close}, {"__gc", cursor_close}, {NULL, NULL}};
    static const luaL_Reg blob_meta[] = {{"__tostring", blob_tostring}, {NULL, NULL}};
    mb_newclass(L, DB_MT, db_methods, db_meta);
    mb_newclass(L, CURSOR_MT, NULL, cursor_meta);
    mb_newclass(L, BLOB_MT, NULL, blob_meta);
    lua_newtable(L);
    lua_pushcfunction(L, l_open);
    lua_setfield(L, -2, "open");
    lua_pushcfunction(L, l_blob);
    lua_setfield(L, -2, "blob");
    return 1;
}
