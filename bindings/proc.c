/*
 * proc.c — the module moonbox.proc: child processes as Process objects (spawn, read, lines,
 * write, wait, kill, close) and proc.run, which runs a command to completion and captures it.
 *
 * runtime/proc.c owns the child, its pipes and its bounded buffers; this file turns its events
 * into task wake-ups. Each Process has one wait queue: any event of that process (output, end of
 * a stream, stdin writable, exit) wakes every task waiting on it, and each continuation checks
 * again whether what it waits for has happened. Few tasks wait on one process, so a shared
 * queue costs a spurious resume now and then and saves per-event bookkeeping.
 *
 * Ownership: the Process userdata owns its runtime proc until p:close(), `<close>` or __gc;
 * closing a process that still runs kills its group with SIGKILL and leaves the reap to the
 * runtime. No registry refs are taken: a waiting task keeps its Process alive on its own stack.
 */
#include "mb.h"
#include "proc.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROCESS_MT "moonbox.Process"

/* Uservalue-free userdata; the runtime's notify callback points at it. */
typedef struct lproc {
    proc *p; /* NULL once closed */
    pid_t pid;
    int exited; /* the child was reaped; wstatus is valid */
    int wstatus;
    int kind[3];      /* enum proc_stdio_kind of each stream, for messages */
    mb_waitq waiters; /* every task waiting on this process */
    mb_task *writer;  /* the task inside p:write, or NULL */
    ev_timer timer;   /* proc.run's timeout */
    struct ev_loop *loop;
    int timed_out;
    char name[64]; /* the program as the caller gave it, for messages */
} lproc;

/* ---- signals ------------------------------------------------------------------------------ */

static const struct {
    const char *name;
    int num;
} g_signals[] = {
    {"HUP", SIGHUP},   {"INT", SIGINT},       {"QUIT", SIGQUIT},   {"ILL", SIGILL},
    {"TRAP", SIGTRAP}, {"ABRT", SIGABRT},     {"BUS", SIGBUS},     {"FPE", SIGFPE},
    {"KILL", SIGKILL}, {"USR1", SIGUSR1},     {"SEGV", SIGSEGV},   {"USR2", SIGUSR2},
    {"PIPE", SIGPIPE}, {"ALRM", SIGALRM},     {"TERM", SIGTERM},   {"CHLD", SIGCHLD},
    {"CONT", SIGCONT}, {"STOP", SIGSTOP},     {"TSTP", SIGTSTP},   {"TTIN", SIGTTIN},
    {"TTOU", SIGTTOU}, {"URG", SIGURG},       {"XCPU", SIGXCPU},   {"XFSZ", SIGXFSZ},
    {"PROF", SIGPROF}, {"VTALRM", SIGVTALRM}, {"WINCH", SIGWINCH}, {"IO", SIGIO},
    {"SYS", SIGSYS},
};
#define NSIGNALS (sizeof g_signals / sizeof g_signals[0])

/* Pushes the name of signal sig without "SIG" ("TERM"), or "SIG<n>" for unnamed ones. */
static void push_signal_name(lua_State *L, int sig)
{
    for (size_t i = 0; i < NSIGNALS; i++) {
        if (g_signals[i].num == sig) {
            lua_pushstring(L, g_signals[i].name);
            return;
        }
    }
    lua_pushfstring(L, "SIG%d", sig);
}

/* Reads a signal argument: a name with or without "SIG" in any case, or a number 0..64. */
static int check_signal(lua_State *L, int idx, const char *def)
{
    if (lua_isinteger(L, idx)) {
        lua_Integer n = lua_tointeger(L, idx);
        if (n < 0 || n > 64) luaL_argerror(L, idx, "signal number out of range 0..64");
        return (int)n;
    }
    const char *name = luaL_optstring(L, idx, def);
    const char *bare = strncasecmp(name, "SIG", 3) == 0 ? name + 3 : name;
    for (size_t i = 0; i < NSIGNALS; i++)
        if (strcasecmp(bare, g_signals[i].name) == 0) return g_signals[i].num;
    return luaL_argerror(L, idx, lua_pushfstring(L, "unknown signal '%s'", name));
}

/* ---- the Process object ----------------------------------------------------------------- */

/* Copies the exit status out of the runtime once it is known (it must survive close). */
static void lproc_sync(lproc *lp)
{
    if (!lp->exited && lp->p) lp->exited = proc_exit_status(lp->p, &lp->wstatus);
}

/* The runtime's notify function: records and wakes, never calls Lua (mb.h invariants). */
static void on_proc_event(proc *p, int events, void *ud)
{
    lproc *lp = (lproc *)ud;
    (void)p;
    if (events & PROC_EV_EXIT) lproc_sync(lp);
    mb_waitq_wake_all(&lp->waiters);
}

/* Releases the runtime process (killing its group if it still runs) and wakes every waiter,
 * which then finds the handle closed. Idempotent; safe from __gc and from abort hooks. */
static void lproc_close(lproc *lp)
{
    if (lp->loop && ev_is_active(&lp->timer)) ev_timer_stop(lp->loop, &lp->timer);
    if (lp->p) {
        lproc_sync(lp);
        proc_close(lp->p);
        lp->p = NULL;
    }
    lp->writer = NULL;
    mb_waitq_wake_all(&lp->waiters);
}

static lproc *check_process(lua_State *L, int idx)
{
    return (lproc *)luaL_checkudata(L, idx, PROCESS_MT);
}

static lproc *check_open(lua_State *L, int idx, const char *what)
{
    lproc *lp = check_process(L, idx);
    if (!lp->p)
        luaL_error(L, "%s: the process handle of '%s' (pid %d) is closed", what, lp->name,
                   (int)lp->pid);
    return lp;
}

