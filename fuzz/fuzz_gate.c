/* fuzz_gate.c - libFuzzer target for tools/sandbox/gate_parse.c, the parsers of the allow-list
 * gate, which read bytes a sandbox sends (HTTP request heads, TLS ClientHellos, DNS queries) and
 * bytes its upstream resolver answers.
 *
 * Input layout: byte 0 picks the parser (mod 5), bytes 1-2 (big-endian) a split position; the
 * rest is the input. Checked besides memory safety (ASan, UBSan):
 *   - every name a parser returns is normalized: 1..253 bytes, labels of 1..63 [a-z0-9_-]
 *     joined by single dots, no final dot;
 *   - the HTTP and TLS parsers return -1, 0 or 1, and a decision made on a prefix is the
 *     decision on the whole (the gate decides as soon as it can, on what it has read so far);
 *   - the DNS parsers stay within their bounds (offsets within the message, at most max
 *     addresses);
 *   - gate_listed agrees with a naive restatement of the matching rules.
 */
#include "sandbox.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void check_name(const char *name)
{
    size_t n = strlen(name), label = 0;
    if (n == 0 || n > GATE_NAME_MAX) abort();
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (c == '.') {
            if (label == 0) abort(); /* empty label */
            label = 0;
        } else if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-') {
            if (++label > 63) abort();
        } else {
            abort();
        }
    }
    if (label == 0) abort();
}

typedef int (*head_parser)(const unsigned char *, size_t, char *);

static void check_head(head_parser parse, const unsigned char *b, size_t n, size_t split)
{
    char whole[GATE_NAME_MAX + 1], part[GATE_NAME_MAX + 1];
    int r = parse(b, n, whole);
    if (r < -1 || r > 1) abort();
    if (r == 1) check_name(whole);
    if (split > n) split = n;
    int p = parse(b, split, part);
    if (p < -1 || p > 1) abort();
    if (p != -1 && (p != r || (p == 1 && strcmp(part, whole) != 0))) abort();
}

/* The rules as the docs state them, written the slow way. */
static int naive_listed(const char *const *allow, int count, const char *name)
{
    for (int i = 0; i < count; i++) {
        const char *p = allow[i];
        if (strncmp(p, "*.", 2) == 0) {
            const char *suffix = p + 1; /* ".x" */
            size_t sl = strlen(suffix), nl = strlen(name);
            /* below the suffix: something, then ".x" at the very end */
            if (nl > sl && memcmp(name + nl - sl, suffix, sl) == 0) return 1;
        } else if (strcmp(p, name) == 0) {
            return 1;
        }
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3) return 0;
    int which = data[0] % 5;
    size_t split = ((size_t)data[1] << 8) | data[2];
    const unsigned char *b = data + 3;
    size_t n = size - 3;
    char name[GATE_NAME_MAX + 1];
    switch (which) {
    case 0:
        check_head(gate_http_host, b, n, split);
        break;
    case 1:
        check_head(gate_tls_sni, b, n, split);
        break;
    case 2: {
        unsigned qtype = 0;
        if (n > 65535) return 0;
        int end = gate_dns_question(b, (int)n, name, &qtype);
        if (end > (int)n || qtype > 0xffff) abort();
        if (end >= 0 && name[0]) check_name(name);
        break;
    }
    case 3: {
        uint32_t addrs[4];
        if (n > 65535) return 0;
        int got = gate_dns_addrs(b, (int)n, addrs, 4);
        if (got < 0 || got > 4) abort();
        char small[8];
        int end = gate_dns_name(b, (int)n, (int)(split % (n + 1)), small, sizeof small);
        if (end > (int)n || (end >= 0 && strlen(small) >= sizeof small)) abort();
        break;
    }
    default: {
        /* up to 4 NUL-separated entries, then a name to look up */
        const char *entries[4];
        char *copy = malloc(n + 1);
        if (!copy) return 0;
        memcpy(copy, b, n);
        copy[n] = 0;
        struct str_list allow = {.n = 0};
        char *p = copy, *end = copy + n;
        while (allow.n < 4 && p < end) {
            entries[allow.n] = p;
            allow.v[allow.n++] = p;
            p += strlen(p) + 1;
        }
        if (p < end && gate_normalize(p, strlen(p), name)) {
            check_name(name);
            if (gate_listed(&allow, name) != naive_listed(entries, allow.n, name)) abort();
        }
        free(copy);
    }
    }
    return 0;
}
