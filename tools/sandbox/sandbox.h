/*
 * sandbox.h — moonbox-sandbox, the one program through which `moonbox local` makes, enters and
 * reads its sandboxes. Shared declarations of its parts:
 *
 *   main.c     argument parsing, dispatch, errors
 *   start.c    `start`: a new sandbox (user, mount, PID, IPC, UTS, network, cgroup namespaces,
 *              its overlay root, /proc, /sys, /dev) and its init
 *   enter.c    `exec` and `files`: joining a running sandbox (cgroup, namespaces, root, ids)
 *   starter.c  the init's starter (exec'd processes started from inside, on the server's
 *              request over a channel only the server holds) and `exec`'s side of it
 *   starter_proto.c  the frames of that channel (fuzzed)
 *   confine.c  what every process inside gets last: capabilities, no_new_privs, seccomp
 *   fileops.c  `files`: reading and writing the sandbox's files with our own code, inside it
 *   shift.c    `capture`: copying an upper layer into a snapshot layer with ids made 0-based;
 *              `verify`: checking a layer against its manifest
 *   manifest.c a layer's manifest (file count, bytes, checksums of its tree); sha256.c
 *   linkmap.c  the hard-link table of the copies (bounded memory, spills to files)
 *   gate.c     the allow-list gate: the only way out of an "allow-list" sandbox
 *   gate_parse.c  what the gate reads of the sandbox's traffic (fuzzed)
 *   netconf.c  the allow-list sandbox's veth pair, addresses and route
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

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
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
    int join_in_child;       /* exec, files: the child joins them, this process stays put */
    const char *freezer;     /* start: the freezer cgroup to thaw when the sandbox must die */
    const char *net;         /* start: "none" (loopback only), "slirp" or "allowlist" */
    const char *slirp;       /* start: the slirp4netns program */
    struct str_list allow;   /* start: allowlist: the names let through ("*.x": below x) */
    const char *dns;         /* start: allowlist: the upstream resolver (default slirp's) */
    const char *nft;         /* start: allowlist: the nft program */
    const char *resolv;     /* start: contents of /etc/resolv.conf (binds when the image has one) */
    const char *hosts;      /* start: contents of /etc/hosts */
    pid_t target;           /* exec, files: the sandbox's init (host pid) */
    unsigned long uid_base; /* exec, files: the sandbox's id base, checked against the target */
    const char *cwd;        /* exec: working directory inside (default /root) */
    const char *shell;      /* exec: the shell text of plain words (bash -c when they cannot run) */
    const char *op;         /* files: the operation */
    const char *path;       /* files: its path inside the sandbox */
    const char *mode;       /* files: octal mode of a written file */
    long depth;             /* files: list depth */
    int follow;             /* files: stat follows a final symlink */
    struct str_list excludes;     /* files: names left out of a pack of its top directory */
    unsigned long long max_bytes; /* files: file data a pack may carry (0: the default) */
    const char *src, *dst;        /* capture: upper directory and new layer */
    const char *manifest;         /* verify: the manifest file (the layer comes as --layer) */
    int quick;                    /* verify: compare names and attributes only, not contents */
    int setsid;                   /* exec: make the command a session leader */
    pid_t keeper;                 /* exec: the sandbox's keeper (host pid), holder of the channel */
    long channel;                 /* exec: the keeper's descriptor of the starter's channel */
    char **argv;                  /* exec: the program and its arguments */
};

/* main.c */
/* One line on stderr: head, then fmt formatted with ap (the helper's two message forms, the
 * exit-time "moonbox-sandbox: STEP: ..." and fileops' "CODE message", both go through it). */
