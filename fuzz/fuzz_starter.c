/* fuzz_starter.c - libFuzzer target for tools/sandbox/starter_proto.c, the frames of the
 * starter's channel: the requests a sandbox's init reads before it starts a command, and the
 * messages the init and the exec helper exchange.
 *
 * Input layout: byte 0 picks the mode (mod 3); the rest is the input. Checked besides memory
 * safety (ASan, UBSan):
 *   0 raw request: the parser agrees with a reference decoder written here the slow way (a
 *     bounds-checked cursor, every rule restated); an accepted frame re-encodes to exactly its
 *     own bytes (one encoding per request), no string it returns holds a NUL or lies outside
 *     the input, and every strict prefix of it is refused;
 *   1 built request: the input read as a recipe (flags, a cwd, words, env entries, a shell text),
 *     encoded, must parse back to the same fields, and be refused once any byte of its header
 *     says another length;
 *   2 messages: the parser takes exactly the 12-byte messages whose kind and value the rules
 *     allow (restated here), and what it takes re-encodes to the same bytes.
 */
#include "sandbox.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- the reference decoder ----------------------------------------------------------------- */

struct cursor {
    const uint8_t *b;
    size_t n, at;
    int bad;
};

static uint32_t ref_u32(struct cursor *c)
{
    if (c->bad || c->n - c->at < 4) {
        c->bad = 1;
        return 0;
    }
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = v << 8 | c->b[c->at + (size_t)i];
    c->at += 4;
    return v;
}

/* A string: its length, then its bytes, none a NUL. Returns its length (or 0 when bad). */
static uint32_t ref_str(struct cursor *c, size_t *start)
{
    uint32_t len = ref_u32(c);
    if (c->bad || len > c->n - c->at) {
        c->bad = 1;
        return 0;
    }
    for (uint32_t i = 0; i < len; i++)
        if (c->b[c->at + i] == 0) c->bad = 1;
    *start = c->at;
    c->at += len;
    return len;
}

static int ref_accepts(const uint8_t *b, size_t n)
{
    if (n < 8 || n > STARTER_MAX_FRAME) return 0;
    struct cursor c = {b, n, 0, 0};
    if (ref_u32(&c) != n) return 0;
    if (b[4] != 'X' || (b[5] | 1) != 1 || b[6] != 0 || b[7] != 0) return 0;
    c.at = 8;
    size_t at;
    uint32_t cwd = ref_str(&c, &at);
    if (c.bad || cwd == 0 || cwd > STARTER_MAX_PATH || b[at] != '/') return 0;
    uint32_t argc = ref_u32(&c);
    if (c.bad || argc == 0 || argc > STARTER_MAX_ARGS) return 0;
    for (uint32_t i = 0; i < argc; i++) {
        uint32_t len = ref_str(&c, &at);
        if (c.bad) return 0;
        if (i == 0 && (len == 0 || len > STARTER_MAX_PATH)) return 0;
    }
    uint32_t envc = ref_u32(&c);
    if (c.bad || envc > STARTER_MAX_ENV) return 0;
    for (uint32_t i = 0; i < envc; i++) {
        uint32_t len = ref_str(&c, &at);
        if (c.bad) return 0;
        uint32_t eq = 0;
        while (eq < len && b[at + eq] != '=')
            eq++;
        if (eq == 0 || eq == len) return 0; /* NAME=value, NAME not empty */
    }
    ref_str(&c, &at);
    return !c.bad && c.at == n;
}

