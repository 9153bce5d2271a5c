/*
 * gate.c — the allow-list gate of a sandbox: the only way out of a sandbox whose network policy
 * is "allow-list" (Render's semantics: HTTP and HTTPS to the listed names, a leftmost "*."
 * wildcard for any subdomain, everything else dropped, DNS answered for listed names only).
 *
 * It runs in a network namespace of its own between the sandbox and slirp4netns (start.c builds
 * it: a veth pair into the sandbox, nftables redirecting the sandbox's TCP 80 and 443 and its
 * DNS to us, no forwarding at all), as an unprivileged process of the sandbox's id range, outside
 * the sandbox's PID and mount namespaces, confined like everything else (confine.c). One epoll
 * loop serves:
 *   - DNS (UDP): a query whose name is no host name (a label with a NUL, a dot or an odd byte;
 *     gate_parse.c) is refused and goes nowhere; for a listed name the gate asks the upstream
 *     resolver (slirp4netns's, or one given) a query it builds from the checked name (a fresh
 *     id, one question), and relays the answer to exactly that question, after noting the IPv4
 *     addresses it holds for that name; AAAA gets an empty answer (the sandbox has IPv4 only);
 *     any other name NXDOMAIN.
 *   - HTTP: the request head is read (at most HEAD_MAX bytes, HEAD_SECONDS to arrive), its Host
 *     checked against the list, and the connection relayed to where the sandbox sent it;
 *   - TLS: the ClientHello is read the same way and its SNI checked.
 * A connection is relayed only if the name is listed AND the address the sandbox connected to is
 * one our DNS answered for that name, so a listed name in SNI cannot carry a connection to any
 * other host. Everything refused is closed at once. Bounded: CONN_MAX connections, BUF bytes of
 * buffer per direction, PENDING_MAX DNS queries in flight, NAMES_MAX resolved names.
 * Alternatives rejected: an HTTP CONNECT proxy needs the sandbox's programs to be told about it
 * (Render's allow-list is transparent); filtering by IP alone (nftables sets from DNS answers)
 * cannot tell two names on one address apart, which SNI and Host can.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/netfilter_ipv4.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "sandbox.h"

#define CONN_MAX     512
#define BUF          (32 * 1024)
#define HEAD_MAX     (16 * 1024)
#define HEAD_SECONDS 10
#define PENDING_MAX  256
#define NAMES_MAX    4096
#define ADDRS_MAX    16

enum { K_LISTEN_HTTP, K_LISTEN_TLS, K_DNS, K_UPSTREAM_DNS, K_CLIENT, K_SERVER };

/* ---- names ------------------------------------------------------------------------------------
 */

static const struct str_list *allowed;

/* Addresses our DNS answered for each name, so a relayed connection must go to one of them. */
static struct resolved {
    char name[GATE_NAME_MAX + 1];
    uint32_t addr[ADDRS_MAX];
    unsigned next; /* addresses ever noted; the ring's next slot */
    time_t used;
} names[NAMES_MAX];
static int nnames;

static struct resolved *resolved_of(const char *name, int create)
{
    struct resolved *oldest = NULL;
    for (int i = 0; i < nnames; i++) {
        if (strcmp(names[i].name, name) == 0) return &names[i];
        if (!oldest || names[i].used < oldest->used) oldest = &names[i];
    }
    if (!create) return NULL;
    struct resolved *r = nnames < NAMES_MAX ? &names[nnames++] : oldest;
    memset(r, 0, sizeof *r);
    snprintf(r->name, sizeof r->name, "%s", name);
    return r;
}

static int resolved_to(const char *name, uint32_t addr)
{
    struct resolved *r = resolved_of(name, 0);
    if (!r) return 0;
    for (unsigned i = 0; i < r->next && i < ADDRS_MAX; i++)
        if (r->addr[i] == addr) return 1;
    return 0;
}

/* ---- DNS --------------------------------------------------------------------------------------
 */

struct pending {
    int used;
    uint16_t client_id;
    struct gate_query asked; /* what we asked upstream: our id, the checked name, type, class */
    unsigned char question[GATE_NAME_MAX + 2 + 4]; /* the client's question, echoed back */
    int qlen;
    struct sockaddr_in client;
    time_t at;
};
static struct pending pend[PENDING_MAX];

