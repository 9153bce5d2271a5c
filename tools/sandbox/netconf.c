/*
 * netconf.c — the few network settings an allow-list sandbox needs (start.c's wire_gate), made
 * with the kernel's own interfaces instead of running ip(8): a veth pair by one rtnetlink
 * request, addresses, links and the default route by the classic ioctls. Each runs in the
 * calling process's current network namespace. Running ip three times cost about as much as the
 * rest of a sandbox's start; these calls cost microseconds.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_link.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/veth.h>
#include <net/if.h>
#include <net/route.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sandbox.h"

struct nlreq {
    struct nlmsghdr n;
    struct ifinfomsg i;
    char buf[512];
};

/* Appends attribute type with len bytes of data at the end of request r; returns it (for a
 * nest), or NULL when it would not fit. */
static struct rtattr *add_attr(struct nlreq *r, unsigned short type, const void *data, size_t len)
{
    struct nlmsghdr *n = &r->n;
    size_t rl = RTA_LENGTH(len);
    if (NLMSG_ALIGN(n->nlmsg_len) + RTA_ALIGN(rl) > sizeof *r) return NULL;
    struct rtattr *a = (struct rtattr *)(void *)((char *)r + NLMSG_ALIGN(n->nlmsg_len));
    a->rta_type = type;
    a->rta_len = (unsigned short)rl;
    if (len) memcpy(RTA_DATA(a), data, len);
    n->nlmsg_len = (unsigned)(NLMSG_ALIGN(n->nlmsg_len) + RTA_ALIGN(rl));
    return a;
}

static void end_nest(struct nlmsghdr *n, struct rtattr *nest)
{
    nest->rta_len = (unsigned short)((char *)n + NLMSG_ALIGN(n->nlmsg_len) - (char *)nest);
}

/* Creates the veth pair name <-> peer with one RTM_NEWLINK request over rtnetlink (NLM_F_EXCL:
 * an existing name is EEXIST), the peer created straight inside the network namespace open on
 * fd peer_netns, and waits for the kernel's acknowledgement. Returns 0 or an errno: ENOBUFS when
 * the request does not fit, EPROTO for an answer that is not an ack, else the kernel's error.
 * Blocks on the netlink socket (a local round trip). */
int net_veth(const char *name, const char *peer, int peer_netns)
{
    struct nlreq r;
    memset(&r, 0, sizeof r);
    r.n.nlmsg_len = NLMSG_LENGTH(sizeof(struct ifinfomsg));
    r.n.nlmsg_type = RTM_NEWLINK;
    r.n.nlmsg_flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL | NLM_F_ACK;
    r.n.nlmsg_seq = 1;
    r.i.ifi_family = AF_UNSPEC;
    struct rtattr *info, *data, *peer_info;
    struct ifinfomsg peer_msg;
    memset(&peer_msg, 0, sizeof peer_msg);
    if (!add_attr(&r, IFLA_IFNAME, name, strlen(name) + 1) ||
        !(info = add_attr(&r, IFLA_LINKINFO, NULL, 0)) ||
        !add_attr(&r, IFLA_INFO_KIND, "veth", 4) ||
        !(data = add_attr(&r, IFLA_INFO_DATA, NULL, 0)) ||
        !(peer_info = add_attr(&r, VETH_INFO_PEER, &peer_msg, sizeof peer_msg)) ||
        !add_attr(&r, IFLA_IFNAME, peer, strlen(peer) + 1) ||
        !add_attr(&r, IFLA_NET_NS_FD, &peer_netns, sizeof peer_netns))
        return ENOBUFS;
    end_nest(&r.n, peer_info);
    end_nest(&r.n, data);
    end_nest(&r.n, info);
    int fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (fd < 0) return errno;
    struct sockaddr_nl to = {.nl_family = AF_NETLINK};
    int e = 0;
    if (sendto(fd, &r, r.n.nlmsg_len, 0, (struct sockaddr *)&to, sizeof to) < 0) {
        e = errno;
    } else {
        char ack[1024];
        ssize_t got = recv(fd, ack, sizeof ack, 0);
        struct nlmsghdr *h = (struct nlmsghdr *)(void *)ack;
        if (got < 0)
            e = errno;
        else if (got < (ssize_t)NLMSG_LENGTH(sizeof(struct nlmsgerr)) ||
                 h->nlmsg_type != NLMSG_ERROR)
            e = EPROTO;
        else
            e = -((struct nlmsgerr *)NLMSG_DATA(h))->error;
    }
    close(fd);
    return e;
}

static int set_ipv4(int fd, unsigned long req, const char *ifname, const char *addr)
{
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", ifname);
    struct sockaddr_in *sin = (struct sockaddr_in *)(void *)&ifr.ifr_addr;
    sin->sin_family = AF_INET;
    if (inet_pton(AF_INET, addr, &sin->sin_addr) != 1) return EINVAL;
    return ioctl(fd, req, &ifr) < 0 ? errno : 0;
}

int net_addr_up(const char *ifname, const char *addr, const char *mask)
{
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return errno;
    int e = set_ipv4(fd, SIOCSIFADDR, ifname, addr);
    if (!e) e = set_ipv4(fd, SIOCSIFNETMASK, ifname, mask);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", ifname);
    if (!e && ioctl(fd, SIOCGIFFLAGS, &ifr) < 0) e = errno;
    ifr.ifr_flags |= IFF_UP;
    if (!e && ioctl(fd, SIOCSIFFLAGS, &ifr) < 0) e = errno;
    close(fd);
    return e;
}

int net_default_route(const char *gateway)
{
    struct rtentry rt;
    memset(&rt, 0, sizeof rt);
    struct sockaddr_in *gw = (struct sockaddr_in *)(void *)&rt.rt_gateway;
    struct sockaddr_in *dst = (struct sockaddr_in *)(void *)&rt.rt_dst;
    struct sockaddr_in *mask = (struct sockaddr_in *)(void *)&rt.rt_genmask;
    gw->sin_family = dst->sin_family = mask->sin_family = AF_INET;
    if (inet_pton(AF_INET, gateway, &gw->sin_addr) != 1) return EINVAL;
    rt.rt_flags = RTF_UP | RTF_GATEWAY;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return errno;
    int e = ioctl(fd, SIOCADDRT, &rt) < 0 ? errno : 0;
    close(fd);
    return e;
}