/* Abort hook of every wait on a Process: the task leaves the queue and, if it was writing,
 * the write watcher stops. The process keeps running and the handle stays usable. The child
 * watcher and the output watchers stay on: they belong to the process, not to the wait, and
 * stopping them would lose the exit status or stall the child. */
static void abort_wait(mb_task *t, void *ud)
{
    lproc *lp = (lproc *)ud;
    mb_waitq_remove(t);
    if (lp->writer == t) {
        lp->writer = NULL;
        if (lp->p) proc_want_writable(lp->p, 0);
    }
}

static int park_on(lua_State *L, lproc *lp, mb_task *t, lua_KContext ctx, lua_KFunction k)
{
    mb_waitq_push(&lp->waiters, t);
    return mb_task_park(L, t, abort_wait, lp, ctx, k);
}

static const char *kind_name(int kind)
{
    switch (kind) {
    case PROC_STDIO_NULL:
        return "null";
    case PROC_STDIO_PIPE:
        return "pipe";
    case PROC_STDIO_INHERIT:
        return "inherit";
    case PROC_STDIO_FILE:
        return "a file";
    default:
        return "stdout";
    }
}

/* Reads the stream argument at idx ("stdout" when absent) and checks it is a pipe. */
static int check_stream(lua_State *L, lproc *lp, int idx, const char *what)
{
    static const char *const names[] = {"stdout", "stderr", NULL};
    int s = luaL_checkoption(L, idx, "stdout", names) + PROC_STDOUT;
    if (!proc_is_pipe(lp->p, s))
        luaL_error(L, "%s: %s of '%s' is not a pipe (it was spawned with %s = %s)", what,
                   names[s - PROC_STDOUT], lp->name, names[s - PROC_STDOUT],
                   kind_name(lp->kind[s]));
    return s;
}

/* Raises the structured error of a failed read of stream s (end < 0 is -errno). */
static int raise_read_error(lua_State *L, lproc *lp, int s, int end)
{
    mb_error_new(L, "proc.read", "io_error", "reading %s of '%s' (pid %d) failed: %s",
                 s == PROC_STDOUT ? "stdout" : "stderr", lp->name, (int)lp->pid, strerror(-end));
    mb_setfield_int(L, -1, "pid", lp->pid);
    return lua_error(L);
}

static int read_k(lua_State *L, int status, lua_KContext ctx)
{
    lproc *lp = check_open(L, 1, "p:read");
    int s = (int)ctx;
    lua_Integer max = lua_tointeger(L, 3);
    const char *data;
    size_t n = proc_peek(lp->p, s, &data);
    (void)status;
    if (n > 0) {
        if (max > 0 && n > (size_t)max) n = (size_t)max;
        lua_pushlstring(L, data, n);
        proc_consume(lp->p, s, n);
        return 1;
    }
    int end = proc_stream_end(lp->p, s);
    if (end < 0) return raise_read_error(L, lp, s, end);
    if (end > 0) {
        lua_pushnil(L);
        return 1;
    }
    return park_on(L, lp, mb_task_check_yieldable(L, "p:read"), ctx, read_k);
}

/* p:read([stream [, max]]) -> string|nil. stream is "stdout" (default) or "stderr" and must have
 * been spawned as a pipe; max (> 0) caps the size of the chunk. Returns the bytes buffered so
 * far (at most max), waiting for some when none are; returns nil at the end of the stream.
 * Raises a usage error if the stream is not a pipe or the handle is closed, and a structured
 * error (op "proc.read", code "io_error") if reading the pipe failed. [yields] */
static int l_read(lua_State *L)
{
    lproc *lp = check_open(L, 1, "p:read");
    int s = check_stream(L, lp, 2, "p:read");
    lua_Integer max = luaL_optinteger(L, 3, 0);
    if (max < 0 || (lua_gettop(L) >= 3 && !lua_isnil(L, 3) && max == 0))
        return luaL_argerror(L, 3, "expected a maximum size > 0");
    lua_settop(L, 3);
    lua_pushinteger(L, max);
    lua_replace(L, 3);
    return read_k(L, LUA_OK, s);
}

/* Pushes the pieces gathered in the table at `pieces` followed by tail[0..n) as one string, and
 * empties the table. O(total length): pieces are concatenated once, not line by line. */
static void push_joined(lua_State *L, int pieces, const char *tail, size_t n)
{
    luaL_Buffer b;
    lua_Integer count = (lua_Integer)lua_rawlen(L, pieces);
    luaL_buffinit(L, &b);
    for (lua_Integer i = 1; i <= count; i++) {
        lua_rawgeti(L, pieces, i);
        luaL_addvalue(&b);
    }
    luaL_addlstring(&b, tail, n);
    luaL_pushresult(&b);
    for (lua_Integer i = count; i >= 1; i--) {
        lua_pushnil(L);
        lua_rawseti(L, pieces, i);
    }
}

/* The iterator p:lines returns; upvalues: the Process, the stream, a table of the current
 * line's earlier pieces. A line that does not fit in the C buffer is moved piece by piece into
 * that table, so the buffer keeps its bound however long the line is. */
