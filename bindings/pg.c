/*
 * pg.c — module moonbox.pg: PostgreSQL connections (runtime/pg.c) for Lua, where the database
 * of several `moonbox schedule` daemons lives.
 *
 * pg.connect and conn:query yield the calling task while libpq talks to the server on the
 * loop's own watchers, so a slow or restarting database never stalls the loop; cancelling the
 * task (or its deadline) abandons the operation and leaves the connection broken (conn:ok() is
 * false: the caller connects again). Outside a task (no one can wait: a process closing its
 * database after its loop stopped) the same calls wait with poll(2) instead.
 *
 * SQL always travels with bound parameters ($1, $2, ...; PQsendQueryParams, text format);
 * nothing here puts a value into SQL text. Results come back typed by column: booleans,
 * integers (int2/4/8, oid), numbers (float4/8, numeric), text otherwise; NULL columns are left
 * out of the row table, as in moonbox.store.
 *
 * Ownership: a Conn userdata owns its pg_conn (freed by conn:close or __gc). A task parked in
 * an operation keeps the Conn on its stack, so the Conn outlives the wait. No registry refs.
 */
#include "mb.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg.h"

#define CONN_MT     "moonbox.pg.Conn"
#define MAX_PARAMS  64
#define SQL_EXCERPT 120

typedef struct lpg {
    pg_conn *c;      /* NULL once closed */
    mb_task *waiter; /* the task parked in the current operation, or NULL */
    int finished;    /* the current operation ended (its done ran) */
} lpg;

static void op_done(pg_conn *c, void *ud)
{
    lpg *p = (lpg *)ud;
    (void)c;
    p->finished = 1;
    if (p->waiter) mb_task_wake(p->waiter);
}

static void op_abort(mb_task *t, void *ud)
{
    lpg *p = (lpg *)ud;
    (void)t;
    p->waiter = NULL;
    if (p->c) pg_conn_abandon(p->c);
}

static lpg *check_conn(lua_State *L, const char *what)
{
    lpg *p = (lpg *)luaL_checkudata(L, 1, CONN_MT);
    if (!p->c) luaL_error(L, "%s: the connection is closed", what);
    return p;
}

/* Waits for the current operation: parks the task when there is one that can yield, else
 * polls. Continues in k with the Conn at index 1. */
static int wait_op(lua_State *L, lpg *p, lua_KFunction k)
{
    if (!p->finished) {
        mb_task *t = mb_task_of(L);
        if (t && lua_isyieldable(L)) {
            p->waiter = t;
            return mb_task_park(L, t, op_abort, p, 0, k);
        }
        pg_conn_wait(p->c);
    }
    return k(L, LUA_OK, 0);
}

static int connect_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)status;
    (void)ctx;
    lpg *p = (lpg *)lua_touserdata(L, 1);
    p->waiter = NULL;
    if (pg_conn_state(p->c) != PG_READY) {
        mb_error_new(L, "pg.connect", "connect_failed", "%s", pg_conn_error(p->c));
        return lua_error(L);
    }
    lua_settop(L, 1);
    return 1;
}

/* pg.connect(conninfo) -> Conn: connects (a postgres:// URL or key=value text). Raises a
 * structured error (op "pg.connect", code connect_failed) with libpq's reason, which never
 * contains the password. [yields] */
static int l_connect(lua_State *L)
{
    const char *info = luaL_checkstring(L, 1);
    lpg *p = (lpg *)lua_newuserdatauv(L, sizeof *p, 0);
    memset(p, 0, sizeof *p);
    luaL_setmetatable(L, CONN_MT);
    lua_replace(L, 1);
    lua_settop(L, 1);
    mb_runtime *rt = mb_runtime_get(L);
    p->c = pg_conn_start(rt->loop, info, op_done, p);
    if (!p->c) return luaL_error(L, "pg.connect: out of memory");
    return wait_op(L, p, connect_k);
}

