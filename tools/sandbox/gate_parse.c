/*
 * gate_parse.c — what the allow-list gate (gate.c) reads of a sandbox's traffic: host names,
 * DNS queries and the answers to the queries it makes, the Host header of an HTTP request
 * head, the SNI of a TLS ClientHello. Every byte comes from code nobody trusts, so each function
 * checks each length against the bytes it has and never reads past them; fuzz/fuzz_gate.c runs
 * them on arbitrary input under ASan and UBSan, against reference decoders of its own. Pure
 * functions: no I/O, no state.
 *
 * Names are never decoded into C strings and then checked: a DNS name is length-prefixed
 * labels, and a label may hold any byte, a NUL or a dot among them, so "allowed.test\0.evil"
 * as a C string is "allowed.test". A question name is refused unless every label is made of
 * host-name bytes only (gate_dns_qname); the gate then asks upstream a query it builds itself
 * from the checked name (gate_dns_build_query), and takes addresses only from an answer to
 * exactly that question (gate_dns_answer). Host and SNI values are checked with their lengths
 * (gate_normalize), never up to a NUL.
 */
#include <string.h>
#include <strings.h>

#include "sandbox.h"

/* The bytes of a host-name label: letters, digits, '-', and '_' (which allowedDomains entries
 * may hold, engine/init.lua check_domain; it is no separator and no wildcard in any syntax the
 * gate or a server reads, so it cannot move a label boundary). */
static int host_byte(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
}

static char lower(unsigned char c)
{
    return (char)(c >= 'A' && c <= 'Z' ? c + 32 : c);
}

int gate_normalize(const char *name, size_t len, char *out)
{
    if (len > 0 && name[len - 1] == '.') len--; /* one final dot: the root */
    if (len == 0 || len > GATE_NAME_MAX) return 0;
    size_t label = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)name[i];
        if (c == '.') {
            if (label == 0) return 0; /* an empty label */
            label = 0;
        } else if (host_byte(c)) {
            if (++label > 63) return 0;
        } else {
            return 0;
        }
        out[i] = lower(c);
    }
    if (label == 0) return 0;
    out[len] = 0;
    return 1;
}

int gate_listed(const struct str_list *allow, const char *name)
{
    size_t n = strlen(name);
    for (int i = 0; i < allow->n; i++) {
        const char *p = allow->v[i];
        if (p[0] == '*' && p[1] == '.') {
            size_t s = strlen(p + 1); /* ".suffix" */
            if (n > s && strcmp(name + n - s, p + 1) == 0) return 1;
        } else if (strcmp(name, p) == 0) {
            return 1;
        }
    }
    return 0;
}

/* ---- DNS ---------------------------------------------------------------------------------------
 */

int gate_dns_qname(const unsigned char *m, int n, int off, char *out, int *end)
{
    int o = 0, bad = 0, start = off;
    for (;;) {
        if (off < 0 || off >= n) return GATE_DNS_FORMERR;
        unsigned l = m[off];
        if (l == 0) break;
        if (l > 63) return GATE_DNS_FORMERR; /* a pointer (0xc0) or a reserved label type */
        if (off + 1 + (int)l > n) return GATE_DNS_FORMERR;
        if (off + 1 + (int)l + 1 - start > 255) return GATE_DNS_FORMERR; /* RFC 1035 2.3.4 */
        if (o > 0) out[o++] = '.';
        for (unsigned i = 0; i < l; i++) {
            unsigned char c = m[off + 1 + (int)i];
            if (!host_byte(c)) bad = 1;
            out[o++] = bad ? '?' : lower(c);
        }
        off += 1 + (int)l;
    }
    out[o] = 0;
    *end = off + 1;
    if (bad || o == 0) return GATE_DNS_REFUSED; /* not a host name: a NUL, a dot, an odd byte */
    return GATE_DNS_OK;
}