static int lines_k(lua_State *L, int status, lua_KContext ctx)
{
    lproc *lp = check_open(L, lua_upvalueindex(1), "p:lines");
    int s = (int)ctx;
    int pieces = lua_upvalueindex(3);
    (void)status;
    for (;;) {
        const char *data;
        size_t n = proc_peek(lp->p, s, &data);
        const char *nl = n > 0 ? (const char *)memchr(data, '\n', n) : NULL;
        if (nl) {
            size_t len = (size_t)(nl - data);
            push_joined(L, pieces, data, len);
            proc_consume(lp->p, s, len + 1);
            return 1;
        }
        if (n == 0) break;
        lua_pushlstring(L, data, n);
        lua_rawseti(L, pieces, (lua_Integer)lua_rawlen(L, pieces) + 1);
        proc_consume(lp->p, s, n);
    }
    int end = proc_stream_end(lp->p, s);
    if (end < 0) return raise_read_error(L, lp, s, end);
    if (end > 0) {
        if (lua_rawlen(L, pieces) > 0)
            push_joined(L, pieces, "", 0); /* the last line had no newline */
        else
            lua_pushnil(L);
        return 1;
    }
    return park_on(L, lp, mb_task_check_yieldable(L, "p:lines iterator"), ctx, lines_k);
}

static int lines_iter(lua_State *L)
{
    lua_settop(L, 0); /* the generic for's state and control values are not used */
    lua_Integer s = lua_tointeger(L, lua_upvalueindex(2));
    return lines_k(L, LUA_OK, (lua_KContext)s);
}

/* p:lines([stream]) -> iterator. Each call of the iterator returns the next line of stream
 * ("stdout" by default) without its "\n" (a "\r" before it is kept), the last line even when it
 * does not end with a newline, then nil at the end of the stream. Raises like p:read; the
 * iterator [yields]. */
static int l_lines(lua_State *L)
{
    lproc *lp = check_open(L, 1, "p:lines");
    int s = check_stream(L, lp, 2, "p:lines");
    lua_settop(L, 1);
    lua_pushinteger(L, s);
    lua_newtable(L);
    lua_pushcclosure(L, lines_iter, 3);
    return 1;
}

static int raise_write_error(lua_State *L, lproc *lp, long rc, size_t off, size_t len)
{
    if (rc == -EPIPE)
        mb_error_new(L, "proc.write", "broken_pipe",
                     "'%s' (pid %d) closed its stdin after %I of %I bytes were written", lp->name,
                     (int)lp->pid, (lua_Integer)off, (lua_Integer)len);
    else if (rc == -EBADF)
        mb_error_new(L, "proc.write", "closed",
                     "stdin of '%s' (pid %d) was closed after %I of %I bytes were written",
                     lp->name, (int)lp->pid, (lua_Integer)off, (lua_Integer)len);
    else
        mb_error_new(L, "proc.write", "io_error", "writing to stdin of '%s' (pid %d) failed: %s",
                     lp->name, (int)lp->pid, strerror((int)-rc));
    mb_setfield_int(L, -1, "pid", lp->pid);
    mb_setfield_int(L, -1, "written", (lua_Integer)off);
    return lua_error(L);
}

static int write_k(lua_State *L, int status, lua_KContext ctx)
{
    lproc *lp = check_process(L, 1);
    size_t off = (size_t)ctx, len;
    const char *data = lua_tolstring(L, 2, &len);
    (void)status;
    lp->writer = NULL; /* we run again; we take the slot back below if we must wait more */
    if (!lp->p) return raise_write_error(L, lp, -EBADF, off, len);
    while (off < len) {
        long n = proc_write(lp->p, data + off, len - off);
        if (n < 0) return raise_write_error(L, lp, n, off, len);
        if (n == 0) {
            mb_task *t = mb_task_check_yieldable(L, "p:write");
            lp->writer = t;
            proc_want_writable(lp->p, 1);
            return park_on(L, lp, t, (lua_KContext)off, write_k);
        }
        off += (size_t)n;
    }
    return 0;
}

/* p:write(data): writes the string data to the child's stdin (spawned with stdin = "pipe"),
 * waiting while the pipe is full. Returns nothing once every byte is in the pipe. If the task
 * is cancelled meanwhile, a prefix of data may have been written. Raises a usage error if stdin
 * is not a pipe, the handle is closed, or another task is writing to it; a structured error
 * (op "proc.write", code "broken_pipe" when the child closed its stdin, "closed" after
 * p:close_stdin, else "io_error"; fields pid, written). [yields] */
static int l_write(lua_State *L)
{
    lproc *lp = check_open(L, 1, "p:write");
    luaL_checkstring(L, 2);
    lua_settop(L, 2);
    if (!proc_is_pipe(lp->p, PROC_STDIN))
        return luaL_error(L,
                          "p:write: stdin of '%s' is not a pipe (it was spawned with stdin = %s)",
                          lp->name, kind_name(lp->kind[PROC_STDIN]));
    if (lp->writer)
        return luaL_error(L, "p:write: another task is already writing to the stdin of '%s'",
                          lp->name);
    return write_k(L, LUA_OK, 0);
}

/* p:close_stdin(): closes the child's stdin so it reads end of file. Idempotent; a task waiting
 * in p:write gets an error with code "closed". Does not yield. */
static int l_close_stdin(lua_State *L)
{
    lproc *lp = check_process(L, 1);
    if (lp->p) {
        proc_close_stdin(lp->p);
        mb_waitq_wake_all(&lp->waiters);
    }
    return 0;
}

/* Pushes code, signal for a waitpid status: (n, nil) after exit(n), (nil, "TERM") after a
 * signal. */
static int push_exit(lua_State *L, int wstatus)
{
    if (WIFSIGNALED(wstatus)) {
        lua_pushnil(L);
        push_signal_name(L, WTERMSIG(wstatus));
    } else {
        lua_pushinteger(L, WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1);
        lua_pushnil(L);
    }
    return 2;
}

