/*
 * starter.c — exec'd processes started by the sandbox's own init, on the server's request.
 *
 * The slow way into a sandbox (enter.c) is a host-side helper per exec that opens seven
 * namespaces, enters them, chroots, loads the seccomp filter and forks: most of an exec's cost.
 * The init already is inside all of that, confined and under the filter, so it starts the
 * commands itself: a fork of a small process and an execve.
 *
 * The channel. The keeper makes a SOCK_SEQPACKET socketpair before it clones the init: the init
 * keeps one end, the keeper the other, and nothing else ever holds either. It has no name or
 * path (a socketpair has no address to connect to); the init's descriptors cannot be reached
 * from inside (the init is undumpable and its memory belongs to the host's user namespace, so
 * neither /proc/1/fd, ptrace nor pidfd_getfd work on it: that takes CAP_SYS_PTRACE over the
 * host); every process the init starts closes it before it runs anything; and the keeper lives
 * in the host's PID namespace, invisible inside. An exec helper (`moonbox-sandbox exec`, a
 * child of the server, host root) takes a copy of the keeper's end with pidfd_getfd after
 * checking that the keeper is that sandbox's (the parent of the sandbox's init, which its uid map
 * names), sends one request frame (starter_proto.c) with four descriptors — the command's stdin,
 * stdout and stderr, whose other ends the server holds, and its own end of a fresh socketpair
 * for the replies — and drops the copy. One request is one message, so helpers sending at once
 * never interleave, and the replies go to each helper's own socket.
 *
 * The init refuses anything but a well-formed request with exactly four descriptors (it closes
 * what came, answers 'F' EINVAL where it can and goes on), bounds the commands it watches at
 * once (STARTER_MAX_EXECS) and never blocks on a helper: replies are sent without waiting, a
 * helper's signal requests are read when they come. It answers 'P' with the command's pid, or 'F'
 * with the fork's errno — a sandbox at its process limit refuses the init's fork, and then the
 * helper starts the command the slow way, from the host side, which the limit cannot refuse —
 * and 'W' with its wait status when it ends. A helper that goes away (killed: the server's
 * handle:kill("KILL")) takes its command's process group with it.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sandbox.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

/* Commands the init watches at once; a request beyond them is answered 'F' EAGAIN. */
#define STARTER_MAX_EXECS 1024
/* Descriptors a request carries, and room for a sender that passes more (all are closed). */
#define STARTER_FDS     4
#define STARTER_FDS_MAX 16

extern char **environ;

/* ---- the init's side ------------------------------------------------------------------------- */

struct running {
    pid_t pid; /* 0: a free slot */
    int reply; /* the helper's socket; -1 once it went away */
    int group; /* signals go to the process group (the command leads a session) */
};

static struct running runs[STARTER_MAX_EXECS];
static unsigned char frame[STARTER_MAX_FRAME];
static struct starter_req req;

