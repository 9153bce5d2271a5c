/*
 * lineedit.c — moonbox.lineedit: the REPL's terminal side. Line editing, history and completion
 * come from libedit's readline-compatible *callback* interface, driven by an ev_io on stdin, so
 * the event loop (and every background task) keeps running while the prompt waits.
 *
 * The reading task parks until stdin is readable; its continuation (task context, so Lua may be
 * called) feeds the available bytes to rl_callback_read_char. Completion therefore calls the
 * Lua completer from inside a running task, never from a libev callback.
 *
 * SIGINT is owned here while the module is open: a sigaction handler writes to a self-pipe
 * (watched by an ev_io) and, when a chunk task is the interrupt target, sets a debug hook on its
 * coroutine as lua.c does, so even a chunk busy in pure Lua stops. The loop side cancels a
 * parked target (its `<close>` guards and exec kills unwind normally) or, at the prompt, discards
 * the line being edited. One reader at a time; the module state is static because the terminal
 * and the signal are one per process.
 */
#include "mb.h"

#include <editline/readline.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define COMPLETER_KEY "moonbox.lineedit.completer"
#define MAX_MATCHES   4096

enum read_state { RS_IDLE, RS_WAITING };

static struct {
    int open;
    struct ev_loop *loop;
    ev_io in_io;  /* stdin readable: wakes the reader */
    ev_io sig_io; /* self-pipe of the SIGINT handler */
    int sigpipe[2];
    struct sigaction old_int;

    mb_task *reader; /* the task parked in read/read_raw, or NULL */
    int handler_installed;
    char *line; /* completed line (malloc'd), owned until returned */
    int line_done, line_eof, prompt_interrupted;

    /* raw (non-TTY) reading */
    char *rbuf;
    size_t rlen, rcap;
    int reof;

    /* interrupt target: the chunk task SIGINT cancels */
    int target_ref;
    int target_co_ref; /* keeps target_co alive: a finished task lets go of its thread */
    mb_task *target;
    lua_State *volatile target_co;
    volatile sig_atomic_t hook_fired;     /* the hook raised "interrupted" in the target */
    volatile sig_atomic_t loop_cancelled; /* the loop cancelled the target */

    lua_State *complete_L; /* the task running rl_callback_read_char (completion calls Lua) */
    char *matches[MAX_MATCHES];
    int nmatches, next_match;
} g = {.sigpipe = {-1, -1}, .target_ref = LUA_NOREF, .target_co_ref = LUA_NOREF};

/* ---- SIGINT -----------------------------------------------------------------------------------
 */

/* Runs in the target coroutine at its next instruction after a SIGINT. If the loop already
 * cancelled the (parked) target, that cancellation is the interruption: do nothing more. */
static void interrupt_hook(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    if (g.loop_cancelled) return;
    g.hook_fired = 1;
    mb_error_raise(L, "repl", "interrupted", "interrupted by Ctrl-C");
}

static void on_sigint(int sig)
{
    int saved = errno;
    (void)sig;
    lua_State *co = g.target_co;
    /* lua_sethook may be called from a signal handler (lua.c relies on it). */
    if (co) lua_sethook(co, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
    if (g.sigpipe[1] >= 0) {
        ssize_t r = write(g.sigpipe[1], "i", 1);
        (void)r;
    }
    errno = saved;
}

static void sig_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    char buf[64];
    (void)loop;
    (void)revents;
    while (read(w->fd, buf, sizeof buf) > 0) {
    }
    if (g.target) {
        if (!g.hook_fired) {
            g.loop_cancelled = 1;
            mb_task_cancel(g.target);
        } else {
            g.hook_fired = 0; /* that one was delivered; a further Ctrl-C cancels */
        }
        return;
    }
    if (g.reader) {
        g.prompt_interrupted = 1;
        mb_task_wake(g.reader);
    }
}

/* ---- completion ------------------------------------------------------------------------------ */

