/*
 * seccomp_policy.c — the seccomp policy of every process inside a `moonbox local` sandbox, and
 * the build-time generator that compiles it. Built and run once by the build (CMakeLists.txt):
 * it writes seccomp_filter.h, the classic-BPF program that confine.c loads. Compiling at build
 * time instead of in each helper keeps libseccomp out of the static helper and saves ~2 ms of
 * every sandbox start and every exec on this kind of VM; the cost is that the filter is for the
 * architecture that built it (moonbox builds natively, so that is the one it runs on).
 *
 * The policy is an allow-list: a call not listed fails with EPERM (clone3 with ENOSYS, so libc
 * falls back to clone, whose flags are checked). It follows the shape of Docker's default
 * profile, written from the kernel's list of calls rather than copied, and is stricter where
 * Docker is lenient for compatibility: no io_uring, no userfaultfd, no name_to_handle_at, no
 * kcmp, no AF_VSOCK sockets (vsock is not network-namespaced and reaches the hypervisor), no
 * kernel AIO (io_setup and friends draw on one machine-wide pool, fs.aio-max-nr, that a sandbox
 * could take whole; glibc's POSIX AIO uses threads and does not need them), no other
 * architecture's calls (x32 and i386 entry points are killed by libseccomp's arch check).
 * docs/local-isolation.md compares it with Docker's point by point.
 */
#include <errno.h>
#include <sched.h>
#include <seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#ifndef AF_VSOCK
#define AF_VSOCK 40
#endif

/* System calls allowed whatever their arguments. */
static const char *const allowed[] = {
    "accept",
    "accept4",
    "access",
    "adjtimex",
    "alarm",
    "arch_prctl",
    "bind",
    "brk",
    "cachestat",
    "capget",
    "capset",
    "chdir",
    "chmod",
    "chown",
    "chroot",
    "clock_adjtime",
    "clock_getres",
    "clock_gettime",
    "clock_nanosleep",
    "close",
    "close_range",
    "connect",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "eventfd",
    "eventfd2",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fallocate",
    "fanotify_mark",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "fchown",
    "fchownat",
    "fcntl",
    "fdatasync",
    "fgetxattr",
    "flistxattr",
    "flock",
    "fork",
    "fremovexattr",
    "fsetxattr",
    "fstat",
    "fstatfs",
    "fsync",
    "ftruncate",
    "futex",
    "futex_requeue",
    "futex_wait",
    "futex_waitv",
    "futex_wake",
    "futimesat",
    "getcpu",
    "getcwd",
    "getdents",
    "getdents64",
    "getegid",
    "geteuid",
    "getgid",
    "getgroups",
    "getitimer",
    "getpeername",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getrandom",
    "getresgid",
    "getresuid",
    "getrlimit",
    "get_robust_list",
    "getrusage",
    "getsid",
    "getsockname",
    "getsockopt",
    "gettid",
    "gettimeofday",
    "getuid",
    "getxattr",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "ioctl",
    "ioprio_get",
    "ioprio_set",
    "kill",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "lchown",
    "lgetxattr",
    "link",
    "linkat",
    "listen",
    "listxattr",
    "llistxattr",
    "lremovexattr",
    "lseek",
    "lsetxattr",
    "lstat",
    "madvise",
    "map_shadow_stack",
    "membarrier",
    "memfd_create",
    "memfd_secret",
    "mincore",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "modify_ldt",
    "mprotect",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedsend",
    "mq_unlink",
    "mremap",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "nanosleep",
    "newfstatat",
    "open",
    "openat",
    "openat2",
    "pause",
    "pidfd_getfd",
    "pidfd_open",
    "pidfd_send_signal",
    "pipe",
    "pipe2",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "poll",
    "ppoll",
    "prctl",
    "pread64",
    "preadv",
    "preadv2",
    "prlimit64",
    "process_madvise",
    "process_mrelease",
    "process_vm_readv",
    "process_vm_writev",
    "pselect6",
    "ptrace",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "recvfrom",
    "recvmmsg",
    "recvmsg",
    "remap_file_pages",
    "removexattr",
    "rename",
    "renameat",
    "renameat2",
    "restart_syscall",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_tgsigqueueinfo",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    "seccomp",
    "select",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "sendfile",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "setfsgid",
    "setfsuid",
    "setgid",
    "setgroups",
    "setitimer",
    "setpgid",
    "setpriority",
    "setregid",
    "setresgid",
    "setresuid",
    "setreuid",
    "setrlimit",
    "set_robust_list",
    "setsid",
    "setsockopt",
    "set_tid_address",
    "setuid",
    "setxattr",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    "shutdown",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "socketpair",
    "splice",
    "stat",
    "statfs",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "sysinfo",
    "tee",
    "tgkill",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_settime",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_settime",
    "times",
    "tkill",
    "truncate",
    "umask",
    "uname",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimes",
    "vfork",
    "vmsplice",
    "wait4",
    "waitid",
    "write",
    "writev",
};