int gate_dns_parse_query(const unsigned char *q, int n, struct gate_query *out)
{
    /* a query (QR clear) with a whole header; anything else gets no answer */
    if (n < 12 || (q[2] & 0x80)) return -1;
    memset(out, 0, sizeof *out);
    out->id = (unsigned)((q[0] << 8) | q[1]);
    out->flags = (unsigned)(q[2] & 0x79);    /* opcode and RD, for the reply */
    if (q[2] & 0x78) return GATE_DNS_NOTIMP; /* opcode QUERY only */
    unsigned qd = (unsigned)((q[4] << 8) | q[5]), an = (unsigned)((q[6] << 8) | q[7]),
             ns = (unsigned)((q[8] << 8) | q[9]);
    if (qd != 1 || an != 0 || ns != 0) return GATE_DNS_FORMERR;
    /* the additional section (an EDNS OPT record, say) and any bytes after the question are
     * read no further: the query sent upstream is built from the question alone */
    int end = 0, r = gate_dns_qname(q, n, 12, out->name, &end);
    if (r == GATE_DNS_FORMERR) return r;
    if (end + 4 > n) return GATE_DNS_FORMERR;
    out->qtype = (unsigned)((q[end] << 8) | q[end + 1]);
    out->qclass = (unsigned)((q[end + 2] << 8) | q[end + 3]);
    out->qend = end + 4;
    if (r != GATE_DNS_OK) return r;
    if (out->qclass != 1) return GATE_DNS_REFUSED; /* IN only */
    return GATE_DNS_OK;
}

int gate_dns_build_query(const char *name, unsigned id, unsigned qtype, unsigned qclass,
                         unsigned char *out, size_t cap)
{
    size_t len = strlen(name);
    if (len == 0 || len > GATE_NAME_MAX || cap < 12 + len + 2 + 4) return -1;
    unsigned char *p = out;
    *p++ = (unsigned char)(id >> 8);
    *p++ = (unsigned char)id;
    *p++ = 0x01; /* RD */
    *p++ = 0x00;
    static const unsigned char counts[8] = {0, 1, 0, 0, 0, 0, 0, 0};
    memcpy(p, counts, sizeof counts);
    p += sizeof counts;
    const char *s = name;
    while (*s) {
        const char *dot = strchr(s, '.');
        size_t l = dot ? (size_t)(dot - s) : strlen(s);
        if (l == 0 || l > 63) return -1;
        *p++ = (unsigned char)l;
        memcpy(p, s, l);
        p += l;
        s += l + (dot ? 1 : 0);
        if (dot && !*s) return -1; /* a final dot: normalized names have none */
    }
    *p++ = 0;
    *p++ = (unsigned char)(qtype >> 8);
    *p++ = (unsigned char)qtype;
    *p++ = (unsigned char)(qclass >> 8);
    *p++ = (unsigned char)qclass;
    return (int)(p - out);
}

/* The (possibly compressed) name at off of message m in wire form, uncompressed and with ASCII
 * letters lower-cased, into out (256 bytes); returns the offset after the name where it
 * stands, or -1. A pointer must point before the label that holds it, so every jump goes
 * backwards and the walk ends; the name is at most 255 bytes (RFC 1035 4.1.4, 2.3.4). */
static int wire_name(const unsigned char *m, int n, int off, unsigned char *out, int *outlen)
{
    int o = 0, end = -1;
    for (;;) {
        if (off < 0 || off >= n) return -1;
        unsigned l = m[off];
        if ((l & 0xc0) == 0xc0) {
            if (off + 1 >= n) return -1;
            int to = (int)((l & 0x3f) << 8) | m[off + 1];
            if (to >= off) return -1; /* forward or to itself: a loop or worse */
            if (end < 0) end = off + 2;
            off = to;
            continue;
        }
        if (l > 63) return -1;
        if (off + 1 + (int)l > n || o + 1 + (int)l > 255) return -1;
        out[o++] = (unsigned char)l;
        if (l == 0) break;
        for (unsigned i = 0; i < l; i++)
            out[o++] = (unsigned char)lower(m[off + 1 + (int)i]);
        off += 1 + (int)l;
    }
    *outlen = o;
    return end >= 0 ? end : off + 1;
}

/* A normalized name ("a.b") in wire form into out (256 bytes); its length, or -1. */
static int wire_of(const char *name, unsigned char *out)
{
    unsigned char q[12 + 256 + 4];
    int len = gate_dns_build_query(name, 0, 0, 0, q, sizeof q);
    if (len < 0) return -1;
    memcpy(out, q + 12, (size_t)len - 16);
    return len - 16;
}

#define CHAIN_MAX   8
#define RECORDS_MAX 64