static void free_matches(void)
{
    for (int i = 0; i < g.nmatches; i++)
        free(g.matches[i]);
    g.nmatches = g.next_match = 0;
}

static char *match_generator(const char *text, int state)
{
    (void)text;
    if (state == 0) g.next_match = 0;
    if (g.next_match >= g.nmatches) return NULL;
    return strdup(g.matches[g.next_match++]);
}

/* rl_attempted_completion_function: asks the Lua completer (text, line, start, stop) -> {..}
 * for the candidates that replace `text`. Errors in the completer mean "no completion". */
static char **complete_cb(const char *text, int start, int stop)
{
    lua_State *L = g.complete_L;
    rl_attempted_completion_over = 1; /* never fall back to file names */
    free_matches();
    if (!L) return NULL;
    int top = lua_gettop(L);
    if (lua_getfield(L, LUA_REGISTRYINDEX, COMPLETER_KEY) != LUA_TFUNCTION) {
        lua_settop(L, top);
        return NULL;
    }
    lua_pushstring(L, text);
    lua_pushstring(L, rl_line_buffer ? rl_line_buffer : "");
    lua_pushinteger(L, start);
    lua_pushinteger(L, stop);
    if (lua_pcall(L, 4, 1, 0) == LUA_OK && lua_istable(L, -1)) {
        /* Raw access, strings only: nothing here may raise (we are inside libedit's call). */
        lua_Integer n = (lua_Integer)lua_rawlen(L, -1);
        for (lua_Integer i = 1; i <= n && g.nmatches < MAX_MATCHES; i++) {
            const char *s = lua_rawgeti(L, -1, i) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
            if (s) {
                char *dup = strdup(s);
                if (dup) g.matches[g.nmatches++] = dup;
            }
            lua_pop(L, 1);
        }
    }
    lua_settop(L, top);
    if (g.nmatches == 0) return NULL;
    return rl_completion_matches(text, match_generator);
}

/* ---- reading --------------------------------------------------------------------------------- */

static void line_cb(char *line)
{
    /* libedit hands over a malloc'd line, or NULL on end of input. */
    free(g.line);
    g.line = line;
    g.line_eof = (line == NULL);
    g.line_done = 1;
    rl_callback_handler_remove();
    g.handler_installed = 0;
}

static void in_io_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    (void)revents;
    ev_io_stop(loop, w);
    if (g.reader) mb_task_wake(g.reader);
}

static void reader_abort(mb_task *t, void *ud)
{
    (void)t;
    (void)ud;
    ev_io_stop(g.loop, &g.in_io);
    g.reader = NULL;
}

/* 1 when stdin has input, 0 when not, -1 when it is gone (the terminal hung up): libedit
 * would then read end-of-file forever without finishing a line. */
static int stdin_poll(void)
{
    struct pollfd p = {.fd = 0, .events = POLLIN};
    if (poll(&p, 1, 0) <= 0) return 0;
    if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return -1;
    return (p.revents & POLLIN) ? 1 : 0;
}

static int read_k(lua_State *L, int status, lua_KContext ctx);

static int park_reader(lua_State *L, mb_task *t, lua_KFunction k)
{
    g.reader = t;
    ev_io_start(g.loop, &g.in_io);
    return mb_task_park(L, t, reader_abort, NULL, 0, k);
}

/* Pushes the outcome of a finished line: the line, nil at end of input, false if Ctrl-C. */
static int push_line_result(lua_State *L)
{
    if (g.prompt_interrupted) {
        g.prompt_interrupted = 0;
        lua_pushboolean(L, 0);
        return 1;
    }
    g.line_done = 0;
    if (g.line_eof) {
        g.line_eof = 0;
        lua_pushnil(L);
        return 1;
    }
    lua_pushstring(L, g.line ? g.line : "");
    free(g.line);
    g.line = NULL;
    return 1;
}

