/*
 * sandbox.h — moonbox-sandbox, the one program through which `moonbox local` makes, enters and
 * reads its sandboxes. Shared declarations of its parts:
 *
 *   main.c     argument parsing, dispatch, errors
 *   start.c    `start`: a new sandbox (user, mount, PID, IPC, UTS, network, cgroup namespaces,
 *              its overlay root, /proc, /sys, /dev) and its init
 *   enter.c    `exec` and `files`: joining a running sandbox (cgroup, namespaces, root, ids)
 *   confine.c  what every process inside gets last: capabilities, no_new_privs, seccomp
 *   fileops.c  `files`: reading and writing the sandbox's files with our own code, inside it
 *   shift.c    `capture`: copying an upper layer into a snapshot layer with ids made 0-based
 *
 * Invariants: the program is linked statically and never loads code from a sandbox's
 * filesystem (no dynamic loader, no NSS, no iconv); every step that runs after a process entered
 * a sandbox runs with at most the sandbox's own privileges (its user namespace's root, the
 * confinement of confine.c, its cgroup). Errors of our own steps exit EXIT_HELPER with one line
 * "moonbox-sandbox: <step>: <reason>" on stderr, which the engine turns into its error.
 * docs/local-isolation.md explains the design and what each step defends against.
 */
#ifndef MOONBOX_SANDBOX_H
#define MOONBOX_SANDBOX_H

#include <stddef.h>
#include <sys/types.h>

#define EXIT_HELPER 125

/* Every sandbox's ids: root inside is host id base, uid/gid n inside is base + n. */
#define SANDBOX_ID_RANGE 65536u

/* Limits of argument lists, checked when parsing (a spec is built by the engine, not a user). */
#define MAX_LIST 256

struct str_list {
    const char *v[MAX_LIST];
    int n;
};

/* The parsed command line: --key=value options, repeatable ones collected into lists, and the
 * words after "--". Only the options a subcommand reads matter to it. */
struct spec {
    const char *cmd;
    const char *id;    /* sandbox id (hostname, messages) */
    const char *root;  /* start: the overlay's mount point (a host directory) */
    const char *upper; /* start: the overlay's upper and work directories */
    const char *work;
    struct str_list layers; /* start: lower layers, topmost first, stored with 0-based ids */
    const char *base;       /* start: a lower below them used as is (the host-root base) */
    const char *slots;      /* start: directory of the machine-wide id-range slot locks */
    long slot_hint;         /* start: the first slot to try */
    unsigned long id_base;  /* start: host id of slot 0's root */
    long slot_count;
    struct str_list cgroups; /* start, exec, files: cgroup directories to join */
    const char *freezer;     /* start: the freezer cgroup to thaw when the sandbox must die */
    const char *net;         /* start: "none" (loopback only) or "slirp" */
    const char *slirp;       /* start: the slirp4netns program */
    const char *resolv;     /* start: contents of /etc/resolv.conf (binds when the image has one) */
    const char *hosts;      /* start: contents of /etc/hosts */
    pid_t target;           /* exec, files: the sandbox's init (host pid) */
    unsigned long uid_base; /* exec, files: the sandbox's id base, checked against the target */
    const char *cwd;        /* exec: working directory inside (default /root) */
    const char *op;         /* files: the operation */
    const char *path;       /* files: its path inside the sandbox */
    const char *mode;       /* files: octal mode of a written file */
    long depth;             /* files: list depth */
    int follow;             /* files: stat follows a final symlink */
    struct str_list excludes;     /* files: names left out of a pack of its top directory */
    unsigned long long max_bytes; /* files: file data a pack may carry (0: the default) */
    const char *src, *dst;        /* capture: upper directory and new layer */
    int setsid;                   /* exec: make the command a session leader */
    char **argv;                  /* exec: the program and its arguments */
};

/* main.c */
void die(const char *step, const char *what, int err) __attribute__((noreturn));
void fail_msg(const char *step, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 2, 3)));
int write_file(const char *path, const char *text); /* 0 or errno */
int write_all(int fd, const void *buf, size_t len); /* 0 or errno */

/* start.c */
int cmd_start(struct spec *s, int argc, char **argv);

/* enter.c: joins the sandbox of s->target (cgroups s->cgroups) and leaves the caller as root
 * of its user namespace in all its namespaces and its root directory, still in the host's PID
 * namespace (the next fork is in the sandbox's). Dies on failure. */
void enter_sandbox(const struct spec *s);
/* Lets the exec and files children overwrite the argument strings (see enter.c). */
void enter_set_args(int argc, char **argv);
int cmd_exec(struct spec *s);
int cmd_files(struct spec *s);

/* confine.c */
/* Drops every capability but the container default set, sets no_new_privs and loads the
 * seccomp filter. Returns 0, or a negative errno with *step naming what failed. */
int confine(const char **step);
/* Brings the loopback interface of the current network namespace up. */
int loopback_up(void);

/* fileops.c */
int fileops_run(const struct spec *s);

/* shift.c */
int cmd_capture(struct spec *s);

#endif