static int ref_msg_ok(const uint8_t *b, size_t n)
{
    if (n != 12) return 0;
    uint32_t len =
        (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    int32_t v = (int32_t)((uint32_t)b[8] | (uint32_t)b[9] << 8 | (uint32_t)b[10] << 16 |
                          (uint32_t)b[11] << 24);
    if (len != 12 || b[5] || b[6] || b[7]) return 0;
    switch (b[4]) {
    case 'P':
        return v > 1;
    case 'F':
        return v > 0 && v < 4096;
    case 'S':
        return v > 0 && v <= 64;
    case 'W': {
        if (v < 0 || v > 0xffff) return 0;
        int low = v & 0x7f, high = (v >> 8) & 0xff, core = v & 0x80;
        if (low == 0 && !core) return 1;             /* exited with status high */
        return high == 0 && low != 0 && low != 0x7f; /* killed by signal low */
    }
    default:
        return 0;
    }
}

/* ---- the checks ---------------------------------------------------------------------------- */

static struct starter_req req, again;

static void check_strings_inside(const struct starter_req *r, const uint8_t *b, size_t n)
{
    const struct starter_str *all[] = {&r->cwd, &r->shell};
    for (size_t i = 0; i < 2; i++)
        if (all[i]->p < b || all[i]->p + all[i]->n > b + n || memchr(all[i]->p, 0, all[i]->n))
            abort();
    for (uint32_t i = 0; i < r->argc; i++)
        if (r->argv[i].p < b || r->argv[i].p + r->argv[i].n > b + n ||
            memchr(r->argv[i].p, 0, r->argv[i].n))
            abort();
    for (uint32_t i = 0; i < r->envc; i++)
        if (!starter_env_ok(&r->env[i]) || memchr(r->env[i].p, 0, r->env[i].n)) abort();
}

static int same_str(const struct starter_str *a, const struct starter_str *b)
{
    return a->n == b->n && (a->n == 0 || memcmp(a->p, b->p, a->n) == 0);
}

static int same_req(const struct starter_req *a, const struct starter_req *b)
{
    if (a->flags != b->flags || a->argc != b->argc || a->envc != b->envc) return 0;
    if (!same_str(&a->cwd, &b->cwd) || !same_str(&a->shell, &b->shell)) return 0;
    for (uint32_t i = 0; i < a->argc; i++)
        if (!same_str(&a->argv[i], &b->argv[i])) return 0;
    for (uint32_t i = 0; i < a->envc; i++)
        if (!same_str(&a->env[i], &b->env[i])) return 0;
    return 1;
}

static void raw_request(const uint8_t *b, size_t n)
{
    int ok = starter_parse_request(b, n, &req) == 0;
    if (ok != ref_accepts(b, n)) abort();
    if (!ok) return;
    check_strings_inside(&req, b, n);
    uint8_t *out = malloc(n);
    if (!out) return;
    if (starter_encode_request(&req, out, n) != n || memcmp(out, b, n) != 0) abort();
    free(out);
    for (size_t k = 0; k < n; k++)
        if (starter_parse_request(b, k, &again) == 0) abort();
}

/* Reads the input as a recipe: a flags byte, then strings separated by 0xff bytes: the cwd,
 * then words until a 0xfe byte, then env entries until another 0xfe, then the shell text. */
static void built_request(const uint8_t *b, size_t n)
{
    if (n == 0) return;
    memset(&req, 0, sizeof req);
    req.flags = b[0] & 1;
    size_t at = 1, part = 0;
    while (at <= n) {
        size_t end = at;
        while (end < n && b[end] != 0xff && b[end] != 0xfe)
            end++;
        struct starter_str s = {b + at, (uint32_t)(end - at)};
        if (part == 0)
            req.cwd = s;
        else if (part == 1 && req.argc < STARTER_MAX_ARGS)
            req.argv[req.argc++] = s;
        else if (part == 2 && req.envc < STARTER_MAX_ENV)
            req.env[req.envc++] = s;
        else if (part == 3)
            req.shell = s;
        if (part == 0 || (end < n && b[end] == 0xfe)) part++;
        at = end + 1;
    }
    size_t len = starter_encode_request(&req, NULL, 0);
    uint8_t *out = malloc(len);
    if (!out) return;
    if (starter_encode_request(&req, out, len) != len) abort();
    /* fields the parser refuses are the recipe's problem; the reference says which */
    int ok = starter_parse_request(out, len, &again) == 0;
    if (ok != ref_accepts(out, len)) abort();
    if (ok && !same_req(&req, &again)) abort();
    if (ok) {
        for (int i = 0; i < 4; i++) {
            out[i] ^= 0x01;
            if (starter_parse_request(out, len, &again) == 0) abort();
            out[i] ^= 0x01;
        }
    }
    free(out);
}

static void messages(const uint8_t *b, size_t n)
{
    struct starter_msg m;
    int ok = starter_parse_msg(b, n, &m) == 0;
    if (ok != ref_msg_ok(b, n)) abort();
    if (!ok) return;
    uint8_t out[STARTER_MSG_LEN];
    if (starter_encode_msg(m.kind, m.value, out) != 0 || memcmp(out, b, sizeof out) != 0) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > STARTER_MAX_FRAME) return 0;
    switch (data[0] % 3) {
    case 0:
        raw_request(data + 1, size - 1);
        break;
    case 1:
        built_request(data + 1, size - 1);
        break;
    default:
        messages(data + 1, size - 1);
        break;
    }
    return 0;
}
