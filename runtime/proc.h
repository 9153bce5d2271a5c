/* proc.h - child processes on the libev default loop.
 *
 * Owns one child process from spawn to reap: its pipes, the ev_io watchers that drain them into
 * bounded buffers, the ev_child watcher that records its exit, and its process group (the child
 * leads a new group, so signalling the group reaches everything it started that did not leave).
 *
 * Invariants: a buffered output stream never holds more than buffer_limit bytes; when it is full
 * its watcher is stopped (the child then blocks writing: backpressure) until the owner consumes
 * at least half. Every fd this file creates is close-on-exec, and the child gets fds 0-2 only.
 * Watcher callbacks only update the struct and call the owner's notify function; they never
 * call anything else, so the owner (bindings/proc.c) decides what an event means.
 *
 * Single-threaded: call everything from the thread that runs the default loop. No Lua here.
 */
#ifndef MOONBOX_PROC_H
#define MOONBOX_PROC_H

#include <stddef.h>
#include <sys/types.h>

#include <ev.h>

#define PROC_DEFAULT_BUFFER_LIMIT (64 * 1024)

/* Stream indexes, also the child's fd numbers. */
enum { PROC_STDIN = 0, PROC_STDOUT = 1, PROC_STDERR = 2 };

/* What a child's fd 0, 1 or 2 is connected to. */
enum proc_stdio_kind {
    PROC_STDIO_NULL = 0, /* /dev/null */
    PROC_STDIO_PIPE,     /* a pipe to this process (non-blocking on our side) */
    PROC_STDIO_INHERIT,  /* the same fd as ours */
    PROC_STDIO_FILE,     /* a file opened by path (truncated unless append) */
    PROC_STDIO_STDOUT,   /* stderr only: wherever the child's stdout goes (2>&1) */
};

/* Events passed to the notify function; several may be or-ed together. */
enum {
    PROC_EV_STDOUT = 1 << 0, /* new bytes buffered, or end of stream reached */
    PROC_EV_STDERR = 1 << 1,
    PROC_EV_STDIN = 1 << 2, /* stdin became writable (after proc_want_writable) */
    PROC_EV_EXIT = 1 << 3,  /* the child was reaped; proc_exit_status is now valid */
};

/* Status codes of proc_spawn; the message goes into the caller's buffer. */
enum {
    PROC_OK = 0,
    PROC_ERR_NOT_FOUND = -1,  /* program, working directory or stdio file does not exist */
    PROC_ERR_PERMISSION = -2, /* exists but may not be executed/entered/opened */
    PROC_ERR_SPAWN = -3,      /* anything else (out of fds, bad executable format, ...) */
};

typedef struct proc proc;

typedef void (*proc_notify_fn)(proc *p, int events, void *ud);

typedef struct proc_stdio {
    int kind;         /* enum proc_stdio_kind */
    const char *path; /* PROC_STDIO_FILE only */
    int append;       /* PROC_STDIO_FILE for stdout/stderr: O_APPEND instead of O_TRUNC */
} proc_stdio;

typedef struct proc_opts {
    const char *const *argv; /* NULL-terminated, argv[0] non-empty; searched in PATH unless it
                                contains a slash */
    const char *const *envp; /* NULL-terminated "NAME=value" array, or NULL to inherit ours */
    const char *cwd;         /* working directory of the child, or NULL for ours */
    proc_stdio stdio[3];
    size_t buffer_limit; /* per output stream; 0 means PROC_DEFAULT_BUFFER_LIMIT */
    proc_notify_fn notify;
    void *notify_ud;
} proc_opts;

typedef struct proc_stats {
    size_t buffered[3]; /* bytes buffered now, per stream (stdin always 0) */
    size_t peak[3];     /* most bytes ever buffered at once */
    size_t total[3];    /* bytes read from the child so far */
    size_t buffer_limit;
} proc_stats;

/* Starts a child as described by o on loop, which must be libev's default loop (only it can
 * watch children). On success stores the new process in *out and returns PROC_OK; the child's
 * exit is already being watched, so it cannot be missed however late the caller waits. On
 * failure returns a PROC_ERR_* code, writes a sentence naming the program and the OS reason into
 * err (when errlen > 0) and leaves nothing behind (no child, no fd, no allocation).
 * Assumes SIGPIPE is ignored in this process (writes to a closed stdin must fail with EPIPE). */
int proc_spawn(struct ev_loop *loop, const proc_opts *o, proc **out, char *err, size_t errlen);

/* The child's pid, which is also its process group id. */
pid_t proc_pid(const proc *p);

/* Returns 1 and stores the waitpid status in *wstatus once the child has been reaped, else 0. */
int proc_exit_status(const proc *p, int *wstatus);

/* Sends sig to the child's whole process group. Returns 0 when sent; -ESRCH once the child has
 * been reaped (its group id may since belong to an unrelated group, so nothing is sent);
 * otherwise -errno from kill(2). Signal 0 only checks that the group still exists. */
int proc_kill(proc *p, int sig);

/* Whether stream s was spawned as a pipe (otherwise reading or writing it is a usage error). */
int proc_is_pipe(const proc *p, int s);

/* Buffered output of stream s (PROC_STDOUT or PROC_STDERR): stores a pointer to the oldest
 * unconsumed byte in *data and returns how many bytes follow it contiguously (all of them).
 * The pointer is valid until the next proc_consume or loop iteration. */
size_t proc_peek(const proc *p, int s, const char **data);

/* Drops the first n (<= what proc_peek returned) bytes of stream s, and resumes reading the
 * pipe if it was paused and the buffer is now at most half full. */
void proc_consume(proc *p, int s, size_t n);

/* 0 while stream s may still produce bytes; 1 once the child closed it (EOF) and everything
 * before was buffered; -errno if reading it failed (also final). Buffered bytes remain readable
 * after the end. Not-a-pipe streams report 1. */
int proc_stream_end(const proc *p, int s);

/* Writes up to len bytes of data to the child's stdin without blocking. Returns how many were
 * written (possibly 0 when the pipe is full), or -errno: -EPIPE when the child closed its end,
 * -EBADF when stdin was closed with proc_close_stdin or is not a pipe. */
long proc_write(proc *p, const void *data, size_t len);

/* Asks for one PROC_EV_STDIN notification when stdin becomes writable (on = 1), or withdraws
 * the request (on = 0). The request is dropped after it fires. */
void proc_want_writable(proc *p, int on);

/* Closes our end of the child's stdin, so the child reads EOF. Idempotent. */
void proc_close_stdin(proc *p);

/* Fills *st with buffer figures for the tests and for stats. */
void proc_get_stats(const proc *p, proc_stats *st);

/* Releases p: stops its I/O watchers and closes every pipe. A child not yet reaped is killed
 * with SIGKILL (its whole group) and left to the child watcher, which reaps it and frees p
 * without notifying anyone; returns 1 in that case. Otherwise frees p at once and returns 0.
 * p must not be used afterwards. */
int proc_close(proc *p);

/* Processes spawned and not yet freed, including closed ones waiting to be reaped. */
long proc_live_count(void);

#endif
