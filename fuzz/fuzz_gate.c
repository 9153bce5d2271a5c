/* fuzz_gate.c - libFuzzer target for tools/sandbox/gate_parse.c, the parsers of the allow-list
 * gate, which read bytes a sandbox sends (HTTP request heads, TLS ClientHellos, DNS queries) and
 * bytes its upstream resolver answers.
 *
 * Input layout: byte 0 picks the parser (mod 6), bytes 1-2 (big-endian) a split position or a
 * choice; the rest is the input. Checked besides memory safety (ASan, UBSan):
 *   - every parser agrees with a reference decoder written here, separately and the slow way
 *     (a DNS name as a list of labels, a request head as a list of lines, a ClientHello through
 *     a bounds-checked reader): the same accept/refuse (and DNS rcode) and the same name;
 *   - every name a parser returns is normalized: 1..253 bytes, labels of 1..63 [a-z0-9_-]
 *     joined by single dots, no final dot;
 *   - the HTTP and TLS parsers decide on a prefix as on the whole (the gate decides as soon as
 *     it can, on what it has read so far);
 *   - a query the gate accepts, rebuilt (gate_dns_build_query), is the client's question in
 *     lower case and reads back the same; an answer made for it is taken, with its address,
 *     directly or through a CNAME; the answer parser takes exactly the answers to the question
 *     asked and returns only addresses present in the message;
 *   - gate_listed agrees with a naive restatement of the matching rules.
 */
#include "sandbox.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- the reference decoders ---------------------------------------------------------------- */

static int ref_host_byte(uint8_t c)
{
    if (c == '-' || c == '_') return 1;
    if (c >= '0' && c <= '9') return 1;
    c |= 0x20;
    return c >= 'a' && c <= 'z';
}