void say(const char *head, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
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
/* With s->join_in_child, enter_sandbox only opened the cgroups; the child calls this after the
 * fork (moving itself in) and the parent enter_cgroups_done() (closing them). Dies on failure. */
void enter_cgroups_child(const struct spec *s);
void enter_cgroups_done(void);
/* Lets the exec and files children overwrite the argument strings (see enter.c). */
void enter_set_args(int argc, char **argv);
/* Dies ("gone") unless s->target still is the init of the sandbox whose ids start at
 * s->uid_base (its uid map says so: a recycled pid's would not). */
void enter_check_target(const struct spec *s);
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
int cmd_verify(struct spec *s);

/* gate.c: the allow-list gate's addresses (a /30 between the sandbox's eth0 and the gate's gw0)
 * and the ports its nftables rules redirect the sandbox's HTTP, TLS and DNS to. */
#define GATE_ADDR      "10.200.0.1"
#define GATE_SANDBOX   "10.200.0.2"
#define GATE_HTTP_PORT 15080
#define GATE_TLS_PORT  15443
#define GATE_DNS_PORT  15053
/* Binds the gate's sockets in the current network namespace; then gate_serve() never returns.
 * allow: normalized names ("a.b" or "*.b"); dns: the upstream resolver (NULL: slirp4netns's). */
void gate_bind(const struct str_list *allow, const char *dns);
void gate_serve(void) __attribute__((noreturn));

/* netconf.c: network settings in the current network namespace; each returns 0 or an errno. */
/* A veth pair: name here, peer moved into the network namespace of fd peer_netns. */
int net_veth(const char *name, const char *peer, int peer_netns);
/* An IPv4 address and netmask on interface ifname, which is brought up. */
int net_addr_up(const char *ifname, const char *addr, const char *mask);
/* The default route via gateway. */
int net_default_route(const char *gateway);

/* gate_parse.c: what the gate reads of the sandbox's traffic. Names are written to out buffers
 * of GATE_NAME_MAX + 1 bytes, lower-cased, without a final dot. */
#define GATE_NAME_MAX 253
/* Copies name[0..len) normalized into out; 0 unless it is a plausible host name: labels of
 * 1..63 letters, digits, '-' and '_', one final dot at most. */
int gate_normalize(const char *name, size_t len, char *out);
/* Whether normalized name is in allow: an exact entry, or below a "*.suffix" entry (at any
 * depth, never the suffix itself). */
int gate_listed(const struct str_list *allow, const char *name);
/* DNS response codes the gate answers with (RFC 1035 4.1.1). */
#define GATE_DNS_OK      0
#define GATE_DNS_FORMERR 1
#define GATE_DNS_NOTIMP  4
#define GATE_DNS_REFUSED 5
/* The question name at off of DNS message m, uncompressed: length-prefixed labels of 1..63
 * bytes, at most 255 bytes in all. Writes it normalized to out ("a.b", GATE_NAME_MAX + 1
 * bytes) and the offset after it to *end. Returns GATE_DNS_OK; GATE_DNS_REFUSED if a label
 * holds a byte outside letters, digits, '-' and '_' (a NUL, a dot, a space...) or the name is
 * the root, so it is no host name; GATE_DNS_FORMERR for a compression pointer, a reserved label
 * type, a name longer than 255 bytes or one past the message's end (structure is checked
 * first: FORMERR wins over REFUSED). Never truncates. */
int gate_dns_qname(const unsigned char *m, int n, int off, char *out, int *end);
/* A query as the gate reads it: the client's id and flags (opcode, RD), the checked name, type
 * and class, and where the question ends in the client's message. */
struct gate_query {
    unsigned id, flags;
    char name[GATE_NAME_MAX + 1];
    unsigned qtype, qclass;
    int qend;
};
/* Reads DNS query q: -1 if it is no query to answer (shorter than a header, or QR set);
 * GATE_DNS_NOTIMP for an opcode other than QUERY; GATE_DNS_FORMERR unless it holds exactly one
 * question, no answer or authority records and a well-formed name (gate_dns_qname), type and
 * class; GATE_DNS_REFUSED for a name that is no host name or a class other than IN; else
 * GATE_DNS_OK with *out filled. The additional section and trailing bytes are ignored. */
int gate_dns_parse_query(const unsigned char *q, int n, struct gate_query *out);
/* Builds the query the gate sends upstream for normalized name: id, RD, one question (type,
 * class), no other record; returns its length, or -1 if name is not normalized or cap short. */
int gate_dns_build_query(const char *name, unsigned id, unsigned qtype, unsigned qclass,
                         unsigned char *out, size_t cap);
/* Whether m answers the query asked (asked->id, name, qtype, qclass: as gate_dns_build_query
 * sent it): -1 if not (another id, no response, not exactly that one question); else the
 * number of IPv4 addresses (network order, at most max) of its A records (class IN) whose owner
 * is the name asked or a CNAME target reached from it; 0 for an error rcode or a malformed
 * answer section. */
int gate_dns_answer(const unsigned char *m, int n, const struct gate_query *asked, uint32_t *addrs,
                    int max);
/* The host of an HTTP/1 request head (a well-formed request line with an origin-form target,
 * header lines of a token, a colon and visible bytes, exactly one Host header of a host name
 * and an optional port): 1 found, 0 refused, -1 incomplete. */
int gate_http_host(const unsigned char *b, size_t n, char *out);
/* The SNI of a TLS ClientHello record at the start of b (the whole hello in that record,
 * exactly one server_name extension holding exactly one host_name): 1 found, 0 absent or
 * malformed, -1 incomplete. */
int gate_tls_sni(const unsigned char *b, size_t n, char *out);

/* starter.c: the init's starter. chan is the init's end of the channel (a SOCK_SEQPACKET
 * socketpair made by the keeper; the keeper holds the other end and nothing else does); fds 0-2
 * are /dev/null. Serves requests and reaps orphans forever, with every signal blocked (SIGCHLD
 * is read from a signalfd). Never returns. */
void starter_serve(int chan) __attribute__((noreturn));
/* `exec` through the starter (--keeper, --channel): asks the init to start s->argv with env and
 * relays its end. Returns the exit status to exit with (or dies by the command's signal), or -1
 * when the init could not fork (its sandbox at its process limit, or too many commands at once):
 * then the caller starts the command the slow way, from the host side (enter.c). */
int starter_exec(const struct spec *s, char **env);
/* Becomes argv[0] (PATH searched in env for a name without a slash) with env; when that fails
 * and shell is not NULL (argv are plain words of that shell text), `/bin/bash -c shell` instead,
 * so a missing program is reported as bash reports it. Never returns: exits 127 (not found) or
 * 126 with a message on stderr. */
void starter_execute(char **argv, char **env, const char *shell) __attribute__((noreturn));

/* starter_proto.c: the frames of the starter's channel (see there). */
#define STARTER_MAX_FRAME (2u << 20) /* a request: the command and its environment */
#define STARTER_MAX_ARGS  4096
#define STARTER_MAX_ENV   4096
#define STARTER_MAX_PATH  4095 /* the working directory and the program */
#define STARTER_SETSID    1u   /* request flag: the command leads a new session */
#define STARTER_MSG_LEN   12
#define STARTER_STARTED   'P'
#define STARTER_FAILED    'F'
#define STARTER_EXITED    'W'
#define STARTER_SIGNAL    'S'
/* A string of a frame: n bytes at p (inside the frame's buffer), no NUL among them. */
struct starter_str {
    const unsigned char *p;
    uint32_t n;
};
struct starter_req {
    unsigned flags;
    struct starter_str cwd; /* absolute */
    uint32_t argc, envc;    /* argc >= 1 */
    struct starter_str argv[STARTER_MAX_ARGS];
    struct starter_str env[STARTER_MAX_ENV]; /* "NAME=value", NAME not empty */
    struct starter_str shell; /* empty, or the words' shell text (bash -c when they cannot run) */
};
struct starter_msg {
    unsigned kind;
    int32_t value;
};
/* Reads request frame b[0..n) into r (whose strings point into b): 0, or -1 unless it is one
 * well-formed request exactly n bytes long (its declared length, kind 'X', only known flags,
 * an absolute cwd, 1..STARTER_MAX_ARGS arguments with a non-empty program, at most
 * STARTER_MAX_ENV NAME=value entries, a shell text, no NUL anywhere, nothing after). O(n). */
int starter_parse_request(const unsigned char *b, size_t n, struct starter_req *r);
/* Writes the frame of r into out[0..cap) and returns its length; when that exceeds cap nothing
 * usable is written (out may be NULL to ask for the length). */
size_t starter_encode_request(const struct starter_req *r, unsigned char *out, size_t cap);
/* Whether env entry e is NAME=value with a non-empty NAME. */
int starter_env_ok(const struct starter_str *e);
/* Reads a message (STARTER_MSG_LEN bytes, a known kind, a value that kind may carry: a pid
 * above 1, an errno 1..4095, a signal 1..64, a wait status of an end): 0, or -1. */
int starter_parse_msg(const unsigned char *b, size_t n, struct starter_msg *m);
/* Writes a message; -1 (nothing written) when the value is not one kind may carry. */
int starter_encode_msg(unsigned kind, int32_t value, unsigned char out[STARTER_MSG_LEN]);

#endif