static int read_k(lua_State *L, int status, lua_KContext ctx)
{
    mb_task *t = mb_task_of(L);
    (void)status;
    (void)ctx;
    g.reader = NULL;
    if (g.prompt_interrupted) {
        /* Ctrl-C at the prompt: drop what was typed and start a fresh prompt. */
        if (g.handler_installed) {
            rl_replace_line("", 0);
            rl_callback_handler_remove();
            g.handler_installed = 0;
        }
        fputs("\n", stdout);
        fflush(stdout);
        return push_line_result(L);
    }
    g.complete_L = L;
    for (;;) {
        int st = stdin_poll();
        if (st < 0) {
            line_cb(NULL);
            break;
        }
        if (st == 0) break;
        rl_callback_read_char();
        if (g.line_done || !g.handler_installed) break;
    }
    g.complete_L = NULL;
    if (g.line_done) return push_line_result(L);
    return park_reader(L, t, read_k);
}

static void check_open(lua_State *L)
{
    if (!g.open) luaL_error(L, "lineedit: not open (call lineedit.open first)");
}

/* lineedit.read(prompt) -> line | nil (Ctrl-D on an empty line) | false (Ctrl-C). Edits one
 * line on the terminal while the loop keeps running. [yields] */
static int l_read(lua_State *L)
{
    const char *prompt = luaL_checkstring(L, 1);
    check_open(L);
    mb_task *t = mb_task_check_yieldable(L, "lineedit.read");
    if (g.reader) return luaL_error(L, "lineedit.read: another task is already reading");
    g.line_done = 0;
    g.prompt_interrupted = 0;
    rl_callback_handler_install(prompt, line_cb);
    g.handler_installed = 1;
    fflush(stdout);
    return park_reader(L, t, read_k);
}

static int raw_k(lua_State *L, int status, lua_KContext ctx);

/* Pushes the next complete line of the raw buffer (without its newline), or returns 0. */
static int raw_take_line(lua_State *L)
{
    char *nl = g.rlen ? memchr(g.rbuf, '\n', g.rlen) : NULL;
    size_t n;
    if (nl) {
        n = (size_t)(nl - g.rbuf);
        lua_pushlstring(L, g.rbuf, n);
        n++;
    } else if (g.reof && g.rlen > 0) {
        n = g.rlen;
        lua_pushlstring(L, g.rbuf, n);
    } else if (g.reof) {
        lua_pushnil(L);
        return 1;
    } else {
        return 0;
    }
    memmove(g.rbuf, g.rbuf + n, g.rlen - n);
    g.rlen -= n;
    return 1;
}

static int raw_k(lua_State *L, int status, lua_KContext ctx)
{
    mb_task *t = mb_task_of(L);
    (void)status;
    (void)ctx;
    g.reader = NULL;
    if (g.prompt_interrupted) return push_line_result(L);
    for (;;) {
        if (raw_take_line(L)) return 1;
        if (g.rcap - g.rlen < 4096) {
            size_t cap = g.rcap ? g.rcap * 2 : 8192;
            char *nb = realloc(g.rbuf, cap);
            if (!nb) return luaL_error(L, "lineedit.read_raw: out of memory");
            g.rbuf = nb;
            g.rcap = cap;
        }
        ssize_t r = read(0, g.rbuf + g.rlen, g.rcap - g.rlen);
        if (r > 0) {
            g.rlen += (size_t)r;
        } else if (r == 0) {
            g.reof = 1;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            return park_reader(L, t, raw_k);
        } else if (errno != EINTR) {
            return luaL_error(L, "lineedit.read_raw: reading stdin: %s", strerror(errno));
        }
    }
}

/* lineedit.read_raw() -> the next line of stdin (no editing; for pipes), nil at end of input,
 * false after Ctrl-C. [yields] */
static int l_read_raw(lua_State *L)
{
    check_open(L);
    (void)mb_task_check_yieldable(L, "lineedit.read_raw");
    if (g.reader) return luaL_error(L, "lineedit.read_raw: another task is already reading");
    g.prompt_interrupted = 0;
    int fl = fcntl(0, F_GETFL);
    if (fl >= 0 && !(fl & O_NONBLOCK)) fcntl(0, F_SETFL, fl | O_NONBLOCK);
    lua_settop(L, 0);
    if (raw_take_line(L)) return 1;
    return raw_k(L, LUA_YIELD, 0);
}