/* Pushes the value of row r, column col of res, typed by the column's type. */
static void push_value(lua_State *L, PGresult *res, int r, int col)
{
    const char *v = PQgetvalue(res, r, col);
    switch (PQftype(res, col)) {
    case 16: /* bool */
        lua_pushboolean(L, v[0] == 't');
        break;
    case 20: /* int8 */
    case 21: /* int2 */
    case 23: /* int4 */
    case 26: /* oid */
        lua_pushinteger(L, (lua_Integer)strtoll(v, NULL, 10));
        break;
    case 700:  /* float4 */
    case 701:  /* float8 */
    case 1700: /* numeric */
        lua_pushnumber(L, (lua_Number)strtod(v, NULL));
        break;
    default:
        lua_pushlstring(L, v, (size_t)PQgetlength(res, r, col));
        break;
    }
}

static int push_rows_protected(lua_State *L)
{
    PGresult *res = (PGresult *)lua_touserdata(L, 1);
    int nrows = PQntuples(res), ncols = PQnfields(res);
    lua_createtable(L, nrows, 0);
    for (int r = 0; r < nrows; r++) {
        lua_createtable(L, 0, ncols);
        for (int col = 0; col < ncols; col++) {
            if (PQgetisnull(res, r, col)) continue;
            push_value(L, res, r, col);
            lua_setfield(L, -2, PQfname(res, col));
        }
        lua_rawseti(L, -2, r + 1);
    }
    const char *n = PQcmdTuples(res);
    lua_pushinteger(L, *n ? (lua_Integer)strtoll(n, NULL, 10) : 0);
    return 2;
}

/* Continuation of conn:query once the connection has the statement's result (stack: conn, sql,
 * arguments). Returns 2 values, rows and count (built by push_rows_protected under a pcall so
 * that the PGresult is cleared even on out of memory). Raises "connection_lost" (retryable) when
 * there is no result or the connection broke, and for a failed statement "constraint" (SQLSTATE
 * 23505), "connection_lost" (class 08) or "sql_error", with sqlstate and the server's message
 * followed by the start of the SQL (SQL_EXCERPT bytes). The result is cleared on every path. Runs
 * in the querying task; does not park again. */
static int query_k(lua_State *L, int status, lua_KContext ctx)
{
    (void)status;
    (void)ctx;
    lpg *p = (lpg *)lua_touserdata(L, 1);
    p->waiter = NULL;
    PGresult *res = pg_conn_take_result(p->c);
    const char *sql = lua_tostring(L, 2);
    if (!res || pg_conn_state(p->c) == PG_BROKEN) {
        if (res) PQclear(res);
        mb_error_new(L, "pg.query", "connection_lost", "the database connection was lost: %s",
                     pg_conn_error(p->c));
        mb_setfield_bool(L, -1, "retryable", 1);
        return lua_error(L);
    }
    ExecStatusType st = PQresultStatus(res);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
        char msg[512];
        snprintf(msg, sizeof msg, "%s", PQresultErrorMessage(res));
        size_t n = strlen(msg);
        while (n > 0 && msg[n - 1] == '\n')
            msg[--n] = '\0';
        const char *code = state && strcmp(state, "23505") == 0    ? "constraint"
                           : state && strncmp(state, "08", 2) == 0 ? "connection_lost"
                                                                   : "sql_error";
        char full[768]; /* lua_pushfstring knows no precision: cut the SQL here */
        snprintf(full, sizeof full, "%s (in: %.*s)", msg, SQL_EXCERPT, sql ? sql : "?");
        mb_error_new(L, "pg.query", code, "%s", full);
        if (state) mb_setfield_str(L, -1, "sqlstate", state);
        PQclear(res);
        return lua_error(L);
    }
    lua_settop(L, 0);
    lua_pushcfunction(L, push_rows_protected);
    lua_pushlightuserdata(L, res);
    int rc = lua_pcall(L, 1, 2, 0);
    PQclear(res);
    if (rc != LUA_OK) return lua_error(L);
    return 2;
}