static int wait_k(lua_State *L, int status, lua_KContext ctx)
{
    lproc *lp = check_process(L, 1);
    (void)status;
    lproc_sync(lp);
    if (lp->exited) return push_exit(L, lp->wstatus);
    check_open(L, 1, "p:wait");
    return park_on(L, lp, mb_task_check_yieldable(L, "p:wait"), ctx, wait_k);
}

/* p:wait() -> code, signal. Waits for the child to exit: code is its exit status (0-255) and
 * signal nil, or code is nil and signal the name of the signal that killed it ("TERM", "KILL",
 * "SEGV", ...; "SIG<n>" for unnamed ones). Returns at once when it already exited, also after
 * p:close(). Does not read the pipes: output beyond the buffer bound makes the child wait for a
 * reader. Cancelling the waiting task leaves the process running and the handle usable. Raises
 * a usage error if the handle was closed before the exit was seen. [yields] */
static int l_wait(lua_State *L)
{
    lua_settop(L, 1);
    return wait_k(L, LUA_OK, 0);
}

/* p:kill([sig]) -> boolean. Sends sig (default "TERM"; a name like "KILL", "INT" or "SIGHUP",
 * or a number; 0 only checks) to the child's whole process group. Returns true when sent, false
 * once the child has exited and been reaped or the handle is closed (nothing is sent: the group
 * id may belong to someone else by then). Raises a structured error (op "proc.kill", code
 * "permission_denied" or "kill_failed") if kill(2) refuses. Does not yield. */