/* Sends message kind/value on socket fd without waiting (a helper that does not read loses it). */
static void reply(int fd, unsigned kind, int32_t value)
{
    unsigned char m[STARTER_MSG_LEN];
    if (fd >= 0 && starter_encode_msg(kind, value, m) == 0)
        (void)!send(fd, m, sizeof m, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* Makes a C string of s (the child's copy; it is about to exec, nothing is freed). */
static char *cstr(const struct starter_str *s)
{
    char *c = malloc((size_t)s->n + 1);
    if (!c) _exit(126);
    memcpy(c, s->p, s->n);
    c[s->n] = 0;
    return c;
}

/* The forked child: becomes the command. Its signals back to default and unblocked, a session
 * of its own when asked, fds 0-2 the request's and nothing else open (the channel and every
 * helper's socket are closed first, before anything else happens here), then dumpable again and
 * its OOM score the kernel's default: the init's -1000 is inherited, and without this the OOM
 * killer could never pick a command; its /proc files are writable by the sandbox's root only
 * once it is dumpable, and from then on it holds nothing the command would not. Then the
 * request's working directory (else /) and starter_execute. */
static void become_command(const int fds[STARTER_FDS])
{
    sigset_t none;
    sigemptyset(&none);
    for (int i = 1; i < 65; i++)
        if (i != SIGKILL && i != SIGSTOP) signal(i, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (req.flags & STARTER_SETSID) setsid();
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], i) < 0) _exit(126);
    syscall(SYS_close_range, 3, ~0U, 0);
    prctl(PR_SET_DUMPABLE, 1);
    int e = write_file("/proc/self/oom_score_adj", "0");
    if (e) {
        fprintf(stderr, "moonbox-sandbox: resetting the OOM score: %s\n", strerror(e));
        _exit(126);
    }
    char **argv = calloc((size_t)req.argc + 1, sizeof *argv);
    char **env = calloc((size_t)req.envc + 1, sizeof *env);
    if (!argv || !env) _exit(126);
    for (uint32_t i = 0; i < req.argc; i++)
        argv[i] = cstr(&req.argv[i]);
    for (uint32_t i = 0; i < req.envc; i++)
        env[i] = cstr(&req.env[i]);
    char *cwd = cstr(&req.cwd);
    if (chdir(cwd) < 0 && chdir("/") < 0) _exit(126);
    starter_execute(argv, env, req.shell.n ? cstr(&req.shell) : NULL);
}

void starter_execute(char **argv, char **env, const char *shell)
{
    environ = env; /* execvp searches the command's PATH, not ours */
    execvp(argv[0], argv);
    int e = errno;
    if (shell) {
        /* Plain words that cannot run as they are: bash says why, in its own words. */
        char *sh[] = {"/bin/bash", "-c", (char *)shell, NULL};
        execve(sh[0], sh, env);
        e = errno;
    }
    fprintf(stderr, "moonbox-sandbox: cannot run %s: %s\n", shell ? "/bin/bash" : argv[0],
            strerror(e));
    _exit(e == ENOENT ? 127 : 126);
}

/* Takes one message off the channel: a request, or garbage. Starts the command of a good one
 * and remembers it; every descriptor that came is closed or kept, never leaked. */
static void take_request(int chan)
{
    struct iovec iov = {frame, sizeof frame};
    union {
        char buf[CMSG_SPACE(STARTER_FDS_MAX * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    ssize_t n = recvmsg(chan, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) return; /* (an empty message is a message: its descriptors are handled below) */
    int fds[STARTER_FDS_MAX], nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k && nfds < STARTER_FDS_MAX; i++)
            memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    }
    int ok = nfds == STARTER_FDS && !(msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) &&
             starter_parse_request(frame, (size_t)n, &req) == 0;
    struct stat st;
    if (ok && (fstat(fds[3], &st) < 0 || !S_ISSOCK(st.st_mode))) ok = 0;
    int slot = -1;
    for (int i = 0; ok && i < STARTER_MAX_EXECS; i++)
        if (runs[i].pid == 0) {
            slot = i;
            break;
        }
    pid_t pid = -1;
    int err = !ok ? EINVAL : slot < 0 ? EAGAIN : 0;
    if (!err) {
        pid = fork();
        if (pid == 0) become_command(fds);
        if (pid < 0) err = errno;
    }
    if (nfds == STARTER_FDS) reply(fds[3], err ? STARTER_FAILED : STARTER_STARTED, err ? err : pid);
    for (int i = 0; i < nfds; i++)
        if (err || i != 3) close(fds[i]);
    if (err) return;
    fcntl(fds[3], F_SETFL, O_NONBLOCK);
    runs[slot] =
        (struct running){.pid = pid, .reply = fds[3], .group = !!(req.flags & STARTER_SETSID)};
}

/* Reads what the helper of run r says: a signal to deliver; its end (it was killed, or left)
 * kills the command's group, whose helper can no longer relay its end. */
static void take_message(struct running *r)
{
    unsigned char b[64];
    ssize_t n = recv(r->reply, b, sizeof b, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    struct starter_msg m;
    if (n > 0 && starter_parse_msg(b, (size_t)n, &m) == 0 && m.kind == STARTER_SIGNAL) {
        kill(r->group ? -r->pid : r->pid, m.value);
        return;
    }
    if (n > 0) return; /* anything else from a helper is ignored */
    kill(r->group ? -r->pid : r->pid, SIGKILL);
    close(r->reply);
    r->reply = -1;
}

/* Reaps every ended child: a command's status goes to its helper, an orphan's is dropped. */
static void reap(void)
{
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
        for (int i = 0; i < STARTER_MAX_EXECS; i++)
            if (runs[i].pid == pid) {
                if (runs[i].reply >= 0) {
                    reply(runs[i].reply, STARTER_EXITED, st);
                    close(runs[i].reply);
                }
                runs[i] = (struct running){.pid = 0, .reply = -1};
                break;
            }
}

void starter_serve(int chan)
{
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sig = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    static struct pollfd pfd[2 + STARTER_MAX_EXECS];
    static int which[2 + STARTER_MAX_EXECS];
    for (;;) {
        int n = 0;
        pfd[n++] = (struct pollfd){.fd = chan, .events = POLLIN};
        pfd[n++] = (struct pollfd){.fd = sig, .events = POLLIN};
        for (int i = 0; i < STARTER_MAX_EXECS; i++)
            if (runs[i].pid && runs[i].reply >= 0) {
                which[n] = i;
                pfd[n++] = (struct pollfd){.fd = runs[i].reply, .events = POLLIN};
            }
        if (poll(pfd, (nfds_t)n, -1) < 0) continue;
        if (pfd[1].revents) {
            struct signalfd_siginfo si;
            while (read(sig, &si, sizeof si) > 0) {
            }
            reap();
        }
        for (int k = 2; k < n; k++)
            if (pfd[k].revents && runs[which[k]].reply == pfd[k].fd) take_message(&runs[which[k]]);
        if (pfd[0].revents & POLLIN) take_request(chan);
        /* The keeper's end closed: the keeper is gone, and the sandbox with it (the parent-death
         * signal is on its way). */
        if (pfd[0].revents & POLLHUP) _exit(EXIT_HELPER);
        /* Without a signalfd (it cannot fail short of memory), reap on every wake-up. */
        if (sig < 0) reap();
    }
}

/* ---- the exec helper's side ------------------------------------------------------------------ */

static int reply_fd = -1;

/* Relays a signal the helper got to the command (its group when it leads one). */
static void forward(int sig)
{
    unsigned char m[STARTER_MSG_LEN];
    int saved = errno;
    if (starter_encode_msg(STARTER_SIGNAL, sig, m) == 0)
        (void)!send(reply_fd, m, sizeof m, MSG_DONTWAIT | MSG_NOSIGNAL);
    errno = saved;
}

/* The signals relayed: every one a process can catch but those that say something about the
 * helper itself (a fault, a stop from a terminal it has not got, a child of its own). */
static int relayed(int sig)
{
    return sig != SIGKILL && sig != SIGSTOP && sig != SIGCHLD && sig != SIGSEGV && sig != SIGBUS &&
           sig != SIGFPE && sig != SIGILL && sig != SIGTRAP && sig != SIGSYS;
}

/* Reads /proc/PID/stat's parent pid; -1 when the process is gone. */
static pid_t parent_of(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *paren = strrchr(buf, ')');
    int ppid;
    char state;
    if (!paren || sscanf(paren + 1, " %c %d", &state, &ppid) != 2) return -1;
    return (pid_t)ppid;
}

static void gone(const struct spec *s)
{
    fail_msg("gone", "sandbox %s: its init (pid %d) is gone", s->id ? s->id : "?", (int)s->target);
}

/* The keeper's end of the channel, copied: after pidfds pin the keeper and the init, the init
 * must be the sandbox's (its uid map) and the keeper its parent, and both still alive after
 * those checks — so a pid recycled in between is never taken for the sandbox's keeper. */
static int take_channel(const struct spec *s)
{
    int kp = (int)syscall(SYS_pidfd_open, s->keeper, 0);
    int ip = (int)syscall(SYS_pidfd_open, s->target, 0);
    if (kp < 0 || ip < 0) gone(s);
    enter_check_target(s);
    if (parent_of(s->target) != s->keeper || syscall(SYS_pidfd_send_signal, kp, 0, NULL, 0) < 0 ||
        syscall(SYS_pidfd_send_signal, ip, 0, NULL, 0) < 0)
        gone(s);
    int chan = (int)syscall(SYS_pidfd_getfd, kp, (int)s->channel, 0);
    if (chan < 0) die("taking the starter's channel", NULL, errno);
    close(kp);
    close(ip);
    int type = 0;
    socklen_t len = sizeof type;
    struct stat st;
    if (fstat(chan, &st) < 0 || !S_ISSOCK(st.st_mode) ||
        getsockopt(chan, SOL_SOCKET, SO_TYPE, &type, &len) < 0 || type != SOCK_SEQPACKET)
        fail_msg("arguments", "--channel=%ld is not the keeper's starter channel", s->channel);
    return chan;
}

/* Ends like status: its exit code, or death by its signal (as the command died). */
static int end_like(int status)
{
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    int sig = WTERMSIG(status);
    signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    sigprocmask(SIG_UNBLOCK, &one, NULL);
    kill(getpid(), sig);
    return 128 + sig;
}

int starter_exec(const struct spec *s, char **env)
{
    static struct starter_req r; /* 128 KiB of slots: only what is used is written (touched) */
    r.argc = r.envc = 0;
    r.shell = (struct starter_str){(const unsigned char *)"", 0};
    r.flags = s->setsid ? STARTER_SETSID : 0;
    const char *cwd = s->cwd ? s->cwd : "/root";
    if (s->shell)
        r.shell = (struct starter_str){(const unsigned char *)s->shell, (uint32_t)strlen(s->shell)};
    r.cwd = (struct starter_str){(const unsigned char *)cwd, (uint32_t)strlen(cwd)};
    for (char **a = s->argv; *a; a++) {
        if (r.argc == STARTER_MAX_ARGS)
            fail_msg("arguments", "a command has at most %d words", STARTER_MAX_ARGS);
        r.argv[r.argc++] = (struct starter_str){(const unsigned char *)*a, (uint32_t)strlen(*a)};
    }
    for (char **e = env; *e; e++) {
        if (r.envc == STARTER_MAX_ENV)
            fail_msg("arguments", "an environment has at most %d variables", STARTER_MAX_ENV);
        r.env[r.envc++] = (struct starter_str){(const unsigned char *)*e, (uint32_t)strlen(*e)};
    }
    size_t len = starter_encode_request(&r, NULL, 0);
    if (len > STARTER_MAX_FRAME)
        fail_msg("arguments", "the command and its environment take %zu bytes, more than %u", len,
                 STARTER_MAX_FRAME);
    unsigned char *buf = malloc(len);
    if (!buf) die("exec", NULL, ENOMEM);
    starter_encode_request(&r, buf, len);
    int chan = take_channel(s);
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0)
        die("socketpair", NULL, errno);
    int fds[STARTER_FDS] = {0, 1, 2, pair[1]};
    union {
        char buf[CMSG_SPACE(sizeof fds)];
        struct cmsghdr align;
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {buf, len};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    ssize_t sent;
    while ((sent = sendmsg(chan, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR) {
    }
    if (sent < 0) {
        if (errno == EPIPE || errno == ECONNRESET || errno == ECONNREFUSED) gone(s);
        die("sending to the starter", NULL, errno);
    }
    close(chan);
    close(pair[1]);
    free(buf);
    reply_fd = pair[0];
    /* Relayed signals are held until the command runs (a kill before 'P' is not lost). */
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &old);
    struct sigaction sa = {.sa_handler = forward};
    sigfillset(&sa.sa_mask);
    for (int i = 1; i < 32; i++)
        if (relayed(i)) sigaction(i, &sa, NULL);
    int started = 0;
    for (;;) {
        unsigned char m[64];
        ssize_t n = recv(reply_fd, m, sizeof m, 0);
        if (n < 0 && errno == EINTR) continue;
        struct starter_msg got;
        if (n <= 0 || starter_parse_msg(m, (size_t)n, &got) < 0) {
            /* The init went away (the sandbox ended): so did the command, killed with it. */
            if (!started) gone(s);
            return end_like(SIGKILL); /* a wait status of "killed by SIGKILL" */
        }
        if (!started && got.kind == STARTER_FAILED) {
            if (got.value == EAGAIN || got.value == ENOMEM) {
                close(reply_fd);
                for (int i = 1; i < 32; i++)
                    if (relayed(i)) signal(i, SIG_DFL);
                sigprocmask(SIG_SETMASK, &old, NULL);
                return -1;
            }
            die("starting the command in the sandbox", NULL, got.value);
        }
        if (!started && got.kind == STARTER_STARTED) {
            started = 1;
            /* The command has the streams now: ours must not keep them open after it ends. */
            int null = open("/dev/null", O_RDWR | O_CLOEXEC);
            if (null >= 0) {
                dup2(null, 0);
                dup2(null, 1);
                dup2(null, 2);
                close(null);
            }
            sigprocmask(SIG_SETMASK, &old, NULL);
            continue;
        }
        if (started && got.kind == STARTER_EXITED) {
            /* The init closes its end right after the status: waiting for that close makes an
             * exec's end mean the init holds nothing of it any more. */
            while ((n = recv(reply_fd, m, sizeof m, 0)) > 0 || (n < 0 && errno == EINTR)) {
            }
            return end_like(got.value);
        }
    }
}