static int dns_fd, up_fd;
static struct sockaddr_in upstream;

/* A fresh id for a query upstream, none of those in flight: an answer is taken only for the
 * id, and the question, we sent. */
static uint16_t fresh_id(void)
{
    for (;;) {
        uint16_t id;
        if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) die("gate: getrandom", NULL, errno);
        int taken = 0;
        for (int i = 0; i < PENDING_MAX && !taken; i++)
            taken = pend[i].used && pend[i].asked.id == id;
        if (!taken) return id;
    }
}

/* Answers query q (its header and question, qend bytes) with no records and rcode. */
static void dns_reply_empty(const unsigned char *q, int qend, int rcode,
                            const struct sockaddr_in *to)
{
    unsigned char r[512];
    if (qend > (int)sizeof r) return;
    memcpy(r, q, (size_t)qend);
    r[2] = (unsigned char)(0x80 | (q[2] & 0x01));  /* QR, RD copied */
    r[3] = (unsigned char)(0x80 | rcode);          /* RA, rcode */
    r[6] = r[7] = r[8] = r[9] = r[10] = r[11] = 0; /* no answers, authority, additional */
    sendto(dns_fd, r, (size_t)qend, 0, (const struct sockaddr *)to, sizeof *to);
}

/* Answers a query whose question was not read (or is refused) with its header alone: its id,
 * opcode and RD, and rcode (FORMERR, NOTIMP, REFUSED). */
static void dns_reply_header(const struct gate_query *gq, int rcode, const struct sockaddr_in *to)
{
    unsigned char r[12] = {(unsigned char)(gq->id >> 8), (unsigned char)gq->id,
                           (unsigned char)(0x80 | gq->flags), (unsigned char)(0x80 | rcode)};
    sendto(dns_fd, r, sizeof r, 0, (const struct sockaddr *)to, sizeof *to);
}

/* One query of the sandbox: refused unless its question is a host name (gate_dns_parse_query:
 * a label with a NUL, a dot or another odd byte is REFUSED, a pointer or a malformed question
 * FORMERR, and nothing goes upstream); NXDOMAIN unless the name is listed; an empty answer
 * for any type but A; else a query the gate builds from the checked name goes upstream. */
static void dns_query(void)
{
    unsigned char q[1500];
    struct sockaddr_in from;
    socklen_t fl = sizeof from;
    ssize_t n = recvfrom(dns_fd, q, sizeof q, 0, (struct sockaddr *)&from, &fl);
    struct gate_query gq;
    int r = n > 0 ? gate_dns_parse_query(q, (int)n, &gq) : -1;
    if (r < 0) return; /* not a query we answer: dropped */
    if (r != GATE_DNS_OK) {
        dns_reply_header(&gq, r, &from);
        return;
    }
    if (!gate_listed(allowed, gq.name)) {
        dns_reply_empty(q, gq.qend, 3, &from); /* NXDOMAIN */
        return;
    }
    if (gq.qtype != 1) { /* A only: the sandbox's side of the gate is IPv4 */
        dns_reply_empty(q, gq.qend, 0, &from);
        return;
    }
    time_t now = time(NULL);
    struct pending *p = NULL;
    for (int i = 0; i < PENDING_MAX && !p; i++)
        if (!pend[i].used || now - pend[i].at > 10) p = &pend[i];
    if (!p) return; /* too many in flight: the client will retry */
    unsigned char up[12 + GATE_NAME_MAX + 2 + 4];
    p->used = 0;
    p->asked = gq;
    p->asked.id = fresh_id();
    int len = gate_dns_build_query(gq.name, p->asked.id, gq.qtype, gq.qclass, up, sizeof up);
    if (len < 0 || gq.qend - 12 > (int)sizeof p->question) return;
    p->used = 1;
    p->client_id = (uint16_t)gq.id;
    p->client = from;
    p->at = now;
    p->qlen = gq.qend - 12;
    memcpy(p->question, q + 12, (size_t)p->qlen);
    sendto(up_fd, up, (size_t)len, 0, (struct sockaddr *)&upstream, sizeof upstream);
}

/* One message from upstream: relayed to the client only if it answers a question we asked
 * (gate_dns_answer: our id, that name, type and class), and only then are its addresses noted
 * as the name's; the client gets it with its own id and its own question (the same labels,
 * in the client's letter case). */
