/*
 * main.c — moonbox-sandbox's entry: the command line, dispatch and the error convention.
 *
 *   moonbox-sandbox start   --id=ID --root=DIR --upper=DIR --work=DIR [--layer=DIR]...
 *                           [--base=DIR] --slots=DIR --slot-hint=N --id-base=N --slot-count=N
 *                           [--cgroup=DIR]... [--freezer=DIR] --net=none|slirp|allowlist
 *                           [--slirp=PATH] [--resolv=TEXT] [--hosts=TEXT]
 *                           [--allow=NAME]... [--dns=IPV4] [--nft=PATH]
 *   moonbox-sandbox exec    --target=PID --uid-base=N [--cgroup=DIR]... [--join-in-child]
 *                           [--cwd=DIR] [--setsid] [--keeper=PID --channel=FD] [--shell=TEXT]
 *                           -- PROGRAM ARG...          (environment: MBENV_NAME=VALUE)
 *   moonbox-sandbox files   --target=PID --uid-base=N [--cgroup=DIR]... [--join-in-child]
 *                           --op=OP --path=PATH
 *                           [--mode=OCTAL] [--depth=N] [--follow] [--exclude=NAME]...
 *   moonbox-sandbox capture --src=UPPER --dst=LAYER --uid-base=N
 *   moonbox-sandbox verify  --layer=LAYER --manifest=FILE [--quick]
 *
 * Options are --key=value words so that a value may hold anything but a NUL; the engine
 * (lua/moonbox/local/engine/init.lua) builds them and nothing else is expected to. Secrets never
 * travel in arguments (host users can read them in ps): a sandbox's environment comes as
 * MBENV_-prefixed variables of this process, which only root and the sandbox itself can see,
 * and which the prefix keeps from meaning anything to this program's own libc.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sandbox.h"

/* The exit status of die() and fail_msg(): EXIT_HELPER, but 2 for verify (its usage and I/O
 * errors; see cmd_verify). */
static int helper_exit = EXIT_HELPER;

void die(const char *step, const char *what, int err)
{
    fprintf(stderr, "moonbox-sandbox: %s%s%s: %s\n", step, what ? " " : "", what ? what : "",
            strerror(err));
    exit(helper_exit);
}

void say(const char *head, const char *fmt, va_list ap)
{
    fputs(head, stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
}

void fail_msg(const char *step, const char *fmt, ...)
{
    char head[256];
    snprintf(head, sizeof head, "moonbox-sandbox: %s: ", step);
    va_list ap;
    va_start(ap, fmt);
    say(head, fmt, ap);
    va_end(ap);
    exit(helper_exit);
}

int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return errno;
    int e = write_all(fd, text, strlen(text));
    if (close(fd) < 0 && !e) e = errno;
    return e;
}

static void add(struct str_list *l, const char *v, const char *key)
{
    if (l->n == MAX_LIST) fail_msg("arguments", "more than %d --%s options", MAX_LIST, key);
    l->v[l->n++] = v;
}

static long number(const char *key, const char *v)
{
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (errno || end == v || *end || n < 0)
        fail_msg("arguments", "--%s wants a number, got '%s'", key, v);
    return n;
}

/* Fills s from argv: argv[1] is the command; then --key=value words (each value any string
 * but a NUL; repeatable keys such as --layer, --cgroup, --allow, --exclude accumulate), the
 * flags --setsid, --join-in-child, --follow and --quick, and "--" after which the rest is the
 * program and its arguments. Numbers are checked (number()). An unknown option, a word that is not
 * --key=value, or a bad number exits through fail_msg naming it; nothing is returned half-parsed. s
 * points into argv, which must outlive it. */
