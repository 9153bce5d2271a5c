/*
 * gate_parse.c — what the allow-list gate (gate.c) reads of a sandbox's traffic: host names,
 * DNS questions and answers, the Host header of an HTTP request head, the SNI of a TLS
 * ClientHello. Every byte comes from code nobody trusts, so each function checks each length
 * against the bytes it has and never reads past them; fuzz/fuzz_gate.c runs them on arbitrary
 * input under ASan and UBSan. Pure functions: no I/O, no state.
 */
#include <string.h>
#include <strings.h>

#include "sandbox.h"

int gate_normalize(const char *name, size_t len, char *out)
{
    if (len > 0 && name[len - 1] == '.') len--; /* one final dot: the root */
    if (len == 0 || len > GATE_NAME_MAX) return 0;
    size_t label = 0;
    for (size_t i = 0; i < len; i++) {
        char c = name[i];
        if (c >= 'A' && c <= 'Z') c = (char)(c + 32);
        if (c == '.') {
            if (label == 0) return 0; /* an empty label */
            label = 0;
        } else if ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_') {
            if (++label > 63) return 0;
        } else {
            return 0;
        }
        out[i] = c;
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

int gate_dns_name(const unsigned char *m, int len, int off, char *out, size_t outlen)
{
    size_t o = 0;
    int end = -1, jumps = 0;
    if (outlen == 0) return -1;
    while (off >= 0 && off < len) {
        unsigned l = m[off];
        if (l == 0) {
            if (end < 0) end = off + 1;
            out[o > 0 ? o - 1 : 0] = 0; /* drop the last dot */
            return end;
        }
        if ((l & 0xc0) == 0xc0) {
            if (off + 1 >= len || ++jumps > 16) return -1;
            if (end < 0) end = off + 2;
            off = ((int)(l & 0x3f) << 8) | m[off + 1];
            continue;
        }
        if (l > 63 || off + 1 + (int)l > len || o + l + 1 >= outlen) return -1;
        memcpy(out + o, m + off + 1, l);
        o += l;
        out[o++] = '.';
        off += 1 + (int)l;
    }
    return -1;
}

int gate_dns_question(const unsigned char *q, int n, char *name, unsigned *qtype)
{
    char raw[GATE_NAME_MAX + 2];
    /* a query (QR clear), opcode QUERY, exactly one question */
    if (n < 17 || (q[2] & 0x80) || (q[2] & 0x78) || q[4] != 0 || q[5] != 1) return -1;
    int end = gate_dns_name(q, n, 12, raw, sizeof raw);
    if (end < 0 || end + 4 > n) return -1;
    *qtype = ((unsigned)q[end] << 8) | q[end + 1];
    if (!gate_normalize(raw, strlen(raw), name)) name[0] = 0;
    return end + 4;
}

int gate_dns_addrs(const unsigned char *m, int n, uint32_t *addrs, int max)
{
    if (n < 12) return 0;
    int qd = (m[4] << 8) | m[5], an = (m[6] << 8) | m[7], off = 12, got = 0;
    char tmp[GATE_NAME_MAX + 2];
    for (int i = 0; i < qd && off >= 0; i++) {
        off = gate_dns_name(m, n, off, tmp, sizeof tmp);
        if (off >= 0) off += 4;
    }
    for (int i = 0; i < an && off >= 0 && off < n && got < max; i++) {
        off = gate_dns_name(m, n, off, tmp, sizeof tmp);
        if (off < 0 || off + 10 > n) break;
        unsigned type = ((unsigned)m[off] << 8) | m[off + 1];
        unsigned rdlen = ((unsigned)m[off + 8] << 8) | m[off + 9];
        off += 10;
        if (off + (int)rdlen > n) break;
        if (type == 1 && rdlen == 4) memcpy(&addrs[got++], m + off, 4);
        off += (int)rdlen;
    }
    return got;
}

int gate_http_host(const unsigned char *b, size_t n, char *out)
{
    const unsigned char *h = memmem(b, n, "\r\n\r\n", 4);
    if (!h) return -1; /* not complete yet */
    /* The request target must be origin-form ("/...") or "*": an absolute-form target names
     * a host of its own, which a server prefers to the Host header (RFC 9112 3.2.2). */
    const unsigned char *sp = memchr(b, ' ', (size_t)(h - b));
    if (!sp || sp + 1 >= h || (sp[1] != '/' && !(sp[1] == '*' && sp + 2 < h && sp[2] == ' ')))
        return 0;
    size_t head = (size_t)(h - b) + 2; /* through the last header line's CRLF */
    int found = 0;
    for (size_t i = 0; i + 6 <= head; i++) {
        if (b[i] != '\n' || strncasecmp((const char *)b + i + 1, "host:", 5) != 0) continue;
        if (found) return 0; /* two Host headers: which one would the server use? */
        size_t s = i + 6;
        while (s < head && (b[s] == ' ' || b[s] == '\t'))
            s++;
        size_t e = s;
        while (e < head && b[e] != '\r' && b[e] != ':' && b[e] != ' ' && b[e] != '\t')
            e++;
        if (!gate_normalize((const char *)b + s, e - s, out)) return 0;
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
    p += 4;
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
    if ((size_t)(end - p) < el) return 0;
    const unsigned char *ee = p + el;
    while (ee - p >= 4) {
        unsigned type = ((unsigned)p[0] << 8) | p[1];
        size_t len = ((size_t)p[2] << 8) | p[3];
        p += 4;
        if ((size_t)(ee - p) < len) return 0;
        if (type == 0) { /* server_name: list length, then one host_name entry */
            if (len < 5 || p[2] != 0) return 0;
            size_t nl = ((size_t)p[3] << 8) | p[4];
            if (5 + nl > len) return 0;
            return gate_normalize((const char *)p + 5, nl, out) ? 1 : 0;
        }
        p += len;
    }
    return 0;
}