static void dns_answer(void)
{
    unsigned char m[4096];
    struct sockaddr_in from;
    socklen_t fl = sizeof from;
    ssize_t n = recvfrom(up_fd, m, sizeof m, 0, (struct sockaddr *)&from, &fl);
    if (n < 12 || from.sin_addr.s_addr != upstream.sin_addr.s_addr ||
        from.sin_port != upstream.sin_port)
        return; /* only the upstream's answers count */
    /* The A records of the answer (of the name or its CNAME chain) are where connections made
     * for the asked name may go; the oldest give way when a name has more than ADDRS_MAX. */
    uint32_t a[ADDRS_MAX];
    struct pending *p = NULL;
    int got = -1;
    for (int i = 0; i < PENDING_MAX && !p; i++)
        if (pend[i].used && (got = gate_dns_answer(m, (int)n, &pend[i].asked, a, ADDRS_MAX)) >= 0)
            p = &pend[i];
    if (!p) return;
    p->used = 0;
    struct resolved *r = resolved_of(p->asked.name, 1);
    r->used = time(NULL);
    for (int i = 0; i < got; i++)
        if (!resolved_to(p->asked.name, a[i])) {
            r->addr[r->next % ADDRS_MAX] = a[i];
            r->next++;
        }
    m[0] = (unsigned char)(p->client_id >> 8);
    m[1] = (unsigned char)p->client_id;
    if (12 + p->qlen <= n) memcpy(m + 12, p->question, (size_t)p->qlen); /* same length: ours */
    sendto(dns_fd, m, (size_t)n, 0, (struct sockaddr *)&p->client, sizeof p->client);
}

/* ---- TCP: the first bytes decide --------------------------------------------------------------
 */

struct conn;
/* What an epoll event points at: a listening socket, a DNS socket, or one side of a conn. */
struct slot {
    int kind;
    struct conn *c;
};

struct conn {
    int used, tls;
    int fd, peer;        /* client and server sockets (peer -1 until connected) */
    unsigned char *buf;  /* client → server bytes (the head first) */
    size_t blen;         /* bytes in buf */
    unsigned char *back; /* server → client */
    size_t backlen;
    int deciding;   /* still reading the head */
    int connecting; /* the server connect is in flight */
    int client_eof, server_eof;
    time_t deadline;
    struct sockaddr_in dst; /* where the sandbox sent it */
    struct slot client_slot, server_slot;
};
static struct conn conns[CONN_MAX];
static int ep;

static void watch(int fd, struct slot *s)
{
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLET | EPOLLRDHUP, .data.ptr = s};
    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
}

static void close_conn(struct conn *c)
{
    if (c->fd >= 0) close(c->fd);
    if (c->peer >= 0) close(c->peer);
    free(c->buf);
    free(c->back);
    memset(c, 0, sizeof *c);
    c->fd = c->peer = -1;
}

/* Refuses a connection, saying why where the protocol lets us: an HTTP 403 whose body names
 * the host and the reason, or a TLS unrecognized_name alert. One write to a fresh socket. */
static void refuse(struct conn *c, const char *name, const char *why)
{
    char msg[768], addr[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &c->dst.sin_addr, addr, sizeof addr);
    if (c->tls) {
        static const unsigned char alert[] = {0x15, 0x03, 0x01, 0x00, 0x02, 0x02, 0x70};
        (void)!write(c->fd, alert, sizeof alert);
    } else {
        char body[512];
        if (name)
            snprintf(
                body, sizeof body,
                "moonbox allow-list: refused HTTP to %s: the host %s %s (this sandbox may make "
                "HTTP and HTTPS requests to its allowedDomains only)\n",
                addr, name, why);
        else
            snprintf(body, sizeof body,
                     "moonbox allow-list: refused HTTP to %s: the request %s (one Host header and "
                     "an origin-form target are needed)\n",
                     addr, why);
        int ml =
            snprintf(msg, sizeof msg,
                     "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                     "Content-Length: %d\r\n\r\n%s",
                     (int)strlen(body), body);
        if (ml > 0 && ml < (int)sizeof msg) (void)!write(c->fd, msg, (size_t)ml);
    }
    close_conn(c);
}

