/* proc.c - child processes on the libev default loop (see proc.h for the contract).
 *
 * A child is started with posix_spawn, not fork + exec, for three reasons. glibc implements it
 * with clone(CLONE_VM | CLONE_VFORK), so spawning does not copy the page tables of a large Lua
 * heap and fifty spawns stay cheap. An exec or chdir failure comes back as the return value,
 * with no error pipe to manage. And between fork and exec only async-signal-safe calls are
 * allowed in a process that may have other threads (curl's resolver) and libev's signal
 * handlers; posix_spawn does that part correctly (signal mask and dispositions, process group)
 * inside libc. Because the parent resumes only after the exec, the child is already the leader
 * of its own group when proc_spawn returns, so an immediate proc_kill reaches the whole group.
 *
 * Output pipes are drained by level-triggered ev_io watchers into one linear buffer per stream,
 * grown up to buffer_limit. A full buffer stops its watcher; consuming down to half restarts it,
 * so a slow reader costs at most buffer_limit bytes per stream and a handful of syscalls per
 * refill, not one per consumed byte. The exit is seen through ev_child: libev reaps with
 * waitpid(-1) in its SIGCHLD handler and hands the status to the watcher registered for the pid.
 * A process released before it was reaped stays on the live list until that watcher frees it.
 */
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* glibc 2.34 added closefrom as a spawn file action; older libcs rely on CLOEXEC alone. */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
#define PROC_HAVE_ADDCLOSEFROM 1
#endif

#define PROC_FIRST_BUFFER 16384 /* first allocation of an output buffer */
#define PROC_DEFAULT_PATH "/bin:/usr/bin"

typedef struct proc_outbuf {
    char *data;
    size_t start; /* offset of the oldest unconsumed byte */
    size_t len;   /* unconsumed bytes */
    size_t cap;   /* allocated bytes, <= the limit */
    size_t peak, total;
    int end;    /* 0 open, 1 EOF, -errno after a read error */
    int paused; /* watcher stopped because the buffer is full */
} proc_outbuf;

struct proc {
    struct ev_loop *loop;
    pid_t pid;
    int reaped;
    int wstatus;
    int orphaned; /* released by its owner; the child watcher frees it after the reap */
    int pipes;    /* bit s set when stream s is a pipe */
    size_t limit;
    int fd[3]; /* our pipe ends, -1 when closed or not a pipe */
    ev_io io[3];
    int want_write;
    proc_outbuf out[3]; /* [PROC_STDOUT] and [PROC_STDERR] are used */
    ev_child child;
    proc_notify_fn notify;
    void *notify_ud;
    proc *live_prev, *live_next;
};

static proc *g_live; /* every proc not yet freed: owned ones and orphans awaiting their reap */
static long g_live_count;

static void live_link(proc *p)
{
    p->live_prev = NULL;
    p->live_next = g_live;
    if (g_live) g_live->live_prev = p;
    g_live = p;
    g_live_count++;
}

static void live_unlink(proc *p)
{
    if (p->live_prev)
        p->live_prev->live_next = p->live_next;
    else
        g_live = p->live_next;
    if (p->live_next) p->live_next->live_prev = p->live_prev;
    p->live_prev = p->live_next = NULL;
    g_live_count--;
}

long proc_live_count(void)
{
    return g_live_count;
}

/* ---- helpers ----------------------------------------------------------------------------- */

static void close_quietly(int fd)
{
    if (fd >= 0) close(fd);
}

/* Moves fd out of 0-2 (keeping close-on-exec), so the child's dup2 onto 0, 1 and 2 in order can
 * never overwrite a source it still needs. This only happens when our own stdio was closed. */
static int fd_above_stdio(int fd)
{
    if (fd < 0 || fd > 2) return fd;
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    int saved = errno;
    close(fd);
    errno = saved;
    return moved;
}

/* Returns the value of PATH in envp (or in our environment when envp is NULL), or NULL. */
static const char *path_of(const char *const *envp)
{
    if (!envp) return getenv("PATH");
    for (; *envp; envp++)
        if (strncmp(*envp, "PATH=", 5) == 0) return *envp + 5;
    return NULL;
}

/* Checks the file a relative path names as the child will see it: after its chdir to cwd. */
static int check_executable(const char *path, const char *cwd)
{
    char buf[PATH_MAX];
    const char *check = path;
    struct stat st;
    if (path[0] != '/' && cwd) {
        if (snprintf(buf, sizeof buf, "%s/%s", cwd, path) >= (int)sizeof buf) return ENAMETOOLONG;
        check = buf;
    }
    if (stat(check, &st) != 0) return errno;
    if (!S_ISREG(st.st_mode)) return EACCES; /* execve refuses directories and devices so */
    if (access(check, X_OK) != 0) return errno;
    return 0;
}