static void parse(struct spec *s, int argc, char **argv)
{
    memset(s, 0, sizeof *s);
    s->cmd = argv[1];
    s->depth = 1;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            s->argv = argv + i + 1;
            return;
        }
        if (strcmp(a, "--join-in-child") == 0) {
            s->join_in_child = 1;
            continue;
        }
        if (strcmp(a, "--setsid") == 0) {
            s->setsid = 1;
            continue;
        }
        if (strcmp(a, "--follow") == 0) {
            s->follow = 1;
            continue;
        }
        if (strcmp(a, "--quick") == 0) {
            s->quick = 1;
            continue;
        }
        const char *eq = strchr(a, '=');
        if (strncmp(a, "--", 2) != 0 || !eq) fail_msg("arguments", "unexpected argument '%s'", a);
        size_t kl = (size_t)(eq - a - 2);
        const char *k = a + 2, *v = eq + 1;
#define KEY(name) (kl == strlen(name) && strncmp(k, name, kl) == 0)
        if (KEY("id"))
            s->id = v;
        else if (KEY("root"))
            s->root = v;
        else if (KEY("upper"))
            s->upper = v;
        else if (KEY("work"))
            s->work = v;
        else if (KEY("layer"))
            add(&s->layers, v, "layer");
        else if (KEY("base"))
            s->base = v;
        else if (KEY("slots"))
            s->slots = v;
        else if (KEY("slot-hint"))
            s->slot_hint = number("slot-hint", v);
        else if (KEY("slot-count"))
            s->slot_count = number("slot-count", v);
        else if (KEY("id-base"))
            s->id_base = (unsigned long)number("id-base", v);
        else if (KEY("cgroup"))
            add(&s->cgroups, v, "cgroup");
        else if (KEY("freezer"))
            s->freezer = v;
        else if (KEY("net"))
            s->net = v;
        else if (KEY("slirp"))
            s->slirp = v;
        else if (KEY("allow"))
            add(&s->allow, v, "allow");
        else if (KEY("dns"))
            s->dns = v;
        else if (KEY("nft"))
            s->nft = v;
        else if (KEY("resolv"))
            s->resolv = v;
        else if (KEY("hosts"))
            s->hosts = v;
        else if (KEY("target"))
            s->target = (pid_t)number("target", v);
        else if (KEY("uid-base"))
            s->uid_base = (unsigned long)number("uid-base", v);
        else if (KEY("keeper"))
            s->keeper = (pid_t)number("keeper", v);
        else if (KEY("channel"))
            s->channel = number("channel", v);
        else if (KEY("shell"))
            s->shell = v;
        else if (KEY("cwd"))
            s->cwd = v;
        else if (KEY("op"))
            s->op = v;
        else if (KEY("path"))
            s->path = v;
        else if (KEY("mode"))
            s->mode = v;
        else if (KEY("depth"))
            s->depth = number("depth", v);
        else if (KEY("max-bytes"))
            s->max_bytes = (unsigned long long)number("max-bytes", v);
        else if (KEY("exclude"))
            add(&s->excludes, v, "exclude");
        else if (KEY("src"))
            s->src = v;
        else if (KEY("dst"))
            s->dst = v;
        else if (KEY("manifest"))
            s->manifest = v;
        else
            fail_msg("arguments", "unknown option '%.*s'", (int)kl + 2, a);
#undef KEY
    }
}

int main(int argc, char **argv)
{
    if (argc < 2)
        fail_msg("arguments",
                 "usage: moonbox-sandbox start|exec|files|capture|verify --key=value...");
    if (strcmp(argv[1], "verify") == 0) helper_exit = 2;
    struct spec s;
    parse(&s, argc, argv);
    if (strcmp(s.cmd, "start") == 0) return cmd_start(&s, argc, argv);
    enter_set_args(argc, argv);
    if (strcmp(s.cmd, "exec") == 0) return cmd_exec(&s);
    if (strcmp(s.cmd, "files") == 0) return cmd_files(&s);
    if (strcmp(s.cmd, "capture") == 0) return cmd_capture(&s);
    if (strcmp(s.cmd, "verify") == 0) return cmd_verify(&s);
    fail_msg("arguments", "unknown command '%s'", s.cmd);
}