static int build_filter(scmp_filter_ctx ctx)
{
    int rc;
    for (size_t i = 0; i < sizeof allowed / sizeof allowed[0]; i++) {
        int nr = seccomp_syscall_resolve_name(allowed[i]);
        if (nr == __NR_SCMP_ERROR) continue; /* not a call of this architecture */
        if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0)) < 0) return rc;
    }
    /* clone without namespace flags: new namespaces would give back what was dropped. */
    const unsigned long ns = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER |
                             CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP;
    if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(clone), 1,
                               SCMP_A0(SCMP_CMP_MASKED_EQ, ns, 0))) < 0)
        return rc;
    if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0)) < 0) return rc;
    /* sockets of every family but vsock. */
    if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(socket), 1,
                               SCMP_A0(SCMP_CMP_NE, AF_VSOCK))) < 0)
        return rc;
    /* personality: the values programs use (Linux, 32-bit address limit, uname26) and a query. */
    const unsigned long personas[] = {0x0, 0x8, 0x20000, 0x20008, 0xffffffff};
    for (size_t i = 0; i < sizeof personas / sizeof personas[0]; i++)
        if ((rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(personality), 1,
                                   SCMP_A0(SCMP_CMP_EQ, personas[i]))) < 0)
            return rc;
    return 0;
}

/* Writes the compiled program as a C header to stdout. */
int main(void)
{
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ERRNO(EPERM));
    /* A binary tree of the call numbers instead of libseccomp's default linear list: the same
     * decisions, in a dozen comparisons instead of up to three hundred. It matters at load
     * time too: the kernel runs the filter once per call number of the architecture when it
     * is attached (to cache the calls it allows whatever their arguments), with interrupts
     * off; the linear list made that 0.4 ms of CPU per load on the development VM. */
    if (ctx && seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2) < 0) {
        fprintf(stderr, "seccomp_policy: libseccomp cannot build a binary-tree filter\n");
        return 1;
    }
    if (!ctx || build_filter(ctx) < 0) {
        fprintf(stderr, "seccomp_policy: building the filter failed\n");
        return 1;
    }
    int p[2];
    if (pipe(p) < 0 || seccomp_export_bpf(ctx, p[1]) < 0) {
        fprintf(stderr, "seccomp_policy: exporting the filter failed\n");
        return 1;
    }
    close(p[1]);
    unsigned char buf[65536];
    size_t len = 0;
    ssize_t n;
    while ((n = read(p[0], buf + len, sizeof buf - len)) > 0)
        len += (size_t)n;
    if (len == 0 || len % 8) {
        fprintf(stderr, "seccomp_policy: unexpected program size %zu\n", len);
        return 1;
    }
    printf("/* Generated by seccomp_policy.c at build time: do not edit. */\n");
    printf("static const unsigned char sandbox_filter_bytes[%zu] = {", len);
    for (size_t i = 0; i < len; i++)
        printf("%s0x%02x,", i % 16 ? "" : "\n    ", buf[i]);
    printf("\n};\n");
    seccomp_release(ctx);
    return 0;
}