/* Resolves the program of argv[0] the way execvp would in the child (PATH taken from the
 * child's environment; entries relative to its working directory), but in the parent, so
 * "not found" and "not executable" are told apart from each other and from a bad cwd. Stores
 * the path to execute in out. Returns 0, or ENOENT / EACCES / ENAMETOOLONG. */
static int find_program(const char *name, const char *const *envp, const char *cwd, char *out,
                        size_t outlen)
{
    if (strchr(name, '/')) {
        if (strlen(name) >= outlen) return ENAMETOOLONG;
        memcpy(out, name, strlen(name) + 1);
        return check_executable(name, cwd);
    }
    const char *path = path_of(envp);
    if (!path) path = PROC_DEFAULT_PATH;
    int denied = 0;
    size_t nlen = strlen(name);
    for (const char *dir = path;;) {
        const char *colon = strchr(dir, ':');
        size_t dlen = colon ? (size_t)(colon - dir) : strlen(dir);
        if (dlen == 0) { /* an empty entry means the working directory */
            dir = ".";
            dlen = 1;
        }
        if (dlen + 1 + nlen < outlen) {
            memcpy(out, dir, dlen);
            out[dlen] = '/';
            memcpy(out + dlen + 1, name, nlen + 1);
            int rc = check_executable(out, cwd);
            if (rc == 0) return 0;
            if (rc == EACCES) denied = 1;
        }
        if (!colon) break;
        dir = colon + 1;
    }
    return denied ? EACCES : ENOENT;
}

static int code_of_errno(int e)
{
    if (e == ENOENT || e == ENOTDIR) return PROC_ERR_NOT_FOUND;
    if (e == EACCES || e == EPERM) return PROC_ERR_PERMISSION;
    return PROC_ERR_SPAWN;
}

/* Opens what the child's fd i connects to. Stores the child's end in *child (-1: keep ours) and,
 * for a pipe, our non-blocking end in *ours. Returns 0 or an errno. */
static int open_stdio(int i, const proc_stdio *io, int *child, int *ours)
{
    int fds[2];
    *child = -1;
    *ours = -1;
    switch (io->kind) {
    case PROC_STDIO_NULL:
        *child = open("/dev/null", (i == PROC_STDIN ? O_RDONLY : O_WRONLY) | O_CLOEXEC);
        break;
    case PROC_STDIO_PIPE:
        if (pipe2(fds, O_CLOEXEC) != 0) return errno;
        /* Only our end is non-blocking: the child expects ordinary blocking stdio. */
        *child = i == PROC_STDIN ? fds[0] : fds[1];
        *ours = i == PROC_STDIN ? fds[1] : fds[0];
        if (fcntl(*ours, F_SETFL, fcntl(*ours, F_GETFL) | O_NONBLOCK) != 0) {
            int e = errno;
            close(fds[0]);
            close(fds[1]);
            *child = *ours = -1;
            return e;
        }
        break;
    case PROC_STDIO_FILE:
        if (i == PROC_STDIN)
            *child = open(io->path, O_RDONLY | O_CLOEXEC);
        else
            *child = open(io->path,
                          O_WRONLY | O_CREAT | O_CLOEXEC | (io->append ? O_APPEND : O_TRUNC), 0666);
        break;
    default: /* INHERIT, and STDOUT which is a dup2 action added later */
        return 0;
    }
    if (*child < 0) {
        int e = errno;
        close_quietly(*ours);
        *ours = -1;
        return e;
    }
    *child = fd_above_stdio(*child);
    return *child < 0 ? errno : 0;
}

static const char *stream_name(int i)
{
    return i == PROC_STDIN ? "stdin" : i == PROC_STDOUT ? "stdout" : "stderr";
}

/* ---- watchers ----------------------------------------------------------------------------- */

static void notify(proc *p, int events)
{
    if (p->notify) p->notify(p, events, p->notify_ud);
}

static void stream_shut(proc *p, int s)
{
    if (p->fd[s] < 0) return;
    ev_io_stop(p->loop, &p->io[s]);
    close(p->fd[s]);
    p->fd[s] = -1;
}