/* Whether the gate may connect to addr (network order) for the sandbox: never to its own
 * namespace (loopback, the sandbox's /30, slirp4netns's 10.0.2.0/24, whose 10.0.2.2 is the
 * host) nor to 0.0.0.0/8, whatever an allowed name resolves to. The host's own addresses are
 * refused on the host by its firewall rule on the sandbox's ids (slirp4netns runs as them). */
static int reachable(uint32_t addr)
{
    uint32_t a = ntohl(addr);
    if ((a >> 24) == 127 || (a >> 24) == 0) return 0;
    if ((a & 0xfffffffcu) == 0x0ac80000u) return 0; /* 10.200.0.0/30 */
    if ((a & 0xffffff00u) == 0x0a000200u) return 0; /* 10.0.2.0/24 */
    return 1;
}

static void accept_conn(int lfd, int tls)
{
    for (;;) {
        struct sockaddr_in dst;
        socklen_t dl = sizeof dst;
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;
        struct conn *c = NULL;
        for (int i = 0; i < CONN_MAX && !c; i++)
            if (!conns[i].used) c = &conns[i];
        if (!c || getsockopt(fd, SOL_IP, SO_ORIGINAL_DST, &dst, &dl) < 0 ||
            !(c->buf = malloc(BUF)) || !(c->back = malloc(BUF))) {
            if (c) {
                free(c->buf);
                c->buf = NULL;
            }
            close(fd);
            continue;
        }
        c->used = 1;
        c->tls = tls;
        c->fd = fd;
        c->peer = -1;
        c->deciding = 1;
        c->dst = dst;
        c->deadline = time(NULL) + HEAD_SECONDS;
        c->client_slot = (struct slot){K_CLIENT, c};
        c->server_slot = (struct slot){K_SERVER, c};
        watch(fd, &c->client_slot);
    }
}

/* Moves what can move between the two sockets (edge-triggered: until EAGAIN). */
static void pump(struct conn *c)
{
    for (int progress = 1; progress;) {
        progress = 0;
        if (!c->client_eof && c->blen < BUF && (c->deciding || c->peer >= 0)) {
            ssize_t n = read(c->fd, c->buf + c->blen, BUF - c->blen);
            if (n > 0) {
                c->blen += (size_t)n;
                progress = 1;
            } else if (n == 0) {
                c->client_eof = 1;
                progress = 1;
            } else if (errno != EAGAIN && errno != EINTR) {
                close_conn(c);
                return;
            }
        }
        if (c->deciding) {
            char name[GATE_NAME_MAX + 1];
            int r = c->tls ? gate_tls_sni(c->buf, c->blen, name)
                           : gate_http_host(c->buf, c->blen, name);
            if (r < 0 && c->blen < HEAD_MAX && !c->client_eof) {
                if (progress) continue; /* edge-triggered: read on until EAGAIN */
                return;                 /* wait for more */
            }
            const char *why =
                r != 1                                       ? "names no host it can check"
                : !gate_listed(allowed, name)                ? "is not in the allow-list"
                : !resolved_to(name, c->dst.sin_addr.s_addr) ? "was not resolved to this address"
                : !reachable(c->dst.sin_addr.s_addr) ? "resolved to an address never reachable"
                                                     : NULL;
            if (why) {
                refuse(c, r == 1 ? name : NULL, why);
                return;
            }
            int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            if (s < 0 || (connect(s, (struct sockaddr *)&c->dst, sizeof c->dst) < 0 &&
                          errno != EINPROGRESS)) {
                if (s >= 0) close(s);
                close_conn(c);
                return;
            }
            c->peer = s;
            c->deciding = 0;
            c->connecting = 1;
            watch(s, &c->server_slot);
            return;
        }
        if (c->peer < 0 || c->connecting) return;
        if (c->blen > 0) {
            ssize_t n = write(c->peer, c->buf, c->blen);
            if (n > 0) {
                memmove(c->buf, c->buf + n, c->blen - (size_t)n);
                c->blen -= (size_t)n;
                progress = 1;
            } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                close_conn(c);
                return;
            }
        }
        if (c->client_eof && c->blen == 0) shutdown(c->peer, SHUT_WR);
        if (!c->server_eof && c->backlen < BUF) {
            ssize_t n = read(c->peer, c->back + c->backlen, BUF - c->backlen);
            if (n > 0) {
                c->backlen += (size_t)n;
                progress = 1;
            } else if (n == 0) {
                c->server_eof = 1;
                progress = 1;
            } else if (errno != EAGAIN && errno != EINTR) {
                close_conn(c);
                return;
            }
        }
        if (c->backlen > 0) {
            ssize_t n = write(c->fd, c->back, c->backlen);
            if (n > 0) {
                memmove(c->back, c->back + n, c->backlen - (size_t)n);
                c->backlen -= (size_t)n;
                progress = 1;
            } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                close_conn(c);
                return;
            }
        }
        if (c->server_eof && c->backlen == 0) shutdown(c->fd, SHUT_WR);
        if (c->client_eof && c->server_eof && c->blen == 0 && c->backlen == 0) {
            close_conn(c);
            return;
        }
    }
}