static char ref_lower(uint8_t c)
{
    return (char)(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
}

/* A host name as text: one final dot dropped, 1..253 bytes, dot-separated labels of 1..63. */
static int ref_normalize(const uint8_t *s, size_t len, char *out)
{
    if (len && s[len - 1] == '.') len--;
    if (len == 0 || len > GATE_NAME_MAX) return 0;
    size_t start = 0;
    for (size_t i = 0; i <= len; i++) {
        if (i < len && s[i] != '.') continue;
        size_t l = i - start;
        if (l == 0 || l > 63) return 0;
        for (size_t k = start; k < i; k++) {
            if (!ref_host_byte(s[k])) return 0;
            out[k] = ref_lower(s[k]);
        }
        if (i < len) out[i] = '.';
        start = i + 1;
    }
    out[len] = 0;
    return 1;
}

/* A question name: first its structure (labels, bounds, 255 bytes), then its bytes. */
static int ref_qname(const uint8_t *m, size_t n, size_t off, char *out, size_t *end)
{
    size_t labels[128], nl = 0, p = off, wire = 1;
    for (;;) {
        if (p >= n) return GATE_DNS_FORMERR;
        uint8_t l = m[p];
        if (l == 0) break;
        if (l >= 64) return GATE_DNS_FORMERR;
        if (p + 1 + l > n) return GATE_DNS_FORMERR;
        wire += 1 + (size_t)l;
        if (wire > 255) return GATE_DNS_FORMERR;
        labels[nl++] = p;
        p += 1 + (size_t)l;
    }
    *end = p + 1;
    if (nl == 0) return GATE_DNS_REFUSED;
    size_t o = 0;
    for (size_t i = 0; i < nl; i++) {
        if (i) out[o++] = '.';
        for (size_t k = 0; k < m[labels[i]]; k++) {
            uint8_t c = m[labels[i] + 1 + k];
            if (!ref_host_byte(c)) return GATE_DNS_REFUSED;
            out[o++] = ref_lower(c);
        }
    }
    out[o] = 0;
    return GATE_DNS_OK;
}

static unsigned be16(const uint8_t *p)
{
    return ((unsigned)p[0] << 8) | p[1];
}

static int ref_parse_query(const uint8_t *q, size_t n, char *name, unsigned *qtype,
                           unsigned *qclass, size_t *qend)
{
    if (n < 12 || (q[2] & 0x80)) return -1;
    if (((q[2] >> 3) & 0x0f) != 0) return GATE_DNS_NOTIMP;
    if (be16(q + 4) != 1 || be16(q + 6) != 0 || be16(q + 8) != 0) return GATE_DNS_FORMERR;
    size_t end;
    int r = ref_qname(q, n, 12, name, &end);
    if (r == GATE_DNS_FORMERR || end + 4 > n) return GATE_DNS_FORMERR;
    *qtype = be16(q + end);
    *qclass = be16(q + end + 2);
    *qend = end + 4;
    if (r != GATE_DNS_OK) return r;
    return *qclass == 1 ? GATE_DNS_OK : GATE_DNS_REFUSED;
}

static int ref_tchar(uint8_t c)
{
    static const char extra[] = "!#$%&'*+-.^_`|~";
    if ((c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z')) return 1;
    for (const char *e = extra; *e; e++)
        if (c == (uint8_t)*e) return 1;
    return 0;
}

static int ref_http_host(const uint8_t *b, size_t n, char *out)
{
    size_t stop = 0;
    for (;; stop++) {
        if (stop + 4 > n) return -1;
        if (memcmp(b + stop, "\r\n\r\n", 4) == 0) break;
    }
    /* the lines of the head, each without its CRLF */
    size_t starts[4096], lens[4096], nlines = 0, s = 0;
    for (size_t i = 0; i + 1 < stop + 2; i++)
        if (b[i] == '\r' && b[i + 1] == '\n') {
            if (nlines == 4096) return 0;
            starts[nlines] = s;
            lens[nlines++] = i - s;
            s = i + 2;
            i++;
        }
    /* request line: token SP target SP HTTP/1.D, the target "/..." or "*" */
    const uint8_t *l = b + starts[0];
    size_t ll = lens[0], sp1 = 0, sp2 = 0, spaces = 0;
    for (size_t i = 0; i < ll; i++) {
        if (l[i] < 0x20 || l[i] == 0x7f) return 0;
        if (l[i] == ' ') {
            if (++spaces == 1)
                sp1 = i;
            else if (spaces == 2)
                sp2 = i;
            else
                return 0;
        }
    }
    if (spaces != 2 || sp1 == 0 || sp2 == sp1 + 1) return 0;
    for (size_t i = 0; i < sp1; i++)
        if (!ref_tchar(l[i])) return 0;
    if (!(l[sp1 + 1] == '/' || (l[sp1 + 1] == '*' && sp2 == sp1 + 2))) return 0;
    if (ll - sp2 - 1 != 8 || memcmp(l + sp2 + 1, "HTTP/1.", 7) != 0 || l[ll - 1] < '0' ||
        l[ll - 1] > '9')
        return 0;
    int found = 0;
    for (size_t k = 1; k < nlines; k++) {
        const uint8_t *h = b + starts[k];
        size_t hl = lens[k], colon = 0;
        while (colon < hl && h[colon] != ':')
            colon++;
        if (colon == 0 || colon == hl) return 0;
        for (size_t i = 0; i < colon; i++)
            if (!ref_tchar(h[i])) return 0;
        for (size_t i = colon + 1; i < hl; i++)
            if (h[i] != '\t' && (h[i] < 0x20 || h[i] == 0x7f)) return 0;
        if (colon != 4 || (h[0] | 0x20) != 'h' || (h[1] | 0x20) != 'o' || (h[2] | 0x20) != 's' ||
            (h[3] | 0x20) != 't')
            continue;
        if (found) return 0;
        size_t v = colon + 1, e = hl;
        while (v < e && (h[v] == ' ' || h[v] == '\t'))
            v++;
        while (e > v && (h[e - 1] == ' ' || h[e - 1] == '\t'))
            e--;
        size_t c = v;
        while (c < e && h[c] != ':')
            c++;
        if (c < e) {
            if (e - c - 1 < 1 || e - c - 1 > 5) return 0;
            for (size_t i = c + 1; i < e; i++)
                if (h[i] < '0' || h[i] > '9') return 0;
        }
        if (!ref_normalize(h + v, c - v, out)) return 0;
        found = 1;
    }
    return found;
}

struct reader {
    const uint8_t *p;
    size_t n;
    int ok;
};

static unsigned rd_num(struct reader *r, int bytes)
{
    unsigned v = 0;
    if (!r->ok || r->n < (size_t)bytes) {
        r->ok = 0;
        return 0;
    }
    for (int i = 0; i < bytes; i++)
        v = (v << 8) | r->p[i];
    r->p += bytes;
    r->n -= (size_t)bytes;
    return v;
}

static struct reader rd_sub(struct reader *r, size_t len)
{
    struct reader s = {r->p, len, r->ok && r->n >= len};
    if (!s.ok) {
        r->ok = 0;
        s.n = 0;
        return s;
    }
    r->p += len;
    r->n -= len;
    return s;
}

static int ref_tls_sni(const uint8_t *b, size_t n, char *out)
{
    if (n < 5) return -1;
    if (b[0] != 0x16) return 0;
    size_t rec = be16(b + 3);
    if (n < 5 + rec) return -1;
    struct reader r = {b + 5, rec, 1};
    if (rd_num(&r, 1) != 1) return 0;
    size_t hl = rd_num(&r, 3);
    struct reader h = rd_sub(&r, hl);
    rd_sub(&h, 34);
    rd_sub(&h, rd_num(&h, 1));
    rd_sub(&h, rd_num(&h, 2));
    rd_sub(&h, rd_num(&h, 1));
    struct reader e = rd_sub(&h, rd_num(&h, 2));
    if (!h.ok || !e.ok || h.n != 0) return 0;
    int found = 0;
    while (e.n > 0) {
        unsigned type = rd_num(&e, 2);
        struct reader x = rd_sub(&e, rd_num(&e, 2));
        if (!e.ok) return 0;
        if (type != 0) continue;
        if (found) return 0;
        struct reader list = rd_sub(&x, rd_num(&x, 2));
        if (!x.ok || x.n != 0) return 0;
        if (rd_num(&list, 1) != 0) return 0;
        struct reader name = rd_sub(&list, rd_num(&list, 2));
        if (!list.ok || list.n != 0) return 0;
        if (!ref_normalize(name.p, name.n, out)) return 0;
        found = 1;
    }
    return found;
}

/* ---- checks -----------------------------------------------------------------------------------
 */

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

static void check_head(head_parser parse, head_parser ref, const unsigned char *b, size_t n,
                       size_t split)
{
    char whole[GATE_NAME_MAX + 1], part[GATE_NAME_MAX + 1], want[GATE_NAME_MAX + 1];
    int r = parse(b, n, whole);
    if (r < -1 || r > 1) abort();
    if (r == 1) check_name(whole);
    int w = ref(b, n, want);
    if (w != r || (r == 1 && strcmp(want, whole) != 0)) abort();
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

static void check_query(const uint8_t *b, size_t n, size_t split)
{
    if (n > 65535) return;
    struct gate_query gq;
    char want[GATE_NAME_MAX + 2];
    unsigned qtype = 0, qclass = 0;
    size_t qend = 0;
    int r = gate_dns_parse_query(b, (int)n, &gq);
    int w = ref_parse_query(b, n, want, &qtype, &qclass, &qend);
    if (r != w) abort();
    if (r != GATE_DNS_OK) return;
    check_name(gq.name);
    if (strcmp(gq.name, want) != 0 || gq.qtype != qtype || gq.qclass != qclass ||
        gq.qend != (int)qend)
        abort();
    /* rebuilt: the client's question, lower-cased, after a fresh header */
    unsigned char q[12 + 256 + 4 + 64];
    int len = gate_dns_build_query(gq.name, (unsigned)split, gq.qtype, gq.qclass, q, 12 + 256 + 4);
    if (len != 12 + gq.qend - 12) abort();
    for (int i = 12; i < gq.qend; i++) /* the name lower-cased, its type and class as sent */
        if ((i < gq.qend - 4 ? (unsigned char)ref_lower(b[i]) : b[i]) != q[i]) abort();
    struct gate_query again;
    if (gate_dns_parse_query(q, len, &again) != GATE_DNS_OK || strcmp(again.name, gq.name) != 0 ||
        again.id != (split & 0xffff))
        abort();
    /* an answer for it, directly and through a CNAME, is taken with its address */
    uint32_t addr = 0x0a000001u ^ (uint32_t)split, got[4];
    unsigned char a[sizeof q + 64];
    memcpy(a, q, (size_t)len);
    a[2] |= 0x80;
    a[7] = 1;
    static const unsigned char rr[] = {0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4};
    memcpy(a + len, rr, sizeof rr);
    memcpy(a + len + sizeof rr, &addr, 4);
    if (gate_dns_answer(a, len + (int)sizeof rr + 4, &again, got, 4) != 1 || got[0] != addr)
        abort();
    static const unsigned char cname[] = {0xc0, 0x0c, 0, 5,   0, 1,   0,   0,   0,   60,
                                          0,    8,    1, 'x', 4, 't', 'e', 's', 't', 0};
    static const unsigned char target[] = {1, 'x', 4, 't', 'e', 's', 't', 0, 0,
                                           1, 0,   1, 0,   0,   0,   60,  0, 4};
    a[7] = 2;
    memcpy(a + len, cname, sizeof cname);
    memcpy(a + len + sizeof cname, target, sizeof target);
    memcpy(a + len + sizeof cname + sizeof target, &addr, 4);
    int total = len + (int)sizeof cname + (int)sizeof target + 4;
    if (gate_dns_answer(a, total, &again, got, 4) != 1 || got[0] != addr) abort();
    /* and never for another id */
    again.id ^= 1;
    if (gate_dns_answer(a, total, &again, got, 4) != -1) abort();
}

static void check_answer(const uint8_t *b, size_t n, size_t split)
{
    if (n > 65535) return;
    struct gate_query asked = {.qtype = 1, .qclass = 1};
    size_t end = 0;
    strcpy(asked.name, "a.test");
    if (n >= 12) {
        asked.id = (split & 1) ? be16(b) : (unsigned)split;
        char name[GATE_NAME_MAX + 2];
        if (ref_qname(b, n, 12, name, &end) == GATE_DNS_OK && end + 4 <= n) {
            strcpy(asked.name, name);
            asked.qtype = (split & 2) ? be16(b + end) : 1;
            asked.qclass = (split & 4) ? be16(b + end + 2) : 1;
        }
    }
    uint32_t addrs[4];
    int got = gate_dns_answer(b, (int)n, &asked, addrs, 4);
    if (got < -1 || got > 4) abort();
    char name[GATE_NAME_MAX + 2];
    int match = n >= 12 && (b[2] & 0x80) && ((b[2] >> 3) & 0x0f) == 0 && be16(b) == asked.id &&
                be16(b + 4) == 1 && ref_qname(b, n, 12, name, &end) == GATE_DNS_OK &&
                end + 4 <= n && strcmp(name, asked.name) == 0 && be16(b + end) == asked.qtype &&
                be16(b + end + 2) == asked.qclass;
    if (match != (got >= 0)) abort();
    for (int i = 0; i < got; i++)
        if (!memmem(b, n, &addrs[i], 4)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 3) return 0;
    int which = data[0] % 6;
    size_t split = ((size_t)data[1] << 8) | data[2];
    const unsigned char *b = data + 3;
    size_t n = size - 3;
    char name[GATE_NAME_MAX + 1], want[GATE_NAME_MAX + 1];
    switch (which) {
    case 0:
        check_head(gate_http_host, ref_http_host, b, n, split);
        break;
    case 1:
        check_head(gate_tls_sni, ref_tls_sni, b, n, split);
        break;
    case 2:
        check_query(b, n, split);
        break;
    case 3:
        check_answer(b, n, split);
        break;
    case 4: {
        int r = gate_normalize((const char *)b, n, name);
        if (r != ref_normalize(b, n, want) || (r && strcmp(name, want) != 0)) abort();
        if (r) check_name(name);
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