static int l_kill(lua_State *L)
{
    lproc *lp = check_process(L, 1);
    int sig = check_signal(L, 2, "TERM");
    lproc_sync(lp);
    if (!lp->p || lp->exited) {
        lua_pushboolean(L, 0);
        return 1;
    }
    int rc = proc_kill(lp->p, sig);
    if (rc == -ESRCH) {
        lua_pushboolean(L, 0);
        return 1;
    }
    if (rc < 0) {
        mb_error_new(L, "proc.kill", rc == -EPERM ? "permission_denied" : "kill_failed",
                     "cannot signal the process group of '%s' (pid %d): %s", lp->name, (int)lp->pid,
                     strerror(-rc));
        mb_setfield_int(L, -1, "pid", lp->pid);
        return lua_error(L);
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* p:close(): releases the handle: stops its watchers and closes its pipes; if the child still
 * runs, kills its whole group with SIGKILL (the runtime reaps it later). Idempotent. Also runs
 * as `<close>` and when the handle is garbage collected, so a process never outlives its handle
 * silently. Does not yield. */
static int l_close(lua_State *L)
{
    lproc_close(check_process(L, 1));
    return 0;
}

static int l_gc(lua_State *L)
{
    lproc_close((lproc *)lua_touserdata(L, 1));
    return 0;
}

/* p:stats() -> {stdout_buffered, stderr_buffered, stdout_peak, stderr_peak, stdout_bytes,
 * stderr_bytes, buffer_limit}: bytes held in the C buffers now, the most held at once, bytes
 * read from the child so far, and the per-stream bound. Raises if the handle is closed. */
static int l_stats(lua_State *L)
{
    lproc *lp = check_open(L, 1, "p:stats");
    proc_stats st;
    proc_get_stats(lp->p, &st);
    lua_createtable(L, 0, 7);
    mb_setfield_int(L, -1, "stdout_buffered", (lua_Integer)st.buffered[PROC_STDOUT]);
    mb_setfield_int(L, -1, "stderr_buffered", (lua_Integer)st.buffered[PROC_STDERR]);
    mb_setfield_int(L, -1, "stdout_peak", (lua_Integer)st.peak[PROC_STDOUT]);
    mb_setfield_int(L, -1, "stderr_peak", (lua_Integer)st.peak[PROC_STDERR]);
    mb_setfield_int(L, -1, "stdout_bytes", (lua_Integer)st.total[PROC_STDOUT]);
    mb_setfield_int(L, -1, "stderr_bytes", (lua_Integer)st.total[PROC_STDERR]);
    mb_setfield_int(L, -1, "buffer_limit", (lua_Integer)st.buffer_limit);
    return 1;
}

static int l_tostring(lua_State *L)
{
    lproc *lp = check_process(L, 1);
    lproc_sync(lp);
    if (lp->exited && WIFSIGNALED(lp->wstatus)) {
        push_signal_name(L, WTERMSIG(lp->wstatus));
        lua_pushfstring(L, "Process %d (%s, killed by %s)", (int)lp->pid, lp->name,
                        lua_tostring(L, -1));
    } else if (lp->exited) {
        lua_pushfstring(L, "Process %d (%s, exited %d)", (int)lp->pid, lp->name,
                        WEXITSTATUS(lp->wstatus));
    } else {
        lua_pushfstring(L, "Process %d (%s, %s)", (int)lp->pid, lp->name,
                        lp->p ? "running" : "closed");
    }
    return 1;
}

/* p.pid, then the methods (upvalue 1). */
static int l_index(lua_State *L)
{
    lproc *lp = check_process(L, 1);
    const char *k = lua_tostring(L, 2);
    if (k && strcmp(k, "pid") == 0) {
        lua_pushinteger(L, lp->pid);
        return 1;
    }
    lua_pushvalue(L, 2);
    lua_rawget(L, lua_upvalueindex(1));
    return 1;
}

/* ---- spawning ------------------------------------------------------------------------------ */

/* Everything spawn_process reads from an options table; strings are anchored on the Lua stack
 * for as long as the spawn needs them. */
typedef struct spawn_spec {
    proc_opts o;
    const char *name; /* the caller's argv[1], for messages */
} spawn_spec;

static int is_known_option(const char *k, int for_run)
{
    static const char *const common[] = {"env",    "env_mode", "cwd",    "stdin", "stdout",
                                         "stderr", "shell",    "buffer", NULL};
    for (int i = 0; common[i]; i++)
        if (strcmp(k, common[i]) == 0) return 1;
    return for_run && (strcmp(k, "input") == 0 || strcmp(k, "timeout") == 0);
}

/* Appends the string on top of the stack to the sequence at `list` and returns a pointer to it
 * that stays valid while the list is alive. */
static const char *anchor_top(lua_State *L, int list)
{
    const char *s = lua_tostring(L, -1);
    lua_rawseti(L, list, (lua_Integer)lua_rawlen(L, list) + 1);
    return s;
}

/* Pushes a NULL-terminated array of the strings in the sequence at list (a userdata). */
static const char *const *push_string_array(lua_State *L, int list)
{
    size_t n = lua_rawlen(L, list);
    const char **arr = (const char **)lua_newuserdatauv(L, (n + 1) * sizeof *arr, 0);
    for (size_t i = 0; i < n; i++) {
        lua_rawgeti(L, list, (lua_Integer)i + 1);
        arr[i] = lua_tostring(L, -1); /* kept alive by list */
        lua_pop(L, 1);
    }
    arr[n] = NULL;
    return arr;
}

/* Checks that the value at vidx (an element of the options table, argument 1) is a string or
 * a number, converting it in place; raises naming `what` for anything else or for a string with
 * an embedded NUL, which no C program could receive. */
static void check_arg_string(lua_State *L, int vidx, const char *what)
{
    size_t len;
    int t = lua_type(L, vidx);
    if (t != LUA_TSTRING && t != LUA_TNUMBER)
        luaL_argerror(
            L, 1,
            lua_pushfstring(L, "%s is a %s, expected a string", what, luaL_typename(L, vidx)));
    const char *s = lua_tolstring(L, vidx, &len);
    if (strlen(s) != len) luaL_argerror(L, 1, lua_pushfstring(L, "%s contains a NUL byte", what));
}

/* Parses opts.stdin/stdout/stderr into io. */
static void parse_stdio(lua_State *L, int opts, int i, int def, proc_stdio *io)
{
    static const char *const names[] = {"stdin", "stdout", "stderr"};
    io->kind = def;
    io->path = NULL;
    io->append = 0;
    int t = lua_getfield(L, opts, names[i]);
    if (t == LUA_TSTRING) {
        const char *v = lua_tostring(L, -1);
        if (strcmp(v, "pipe") == 0)
            io->kind = PROC_STDIO_PIPE;
        else if (strcmp(v, "inherit") == 0)
            io->kind = PROC_STDIO_INHERIT;
        else if (strcmp(v, "null") == 0)
            io->kind = PROC_STDIO_NULL;
        else if (strcmp(v, "stdout") == 0 && i == PROC_STDERR)
            io->kind = PROC_STDIO_STDOUT;
        else
            t = LUA_TNONE;
    } else if (t == LUA_TTABLE) {
        io->kind = PROC_STDIO_FILE;
        if (lua_getfield(L, -1, "file") != LUA_TSTRING) t = LUA_TNONE;
        io->path = lua_tostring(L, -1); /* anchored by opts */
        lua_pop(L, 1);
        lua_getfield(L, -1, "append");
        io->append = lua_toboolean(L, -1);
        lua_pop(L, 1);
    } else if (t != LUA_TNIL) {
        t = LUA_TNONE;
    }
    if (t == LUA_TNONE)
        luaL_argerror(
            L, 1,
            lua_pushfstring(L, "%s must be \"pipe\", \"inherit\", \"null\"%s or {file = path}",
                            names[i], i == PROC_STDERR ? ", \"stdout\"" : ""));
    lua_pop(L, 1);
}

/* Builds the child's environment into the sequence at `list` from opts.env (table at env):
 * "extend" starts from ours (names given in env replace ours; false removes them), "replace"
 * uses only env. */
static void build_env(lua_State *L, int env, int replace, int list)
{
    if (!replace) {
        for (char **e = environ; *e; e++) {
            const char *eq = strchr(*e, '=');
            if (!eq) continue;
            lua_pushlstring(L, *e, (size_t)(eq - *e));
            int given = lua_rawget(L, env) != LUA_TNIL;
            lua_pop(L, 1);
            if (given) continue;
            lua_pushstring(L, *e);
            anchor_top(L, list);
        }
    }
    lua_pushnil(L);
    while (lua_next(L, env)) {
        size_t klen;
        if (lua_type(L, -2) != LUA_TSTRING)
            luaL_argerror(L, 1, "env keys must be variable names (strings)");
        const char *k = lua_tolstring(L, -2, &klen);
        if (klen == 0 || strchr(k, '=') || strlen(k) != klen)
            luaL_argerror(L, 1, lua_pushfstring(L, "env: invalid variable name '%s'", k));
        if (lua_type(L, -1) == LUA_TBOOLEAN && !lua_toboolean(L, -1)) {
            lua_pop(L, 1); /* false: leave the variable out */
            continue;
        }
        int v = lua_gettop(L);
        check_arg_string(L, v, lua_pushfstring(L, "env.%s", k));
        lua_pop(L, 1);
        lua_pushfstring(L, "%s=%s", k, lua_tostring(L, -1));
        anchor_top(L, list);
        lua_pop(L, 1);
    }
}

/* Reads the spawn options of the table at opts into sp: argv (opts[1..], wrapped in
 * /bin/sh -c when opts.shell), env and env_mode, cwd, stdin/stdout/stderr (stdin defaults to a
 * pipe when input_pipe, else to /dev/null) and buffer; for_run also admits proc.run's input
 * and timeout. Pushes one anchor table holding the strings and the argv/env arrays sp points
 * into: it must stay on the stack until the spawn is done. Raises an argument error (argument 1)
 * for an unknown option, an empty argv, a non-string argv entry, env or cwd, stdout = "stdout", or
 * input without a piped stdin; sp must not be used then. Does not yield. */
static void parse_spawn(lua_State *L, int opts, int for_run, int input_pipe, spawn_spec *sp)
{
    memset(sp, 0, sizeof *sp);
    luaL_checktype(L, opts, LUA_TTABLE);
    lua_newtable(L);
    int strings = lua_gettop(L);

    lua_pushnil(L);
    while (lua_next(L, opts)) {
        lua_pop(L, 1);
        if (lua_type(L, -1) == LUA_TSTRING && !is_known_option(lua_tostring(L, -1), for_run))
            luaL_argerror(L, 1, lua_pushfstring(L, "unknown option '%s'", lua_tostring(L, -1)));
    }

    lua_Integer n = luaL_len(L, opts);
    if (n < 1) luaL_argerror(L, 1, "expected an argv array with at least the program name");
    lua_getfield(L, opts, "shell");
    int shell = lua_toboolean(L, -1);
    lua_pop(L, 1);
    lua_newtable(L);
    int argv = lua_gettop(L);
    if (shell) {
        lua_pushliteral(L, "/bin/sh");
        anchor_top(L, argv);
        lua_pushliteral(L, "-c");
        anchor_top(L, argv);
    }
    for (lua_Integer i = 1; i <= n; i++) {
        lua_geti(L, opts, i);
        int v = lua_gettop(L);
        check_arg_string(L, v, lua_pushfstring(L, "argv[%I]", (lua_Integer)i));
        lua_pop(L, 1);
        if (i == 1) sp->name = lua_tostring(L, -1);
        anchor_top(L, argv);
        if (shell && i == 1) {
            lua_pushliteral(L, "sh"); /* $0 of the script; argv[2..] become $1.. */
            anchor_top(L, argv);
        }
    }
    sp->o.argv = push_string_array(L, argv);
    lua_rawseti(L, strings, 1);
    lua_rawseti(L, strings, 2); /* argv strings stay reachable through the anchor */

    if (lua_getfield(L, opts, "env") != LUA_TNIL) {
        luaL_argexpected(L, lua_istable(L, -1), 1, "env to be a table");
        static const char *const modes[] = {"extend", "replace", NULL};
        lua_getfield(L, opts, "env_mode");
        int replace = luaL_checkoption(L, -1, "extend", modes);
        lua_pop(L, 1);
        lua_newtable(L);
        build_env(L, lua_gettop(L) - 1, replace, lua_gettop(L));
        sp->o.envp = push_string_array(L, lua_gettop(L));
        lua_rawseti(L, strings, 3);
        lua_rawseti(L, strings, 4);
    }
    lua_pop(L, 1);

    if (lua_getfield(L, opts, "cwd") != LUA_TNIL) {
        check_arg_string(L, lua_gettop(L), "cwd");
        sp->o.cwd = lua_tostring(L, -1);
        lua_rawseti(L, strings, 5);
    } else {
        lua_pop(L, 1);
    }

    parse_stdio(L, opts, PROC_STDIN, input_pipe ? PROC_STDIO_PIPE : PROC_STDIO_NULL,
                &sp->o.stdio[PROC_STDIN]);
    parse_stdio(L, opts, PROC_STDOUT, PROC_STDIO_PIPE, &sp->o.stdio[PROC_STDOUT]);
    parse_stdio(L, opts, PROC_STDERR, PROC_STDIO_PIPE, &sp->o.stdio[PROC_STDERR]);
    if (sp->o.stdio[PROC_STDOUT].kind == PROC_STDIO_STDOUT)
        luaL_argerror(L, 1, "stdout cannot be \"stdout\"");
    if (input_pipe && sp->o.stdio[PROC_STDIN].kind != PROC_STDIO_PIPE)
        luaL_argerror(L, 1, "input needs stdin = \"pipe\" (the default when input is given)");

    if (lua_getfield(L, opts, "buffer") != LUA_TNIL) {
        lua_Integer lim = lua_tointeger(L, -1);
        if (!lua_isinteger(L, -1) || lim < 1)
            luaL_argerror(L, 1, "buffer must be an integer number of bytes >= 1");
        sp->o.buffer_limit = (size_t)lim;
    }
    lua_pop(L, 1);
    lua_settop(L, strings); /* keep only the anchor table */
}

/* Spawns the process the options table at opts describes and pushes its Process object. On a
 * spawn failure raises the structured error (op names the Lua function). */
static lproc *spawn_process(lua_State *L, int opts, int for_run, int input_pipe, const char *op)
{
    mb_runtime *rt = mb_runtime_get(L);
    spawn_spec sp;
    char err[512];
    parse_spawn(L, opts, for_run, input_pipe, &sp);
    lproc *lp = (lproc *)lua_newuserdatauv(L, sizeof *lp, 0);
    memset(lp, 0, sizeof *lp);
    lp->loop = rt->loop;
    ev_timer_init(&lp->timer, NULL, 0, 0);
    lp->timer.data = lp;
    snprintf(lp->name, sizeof lp->name, "%s", sp.name);
    for (int i = 0; i < 3; i++)
        lp->kind[i] = sp.o.stdio[i].kind;
    luaL_setmetatable(L, PROCESS_MT);
    sp.o.notify = on_proc_event;
    sp.o.notify_ud = lp;
    int rc = proc_spawn(rt->loop, &sp.o, &lp->p, err, sizeof err);
    if (rc != PROC_OK) {
        const char *code = rc == PROC_ERR_NOT_FOUND    ? "not_found"
                           : rc == PROC_ERR_PERMISSION ? "permission_denied"
                                                       : "spawn_failed";
        mb_error_new(L, op, code, "%s", err);
        mb_setfield_str(L, -1, "program", sp.name);
        if (sp.o.cwd) mb_setfield_str(L, -1, "cwd", sp.o.cwd);
        return (lproc *)(intptr_t)lua_error(L);
    }
    lp->pid = proc_pid(lp->p);
    lua_remove(L, -2); /* the anchors: the child has its own copies now */
    return lp;
}

/* proc.spawn(argv_or_opts) -> Process. Starts a child process; does not wait for it and does
 * not yield. argv_or_opts is an array of strings (numbers are converted), the program first;
 * the program is searched in PATH unless it contains a slash, and no shell is involved, so
 * arguments arrive exactly as given. Options in the same table:
 *   shell = true     run `/bin/sh -c argv[1]`, argv[2], ... becoming $1, ... of the script
 *   env = {K = v}    environment variables (v a string or number; false removes K)
 *   env_mode         "extend" (default: env is added to ours) or "replace" (env only)
 *   cwd = path       working directory of the child
 *   stdin            "null" (default), "pipe", "inherit" or {file = path}
 *   stdout, stderr   "pipe" (default), "inherit", "null" or {file = path, append = bool};
 *                    stderr may also be "stdout" (2>&1)
 *   buffer = bytes   held per output stream before reading pauses (default 65536)
 * The child leads a new process group, starts with default signal dispositions and an empty
 * signal mask, and inherits no fd but 0-2. Raises a usage error for bad arguments and a
 * structured error (op "proc.spawn", code "not_found", "permission_denied" or "spawn_failed";
 * fields program, cwd) when the child cannot be started. */
static int l_spawn(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_settop(L, 1);
    spawn_process(L, 1, 0, 0, "proc.spawn");
    return 1;
}

/* ---- proc.run ------------------------------------------------------------------------------ */

/* Stack of proc.run while it waits. */
#define RUN_OPTS   1
#define RUN_INPUT  2
#define RUN_PROC   3
#define RUN_OUT    4 /* pieces of stdout */
#define RUN_ERR    5 /* pieces of stderr */
#define RUN_SECS   6 /* the timeout in seconds, or nil */
#define RUN_RESULT 7

static void run_timeout_cb(struct ev_loop *loop, ev_timer *w, int revents)
{
    lproc *lp = (lproc *)w->data;
    (void)loop;
    (void)revents;
    lp->timed_out = 1;
    if (lp->p) proc_kill(lp->p, SIGKILL);
    mb_waitq_wake_all(&lp->waiters);
}

/* Abort hook of proc.run: a cancelled or timed-out caller kills the group at once (SIGKILL)
 * and releases the pipes; the cancellation error is raised after this returns. */
static void abort_run(mb_task *t, void *ud)
{
    mb_waitq_remove(t);
    lproc_close((lproc *)ud);
}

/* Moves everything buffered for stream s into the pieces table at idx. */
static void run_drain(lua_State *L, lproc *lp, int s, int idx)
{
    const char *data;
    size_t n = proc_peek(lp->p, s, &data);
    if (n == 0) return;
    lua_pushlstring(L, data, n);
    lua_rawseti(L, idx, (lua_Integer)lua_rawlen(L, idx) + 1);
    proc_consume(lp->p, s, n);
}

/* Sets result[field] to the joined pieces at idx, or leaves it nil if s was not a pipe. */
static void run_set_output(lua_State *L, lproc *lp, int s, int idx, const char *field)
{
    if (lp->kind[s] != PROC_STDIO_PIPE) return;
    push_joined(L, idx, "", 0);
    lua_setfield(L, RUN_RESULT, field);
}

/* The body of proc.run and its continuation after every park; ctx is how many bytes of the
 * input string were written so far. Stack as RUN_* above. Each pass drains buffered stdout and
 * stderr into their piece tables, writes what stdin takes of the input (closing stdin after the
 * last byte, or at EPIPE), and parks the task (abort hook abort_run) until the child is reaped
 * and both outputs reached EOF, or only until the reap after a timeout. Then returns one value,
 * the result table {code, signal, pid, stdout, stderr} (stdout/stderr only for pipes), and
 * closes the handle. Raises a "timeout" structured error (retryable, with pid, seconds and the
 * output captured so far) if the timer killed the group, and a plain error if the handle was
 * closed under it. [yields] */
static int run_k(lua_State *L, int status, lua_KContext ctx)
{
    lproc *lp = (lproc *)lua_touserdata(L, RUN_PROC);
    size_t off = (size_t)ctx, len = 0;
    const char *input = lua_tolstring(L, RUN_INPUT, &len);
    (void)status;
    if (!lp->p) return luaL_error(L, "proc.run: the process handle was closed");
    lproc_sync(lp);
    run_drain(L, lp, PROC_STDOUT, RUN_OUT);
    run_drain(L, lp, PROC_STDERR, RUN_ERR);
    if (input && proc_is_pipe(lp->p, PROC_STDIN)) {
        while (off < len) {
            long n = proc_write(lp->p, input + off, len - off);
            if (n == 0) {
                proc_want_writable(lp->p, 1);
                break;
            }
            /* A child that stops reading (EPIPE) just does not get the rest, as with a shell
             * here-string; its exit status tells whether that was a failure. */
            off = n < 0 ? len : off + (size_t)n;
        }
        if (off >= len) proc_close_stdin(lp->p);
    }
    int outputs_done =
        proc_stream_end(lp->p, PROC_STDOUT) != 0 && proc_stream_end(lp->p, PROC_STDERR) != 0;
    /* After a timeout only the reap matters: a killed group's pipes may be held open by a
     * process that left the group, and its EOF might never come. */
    if (!lp->exited || (!outputs_done && !lp->timed_out)) {
        mb_task *t = mb_task_of(L);
        mb_waitq_push(&lp->waiters, t);
        return mb_task_park(L, t, abort_run, lp, (lua_KContext)off, run_k);
    }

    lua_settop(L, RUN_SECS);
    lua_createtable(L, 0, 5);
    push_exit(L, lp->wstatus);
    lua_setfield(L, RUN_RESULT, "signal");
    lua_setfield(L, RUN_RESULT, "code");
    mb_setfield_int(L, RUN_RESULT, "pid", lp->pid);
    run_set_output(L, lp, PROC_STDOUT, RUN_OUT, "stdout");
    run_set_output(L, lp, PROC_STDERR, RUN_ERR, "stderr");
    int timed_out = lp->timed_out;
    lproc_close(lp);
    if (!timed_out) return 1;
    mb_error_new(L, "proc.run", "timeout",
                 "'%s' (pid %d) did not finish within %f s; its process group was killed", lp->name,
                 (int)lp->pid, lua_tonumber(L, RUN_SECS));
    int e = lua_gettop(L);
    mb_setfield_int(L, e, "pid", lp->pid);
    mb_setfield_bool(L, e, "retryable", 1);
    lua_pushvalue(L, RUN_SECS);
    lua_setfield(L, e, "seconds");
    lua_getfield(L, RUN_RESULT, "stdout");
    lua_setfield(L, e, "stdout");
    lua_getfield(L, RUN_RESULT, "stderr");
    lua_setfield(L, e, "stderr");
    return lua_error(L);
}

/* proc.run(argv_or_opts) -> {code, signal, stdout, stderr, pid}. Runs a command to completion
 * and captures its output: the same argv and options as proc.spawn, plus
 *   input = string   written to the child's stdin (which then defaults to "pipe"), then closed
 *   timeout = secs   on expiry the whole group is killed (SIGKILL) and an error is raised
 * Both pipes are drained together while the input is written, so a child that fills stderr or
 * stops reading stdin cannot deadlock. code/signal are as p:wait returns them; stdout/stderr are
 * the complete output, or nil for a stream that was not a pipe. A non-zero exit is a result,
 * not an error. Raises what proc.spawn raises, and a structured error (op "proc.run", code
 * "timeout"; fields pid, seconds, stdout and stderr captured so far). If the calling task is
 * cancelled or its deadline expires, the group is killed before the error propagates. [yields] */
static int l_run(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    mb_task_check_yieldable(L, "proc.run");
    lua_settop(L, 1);
    lua_getfield(L, RUN_OPTS, "input");
    if (!lua_isnil(L, RUN_INPUT) && !lua_isstring(L, RUN_INPUT))
        return luaL_argerror(L, 1, "input must be a string");
    lua_getfield(L, RUN_OPTS, "timeout");
    double secs = 0;
    if (!lua_isnil(L, -1)) {
        int isnum;
        secs = lua_tonumberx(L, -1, &isnum);
        if (!isnum || secs != secs || secs < 0)
            return luaL_argerror(L, 1, "timeout must be a number of seconds >= 0");
    }
    int has_timeout = !lua_isnil(L, -1);
    lua_pop(L, 1);
    lproc *lp = spawn_process(L, RUN_OPTS, 1, !lua_isnil(L, RUN_INPUT), "proc.run");
    lua_newtable(L);
    lua_newtable(L);
    if (has_timeout) {
        lua_pushnumber(L, secs);
        ev_timer_init(&lp->timer, run_timeout_cb, secs, 0);
        lp->timer.data = lp;
        ev_timer_start(lp->loop, &lp->timer);
    } else {
        lua_pushnil(L);
    }
    return run_k(L, LUA_OK, 0);
}

/* proc.live_count() -> the number of child processes moonbox still tracks: open handles plus
 * closed ones whose kill has not been reaped yet. */
static int l_live_count(lua_State *L)
{
    lua_pushinteger(L, proc_live_count());
    return 1;
}

/* ---- module -------------------------------------------------------------------------------- */

static const luaL_Reg process_methods[] = {
    {"read", l_read}, {"lines", l_lines}, {"write", l_write}, {"close_stdin", l_close_stdin},
    {"wait", l_wait}, {"kill", l_kill},   {"close", l_close}, {"stats", l_stats},
    {NULL, NULL},
};

static const luaL_Reg proc_funcs[] = {
    {"spawn", l_spawn},
    {"run", l_run},
    {"live_count", l_live_count},
    {NULL, NULL},
};

int luaopen_moonbox_proc(lua_State *L)
{
    mb_runtime_get(L);
    static const luaL_Reg meta[] = {
        {"__close", l_close}, {"__gc", l_gc}, {"__tostring", l_tostring}, {NULL, NULL}};
    mb_newclass_index(L, PROCESS_MT, process_methods, l_index, meta);
    luaL_newlib(L, proc_funcs);
    return 1;
}
