/*
 * enter.c — `moonbox-sandbox exec` and `files`: a process joins a running sandbox.
 *
 * enter_sandbox does, in this order: join the sandbox's cgroups (so everything we start is
 * born inside, counted and frozen with it); open the init's namespaces and root from /proc —
 * all before entering any, so no host path is resolved after the switch; check that the pid
 * still is that sandbox's init (its uid map names the sandbox's id range: a recycled pid
 * would not); enter the user namespace first (from then on our capabilities are those of its
 * root, in it only), then IPC, UTS, network, cgroup, PID and mount; become root of the user
 * namespace (host id = the range's base); chroot into the init's root. The next fork lands in
 * the sandbox's PID namespace. The caller then confines itself like any process inside
 * (confine.c) and forks: the child, born confined (capabilities, no_new_privs and the seccomp
 * filter are inherited), runs the command (exec) or our own file code (files); the parent stays
 * outside the PID namespace, invisible inside, relays signals to the child and its exit status
 * to the backend (as nsenter does). Confining once before the fork rather than in each process
 * after it gives both the same state for one filter load instead of two.
 *
 * An exec normally takes the fast way, starter.c (the init starts the command, nothing is entered
 * here); this way remains for a sandbox whose init cannot fork (at its process limit), and for
 * file operations.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sandbox.h"

static const struct {
    const char *name;
    int type;
} ns_order[] = {
    {"user", CLONE_NEWUSER}, {"ipc", CLONE_NEWIPC},       {"uts", CLONE_NEWUTS},
    {"net", CLONE_NEWNET},   {"cgroup", CLONE_NEWCGROUP}, {"pid", CLONE_NEWPID},
    {"mnt", CLONE_NEWNS},
};
#define NS_COUNT (sizeof ns_order / sizeof ns_order[0])

void enter_check_target(const struct spec *s)
{
    char path[64], buf[128];
    snprintf(path, sizeof path, "/proc/%d/uid_map", (int)s->target);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        fail_msg("gone", "sandbox %s: its init (pid %d) is gone", s->id ? s->id : "?",
                 (int)s->target);
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    buf[n > 0 ? n : 0] = 0;
    unsigned long inside, outside, count;
    if (sscanf(buf, "%lu %lu %lu", &inside, &outside, &count) != 3 || inside != 0 ||
        outside != s->uid_base || count != SANDBOX_ID_RANGE)
        fail_msg("gone", "sandbox %s: pid %d is not its init any more", s->id ? s->id : "?",
                 (int)s->target);
}

/* --join-in-child: the sandbox's cgroup.procs files, opened by enter_sandbox on the host side
 * (host paths, root's credentials: the kernel checks the opener's) for the child to write. The
 * helper itself stays in the cgroups it was started in (the backend's host side): it is not
 * counted in the sandbox's process, memory or CPU limits, and its fork is not refused when
 * the sandbox is at its process limit (joining is never refused, only forking inside). */
#define MAX_CGROUPS 8
static int cg_fds[MAX_CGROUPS] = {-1, -1, -1, -1, -1, -1, -1, -1};

void enter_cgroups_child(const struct spec *s)
{
    if (!s->join_in_child) return;
    for (int i = 0; i < s->cgroups.n && i < MAX_CGROUPS; i++) {
        /* "0": the writer; its pid here would be the one in the sandbox's PID namespace */
        if (write(cg_fds[i], "0", 1) != 1) die("joining", s->cgroups.v[i], errno);
        close(cg_fds[i]);
        cg_fds[i] = -1;
    }
}

void enter_cgroups_done(void)
{
    for (int i = 0; i < MAX_CGROUPS; i++)
        if (cg_fds[i] >= 0) {
            close(cg_fds[i]);
            cg_fds[i] = -1;
        }
}