static int listen_on(int type, int port)
{
    int fd = socket(AF_INET, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0) die("gate: bind", NULL, errno);
    if (type == SOCK_STREAM && listen(fd, 128) < 0) die("gate: listen", NULL, errno);
    return fd;
}

static int http_fd, tls_fd;

void gate_bind(const struct str_list *allow, const char *dns)
{
    allowed = allow;
    for (int i = 0; i < CONN_MAX; i++)
        conns[i].fd = conns[i].peer = -1;
    upstream.sin_family = AF_INET;
    upstream.sin_port = htons(53);
    if (inet_pton(AF_INET, dns && *dns ? dns : "10.0.2.3", &upstream.sin_addr) != 1)
        fail_msg("gate", "the upstream resolver '%s' is not an IPv4 address", dns);
    http_fd = listen_on(SOCK_STREAM, GATE_HTTP_PORT);
    tls_fd = listen_on(SOCK_STREAM, GATE_TLS_PORT);
    dns_fd = listen_on(SOCK_DGRAM, GATE_DNS_PORT);
    up_fd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (up_fd < 0) die("gate: the upstream resolver's socket", NULL, errno);
    if ((ep = epoll_create1(EPOLL_CLOEXEC)) < 0) die("gate: epoll", NULL, errno);
    static struct slot ls[4] = {
        {K_LISTEN_HTTP, NULL}, {K_LISTEN_TLS, NULL}, {K_DNS, NULL}, {K_UPSTREAM_DNS, NULL}};
    int fds[4] = {http_fd, tls_fd, dns_fd, up_fd};
    for (int i = 0; i < 4; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &ls[i]};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fds[i], &ev) < 0) die("gate: epoll", NULL, errno);
    }
}

/* The gate's event loop, forever (sandbox.h: after gate_bind): one epoll set for the HTTP and
 * TLS listeners, the DNS socket and its upstream, and both ends of every proxied connection.
 * A server end still connecting is checked with SO_ERROR first (a refused connect closes the
 * pair); then pump() moves bytes both ways. Once a second, connections still deciding (no
 * complete Host header or SNI before their deadline) are closed. Never returns; fatal setup
 * errors die() elsewhere, per-connection errors only close that connection. */
void gate_serve(void)
{
    for (;;) {
        struct epoll_event evs[64];
        int n = epoll_wait(ep, evs, 64, 1000);
        for (int i = 0; i < n; i++) {
            struct slot *s = (struct slot *)evs[i].data.ptr;
            switch (s->kind) {
            case K_LISTEN_HTTP:
                accept_conn(http_fd, 0);
                break;
            case K_LISTEN_TLS:
                accept_conn(tls_fd, 1);
                break;
            case K_DNS:
                dns_query();
                break;
            case K_UPSTREAM_DNS:
                dns_answer();
                break;
            default:
                if (s->c && s->c->used) {
                    if (s->kind == K_SERVER && s->c->connecting) {
                        int err = 0;
                        socklen_t el = sizeof err;
                        getsockopt(s->c->peer, SOL_SOCKET, SO_ERROR, &err, &el);
                        if (err) {
                            close_conn(s->c);
                            break;
                        }
                        s->c->connecting = 0;
                    }
                    pump(s->c);
                }
            }
        }
        time_t now = time(NULL);
        for (int i = 0; i < CONN_MAX; i++)
            if (conns[i].used && conns[i].deciding && now > conns[i].deadline)
                close_conn(&conns[i]);
    }
}