int gate_dns_answer(const unsigned char *m, int n, const struct gate_query *asked, uint32_t *addrs,
                    int max)
{
    /* the answer to exactly the question asked: id, one question, its name, type and class */
    if (n < 12 || !(m[2] & 0x80) || (m[2] & 0x78)) return -1;
    if ((unsigned)((m[0] << 8) | m[1]) != asked->id) return -1;
    if (m[4] != 0 || m[5] != 1) return -1;
    char qname[GATE_NAME_MAX + 2];
    int off = 0;
    if (gate_dns_qname(m, n, 12, qname, &off) != GATE_DNS_OK || off + 4 > n) return -1;
    if (strcmp(qname, asked->name) != 0) return -1;
    if ((unsigned)((m[off] << 8) | m[off + 1]) != asked->qtype ||
        (unsigned)((m[off + 2] << 8) | m[off + 3]) != asked->qclass)
        return -1;
    off += 4;
    if ((m[3] & 0x0f) != 0) return 0; /* an error: no addresses */

    /* The answer section's records; A records count if their owner is the name asked or a
     * CNAME target reached from it (a chain the resolver followed). A malformed section counts
     * for nothing. */
    struct {
        unsigned char owner[256];
        int ownerlen;
        unsigned type, class;
        int rdata, rdlen;
    } rec[RECORDS_MAX];
    int an = (m[6] << 8) | m[7], nrec = 0;
    for (int i = 0; i < an; i++) {
        unsigned char owner[256];
        int ol = 0;
        off = wire_name(m, n, off, owner, &ol);
        if (off < 0 || off + 10 > n) return 0;
        unsigned type = (unsigned)((m[off] << 8) | m[off + 1]);
        unsigned class = (unsigned)((m[off + 2] << 8) | m[off + 3]);
        int rdlen = (m[off + 8] << 8) | m[off + 9];
        off += 10;
        if (off + rdlen > n) return 0;
        if (nrec < RECORDS_MAX && class == 1 && (type == 1 || type == 5)) {
            memcpy(rec[nrec].owner, owner, (size_t)ol);
            rec[nrec].ownerlen = ol;
            rec[nrec].type = type;
            rec[nrec].class = class;
            rec[nrec].rdata = off;
            rec[nrec].rdlen = rdlen;
            nrec++;
        }
        off += rdlen;
    }
    unsigned char chain[CHAIN_MAX][256];
    int chainlen[CHAIN_MAX], nchain = 0;
    if ((chainlen[0] = wire_of(asked->name, chain[0])) < 0) return 0;
    nchain = 1;
    for (int grew = 1; grew && nchain < CHAIN_MAX;) {
        grew = 0;
        for (int i = 0; i < nrec && nchain < CHAIN_MAX; i++) {
            if (rec[i].type != 5) continue;
            int in = 0;
            for (int c = 0; c < nchain && !in; c++)
                in = rec[i].ownerlen == chainlen[c] &&
                     memcmp(rec[i].owner, chain[c], (size_t)chainlen[c]) == 0;
            if (!in) continue;
            unsigned char target[256];
            int tl = 0, e = wire_name(m, rec[i].rdata + rec[i].rdlen, rec[i].rdata, target, &tl);
            if (e != rec[i].rdata + rec[i].rdlen) continue; /* rdata that is not one name */
            int known = 0;
            for (int c = 0; c < nchain && !known; c++)
                known = tl == chainlen[c] && memcmp(target, chain[c], (size_t)tl) == 0;
            if (known) continue;
            memcpy(chain[nchain], target, (size_t)tl);
            chainlen[nchain++] = tl;
            grew = 1;
        }
    }
    int got = 0;
    for (int i = 0; i < nrec && got < max; i++) {
        if (rec[i].type != 1 || rec[i].rdlen != 4) continue;
        for (int c = 0; c < nchain; c++)
            if (rec[i].ownerlen == chainlen[c] &&
                memcmp(rec[i].owner, chain[c], (size_t)chainlen[c]) == 0) {
                memcpy(&addrs[got++], m + rec[i].rdata, 4);
                break;
            }
    }
    return got;
}

/* ---- HTTP and TLS ------------------------------------------------------------------------------
 */