/* ---- output above the prompt ----------------------------------------------------------------- */

/* lineedit.print(text): writes text (a newline is added if missing) so that, when a prompt is
 * being edited, the prompt and the partly typed line are redrawn below it intact. */
static int l_print(lua_State *L)
{
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    if (!g.handler_installed) {
        fwrite(s, 1, n, stdout);
        if (n == 0 || s[n - 1] != '\n') fputc('\n', stdout);
        fflush(stdout);
        return 0;
    }
    int rows = 0, cols = 0;
    rl_get_screen_size(&rows, &cols);
    const char *prompt = rl_prompt ? rl_prompt : "";
    int used = (int)strlen(prompt) + rl_point;
    int up = cols > 0 ? used / cols : 0;
    if (up > 0) fprintf(stdout, "\033[%dA", up);
    fputs("\r\033[J", stdout);
    /* The terminal is in libedit's edit mode: write CR LF ourselves. */
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\n') fputc('\r', stdout);
        fputc(s[i], stdout);
    }
    if (n == 0 || s[n - 1] != '\n') fputs("\r\n", stdout);
    fflush(stdout);
    rl_forced_update_display();
    return 0;
}

/* ---- history -----------------------------------------------------------------------------------
 */

/* lineedit.add_history(line) */
static int l_add_history(lua_State *L)
{
    add_history(luaL_checkstring(L, 1));
    return 0;
}

/* lineedit.save_history(path) -> true | nil, message */
static int l_save_history(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    /* History may hold what a person typed about their systems: owner-only, like the key file. */
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0) {
        fchmod(fd, 0600);
        close(fd);
    }
    if (write_history(path) != 0) {
        luaL_pushfail(L);
        lua_pushfstring(L, "cannot write the history file %s: %s", path, strerror(errno));
        return 2;
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* ---- interrupts ----------------------------------------------------------------------------- */

static void clear_target(lua_State *L)
{
    lua_State *co = g.target_co;
    if (g.hook_fired && g.sigpipe[0] >= 0) {
        /* The hook delivered that Ctrl-C: it must not reach the next prompt as well. */
        char buf[64];
        while (read(g.sigpipe[0], buf, sizeof buf) > 0) {
        }
        g.hook_fired = 0;
    }
    g.target_co = NULL;
    if (co && g.target && g.target->co == co) lua_sethook(co, NULL, 0, 0);
    g.target = NULL;
    mb_unref(L, g.target_ref);
    g.target_ref = LUA_NOREF;
    mb_unref(L, g.target_co_ref);
    g.target_co_ref = LUA_NOREF;
}

/* lineedit.interrupt_target(task|nil): until changed, Ctrl-C cancels that task (or, when it is
 * busy in pure Lua, raises "interrupted" in it) instead of acting on the prompt. */
static int l_interrupt_target(lua_State *L)
{
    check_open(L);
    clear_target(L);
    g.hook_fired = 0;
    g.loop_cancelled = 0;
    if (lua_isnoneornil(L, 1)) return 0;
    mb_task *t = (mb_task *)luaL_checkudata(L, 1, "moonbox.Task");
    lua_pushvalue(L, 1);
    g.target_ref = mb_ref(L);
    g.target = t;
    if (t->co) {
        /* Our own reference to the thread: the SIGINT handler may set a hook on it until the
         * target is cleared, and the task drops its thread the moment it finishes. */
        lua_pushthread(t->co);
        lua_xmove(t->co, L, 1);
        g.target_co_ref = mb_ref(L);
    }
    g.target_co = t->co;
    return 0;
}

/* ---- open / close ---------------------------------------------------------------------------- */

/* lineedit.set_completer(fn|nil): fn(text, line, start, stop) -> array of replacements for
 * text. It runs inside the reading task and must not wait. */
static int l_set_completer(lua_State *L)
{
    if (!lua_isnoneornil(L, 1)) luaL_checktype(L, 1, LUA_TFUNCTION);
    lua_settop(L, 1);
    lua_setfield(L, LUA_REGISTRYINDEX, COMPLETER_KEY);
    return 0;
}

/* lineedit.open{name = "moonbox", history = PATH|nil, tty = bool}: takes over SIGINT and, for a
 * terminal, sets libedit up (reading PATH's history when it exists). Raises if already open. */
static int l_open(lua_State *L)
{
    mb_runtime *rt = mb_runtime_get(L);
    luaL_checktype(L, 1, LUA_TTABLE);
    if (g.open) return luaL_error(L, "lineedit.open: already open");
    lua_getfield(L, 1, "tty");
    int tty = lua_toboolean(L, -1);
    lua_getfield(L, 1, "history");
    const char *hist = lua_tostring(L, -1);

    if (pipe2(g.sigpipe, O_CLOEXEC | O_NONBLOCK) != 0)
        return luaL_error(L, "lineedit.open: pipe: %s", strerror(errno));
    g.loop = rt->loop;
    ev_io_init(&g.sig_io, sig_io_cb, g.sigpipe[0], EV_READ);
    ev_io_start(g.loop, &g.sig_io);
    ev_unref(g.loop); /* Ctrl-C alone must not keep the loop alive */
    ev_io_init(&g.in_io, in_io_cb, 0, EV_READ);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, &g.old_int);
    g.open = 1;

    if (tty) {
        rl_catch_signals = 0; /* the signals are ours (above), not libedit's */
        rl_catch_sigwinch = 1;
        rl_readline_name = "moonbox";
        rl_initialize();
        using_history();
        stifle_history(1000);
        if (hist) read_history(hist);
        rl_attempted_completion_function = complete_cb;
        /* '.' and ':' do not break words: `sb:ex` completes as one expression. */
        rl_basic_word_break_characters = " \t\n\"\\'`@$><=;|&{(+-*/%^~#,[]";
        rl_completer_word_break_characters = (char *)rl_basic_word_break_characters;
        rl_completion_append_character = '\0';
    }
    return 0;
}

