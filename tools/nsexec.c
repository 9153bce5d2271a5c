/*
 * nsexec.c — moonbox-nsexec, the one host-side helper of a `moonbox local` exec or file
 * operation. It does in one small (statically linked, no Lua) program what the chain
 * `sh -c 'echo $$ > cgroup.procs; exec ...'` → setpriv --bounding-set → nsenter → setsid did
 * in four execs, which on a paravirtualized VM cost milliseconds each:
 *
 *   moonbox-nsexec [--cgroup FILE] [--dup OLD:NEW] [--drop CAP,...] [--target PID
 *                  --ns NS,... [--root-wd]] [--setsid] -- PROGRAM ARG...
 *
 * Steps, in this order: dup OLD onto NEW; write our pid into FILE (a cgroup.procs: every
 * process we start is born inside); drop each CAP (names as setpriv's, without "cap_") from
 * the bounding set; open /proc/PID/ns/NS for each NS (ipc, uts, net, pid, mnt) and, with
 * --root-wd, /proc/PID/root and /proc/PID/cwd — all before entering anything, as nsenter
 * --root --wd without values does, so the root and working directory are the target's and no
 * host path is resolved after the switch; setns each (mnt last); chroot into the target's root
 * and chdir to its cwd; when the PID namespace was entered, fork (only a child is in it) and
 * wait: the parent exits with the child's status, or kills itself with the child's signal, as
 * nsenter does; the child (or the only process) becomes a session leader with --setsid and
 * execs PROGRAM.
 * Exit 125 when a step of our own fails (with "moonbox-nsexec: <step>: <reason>" on stderr),
 * 126/127 when PROGRAM cannot be run; otherwise PROGRAM's status. The engine
 * (lua/moonbox/local/engine.lua) starts it; docs/local-isolation.md describes the isolation.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXIT_HELPER 125

/* Capability numbers of the kernel ABI (linux/capability.h), by setpriv's names. */
static const char *const cap_names[] = {
    "chown",
    "dac_override",
    "dac_read_search",
    "fowner",
    "fsetid",
    "kill",
    "setgid",
    "setuid",
    "setpcap",
    "linux_immutable",
    "net_bind_service",
    "net_broadcast",
    "net_admin",
    "net_raw",
    "ipc_lock",
    "ipc_owner",
    "sys_module",
    "sys_rawio",
    "sys_chroot",
    "sys_ptrace",
    "sys_pacct",
    "sys_admin",
    "sys_boot",
    "sys_nice",
    "sys_resource",
    "sys_time",
    "sys_tty_config",
    "mknod",
    "lease",
    "audit_write",
    "audit_control",
    "setfcap",
    "mac_override",
    "mac_admin",
    "syslog",
    "wake_alarm",
    "block_suspend",
    "audit_read",
    "perfmon",
    "bpf",
    "checkpoint_restore",
};

/* Namespaces in the order they are entered: the mount namespace last, because entering it
 * changes how later /proc paths would resolve (they are all opened before anyway). */
static const struct {
    const char *name;
    int type;
} ns_kinds[] = {
    {"ipc", CLONE_NEWIPC}, {"uts", CLONE_NEWUTS}, {"net", CLONE_NEWNET},
    {"pid", CLONE_NEWPID}, {"mnt", CLONE_NEWNS},
};
#define NS_COUNT (sizeof ns_kinds / sizeof ns_kinds[0])

static void die(const char *step, const char *what, int e)
{
    fprintf(stderr, "moonbox-nsexec: %s%s%s: %s\n", step, what ? " " : "", what ? what : "",
            strerror(e));
    exit(EXIT_HELPER);
}

static void usage(const char *why)
{
    fprintf(stderr, "moonbox-nsexec: %s\n", why);
    exit(EXIT_HELPER);
}

/* Whether name appears in the comma-separated list. */
static int in_list(const char *list, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = list; p && *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == n && strncmp(p, name, n) == 0) return 1;
        p = comma ? comma + 1 : NULL;
    }
    return 0;
}

/* Refuses a --ns list naming a namespace we do not know: a typo must not quietly skip one. */
static void check_ns_list(const char *list)
{
    for (const char *p = list; p && *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        int known = 0;
        for (size_t k = 0; k < NS_COUNT; k++)
            if (strlen(ns_kinds[k].name) == len && strncmp(p, ns_kinds[k].name, len) == 0)
                known = 1;
        if (!known) {
            fprintf(stderr,
                    "moonbox-nsexec: --ns: unknown namespace '%.*s' in '%s' (known: ipc, uts, net, "
                    "pid, mnt)\n",
                    (int)len, p, list);
            exit(EXIT_HELPER);
        }
        p = comma ? comma + 1 : NULL;
    }
}

static void join_cgroup(const char *file)
{
    int fd = open(file, O_WRONLY | O_CLOEXEC);
    if (fd < 0) die("joining the cgroup", file, errno);
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%d\n", (int)getpid());
    if (write(fd, buf, (size_t)n) != n) die("joining the cgroup", file, errno);
    if (close(fd) != 0) die("joining the cgroup", file, errno);
}

/* Drops each capability of the comma-separated list from the bounding set (setpriv
 * --bounding-set -a,-b,...). A capability this kernel does not know cannot be held: skipped. */
