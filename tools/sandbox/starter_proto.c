/*
 * starter_proto.c — the frames of the starter's channel: what the server's exec helper
 * (`moonbox-sandbox exec`, host side) and a sandbox's init (the starter, inside) say to each
 * other. Pure functions, no I/O, fuzzed by fuzz/fuzz_starter.c.
 *
 * Every frame starts with its own length (u32, little-endian) and a kind byte; a frame is one
 * SOCK_SEQPACKET message, and a message whose length is not the length it declares is refused,
 * so a frame is never read from part of a message or from two. Integers are little-endian,
 * strings a u32 length and that many bytes, never NUL-terminated on the wire and never holding a
 * NUL (they become C strings inside). The encoding is canonical: a frame the parser accepts is
 * exactly what the encoder makes of what it parsed (the fuzz target checks both directions), so
 * there is one way to say each thing and no slack for two readers to disagree about.
 *
 *   request  (helper -> init, with 4 descriptors: stdin, stdout, stderr, the reply socket)
 *     u32 len | 'X' | u8 flags (STARTER_SETSID) | u16 0 | str cwd | u32 argc | str arg... |
 *     u32 envc | str env... | str shell
 *     (shell: empty, or the command's shell text, run by /bin/bash -c when the words cannot be
 *     executed themselves: see starter.c)
 *   message  (12 bytes, on the reply socket, either way)
 *     u32 12 | kind | 3 x 0 | i32 value
 *       'P' started: the command's pid inside      'F' not started: an errno
 *       'W' ended: its wait status                 'S' helper -> init: deliver signal value
 */
#include <string.h>

#include "sandbox.h"

static uint32_t get32(const unsigned char *b)
{
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

static void put32(unsigned char *b, uint32_t v)
{
    b[0] = (unsigned char)v;
    b[1] = (unsigned char)(v >> 8);
    b[2] = (unsigned char)(v >> 16);
    b[3] = (unsigned char)(v >> 24);
}

/* Reads a string at *off of b[0..n): its length must fit what is left and its bytes hold no
 * NUL. Advances *off; 0, or -1 refused. */
static int get_str(const unsigned char *b, size_t n, size_t *off, struct starter_str *out)
{
    if (n - *off < 4) return -1;
    uint32_t len = get32(b + *off);
    *off += 4;
    if (len > n - *off || memchr(b + *off, 0, len)) return -1;
    out->p = b + *off;
    out->n = len;
    *off += len;
    return 0;
}

/* Reads a count at *off: at most max. 0, or -1 refused. */
static int get_count(const unsigned char *b, size_t n, size_t *off, uint32_t max, uint32_t *out)
{
    if (n - *off < 4) return -1;
    *out = get32(b + *off);
    *off += 4;
    return *out <= max ? 0 : -1;
}

int starter_env_ok(const struct starter_str *e)
{
    const unsigned char *eq = memchr(e->p, '=', e->n);
    return eq && eq != e->p;
}

int starter_parse_request(const unsigned char *b, size_t n, struct starter_req *r)
{
    if (n < 8 || n > STARTER_MAX_FRAME || get32(b) != n || b[4] != 'X') return -1;
    if ((b[5] & ~STARTER_SETSID) || b[6] || b[7]) return -1;
    r->flags = b[5];
    size_t off = 8;
    if (get_str(b, n, &off, &r->cwd) < 0) return -1;
    if (r->cwd.n == 0 || r->cwd.n > STARTER_MAX_PATH || r->cwd.p[0] != '/') return -1;
    if (get_count(b, n, &off, STARTER_MAX_ARGS, &r->argc) < 0 || r->argc == 0) return -1;
    for (uint32_t i = 0; i < r->argc; i++)
        if (get_str(b, n, &off, &r->argv[i]) < 0) return -1;
    if (r->argv[0].n == 0 || r->argv[0].n > STARTER_MAX_PATH) return -1;
    if (get_count(b, n, &off, STARTER_MAX_ENV, &r->envc) < 0) return -1;
    for (uint32_t i = 0; i < r->envc; i++)
        if (get_str(b, n, &off, &r->env[i]) < 0 || !starter_env_ok(&r->env[i])) return -1;
    if (get_str(b, n, &off, &r->shell) < 0) return -1;
    return off == n ? 0 : -1;
}

/* Appends a u32 at *off when it fits cap; always advances *off (the size is counted even when
 * it does not fit, so the caller learns how much it needs). */
static void add32(unsigned char *out, size_t cap, size_t *off, uint32_t v)
{
    if (out && *off + 4 <= cap) put32(out + *off, v);
    *off += 4;
}

static void add_str(unsigned char *out, size_t cap, size_t *off, const struct starter_str *s)
{
    add32(out, cap, off, s->n);
    if (out && *off + s->n <= cap && s->n) memcpy(out + *off, s->p, s->n);
    *off += s->n;
}

size_t starter_encode_request(const struct starter_req *r, unsigned char *out, size_t cap)
{
    size_t off = 8;
    add_str(out, cap, &off, &r->cwd);
    add32(out, cap, &off, r->argc);
    for (uint32_t i = 0; i < r->argc; i++)
        add_str(out, cap, &off, &r->argv[i]);
    add32(out, cap, &off, r->envc);
    for (uint32_t i = 0; i < r->envc; i++)
        add_str(out, cap, &off, &r->env[i]);
    add_str(out, cap, &off, &r->shell);
    if (out && off <= cap && cap >= 8 && off <= UINT32_MAX) {
        put32(out, (uint32_t)off);
        out[4] = 'X';
        out[5] = (unsigned char)r->flags;
        out[6] = out[7] = 0;
    }
    return off;
}

/* Whether value is one a message of kind may carry. */
static int msg_value_ok(unsigned kind, int32_t v)
{
    switch (kind) {
    case STARTER_STARTED:
        return v >= 2; /* 1 is the init itself */
    case STARTER_FAILED:
        return v >= 1 && v <= 4095;
    case STARTER_SIGNAL:
        return v >= 1 && v <= 64;
    case STARTER_EXITED:
        /* what wait gives for an end: an exit status (0..255 << 8), or a death by signal 1..126
         * (with the core bit, 0x80); 0x7f would be a stop, which is no end */
        if ((v & ~0xff00) == 0) return 1;
        return (v & ~0xff) == 0 && (v & 0x7f) != 0 && (v & 0x7f) != 0x7f;
    default:
        return 0;
    }
}

int starter_parse_msg(const unsigned char *b, size_t n, struct starter_msg *m)
{
    if (n != STARTER_MSG_LEN || get32(b) != STARTER_MSG_LEN || b[5] || b[6] || b[7]) return -1;
    int32_t v = (int32_t)get32(b + 8);
    if (!msg_value_ok(b[4], v)) return -1;
    m->kind = b[4];
    m->value = v;
    return 0;
}

int starter_encode_msg(unsigned kind, int32_t value, unsigned char out[STARTER_MSG_LEN])
{
    if (!msg_value_ok(kind, value)) return -1;
    put32(out, STARTER_MSG_LEN);
    out[4] = (unsigned char)kind;
    out[5] = out[6] = out[7] = 0;
    put32(out + 8, (uint32_t)value);
    return 0;
}
