/*
 * start.c — `moonbox-sandbox start`: makes a sandbox and stays as its keeper.
 *
 * Two processes take part: the keeper (this process, host root) owns what lives outside the
 * sandbox; the init is PID 1 inside.
 *
 *   keeper: claims an id range (a slot lock, see claim_slot), moves into a private mount
 *     namespace, clones the init into new user, PID, IPC, UTS and network namespaces (not yet
 *     a mount namespace: it shares ours until the root is there), writes its id maps
 *     ("0 BASE 65536"), idmaps the 0-based lower layers into the range through the init's user
 *     namespace, mounts the overlay root (layer paths given as /proc/self/fd/N, so
 *     /proc/mounts inside names no host path), moves the init into the sandbox's cgroups,
 *     makes it immune to the OOM killer, and lets it go;
 *   init: becomes root of its user namespace, unshares its mount namespace (a copy of ours,
 *     with the root in it) and its cgroup namespace (now rooted at the sandbox's cgroup),
 *     builds /proc, /sys (read-only), /dev (tmpfs with the usual nodes bound
 *     from the host, devpts, shm, mqueue), masks and read-only paths as runc does, binds
 *     /etc/hosts and /etc/resolv.conf, pivots into the root, confines itself like any process
 *     inside (confine.c), closes everything but its end of the starter's channel, reports,
 *     and then starts the server's commands and reaps orphans (starter.c);
 *   keeper again: meanwhile starts slirp4netns for a network with egress (inside the sandbox's
 *     cgroups, so it is frozen, limited and killed with it), and once both are ready prints "ready
 * PID BASE SLOT CHANNEL", and waits. When the init ends it kills slirp4netns and exits with the
 * init's status. When the backend dies (PR_SET_PDEATHSIG) or tells it to (SIGTERM), it thaws the
 * sandbox — a frozen process cannot die on cgroup v1 — and kills the init, which takes every
 * process inside with it.
 *
 * Because the overlay and every mount of the sandbox live only in namespaces of the keeper and
 * the init, they vanish with them: a backend killed by SIGKILL leaves no mount behind; and the
 * keeper removes the root's (host-side, empty) mount point as its last act.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/mount.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sandbox.h"

#ifndef MOUNT_ATTR_IDMAP
#define MOUNT_ATTR_IDMAP 0x00100000
#endif

/* Claims a machine-wide id range: slot k's range is id_base + k * 65536 .. + 65535, taken by
 * holding an exclusive flock on <slots>/<k> for as long as this keeper lives, so a crash frees
 * it and two backends (two state dirs) never share a range. Tries slot_count slots from the
 * hint on, wrapping around. Returns the slot and leaves its lock fd open (close-on-exec, so
 * slirp4netns does not hold it; the init closes its copy). O(slots taken); a bitmap in shared
 * memory would be O(1) but could not survive a crash as a lock does. */
static long claim_slot(const struct spec *s)
{
    if (mkdir(s->slots, 0700) < 0 && errno != EEXIST)
        die("claiming an id range: mkdir", s->slots, errno);
    for (long i = 0; i < s->slot_count; i++) {
        long k = (s->slot_hint + i) % s->slot_count;
        char path[4096];
        snprintf(path, sizeof path, "%s/%ld", s->slots, k);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd < 0) die("claiming an id range: open", path, errno);
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) return k;
        if (errno != EWOULDBLOCK) die("claiming an id range: flock", path, errno);
        close(fd);
    }
    fail_msg("claiming an id range", "all %ld slots under %s are taken", s->slot_count, s->slots);
}

static void write_id_maps(pid_t pid, unsigned long base)
{
    char path[64], map[64];
    snprintf(map, sizeof map, "0 %lu %u\n", base, SANDBOX_ID_RANGE);
    snprintf(path, sizeof path, "/proc/%d/uid_map", (int)pid);
    int e = write_file(path, map);
    if (e) die("writing the uid map of", path, e);
    snprintf(path, sizeof path, "/proc/%d/gid_map", (int)pid);
    if ((e = write_file(path, map))) die("writing the gid map of", path, e);
}

/* An idmapped, detached copy of dir (a clone of its mount, not of its submounts). */
static int idmapped_layer(const char *dir, int userns)
{
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, dir, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (fd < 0) die("idmapping layer", dir, errno);
    struct mount_attr attr = {.attr_set = MOUNT_ATTR_IDMAP,
                              .userns_fd = (unsigned long long)userns};
    if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0) {
        int e = errno;
        if (e == EINVAL)
            fail_msg("idmapping layer",
                     "%s: its filesystem does not support idmapped mounts "
                     "(ext4, xfs, btrfs and tmpfs do; overlayfs does not)",
                     dir);
        die("idmapping layer", dir, e);
    }
    return fd;
}

static int open_dir(const char *what, const char *dir)
{
    int fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) die(what, dir, errno);
    return fd;
}

/* Mounts the overlay root at s->root in our (private) mount namespace, the lower layers
 * idmapped through userns (the init's, which maps 0.. to the sandbox's range). */