static void drop_caps(const char *list)
{
    char *copy = strdup(list);
    if (!copy) die("dropping capabilities", NULL, ENOMEM);
    for (char *save = NULL, *c = strtok_r(copy, ",", &save); c; c = strtok_r(NULL, ",", &save)) {
        if (*c == '-') c++;
        if (strncmp(c, "cap_", 4) == 0) c += 4;
        int num = -1;
        for (size_t i = 0; i < sizeof cap_names / sizeof cap_names[0]; i++)
            if (strcmp(cap_names[i], c) == 0) num = (int)i;
        if (num < 0) {
            fprintf(stderr, "moonbox-nsexec: dropping capabilities: unknown capability '%s'\n", c);
            exit(EXIT_HELPER);
        }
        if (prctl(PR_CAPBSET_DROP, num, 0, 0, 0) != 0 && errno != EINVAL)
            die("dropping capability", c, errno);
    }
    free(copy);
}

/* The parent's side after the fork into the PID namespace: waits for the child and ends the
 * way it ended (nsenter's behaviour, which the engine's h:wait reads: exit code, or the same
 * signal). A stopped child stops us too, and is continued when we are. */
static void wait_as_parent(pid_t child)
{
    int status;
    for (;;) {
        pid_t r = waitpid(child, &status, WUNTRACED);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) die("waiting for the command", NULL, errno);
        if (WIFSTOPPED(status)) {
            kill(getpid(), SIGSTOP);
            kill(child, SIGCONT);
            continue;
        }
        break;
    }
    if (WIFEXITED(status)) exit(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) {
        int sig = WTERMSIG(status);
        struct rlimit no_core = {0, 0};
        sigset_t set;
        setrlimit(RLIMIT_CORE, &no_core); /* the command's crash is not ours to dump */
        signal(sig, SIG_DFL);
        sigemptyset(&set);
        sigaddset(&set, sig);
        sigprocmask(SIG_UNBLOCK, &set, NULL);
        kill(getpid(), sig);
    }
    exit(EXIT_FAILURE);
}

int main(int argc, char **argv)
{
    const char *cgroup = NULL, *drop = NULL, *target = NULL, *ns = NULL;
    int root_wd = 0, new_session = 0, i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        int has_value = i + 1 < argc;
        if (strcmp(a, "--cgroup") == 0 && has_value) {
            cgroup = argv[++i];
        } else if (strcmp(a, "--dup") == 0 && has_value) {
            int from, to;
            if (sscanf(argv[++i], "%d:%d", &from, &to) != 2) usage("--dup takes OLD:NEW");
            if (dup2(from, to) < 0) die("--dup", argv[i], errno);
        } else if (strcmp(a, "--drop") == 0 && has_value) {
            drop = argv[++i];
        } else if (strcmp(a, "--target") == 0 && has_value) {
            target = argv[++i];
        } else if (strcmp(a, "--ns") == 0 && has_value) {
            ns = argv[++i];
            check_ns_list(ns);
        } else if (strcmp(a, "--root-wd") == 0) {
            root_wd = 1;
        } else if (strcmp(a, "--setsid") == 0) {
            new_session = 1;
        } else {
            fprintf(stderr, "moonbox-nsexec: unknown or incomplete option '%s'\n", a);
            exit(EXIT_HELPER);
        }
    }
    if (i >= argc) usage("no command given after --");
    if ((ns || root_wd) && !target) usage("--ns and --root-wd need --target PID");

    if (cgroup) join_cgroup(cgroup);
    if (drop) drop_caps(drop);

    int ns_fd[NS_COUNT], root_fd = -1, wd_fd = -1, enter_pid = 0;
    char path[64];
    for (size_t k = 0; k < NS_COUNT; k++) {
        ns_fd[k] = -1;
        if (!ns || !in_list(ns, ns_kinds[k].name)) continue;
        snprintf(path, sizeof path, "/proc/%s/ns/%s", target, ns_kinds[k].name);
        if ((ns_fd[k] = open(path, O_RDONLY | O_CLOEXEC)) < 0) die("opening", path, errno);
        if (ns_kinds[k].type == CLONE_NEWPID) enter_pid = 1;
    }
    if (root_wd) {
        snprintf(path, sizeof path, "/proc/%s/root", target);
        if ((root_fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) die("opening", path, errno);
        snprintf(path, sizeof path, "/proc/%s/cwd", target);
        if ((wd_fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) die("opening", path, errno);
    }
    for (size_t k = 0; k < NS_COUNT; k++) {
        if (ns_fd[k] < 0) continue;
        if (setns(ns_fd[k], ns_kinds[k].type) != 0)
            die("entering the namespace", ns_kinds[k].name, errno);
        close(ns_fd[k]);
    }
    if (root_fd >= 0) {
        if (fchdir(root_fd) != 0) die("changing to the target's root", NULL, errno);
        if (chroot(".") != 0) die("chroot to the target's root", NULL, errno);
        if (chdir("/") != 0) die("chdir", "/", errno);
        if (fchdir(wd_fd) != 0) die("changing to the target's working directory", NULL, errno);
        close(root_fd);
        close(wd_fd);
    }
    if (enter_pid) {
        signal(SIGCHLD, SIG_DFL);
        pid_t child = fork();
        if (child < 0) die("fork into the PID namespace", NULL, errno);
        if (child > 0) wait_as_parent(child);
    }
    if (new_session && setsid() < 0) die("setsid", NULL, errno);
    execvp(argv[i], argv + i);
    int e = errno;
    fprintf(stderr, "moonbox-nsexec: cannot run %s: %s\n", argv[i], strerror(e));
    return e == ENOENT ? 127 : 126;
}