/* RFC 9110 5.6.2: the bytes of a token (a method, a header field's name). */
static int tchar(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

int gate_http_host(const unsigned char *b, size_t n, char *out)
{
    const unsigned char *h = memmem(b, n, "\r\n\r\n", 4);
    if (!h) return -1;                 /* not complete yet */
    size_t head = (size_t)(h - b) + 2; /* through the last header line's CRLF */
    /* The request line: method SP target SP HTTP-version, the target origin-form ("/...") or
     * "*": an absolute-form target names a host of its own, which a server prefers to the
     * Host header (RFC 9112 3.2.2); no control byte anywhere, no bare CR or LF. */
    size_t i = 0;
    while (i < head && tchar(b[i]))
        i++;
    if (i == 0 || i >= head || b[i] != ' ') return 0;
    size_t t = ++i;
    while (i < head && b[i] > 0x20 && b[i] != 0x7f)
        i++;
    if (i == t || i >= head || b[i] != ' ') return 0;
    if (b[t] != '/' && !(b[t] == '*' && i == t + 1)) return 0;
    i++;
    if (head - i < 10 || memcmp(b + i, "HTTP/1.", 7) != 0 || b[i + 7] < '0' || b[i + 7] > '9' ||
        b[i + 8] != '\r' || b[i + 9] != '\n')
        return 0;
    i += 10;
    /* The header lines, each "name: value" CRLF: a token for the name, right before the colon
     * (no space: RFC 9112 5.1), a value of visible bytes, spaces and tabs (no NUL or other
     * control byte: RFC 9110 5.5); no line folded onto the one before (obs-fold). One Host. */
    int found = 0;
    while (i < head) {
        size_t s = i;
        while (i < head && tchar(b[i]))
            i++;
        if (i == s || i >= head || b[i] != ':') return 0;
        int is_host = i - s == 4 && strncasecmp((const char *)b + s, "host", 4) == 0;
        size_t v = ++i;
        while (i < head && b[i] != '\r' && (b[i] == '\t' || (b[i] >= 0x20 && b[i] != 0x7f)))
            i++;
        if (i + 1 >= head || b[i] != '\r' || b[i + 1] != '\n') return 0;
        size_t ve = i;
        i += 2;
        if (!is_host) continue;
        if (found) return 0; /* two Host headers: which one would the server use? */
        while (v < ve && (b[v] == ' ' || b[v] == '\t'))
            v++;
        while (ve > v && (b[ve - 1] == ' ' || b[ve - 1] == '\t'))
            ve--;
        /* host [":" port]: the name with its length, then digits only */
        size_t e = v;
        while (e < ve && b[e] != ':')
            e++;
        if (e < ve) {
            size_t d = e + 1;
            if (d == ve || ve - d > 5) return 0;
            for (; d < ve; d++)
                if (b[d] < '0' || b[d] > '9') return 0;
        }
        if (!gate_normalize((const char *)b + v, e - v, out)) return 0;
        found = 1;
    }
    return found;
}

int gate_tls_sni(const unsigned char *b, size_t n, char *out)
{
    if (n < 5) return -1;
    if (b[0] != 0x16) return 0; /* a handshake record */
    size_t rec = ((size_t)b[3] << 8) | b[4];
    if (n < 5 + rec) return -1;
    const unsigned char *p = b + 5, *end = b + 5 + rec;
    if (end - p < 4 || p[0] != 1) return 0; /* ClientHello */
    size_t hl = ((size_t)p[1] << 16) | ((size_t)p[2] << 8) | p[3];
    p += 4;
    if ((size_t)(end - p) < hl) return 0; /* split over records: not read */
    end = p + hl;
    if (end - p < 34) return 0;
    p += 34; /* version, random */
    if (end - p < 1 || end - p < 1 + p[0]) return 0;
    p += 1 + p[0]; /* session id */
    if (end - p < 2) return 0;
    size_t cs = ((size_t)p[0] << 8) | p[1];
    if ((size_t)(end - p) < 2 + cs) return 0;
    p += 2 + cs;
    if (end - p < 1 || end - p < 1 + p[0]) return 0;
    p += 1 + p[0]; /* compression methods */
    if (end - p < 2) return 0;
    size_t el = ((size_t)p[0] << 8) | p[1];
    p += 2;
    if ((size_t)(end - p) != el) return 0; /* the extensions fill the rest of the hello */
    /* Every extension is read: exactly one server_name, holding exactly one host_name that
     * fills it, for a server that reads another entry or a second extension would see a
     * name the gate did not check. */
    int found = 0;
    while (p < end) {
        if (end - p < 4) return 0;
        unsigned type = ((unsigned)p[0] << 8) | p[1];
        size_t len = ((size_t)p[2] << 8) | p[3];
        p += 4;
        if ((size_t)(end - p) < len) return 0;
        if (type == 0) {
            if (found || len < 5 || p[2] != 0) return 0;
            size_t list = ((size_t)p[0] << 8) | p[1];
            size_t nl = ((size_t)p[3] << 8) | p[4];
            if (list != len - 2 || 5 + nl != len) return 0;
            if (!gate_normalize((const char *)p + 5, nl, out)) return 0;
            found = 1;
        }
        p += len;
    }
    return found;
}