/* Makes room at the end of b for at least one byte: reuses consumed space, else grows toward
 * the limit. Returns 0 when the buffer holds `limit` bytes (full), or -ENOMEM. */
static int outbuf_make_room(proc_outbuf *b, size_t limit)
{
    if (b->len == 0) b->start = 0;
    if (b->start + b->len < b->cap) return 1;
    if (b->len >= limit) return 0;
    if (b->start > 0) {
        memmove(b->data, b->data + b->start, b->len);
        b->start = 0;
        return 1;
    }
    size_t cap = b->cap ? b->cap * 2 : PROC_FIRST_BUFFER;
    if (cap > limit) cap = limit;
    char *data = (char *)realloc(b->data, cap);
    if (!data) return -ENOMEM;
    b->data = data;
    b->cap = cap;
    return 1;
}

/* Reads until the pipe is empty or the buffer is full, then tells the owner once. */
static void output_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    proc *p = (proc *)w->data;
    int s = w == &p->io[PROC_STDOUT] ? PROC_STDOUT : PROC_STDERR;
    proc_outbuf *b = &p->out[s];
    int changed = 0;
    (void)loop;
    (void)revents;
    for (;;) {
        int room = outbuf_make_room(b, p->limit);
        if (room == 0) {
            ev_io_stop(p->loop, w);
            b->paused = 1;
            break;
        }
        if (room < 0) {
            b->end = room;
            stream_shut(p, s);
            changed = 1;
            break;
        }
        ssize_t n = read(p->fd[s], b->data + b->start + b->len, b->cap - b->start - b->len);
        if (n > 0) {
            b->len += (size_t)n;
            b->total += (size_t)n;
            if (b->len > b->peak) b->peak = b->len;
            changed = 1;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        b->end = n == 0 ? 1 : -errno;
        stream_shut(p, s);
        changed = 1;
        break;
    }
    if (changed) notify(p, s == PROC_STDOUT ? PROC_EV_STDOUT : PROC_EV_STDERR);
}

static void input_cb(struct ev_loop *loop, ev_io *w, int revents)
{
    proc *p = (proc *)w->data;
    (void)revents;
    ev_io_stop(loop, w);
    p->want_write = 0;
    notify(p, PROC_EV_STDIN);
}

static void child_cb(struct ev_loop *loop, ev_child *w, int revents)
{
    proc *p = (proc *)w->data;
    (void)revents;
    /* libev never stops a child watcher by itself; this pid will not be reported again. */
    ev_child_stop(loop, w);
    p->reaped = 1;
    p->wstatus = w->rstatus;
    if (p->orphaned) {
        live_unlink(p);
        free(p);
        return;
    }
    notify(p, PROC_EV_EXIT);
}

/* ---- spawning ------------------------------------------------------------------------------ */

/* Builds the spawn attributes and file actions and starts the child. Returns 0 or an errno. */
static int spawn_child(const char *path, const proc_opts *o, const int child_fd[3], pid_t *pid)
{
    posix_spawnattr_t attr;
    posix_spawn_file_actions_t fa;
    sigset_t none, all;
    int rc;

    if ((rc = posix_spawnattr_init(&attr)) != 0) return rc;
    if ((rc = posix_spawn_file_actions_init(&fa)) != 0) {
        posix_spawnattr_destroy(&attr);
        return rc;
    }
    /* A new group led by the child; an empty signal mask and default dispositions for every
     * signal, because libev blocks and catches SIGCHLD and moonbox ignores SIGPIPE and catches
     * SIGINT/SIGTERM, and ignored dispositions and the mask survive exec. */
    sigemptyset(&none);
    sigfillset(&all);
    rc = posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK |
                                             POSIX_SPAWN_SETSIGDEF);
    if (!rc) rc = posix_spawnattr_setpgroup(&attr, 0);
    if (!rc) rc = posix_spawnattr_setsigmask(&attr, &none);
    if (!rc) rc = posix_spawnattr_setsigdefault(&attr, &all);
    for (int i = 0; i < 3 && !rc; i++)
        if (child_fd[i] >= 0) rc = posix_spawn_file_actions_adddup2(&fa, child_fd[i], i);
    if (!rc && o->stdio[PROC_STDERR].kind == PROC_STDIO_STDOUT)
        rc = posix_spawn_file_actions_adddup2(&fa, PROC_STDOUT, PROC_STDERR);
#ifdef PROC_HAVE_ADDCLOSEFROM
    /* Our fds are CLOEXEC, but a Lua io.open file or a library's socket may not be. */
    if (!rc) rc = posix_spawn_file_actions_addclosefrom_np(&fa, 3);
