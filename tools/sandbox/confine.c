/*
 * confine.c — the last steps of every process that runs inside a sandbox: the capability set
 * of a default container, no_new_privs, and a seccomp filter at least as strict as Docker's
 * default profile. The init, an exec's command and a file helper all pass through confine()
 * after entering the sandbox's namespaces and before touching anything of the sandbox's.
 *
 * Capabilities are those of the sandbox's user namespace only (root inside maps to an
 * unprivileged host id), and are cut further to the default container set, so even inside
 * its own namespaces root cannot mount, load BPF, or change the network configuration.
 *
 * The seccomp filter (its policy is seccomp_policy.c) is compiled at build time into
 * seccomp_filter.h and loaded here as a classic BPF program.
 */
#include <errno.h>
#include <linux/capability.h>
#include <net/if.h>
#include <sched.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "sandbox.h"
#include "seccomp_filter.h"

/* Docker's default capability set without CAP_NET_RAW: raw and packet sockets would let a
 * sandbox hand-craft packets to slirp4netns (a SYN addressed to the host's 127.0.0.1 passes
 * its --disable-host-loopback, which only guards the 10.0.2.2 alias). ping still works: the
 * init opens ICMP datagram sockets to every group (net.ipv4.ping_group_range). */
static const int keep_caps[] = {
    CAP_CHOWN,  CAP_DAC_OVERRIDE, CAP_FOWNER,  CAP_FSETID,           CAP_KILL,
    CAP_SETGID, CAP_SETUID,       CAP_SETPCAP, CAP_NET_BIND_SERVICE, CAP_SYS_CHROOT,
    CAP_MKNOD,  CAP_AUDIT_WRITE,  CAP_SETFCAP,
};

static int drop_caps(void)
{
    unsigned long long keep = 0;
    for (size_t i = 0; i < sizeof keep_caps / sizeof keep_caps[0]; i++)
        keep |= 1ULL << keep_caps[i];
    for (int cap = 0; cap < 64; cap++) {
        if (keep & (1ULL << cap)) continue;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0) {
            if (errno == EINVAL) break; /* past the kernel's last capability */
            return -errno;
        }
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        return -errno;
    struct __user_cap_header_struct h = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct d[2];
    memset(d, 0, sizeof d);
    d[0].effective = d[0].permitted = d[0].inheritable = (unsigned)(keep & 0xffffffffu);
    d[1].effective = d[1].permitted = d[1].inheritable = (unsigned)(keep >> 32);
    if (syscall(SYS_capset, &h, d) < 0) return -errno;
    return 0;
}

int confine(const char **step)
{
    int rc;
    *step = "dropping capabilities";
    if ((rc = drop_caps()) < 0) return rc;
    *step = "setting no_new_privs";
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) return -errno;
    *step = "loading the seccomp filter";
    struct sock_fprog prog = {
        .len = (unsigned short)(sizeof sandbox_filter_bytes / sizeof(struct sock_filter)),
        .filter = (struct sock_filter *)(void *)sandbox_filter_bytes};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0) return -errno;
    return 0;
}

int loopback_up(void)
{
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return errno;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    int e = 0;
    if (ioctl(fd, SIOCGIFFLAGS, &ifr) < 0) e = errno;
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (!e && ioctl(fd, SIOCSIFFLAGS, &ifr) < 0) e = errno;
    close(fd);
    return e;
}