void enter_sandbox(const struct spec *s)
{
    if (s->target <= 1 || !s->uid_base)
        fail_msg("arguments", "--target and --uid-base are required");
    char pidbuf[32], path[4096];
    snprintf(pidbuf, sizeof pidbuf, "%d\n", (int)getpid());
    for (int i = 0; i < s->cgroups.n; i++) {
        snprintf(path, sizeof path, "%s/cgroup.procs", s->cgroups.v[i]);
        int e = 0;
        if (!s->join_in_child)
            e = write_file(path, pidbuf);
        else if (i >= MAX_CGROUPS)
            fail_msg("arguments", "at most %d --cgroup with --join-in-child", MAX_CGROUPS);
        else if ((cg_fds[i] = open(path, O_WRONLY | O_CLOEXEC)) < 0)
            e = errno;
        if (e == ENOENT) fail_msg("gone", "sandbox %s: its cgroup is gone", s->id ? s->id : "?");
        if (e) die("joining", path, e);
    }
    int fds[NS_COUNT];
    for (size_t i = 0; i < NS_COUNT; i++) {
        snprintf(path, sizeof path, "/proc/%d/ns/%s", (int)s->target, ns_order[i].name);
        if ((fds[i] = open(path, O_RDONLY | O_CLOEXEC)) < 0)
            fail_msg("gone", "sandbox %s: its init (pid %d) is gone", s->id ? s->id : "?",
                     (int)s->target);
    }
    snprintf(path, sizeof path, "/proc/%d/root", (int)s->target);
    int root = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0)
        fail_msg("gone", "sandbox %s: its init (pid %d) is gone", s->id ? s->id : "?",
                 (int)s->target);
    enter_check_target(s);
    for (size_t i = 0; i < NS_COUNT; i++) {
        if (setns(fds[i], ns_order[i].type) < 0) die("entering namespace", ns_order[i].name, errno);
        close(fds[i]);
    }
    if (setresgid(0, 0, 0) < 0 || setgroups(0, NULL) < 0 || setresuid(0, 0, 0) < 0)
        die("becoming root of the sandbox's user namespace", NULL, errno);
    if (fchdir(root) < 0 || chroot(".") < 0) die("entering the sandbox's root", NULL, errno);
    close(root);
    /* Our memory came from the host: nothing inside may ptrace or read it. */
    prctl(PR_SET_DUMPABLE, 0);
}

static pid_t child;
static int g_argc;
static char **g_argv;

/* Overwrites our argument strings: a child inside the sandbox's PID namespace is visible there,
 * and /proc/PID/cmdline is readable by anyone; ours name host paths (the helper, cgroups) and
 * the init's host pid. */
static void wipe_args(void)
{
    if (!g_argv || !g_argv[0]) return;
    char *hi = g_argv[0];
    for (int i = 0; i < g_argc; i++)
        if (g_argv[i] + strlen(g_argv[i]) > hi) hi = g_argv[i] + strlen(g_argv[i]);
    memset(g_argv[0], 0, (size_t)(hi - g_argv[0]));
    strcpy(g_argv[0], "moonbox-helper");
}

void enter_set_args(int argc, char **argv)
{
    g_argc = argc;
    g_argv = argv;
}

static void forward(int sig)
{
    if (child > 0) kill(child, sig);
}

/* Waits for the child and ends like it: its exit status, or death by its signal. */
static int relay(void)
{
    struct sigaction sa = {.sa_handler = forward};
    int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        sigaction(sigs[i], &sa, NULL);
    int st;
    while (waitpid(child, &st, 0) < 0)
        if (errno != EINTR) die("waiting", NULL, errno);
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    signal(WTERMSIG(st), SIG_DFL);
    kill(getpid(), WTERMSIG(st));
    return 128 + WTERMSIG(st);
}

static void reset_signals(void)
{
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int i = 1; i < 65; i++)
        if (i != SIGKILL && i != SIGSTOP) signal(i, SIG_DFL);
}

/* Confines the caller (confine.c), or dies naming the step. */
static void confine_or_die(void)
{
    const char *step = NULL;
    int e = confine(&step);
    if (e < 0) die(step, NULL, -e);
}