/* lineedit.close(): gives SIGINT back, restores the terminal, stops the watchers. */
static int l_close(lua_State *L)
{
    if (!g.open) return 0;
    clear_target(L);
    if (g.handler_installed) {
        rl_callback_handler_remove();
        g.handler_installed = 0;
    }
    sigaction(SIGINT, &g.old_int, NULL);
    ev_ref(g.loop);
    ev_io_stop(g.loop, &g.sig_io);
    ev_io_stop(g.loop, &g.in_io);
    close(g.sigpipe[0]);
    close(g.sigpipe[1]);
    g.sigpipe[0] = g.sigpipe[1] = -1;
    free(g.line);
    g.line = NULL;
    free(g.rbuf);
    g.rbuf = NULL;
    g.rlen = g.rcap = 0;
    g.reof = 0;
    free_matches();
    lua_pushnil(L);
    lua_setfield(L, LUA_REGISTRYINDEX, COMPLETER_KEY);
    int fl = fcntl(0, F_GETFL);
    if (fl >= 0 && (fl & O_NONBLOCK)) fcntl(0, F_SETFL, fl & ~O_NONBLOCK);
    g.open = 0;
    return 0;
}

static const luaL_Reg lineedit_funcs[] = {
    {"open", l_open},
    {"close", l_close},
    {"read", l_read},
    {"read_raw", l_read_raw},
    {"print", l_print},
    {"add_history", l_add_history},
    {"save_history", l_save_history},
    {"set_completer", l_set_completer},
    {"interrupt_target", l_interrupt_target},
    {NULL, NULL},
};

int luaopen_moonbox_lineedit(lua_State *L)
{
    luaL_newlib(L, lineedit_funcs);
    return 1;
}