/* conn:query(sql, ...) -> rows, count: runs one statement with the further arguments bound to
 * $1, $2, ... (nil is NULL; booleans, integers, numbers and strings as text). rows: array of
 * tables column -> value (NULL columns absent); count: the rows it inserted, updated, deleted
 * or returned. Raises a structured error (op "pg.query", code constraint | sql_error |
 * connection_lost, sqlstate) — after connection_lost, conn:ok() is false. [yields] */
static int l_query(lua_State *L)
{
    lpg *p = check_conn(L, "conn:query");
    luaL_checkstring(L, 2);
    int n = lua_gettop(L) - 2;
    if (n > MAX_PARAMS) return luaL_error(L, "conn:query: at most %d parameters", MAX_PARAMS);
    if (p->waiter || pg_conn_state(p->c) == PG_BUSY)
        return luaL_error(L, "conn:query: the connection is busy with another query");
    const char *values[MAX_PARAMS];
    for (int i = 0; i < n; i++) {
        int idx = i + 3;
        switch (lua_type(L, idx)) {
        case LUA_TNIL:
            values[i] = NULL;
            break;
        case LUA_TBOOLEAN:
            values[i] = lua_toboolean(L, idx) ? "t" : "f";
            break;
        case LUA_TNUMBER:
            if (lua_isinteger(L, idx)) {
                lua_pushfstring(L, "%I", (LUAI_UACINT)lua_tointeger(L, idx));
            } else {
                char buf[64];
                snprintf(buf, sizeof buf, "%.17g", (double)lua_tonumber(L, idx));
                lua_pushstring(L, buf);
            }
            lua_replace(L, idx);
            values[i] = lua_tostring(L, idx);
            break;
        case LUA_TSTRING:
            values[i] = lua_tostring(L, idx);
            break;
        default:
            return luaL_error(L, "conn:query: parameter %d: cannot bind a %s", i + 1,
                              luaL_typename(L, idx));
        }
    }
    if (pg_conn_state(p->c) != PG_READY) {
        mb_error_new(L, "pg.query", "connection_lost", "the database connection is not usable: %s",
                     pg_conn_error(p->c));
        mb_setfield_bool(L, -1, "retryable", 1);
        return lua_error(L);
    }
    p->finished = 0;
    if (pg_conn_send(p->c, lua_tostring(L, 2), n, values, op_done, p) != 0) {
        mb_error_new(L, "pg.query", "connection_lost", "the database connection was lost: %s",
                     pg_conn_error(p->c));
        mb_setfield_bool(L, -1, "retryable", 1);
        return lua_error(L);
    }
    lua_settop(L, 2);
    return wait_op(L, p, query_k);
}

/* conn:ok() -> whether the connection is connected and idle (false once it broke). */
static int l_ok(lua_State *L)
{
    lpg *p = (lpg *)luaL_checkudata(L, 1, CONN_MT);
    lua_pushboolean(L, p->c && pg_conn_state(p->c) == PG_READY);
    return 1;
}

/* conn:close(): closes the connection; idempotent. Refused while a task waits on it. */
static int l_close(lua_State *L)
{
    lpg *p = (lpg *)luaL_checkudata(L, 1, CONN_MT);
    if (p->waiter) return luaL_error(L, "conn:close: a task is waiting on this connection");
    pg_conn_free(p->c);
    p->c = NULL;
    return 0;
}

static int l_gc(lua_State *L)
{
    lpg *p = (lpg *)luaL_checkudata(L, 1, CONN_MT);
    pg_conn_free(p->c);
    p->c = NULL;
    return 0;
}

int luaopen_moonbox_pg(lua_State *L)
{
    static const luaL_Reg methods[] = {
        {"query", l_query},
        {"ok", l_ok},
        {"close", l_close},
        {NULL, NULL},
    };
    static const luaL_Reg meta[] = {{"__gc", l_gc}, {"__close", l_close}, {NULL, NULL}};
    mb_newclass(L, CONN_MT, methods, meta);
    static const luaL_Reg funcs[] = {
        {"connect", l_connect},
        {NULL, NULL},
    };
    luaL_newlib(L, funcs);
    return 1;
}