/* `moonbox-sandbox exec ... -- PROGRAM ARG...`: runs PROGRAM inside sandbox s. The command's
 * environment is exactly our MBENV_ variables without the prefix (secrets never travel in
 * arguments). With --keeper and --channel the sandbox's init starts it (starter.c: no namespace
 * is entered here) and this process relays its end; when the init cannot fork, and without
 * them, it is started the slow way, from here: joins the sandbox (enter_sandbox), changes to s->cwd
 * (default /root, else /), confines itself (capabilities, no_new_privs, seccomp) and forks; the
 * child resets signals, copies argv and env, wipes our argument strings, optionally starts a
 * session and execve()s, exiting 127 (not found) or 126 with a message on stderr when it cannot.
 * The parent relays: forwards TERM, INT, HUP, QUIT, USR1, USR2 and returns the child's exit status
 * (or dies by its signal). Setup failures die() with the step and errno (sandbox.h). */
int cmd_exec(struct spec *s)
{
    if (!s->argv || !s->argv[0]) fail_msg("arguments", "exec needs -- PROGRAM ARG...");
    /* The command's environment: our MBENV_ variables without the prefix, and nothing else. */
    size_t n = 0;
    for (char **e = environ; *e; e++)
        n++;
    char **env = calloc(n + 1, sizeof *env);
    if (!env) die("environment", NULL, ENOMEM);
    size_t k = 0;
    for (char **e = environ; *e; e++)
        if (strncmp(*e, "MBENV_", 6) == 0) env[k++] = *e + 6;
    if (s->keeper > 0) {
        int code = starter_exec(s, env);
        if (code >= 0) return code;
        /* the init could not fork (the sandbox at its process limit): the host side can */
    }
    enter_sandbox(s);
    const char *cwd = s->cwd ? s->cwd : "/root";
    if (chdir(cwd) < 0 && chdir("/") < 0) die("chdir", cwd, errno);
    confine_or_die();
    child = fork();
    if (child < 0) die("fork", NULL, errno);
    if (child == 0) {
        enter_cgroups_child(s);
        reset_signals();
        /* Copy what execve needs before the argument strings are gone. */
        int n = 0;
        while (s->argv[n])
            n++;
        char **argv = calloc((size_t)n + 1, sizeof *argv);
        if (!argv) die("exec", NULL, ENOMEM);
        for (int i = 0; i < n; i++)
            if (!(argv[i] = strdup(s->argv[i]))) die("exec", NULL, ENOMEM);
        for (size_t i = 0; env[i]; i++)
            if (!(env[i] = strdup(env[i]))) die("exec", NULL, ENOMEM);
        char *shell = s->shell ? strdup(s->shell) : NULL;
        wipe_args();
        if (s->setsid && setsid() < 0) die("setsid", NULL, errno);
        syscall(SYS_close_range, 3, ~0U, 0);
        starter_execute(argv, env, shell);
    }
    enter_cgroups_done();
    return relay();
}

int cmd_files(struct spec *s)
{
    enter_sandbox(s);
    if (chdir("/") < 0) die("chdir /", NULL, errno);
    confine_or_die();
    child = fork();
    if (child < 0) die("fork", NULL, errno);
    if (child == 0) {
        enter_cgroups_child(s);
        reset_signals();
        struct spec copy = *s; /* the strings it points to are duplicated below */
        const char **fields[] = {&copy.op, &copy.path, &copy.mode, &copy.id};
        for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
            if (*fields[i] && !(*fields[i] = strdup(*fields[i]))) die("files", NULL, ENOMEM);
        for (int i = 0; i < copy.excludes.n; i++)
            if (!(copy.excludes.v[i] = strdup(copy.excludes.v[i]))) die("files", NULL, ENOMEM);
        wipe_args();
        _exit(fileops_run(&copy));
    }
    enter_cgroups_done();
    return relay();
}