static void mount_root(const struct spec *s, int userns, unsigned long base)
{
    int fds[MAX_LIST + 3], nfds = 0;
    char opts[4096];
    size_t off = (size_t)snprintf(opts, sizeof opts, "lowerdir=");
    for (int i = 0; i < s->layers.n; i++) {
        int fd = idmapped_layer(s->layers.v[i], userns);
        fds[nfds++] = fd;
        off +=
            (size_t)snprintf(opts + off, sizeof opts - off, "%s/proc/self/fd/%d", i ? ":" : "", fd);
    }
    if (s->base) {
        int fd = open_dir("opening the base", s->base);
        fds[nfds++] = fd;
        off += (size_t)snprintf(opts + off, sizeof opts - off, "%s/proc/self/fd/%d",
                                s->layers.n ? ":" : "", fd);
    }
    int up = open_dir("opening the upper layer", s->upper);
    /* The merged root takes its owner from the upper layer's root: the sandbox's root owns /. */
    if (fchownat(up, "", (uid_t)base, (gid_t)base, AT_EMPTY_PATH) < 0)
        die("owning the upper layer", s->upper, errno);
    int wk = open_dir("opening the work directory", s->work);
    off += (size_t)snprintf(opts + off, sizeof opts - off,
                            ",upperdir=/proc/self/fd/%d,workdir=/proc/self/fd/%d"
                            ",index=off,redirect_dir=off,metacopy=off",
                            up, wk);
    if (off >= sizeof opts) fail_msg("mounting the root", "too many layers (%d)", s->layers.n);
    if (mount("moonbox", s->root, "overlay", 0, opts) < 0)
        die("mounting the overlay root at", s->root, errno);
    fds[nfds++] = up;
    fds[nfds++] = wk;
    for (int i = 0; i < nfds; i++)
        close(fds[i]); /* the overlay holds its layers now */
}

/* ---- the init -------------------------------------------------------------------------------- */

static int report_fd = -1;
/* The starter's channel (starter.c): a socketpair made before the init is cloned; the init keeps
 * chan_init, this keeper chan_keeper, and no other process holds either. */
static int chan_init = -1, chan_keeper = -1;

/* Reports a failed step of the init to the keeper and ends it. */
static void init_fail(const char *step, const char *what, int err)
{
    char msg[512];
    int n = snprintf(msg, sizeof msg, "%s%s%s: %s", step, what ? " " : "", what ? what : "",
                     strerror(err));
    if (n > 0) (void)!write(report_fd, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    _exit(EXIT_HELPER);
}

/* Mounts src on rel, a path relative to the sandbox's root (our working directory from the
 * moment the root is bound), creating the directory when the image lacks it. */
static void do_mount(const char *src, const char *rel, const char *type, unsigned long flags,
                     const char *data)
{
    if (mkdir(rel, 0755) < 0 && errno != EEXIST) init_fail("creating", rel, errno);
    if (mount(src, rel, type, flags, data) < 0) init_fail("mounting", rel, errno);
}

/* The nodes of /dev, bound from the host's (mknod is not allowed in a user namespace). */
static const char *const dev_nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};

static const struct {
    const char *name, *target;
} dev_links[] = {
    {"fd", "/proc/self/fd"},       {"stdin", "/proc/self/fd/0"}, {"stdout", "/proc/self/fd/1"},
    {"stderr", "/proc/self/fd/2"}, {"ptmx", "pts/ptmx"},
};