#endif
    if (!rc && o->cwd) rc = posix_spawn_file_actions_addchdir_np(&fa, o->cwd);
    if (!rc) {
        char *const *envp = o->envp ? (char *const *)o->envp : environ;
        rc = posix_spawn(pid, path, &fa, &attr, (char *const *)o->argv, envp);
    }
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    return rc;
}

/* Checks the working directory before spawning, so a missing cwd is reported as such and not
 * as the program's ENOENT (posix_spawn returns one errno for both). */
static int check_cwd(const char *cwd, const char *prog, char *err, size_t errlen)
{
    struct stat st;
    int e = 0;
    if (stat(cwd, &st) != 0)
        e = errno;
    else if (!S_ISDIR(st.st_mode))
        e = ENOTDIR;
    else if (access(cwd, X_OK) != 0)
        e = errno;
    if (!e) return PROC_OK;
    if (e == ENOENT)
        snprintf(err, errlen, "cannot run '%s': working directory '%s' does not exist", prog, cwd);
    else
        snprintf(err, errlen, "cannot run '%s': working directory '%s': %s", prog, cwd,
                 strerror(e));
    return code_of_errno(e);
}

/* proc.h has the caller's contract. Here, in order, so that each failure has its own sentence:
 * the working directory (check_cwd), the program (find_program: PATH of o->envp, relative to
 * cwd; not found, not executable), the three stdio ends (open_stdio: a pipe, a file, the
 * parent's, or /dev/null), then the child (spawn_child). The child's ends are closed here; ours
 * get ev_io watchers (stdout/stderr reading at once, stdin only when there is something to
 * write), and the ev_child watcher starts before the loop runs again so that no exit is
 * missed. Returns PROC_OK with *out, or PROC_ERR_* (code_of_errno) with one sentence in err
 * naming the program, every fd closed and nothing allocated. Does not block (but for the
 * spawn itself). */
int proc_spawn(struct ev_loop *loop, const proc_opts *o, proc **out, char *err, size_t errlen)
{
    char path[PATH_MAX];
    int child_fd[3] = {-1, -1, -1}, ours[3] = {-1, -1, -1};
    const char *prog = o->argv && o->argv[0] ? o->argv[0] : "";
    char scratch[1];
    int rc, code;

    if (errlen == 0) {
        err = scratch;
        errlen = sizeof scratch;
    }
    *out = NULL;
    if (!*prog) {
        snprintf(err, errlen, "cannot run a program with an empty name");
        return PROC_ERR_NOT_FOUND;
    }
    if (o->cwd && (code = check_cwd(o->cwd, prog, err, errlen)) != PROC_OK) return code;
    rc = find_program(prog, o->envp, o->cwd, path, sizeof path);
    if (rc == ENOENT && !strchr(prog, '/')) {
        snprintf(err, errlen, "cannot run '%s': no such program in PATH", prog);
        return PROC_ERR_NOT_FOUND;
    }
    if (rc == EACCES) {
        snprintf(err, errlen, "cannot run '%s': permission denied (not an executable file)", prog);
        return PROC_ERR_PERMISSION;
    }
    if (rc) {
        snprintf(err, errlen, "cannot run '%s': %s", prog, strerror(rc));
        return code_of_errno(rc);
    }

    for (int i = 0; i < 3; i++) {
        if ((rc = open_stdio(i, &o->stdio[i], &child_fd[i], &ours[i])) != 0) {
            if (o->stdio[i].kind == PROC_STDIO_FILE)
                snprintf(err, errlen, "cannot run '%s': cannot open %s file '%s': %s", prog,
                         stream_name(i), o->stdio[i].path, strerror(rc));
            else
                snprintf(err, errlen, "cannot run '%s': cannot set up %s: %s", prog, stream_name(i),
                         strerror(rc));
            goto fail;
        }
    }

    proc *p = (proc *)calloc(1, sizeof *p);
    if (!p) {
        rc = ENOMEM;
        snprintf(err, errlen, "cannot run '%s': out of memory", prog);
        goto fail;
    }
    pid_t pid;
    if ((rc = spawn_child(path, o, child_fd, &pid)) != 0) {
        free(p);
        if (rc == ENOEXEC)
            snprintf(err, errlen, "cannot run '%s': not an executable format (%s)", prog,
                     strerror(rc));
        else
            snprintf(err, errlen, "cannot run '%s': %s", prog, strerror(rc));
        goto fail;
    }
    for (int i = 0; i < 3; i++)
        close_quietly(child_fd[i]);

    p->loop = loop;
    p->pid = pid;
    p->limit = o->buffer_limit ? o->buffer_limit : PROC_DEFAULT_BUFFER_LIMIT;
    p->notify = o->notify;
    p->notify_ud = o->notify_ud;
    for (int i = 0; i < 3; i++) {
        p->fd[i] = ours[i];
        if (o->stdio[i].kind == PROC_STDIO_PIPE) p->pipes |= 1 << i;
        if (ours[i] < 0) continue;
        ev_io_init(&p->io[i], i == PROC_STDIN ? input_cb : output_cb, ours[i],
                   i == PROC_STDIN ? EV_WRITE : EV_READ);
        p->io[i].data = p;
        if (i != PROC_STDIN) ev_io_start(loop, &p->io[i]);
    }
    /* Started before the loop runs again: libev reaps in the loop, so no exit can be missed. */
    ev_child_init(&p->child, child_cb, pid, 0);
    p->child.data = p;
    ev_child_start(loop, &p->child);
    live_link(p);
    *out = p;
    return PROC_OK;

fail:
    for (int i = 0; i < 3; i++) {
        close_quietly(child_fd[i]);
        close_quietly(ours[i]);
    }
    return code_of_errno(rc);
}

/* ---- queries and I/O ------------------------------------------------------------------------ */

pid_t proc_pid(const proc *p)
{
    return p->pid;
}

int proc_exit_status(const proc *p, int *wstatus)
{
    if (!p->reaped) return 0;
    *wstatus = p->wstatus;
    return 1;
}

int proc_kill(proc *p, int sig)
{
    if (p->reaped) return -ESRCH;
    /* Until the reap the leader is at least a zombie, which keeps its group id reserved. */
    if (kill(-p->pid, sig) != 0) return -errno;
    return 0;
}

int proc_is_pipe(const proc *p, int s)
{
    return s >= 0 && s < 3 && (p->pipes & (1 << s)) != 0;
}

size_t proc_peek(const proc *p, int s, const char **data)
{
    const proc_outbuf *b = &p->out[s];
    *data = b->data ? b->data + b->start : "";
    return b->len;
}

void proc_consume(proc *p, int s, size_t n)
{
    proc_outbuf *b = &p->out[s];
    if (n > b->len) n = b->len;
    b->start += n;
    b->len -= n;
    if (b->len == 0) b->start = 0;
    if (b->paused && b->len <= p->limit / 2 && p->fd[s] >= 0) {
        b->paused = 0;
        ev_io_start(p->loop, &p->io[s]);
    }
}

int proc_stream_end(const proc *p, int s)
{
    if (!proc_is_pipe(p, s)) return 1;
    return p->out[s].end;
}

long proc_write(proc *p, const void *data, size_t len)
{
    if (p->fd[PROC_STDIN] < 0) return -EBADF;
    for (;;) {
        ssize_t n = write(p->fd[PROC_STDIN], data, len);
        if (n >= 0) return (long)n;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        return -errno;
    }
}

void proc_want_writable(proc *p, int on)
{
    if (p->fd[PROC_STDIN] < 0) return;
    if (on && !p->want_write) ev_io_start(p->loop, &p->io[PROC_STDIN]);
    if (!on && p->want_write) ev_io_stop(p->loop, &p->io[PROC_STDIN]);
    p->want_write = on;
}

void proc_close_stdin(proc *p)
{
    p->want_write = 0;
    stream_shut(p, PROC_STDIN);
}

void proc_get_stats(const proc *p, proc_stats *st)
{
    memset(st, 0, sizeof *st);
    for (int s = PROC_STDOUT; s <= PROC_STDERR; s++) {
        st->buffered[s] = p->out[s].len;
        st->peak[s] = p->out[s].peak;
        st->total[s] = p->out[s].total;
    }
    st->buffer_limit = p->limit;
}

int proc_close(proc *p)
{
    for (int s = 0; s < 3; s++) {
        stream_shut(p, s);
        free(p->out[s].data);
        p->out[s].data = NULL;
        p->out[s].len = p->out[s].cap = 0;
    }
    p->notify = NULL;
    p->notify_ud = NULL;
    if (!p->reaped) {
        kill(-p->pid, SIGKILL);
        p->orphaned = 1;
        return 1;
    }
    live_unlink(p);
    free(p);
    return 0;
}