static void build_dev(void)
{
    char p[64];
    do_mount("tmpfs", "dev", "tmpfs", MS_NOSUID, "mode=755");
    for (size_t i = 0; i < sizeof dev_nodes / sizeof dev_nodes[0]; i++) {
        char host[64];
        snprintf(host, sizeof host, "/dev/%s", dev_nodes[i]);
        snprintf(p, sizeof p, "dev/%s", dev_nodes[i]);
        int fd = open(p, O_CREAT | O_WRONLY | O_CLOEXEC, 0666);
        if (fd < 0) init_fail("creating /dev/", dev_nodes[i], errno);
        close(fd);
        if (mount(host, p, NULL, MS_BIND, NULL) < 0)
            init_fail("binding /dev/", dev_nodes[i], errno);
    }
    for (size_t i = 0; i < sizeof dev_links / sizeof dev_links[0]; i++) {
        snprintf(p, sizeof p, "dev/%s", dev_links[i].name);
        if (symlink(dev_links[i].target, p) < 0)
            init_fail("linking /dev/", dev_links[i].name, errno);
    }
    do_mount("devpts", "dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
             "newinstance,ptmxmode=0666,mode=0620,gid=5");
    do_mount("shm", "dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    do_mount("mqueue", "dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
}

/* runc's masked and read-only paths: what of /proc and /sys the kernel does not namespace. */
static const char *const masked[] = {
    "proc/acpi",
    "proc/asound",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/scsi",
    "sys/firmware",
    "sys/devices/virtual/powercap",
};
static const char *const readonly[] = {
    "proc/bus", "proc/fs", "proc/irq", "proc/sys", "proc/sysrq-trigger",
};

static void mask_paths(void)
{
    for (size_t i = 0; i < sizeof masked / sizeof masked[0]; i++) {
        struct stat st;
        const char *p = masked[i];
        if (lstat(p, &st) < 0) continue; /* not on this kernel */
        int rc = S_ISDIR(st.st_mode) ? mount("tmpfs", p, "tmpfs", MS_RDONLY, "size=0")
                                     : mount("dev/null", p, NULL, MS_BIND, NULL);
        if (rc < 0) init_fail("masking", masked[i], errno);
    }
    for (size_t i = 0; i < sizeof readonly / sizeof readonly[0]; i++) {
        const char *p = readonly[i];
        if (access(p, F_OK) < 0) continue;
        if (mount(p, p, NULL, MS_BIND | MS_REC, NULL) < 0) init_fail("binding", readonly[i], errno);
        if (mount(NULL, p, NULL,
                  MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            init_fail("making read-only", readonly[i], errno);
    }
}

/* Binds a file holding text over <root>/etc/<name> when the image has that file as a regular
 * file (a symlink or nothing is left alone: mounting on it would create or follow). The text
 * lives in /dev's tmpfs under a hidden name that is unlinked once bound. */
static void bind_etc(const char *name, const char *text)
{
    if (!text) return;
    char target[4096], src[4096];
    snprintf(target, sizeof target, "etc/%s", name);
    int tfd = open(target, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (tfd < 0) return;
    struct stat st;
    if (fstat(tfd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(tfd);
        return;
    }
    snprintf(src, sizeof src, "dev/.moonbox-%s", name);
    int fd = open(src, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) init_fail("writing /etc/", name, errno);
    int e = write_all(fd, text, strlen(text));
    close(fd);
    if (e) init_fail("writing /etc/", name, e);
    char fdpath[64];
    snprintf(fdpath, sizeof fdpath, "/proc/self/fd/%d", tfd);
    if (mount(src, fdpath, NULL, MS_BIND, NULL) < 0) init_fail("binding /etc/", name, errno);
    unlink(src);
    close(tfd);
}

/* Overwrites our argument and environment strings: /proc/1/cmdline is readable inside, and
 * they name host paths. */
static void wipe_args(int argc, char **argv)
{
    char *lo = argv[0], *hi = argv[0];
    for (int i = 0; i < argc; i++)
        hi = argv[i] + strlen(argv[i]);
    for (char **e = environ; e && *e; e++)
        if (*e + strlen(*e) > hi) hi = *e + strlen(*e);
    memset(lo, 0, (size_t)(hi - lo));
    strcpy(lo, "moonbox-init");
}

/* The sandbox's init (PID 1 of its namespaces), cloned by the launcher. Dies with the keeper
 * (PR_SET_PDEATHSIG) and waits for its "go" (the keeper wrote the id maps, mounted the root and
 * joined the cgroups); then: its own mount and cgroup namespaces, ping opened to every group,
 * the root bound onto itself, root of the user namespace, /proc, /sys read-only, a minimal /dev,
 * masked paths, /etc/hosts and resolv.conf bound in, pivot_root onto the root and the host's
 * detached, hostname, loopback up, confine() (capabilities, no_new_privs, seccomp), undumpable.
 * It reports "ok" on report_fd, closes every descriptor but the starter's channel and serves
 * it (starter.c: starts the server's commands, reaps orphans) forever with every signal blocked.
 * Never returns; any failure before "ok" ends it through init_fail with the step and errno, which
 * the keeper reads from the report pipe. */
static void init_main(const struct spec *s, int go_fd, int argc, char **argv)
{
    char c;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
        init_fail("setting the parent-death signal", NULL, errno);
    if (read(go_fd, &c, 1) != 1) _exit(EXIT_HELPER); /* the keeper died before letting us go */
    close(go_fd);
    /* Until setresuid below our filesystem id is still the host's 0, the owner of the state
     * directory (which may be 0700, under /root): the root is reached now and used relatively
     * from then on. Our mount namespace is a copy of the keeper's, root included; the bind of
     * the root onto itself is a mount of our own (the copy is locked), which pivot_root takes. */
    if (unshare(CLONE_NEWNS | CLONE_NEWCGROUP) < 0)
        init_fail("mount and cgroup namespaces", NULL, errno);
    /* Without CAP_NET_RAW (see confine.c), ping works through ICMP datagram sockets, which
     * this (namespaced) setting opens to every group inside. */
    int e0 = write_file("/proc/sys/net/ipv4/ping_group_range", "0 65535");
    if (e0) init_fail("allowing ping", NULL, e0);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        init_fail("making mounts private", NULL, errno);
    if (mount(s->root, s->root, NULL, MS_BIND | MS_REC, NULL) < 0)
        init_fail("binding the root onto itself", NULL, errno);
    if (chdir(s->root) < 0) init_fail("entering the root", NULL, errno);
    if (setresgid(0, 0, 0) < 0 || setgroups(0, NULL) < 0 || setresuid(0, 0, 0) < 0)
        init_fail("becoming root of the user namespace", NULL, errno);
    do_mount("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    do_mount("sysfs", "sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    build_dev();
    mask_paths();
    bind_etc("hosts", s->hosts);
    bind_etc("resolv.conf", s->resolv);
    if (syscall(SYS_pivot_root, ".", ".") < 0) init_fail("pivot_root", NULL, errno);
    if (umount2(".", MNT_DETACH) < 0) init_fail("detaching the host's root", NULL, errno);
    if (chdir("/") < 0) init_fail("chdir /", NULL, errno);
    if (s->id && sethostname(s->id, strlen(s->id)) < 0)
        init_fail("setting the hostname", NULL, errno);
    int e = loopback_up();
    if (e) init_fail("bringing up loopback", NULL, e);
    const char *step = NULL;
    if ((e = confine(&step)) < 0) init_fail(step, NULL, -e);
    if (prctl(PR_SET_DUMPABLE, 0) < 0) init_fail("making the init undumpable", NULL, errno);
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);
    for (int i = 1; i < 65; i++)
        signal(i, SIG_DFL);
    wipe_args(argc, argv);
    if (write(report_fd, "ok", 2) != 2) _exit(EXIT_HELPER);
    /* Every descriptor closed but the channel, which becomes 3; 0-2 are /dev/null, so that the
     * descriptors a request brings never land on a standard stream. */
    if (chan_init != 3 && dup3(chan_init, 3, O_CLOEXEC) < 0) _exit(EXIT_HELPER);
    syscall(SYS_close_range, 0, 2, 0);
    syscall(SYS_close_range, 4, ~0U, 0);
    for (int i = 0; i < 3; i++)
        if (open("/dev/null", O_RDWR | O_CLOEXEC) != i) _exit(EXIT_HELPER);
    /* Start commands and reap forever. Signals from inside are never delivered to a
     * namespace's init that has no handler; blocked, all but SIGCHLD are simply dropped. */
    starter_serve(3);
}

/* ---- the keeper -------------------------------------------------------------------------------
 */

/* Starts slirp4netns on the network namespace of netpid (the init's, or the allow-list gate's),
 * joined to the sandbox's cgroups; returns its pid, the write end of its exit pipe (closing it,
 * or our death, ends it) and the read end of its ready pipe (one byte once the namespace's
 * network is configured). */
static pid_t start_slirp(const struct spec *s, pid_t init, pid_t netpid, unsigned long base,
                         int *exit_w, int *ready_r, const sigset_t *mask)
{
    int ready[2], ex[2];
    if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(ex, O_CLOEXEC) < 0)
        die("slirp4netns: pipe", NULL, errno);
    pid_t pid = fork();
    if (pid < 0) die("slirp4netns: fork", NULL, errno);
    if (pid == 0) {
        char pidbuf[32], p[4096];
        snprintf(pidbuf, sizeof pidbuf, "%d\n", (int)getpid());
        for (int i = 0; i < s->cgroups.n; i++) {
            snprintf(p, sizeof p, "%s/cgroup.procs", s->cgroups.v[i]);
            int e = write_file(p, pidbuf);
            if (e) die("slirp4netns: joining", p, e);
        }
        /* slirp4netns runs as the sandbox's root, in its user namespace: it needs privilege
         * only over the sandbox's network namespace (to make and configure tap0), and a flaw in
         * it, fed packets by the sandbox, must not be worth more than the sandbox itself. It
         * keeps the host's network namespace for its outgoing sockets, and gets the sandbox's
         * as an fd opened here (the init is not ours to ptrace once it is undumpable). */
        snprintf(p, sizeof p, "/proc/%d/ns/net", (int)netpid);
        int netns = open(p, O_RDONLY); /* without close-on-exec: slirp4netns opens it by path */
        snprintf(p, sizeof p, "/proc/%d/ns/user", (int)init);
        int userns = open(p, O_RDONLY | O_CLOEXEC);
        if (netns < 0 || userns < 0)
            die("slirp4netns: opening the sandbox's namespaces", NULL, errno);
        /* The tun device may be root's alone (0600 where no udev rule opens it up): in a mount
         * namespace of slirp4netns's own, /dev/net is a tmpfs whose tun node belongs to the
         * sandbox's root. The host's /dev is not touched. */
        if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
            mount("tmpfs", "/dev/net", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=16k") < 0 ||
            mknod("/dev/net/tun", S_IFCHR | 0600, makedev(10, 200)) < 0 ||
            chown("/dev/net/tun", (uid_t)base, (gid_t)base) < 0)
            die("slirp4netns: providing /dev/net/tun", NULL, errno);
        if (setns(userns, CLONE_NEWUSER) < 0)
            die("slirp4netns: entering the user namespace", NULL, errno);
        if (setresgid(0, 0, 0) < 0 || setgroups(0, NULL) < 0 || setresuid(0, 0, 0) < 0)
            die("slirp4netns: becoming the sandbox's root", NULL, errno);
        int r = dup(ready[1]), x = dup(ex[0]); /* without close-on-exec */
        char rfd[32], xfd[32], target[64];
        snprintf(rfd, sizeof rfd, "--ready-fd=%d", r);
        snprintf(xfd, sizeof xfd, "--exit-fd=%d", x);
        snprintf(target, sizeof target, "/proc/self/fd/%d", netns);
        char *args[] = {(char *)s->slirp,
                        "--configure",
                        "--mtu=65520",
                        "--disable-host-loopback",
                        "--enable-sandbox",
                        "--enable-seccomp",
                        "--netns-type=path",
                        rfd,
                        xfd,
                        target,
                        "tap0",
                        NULL};
        char *env[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL};
        sigprocmask(SIG_SETMASK, mask, NULL);
        int null = open("/dev/null", O_RDWR);
        dup2(null, 0);
        dup2(null, 1);
        execve(s->slirp, args, env);
        die("slirp4netns: exec", s->slirp, errno);
    }
    close(ready[1]);
    close(ex[0]);
    *exit_w = ex[1];
    *ready_r = ready[0];
    return pid;
}

/* ---- the allow-list gate ----------------------------------------------------------------------
 * An allow-list sandbox's network namespace has one interface besides loopback: eth0
 * (GATE_SANDBOX/30, default route via GATE_ADDR), a veth whose other end, gw0, is in a second
 * namespace, the gate's. slirp4netns gives the gate's namespace its way out (tap0); the gate
 * process (gate.c) listens there, and nftables rules there send the sandbox's TCP 80 and 443 and
 * its UDP 53 to it and let nothing else through: forwarding is off and a forward rule drops all.
 *
 * The gate's namespace belongs to the sandbox's user namespace (the gate process makes it after
 * joining that), so neither it nor the gate hold any privilege over the host, and the sandbox
 * can never reach it: the gate runs in the host's PID namespace, invisible from inside, and no
 * process inside may call setns (confine.c). The gate process itself runs as the sandbox's
 * nobody, confined, chrooted into an empty tmpfs, in the sandbox's cgroups (frozen, limited and
 * killed with it). The keeper, host root, wires both namespaces (netconf.c) and runs nft(8). */

/* The gate child: makes the gate's namespace, binds, confines itself, reports on ready_w. */
static void gate_child(const struct spec *s, pid_t init, int ready_w, const sigset_t *mask)
{
    close(chan_keeper); /* the gate reads the sandbox's traffic: it must never hold the channel */
    char pidbuf[32], p[4096];
    snprintf(pidbuf, sizeof pidbuf, "%d\n", (int)getpid());
    for (int i = 0; i < s->cgroups.n; i++) {
        snprintf(p, sizeof p, "%s/cgroup.procs", s->cgroups.v[i]);
        int e = write_file(p, pidbuf);
        if (e) die("gate: joining", p, e);
    }
    snprintf(p, sizeof p, "/proc/%d/ns/user", (int)init);
    int userns = open(p, O_RDONLY | O_CLOEXEC);
    if (userns < 0) die("gate: opening the sandbox's user namespace", NULL, errno);
    if (setns(userns, CLONE_NEWUSER) < 0) die("gate: entering the user namespace", NULL, errno);
    close(userns);
    if (setresgid(0, 0, 0) < 0 || setgroups(0, NULL) < 0 || setresuid(0, 0, 0) < 0)
        die("gate: becoming the sandbox's root", NULL, errno);
    if (unshare(CLONE_NEWNET | CLONE_NEWNS) < 0) die("gate: network namespace", NULL, errno);
    /* Forwarding may be inherited from the host's namespace; the gate's must never forward
     * (the nftables forward rule drops everything as well). */
    int e = write_file("/proc/sys/net/ipv4/ip_forward", "0");
    if (e) die("gate: turning forwarding off", NULL, e);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
        mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=555,size=4k") < 0 ||
        chdir("/run") < 0 || chroot(".") < 0 || chdir("/") < 0)
        die("gate: moving into an empty root", NULL, errno);
    gate_bind(&s->allow, s->dns);
    const char *step = NULL;
    if ((e = confine(&step)) < 0) die("gate", step, -e);
    if (setgroups(0, NULL) < 0 || setresgid(65534, 65534, 65534) < 0 ||
        setresuid(65534, 65534, 65534) < 0)
        die("gate: becoming nobody", NULL, errno);
    pid_t keeper = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != keeper) _exit(EXIT_HELPER);
    sigprocmask(SIG_SETMASK, mask, NULL);
    if (write(ready_w, "g", 1) != 1) _exit(EXIT_HELPER);
    close(ready_w);
    gate_serve();
}

/* Starts program with text on its stdin in the network namespace of pid netpid; returns its
 * pid, or -1 with *why set. Its own error messages go to our stderr. */
static pid_t start_in_netns(pid_t netpid, const char *program, const char *arg, const char *text,
                            const char **why)
{
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/ns/net", (int)netpid);
    int in[2];
    if (pipe2(in, O_CLOEXEC) < 0) return *why = "pipe", -1;
    pid_t pid = fork();
    if (pid < 0) return *why = "fork", -1;
    if (pid == 0) {
        int ns = open(p, O_RDONLY | O_CLOEXEC);
        if (ns < 0 || setns(ns, CLONE_NEWNET) < 0) die("entering a network namespace", p, errno);
        close(in[1]);
        dup2(in[0], 0);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        char *args[] = {(char *)program, (char *)arg, "-", NULL};
        char *env[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL};
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        execve(program, args, env);
        die("exec", program, errno);
    }
    close(in[0]);
    int werr = write_all(in[1], text, strlen(text)); /* a few hundred bytes: within the pipe */
    close(in[1]);
    if (werr) {
        kill(pid, SIGKILL);
        *why = "writing to nft";
    }
    return pid;
}

/* Waits for child pid; whether it exited 0. */
static int succeeded(pid_t pid)
{
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* The wiring child: in the gate's namespace, the veth pair (its eth0 end moved into the
 * sandbox's namespace) and gw0's address; then in the sandbox's, eth0's address and the default
 * route. Exits 0, or prints what failed and exits EXIT_HELPER. */
static void wire_child(pid_t init, pid_t gate)
{
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/ns/net", (int)gate);
    int gate_ns = open(p, O_RDONLY | O_CLOEXEC);
    snprintf(p, sizeof p, "/proc/%d/ns/net", (int)init);
    int sandbox_ns = open(p, O_RDONLY | O_CLOEXEC);
    if (gate_ns < 0 || sandbox_ns < 0) die("gate wiring: opening the namespaces", NULL, errno);
    if (setns(gate_ns, CLONE_NEWNET) < 0)
        die("gate wiring: entering the gate's namespace", NULL, errno);
    int e = net_veth("gw0", "eth0", sandbox_ns);
    if (e) die("gate wiring: creating the veth pair", NULL, e);
    if ((e = net_addr_up("gw0", GATE_ADDR, "255.255.255.252")) || (e = loopback_up()))
        die("gate wiring: configuring gw0", NULL, e);
    if (setns(sandbox_ns, CLONE_NEWNET) < 0)
        die("gate wiring: entering the sandbox's namespace", NULL, errno);
    if ((e = net_addr_up("eth0", GATE_SANDBOX, "255.255.255.252")) ||
        (e = net_default_route(GATE_ADDR)))
        die("gate wiring: configuring eth0", NULL, e);
    _exit(0);
}

/* Connects the sandbox (init) to the gate (gate) and installs the gate's rules with nft, both
 * at once. Returns 0, or -1 with *why naming the part that failed. */
static int wire_gate(const struct spec *s, pid_t init, pid_t gate, const char **why)
{
    char text[2048];
    snprintf(text, sizeof text,
             "table inet gate {\n"
             "  chain prerouting {\n"
             "    type nat hook prerouting priority dstnat; policy accept;\n"
             "    iifname \"gw0\" tcp dport 80 redirect to :%d\n"
             "    iifname \"gw0\" tcp dport 443 redirect to :%d\n"
             "    iifname \"gw0\" udp dport 53 redirect to :%d\n"
             "  }\n"
             "  chain refuse {\n"
             "    type filter hook prerouting priority filter; policy accept;\n"
             "    iifname \"gw0\" ct status dnat accept\n"
             "    iifname \"gw0\" meta l4proto tcp reject with tcp reset\n"
             "    iifname \"gw0\" reject with icmpx type admin-prohibited\n"
             "  }\n"
             "  chain input {\n"
             "    type filter hook input priority filter; policy drop;\n"
             "    ct state established,related accept\n"
             "    iif \"lo\" accept\n"
             "    iifname \"gw0\" ct status dnat accept\n"
             "  }\n"
             "  chain forward {\n"
             "    type filter hook forward priority filter; policy drop;\n"
             "  }\n"
             "}\n",
             GATE_HTTP_PORT, GATE_TLS_PORT, GATE_DNS_PORT);
    const char *nft_why = NULL;
    pid_t nft = start_in_netns(gate, s->nft, "-f", text, &nft_why);
    pid_t wire = fork();
    if (wire == 0) wire_child(init, gate);
    int wired = wire > 0 && succeeded(wire);
    int ruled = nft > 0 && succeeded(nft) && !nft_why;
    if (!wired)
        *why = "wiring";
    else if (!ruled)
        *why = "nft";
    return wired && ruled ? 0 : -1;
}

static void thaw(const char *freezer)
{
    if (!freezer) return;
    char p[4096];
    snprintf(p, sizeof p, "%s/freezer.state", freezer);
    if (write_file(p, "THAWED") == ENOENT) {
        snprintf(p, sizeof p, "%s/cgroup.freeze", freezer);
        write_file(p, "0");
    }
}

/* `moonbox-sandbox start`: the keeper of one sandbox, for as long as it lives. Checks the
 * arguments (--net none, slirp or allowlist, with what each needs), claims an id slot, makes a
 * private mount namespace, and has a launcher (become the slot's host uid, so the user namespace
 * is charged to it) clone the init into new user, PID, IPC, UTS and network namespaces as our
 * child. Then writes the id maps, mounts the overlay root idmapped (mount_root), puts the init in
 * the cgroups (and its oom_score_adj to -1000), lets it go, starts slirp4netns (and
 * the allow-list gate) while the init builds its root, and prints on stdout "ready PID BASE SLOT
 * CHANNEL" (CHANNEL: our descriptor of the starter's channel) once the init says ok, later "net" or
 * "net-failed WHY". Then waits: SIGTERM, SIGINT or SIGHUP (the backend's death) thaw and kill the
 * init; the init's end kills the network helpers. Returns the init's exit status (128 + signal when
 * killed). Setup failures exit through die()/fail_msg with the step, which the engine reports. */
int cmd_start(struct spec *s, int argc, char **argv)
{
    if (!s->id || !s->root || !s->upper || !s->work || !s->slots || !s->slot_count || !s->id_base)
        fail_msg("arguments",
                 "start needs --id --root --upper --work --slots --slot-count --id-base");
    int gated = s->net && strcmp(s->net, "allowlist") == 0;
    int slirp = gated || (s->net && strcmp(s->net, "slirp") == 0);
    if (!s->net || (!slirp && strcmp(s->net, "none") != 0))
        fail_msg("arguments", "--net is none, slirp or allowlist");
    if (slirp && !s->slirp) fail_msg("arguments", "--net=%s needs --slirp", s->net);
    if (gated && !s->nft) fail_msg("arguments", "--net=allowlist needs --nft");

    /* The signals that doom the sandbox (the backend's death arrives as SIGTERM) and SIGCHLD
     * are taken by sigwaitinfo in the wait loop; blocked from the start, none is missed. */
    sigset_t waited, old;
    sigemptyset(&waited);
    sigaddset(&waited, SIGTERM);
    sigaddset(&waited, SIGINT);
    sigaddset(&waited, SIGHUP);
    sigaddset(&waited, SIGCHLD);
    sigprocmask(SIG_BLOCK, &waited, &old);
    signal(SIGPIPE, SIG_IGN);
    pid_t backend = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) < 0) die("setting the parent-death signal", NULL, errno);
    if (getppid() != backend) return EXIT_HELPER;

    long slot = claim_slot(s);
    unsigned long base = s->id_base + (unsigned long)slot * SANDBOX_ID_RANGE;
    if (unshare(CLONE_NEWNS) < 0) die("mount namespace", NULL, errno);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        die("making mounts private", NULL, errno);

    int go[2], report[2], launched[2], chan[2];
    if (pipe2(go, O_CLOEXEC) < 0 || pipe2(report, O_CLOEXEC) < 0 || pipe2(launched, O_CLOEXEC) < 0)
        die("pipe", NULL, errno);
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, chan) < 0)
        die("the starter's channel", NULL, errno);
    /* One request is one message, and a message may be as long as the send buffer: room for
     * the largest request twice (a second helper waits while the init reads the first). */
    int sndbuf = 2 * (int)STARTER_MAX_FRAME + 65536;
    if (setsockopt(chan[0], SOL_SOCKET, SO_SNDBUFFORCE, &sndbuf, sizeof sndbuf) < 0)
        die("sizing the starter's channel", NULL, errno);
    chan_keeper = chan[0];
    chan_init = chan[1];
    /* A user namespace belongs to the host uid that created it, and what its processes hold
     * (inotify instances, message queue bytes, ...) is also charged to that uid's limits. So the
     * init is cloned by a launcher that first became the sandbox's own base uid, with
     * CLONE_PARENT so that the init is our child all the same. */
    pid_t launcher = fork();
    if (launcher < 0) die("fork", NULL, errno);
    if (launcher == 0) {
        close(launched[0]);
        if (setgroups(0, NULL) < 0 || setresgid((gid_t)base, (gid_t)base, (gid_t)base) < 0 ||
            setresuid((uid_t)base, (uid_t)base, (uid_t)base) < 0)
            die("becoming the sandbox's host uid", NULL, errno);
        long flags = CLONE_PARENT | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS |
                     CLONE_NEWNET | SIGCHLD;
        pid_t child = (pid_t)syscall(SYS_clone, flags, 0, 0, 0, 0);
        if (child < 0) die("creating the namespaces", NULL, errno);
        if (child == 0) {
            close(go[1]);
            close(report[0]);
            close(launched[1]);
            close(chan_keeper);
            report_fd = report[1];
            init_main(s, go[0], argc, argv);
        }
        if (write_all(launched[1], &child, sizeof child)) _exit(EXIT_HELPER);
        _exit(0);
    }
    close(launched[1]);
    pid_t init = 0;
    ssize_t got;
    while ((got = read(launched[0], &init, sizeof init)) < 0 && errno == EINTR) {
    }
    close(launched[0]);
    while (waitpid(launcher, NULL, 0) < 0 && errno == EINTR) {
    }
    if (got != (ssize_t)sizeof init || init <= 0)
        fail_msg("creating the namespaces", "the launcher failed");
    close(go[0]);
    close(report[1]);
    close(chan_init);
    write_id_maps(init, base);
    char pidbuf[32], p[4096];
    snprintf(p, sizeof p, "/proc/%d/ns/user", (int)init);
    int userns = open(p, O_RDONLY | O_CLOEXEC);
    if (userns < 0) die("opening the sandbox's user namespace", NULL, errno);
    mount_root(s, userns, base);
    close(userns);
    snprintf(pidbuf, sizeof pidbuf, "%d\n", (int)init);
    for (int i = 0; i < s->cgroups.n; i++) {
        snprintf(p, sizeof p, "%s/cgroup.procs", s->cgroups.v[i]);
        int e = write_file(p, pidbuf);
        if (e) {
            kill(init, SIGKILL);
            die("joining", p, e);
        }
    }
    snprintf(p, sizeof p, "/proc/%d/oom_score_adj", (int)init);
    write_file(p, "-1000");
    if (write(go[1], "g", 1) != 1) die("starting the init", NULL, errno);
    close(go[1]);
    /* slirp4netns needs only the network namespace, which exists: it starts while the init
     * builds the root. For an allow-list sandbox, the gate's namespace exists once its process
     * says so: slirp4netns starts on that one, and the keeper wires it to the sandbox's,
     * while the init still builds the root. */
    pid_t net_pid = -1, gate_pid = -1;
    int net_exit = -1, net_ready = -1;
    const char *net_failed = NULL;
    if (gated) {
        int gr[2];
        if (pipe2(gr, O_CLOEXEC) < 0) die("gate: pipe", NULL, errno);
        gate_pid = fork();
        if (gate_pid < 0) die("gate: fork", NULL, errno);
        if (gate_pid == 0) {
            close(gr[0]);
            gate_child(s, init, gr[1], &old);
        }
        close(gr[1]);
        char c;
        ssize_t got;
        while ((got = read(gr[0], &c, 1)) < 0 && errno == EINTR) {
        }
        close(gr[0]);
        const char *why = NULL;
        if (got != 1) {
            net_failed = "the allow-list gate did not start";
        } else {
            net_pid = start_slirp(s, init, gate_pid, base, &net_exit, &net_ready, &old);
            if (wire_gate(s, init, gate_pid, &why) < 0)
                net_failed = why && strcmp(why, s->nft) == 0
                                 ? "nft could not install the gate's rules"
                                 : "ip could not connect the sandbox to its gate";
        }
    } else if (slirp) {
        net_pid = start_slirp(s, init, init, base, &net_exit, &net_ready, &old);
    }
    char msg[512];
    ssize_t n;
    while ((n = read(report[0], msg, sizeof msg - 1)) < 0 && errno == EINTR) {
    }
    close(report[0]);
    if (n != 2 || memcmp(msg, "ok", 2) != 0) {
        kill(init, SIGKILL);
        if (net_pid > 0) kill(net_pid, SIGKILL);
        if (gate_pid > 0) kill(gate_pid, SIGKILL);
        msg[n > 0 ? n : 0] = 0;
        fail_msg("init", "%s", n > 0 ? msg : "it ended before saying it was ready");
    }
    printf("ready %d %lu %ld %d\n", (int)init, base, slot, chan_keeper);
    fflush(stdout);
    /* The network's readiness comes as a second line: an exec waits for it, a create need not
     * (slirp4netns takes ~10 ms to configure, longer than everything else of a start). */
    if (slirp) {
        char c = 0;
        n = 0;
        while (!net_failed && (n = read(net_ready, &c, 1)) < 0 && errno == EINTR) {
        }
        if (net_ready >= 0) close(net_ready);
        if (net_failed || n != 1) {
            printf("net-failed %s\n",
                   net_failed ? net_failed : "slirp4netns did not configure the sandbox's network");
            fflush(stdout);
            thaw(s->freezer);
            kill(init, SIGKILL);
        } else {
            printf("net\n");
            fflush(stdout);
        }
    }
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    dup2(devnull, 1);

    int status = 0, init_alive = 1, children = 1 + (net_pid > 0) + (gate_pid > 0);
    while (children > 0) {
        siginfo_t si;
        int sig = sigwaitinfo(&waited, &si);
        if (sig < 0) continue;
        if (sig != SIGCHLD) {
            if (init_alive) {
                thaw(s->freezer);
                kill(init, SIGKILL);
            }
            continue;
        }
        int st;
        pid_t w;
        while ((w = waitpid(-1, &st, WNOHANG)) > 0) {
            children--;
            if (w == init) {
                status = st;
                init_alive = 0;
                if (net_pid > 0) kill(net_pid, SIGKILL);
                if (gate_pid > 0) kill(gate_pid, SIGKILL);
                if (net_exit >= 0) close(net_exit);
            }
        }
        if (w < 0 && errno == ECHILD) break;
    }
    /* The root's mount point: the overlay is mounted on it in our namespace only (private, so
     * in no other; the init's copy went with the init), so once it is detached here the empty
     * directory is no mount point anywhere and can go. Done here, not only by the backend, so
     * that a backend killed by SIGKILL leaves no directory in the roots dir either. */
    if (umount2(s->root, MNT_DETACH) == 0 || errno == EINVAL) rmdir(s->root);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
