/*
 * jsonq.c - JSON string literals from arbitrary bytes (see jsonq.h for the rule).
 *
 * Exec output is mostly printable ASCII with a newline every few dozen bytes, so the fast path
 * tests eight bytes at a time (SWAR) for anything that needs work — a control character, '"',
 * '\' or a byte >= 0x80 — and copies clean words whole; only the bytes that need an escape or a
 * UTF-8 check leave it. Output goes straight into the caller's buffer: no allocation, one pass.
 */
#include "jsonq.h"

#include <stdint.h>
#include <string.h>

#define ONES  0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL

/* Nonzero when some byte of w is zero. */
static inline uint64_t has_zero(uint64_t w)
{
    return (w - ONES) & ~w & HIGHS;
}

/* Nonzero when some byte of w needs work: < 0x20, '"', '\\' or >= 0x80. */
static inline uint64_t needs_work(uint64_t w)
{
    uint64_t below = (w - ONES * 0x20) & ~w & HIGHS; /* < 0x20 (valid as bytes < 0x80 here) */
    return below | (w & HIGHS) | has_zero(w ^ (ONES * '"')) | has_zero(w ^ (ONES * '\\'));
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 when it is invalid. */
static inline size_t utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    if (c < 0xC2) return 0;
    if (c < 0xE0) return (n >= 2 && (s[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c < 0xF0) {
        if (n < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && s[1] < 0xA0) return 0;  /* overlong */
        if (c == 0xED && s[1] >= 0xA0) return 0; /* surrogate */
        return 3;
    }
    if (c < 0xF5) {
        if (n < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80)
            return 0;
        if (c == 0xF0 && s[1] < 0x90) return 0;  /* overlong */
        if (c == 0xF4 && s[1] >= 0x90) return 0; /* above U+10FFFF */
        return 4;
    }
    return 0;
}

/* 0: copied as is; 1: needs a UTF-8 check; other: the letter of a two-byte escape; 'u': \u00XX. */
static const unsigned char klass[256] = {
    ['\b'] = 'b',  ['\t'] = 't', ['\n'] = 'n', ['\f'] = 'f', ['\r'] = 'r',        ['"'] = '"',
    ['\\'] = '\\', [0x00] = 'u', [0x01] = 'u', [0x02] = 'u', [0x03] = 'u',        [0x04] = 'u',
    [0x05] = 'u',  [0x06] = 'u', [0x07] = 'u', [0x0B] = 'u', [0x0E] = 'u',        [0x0F] = 'u',
    [0x10] = 'u',  [0x11] = 'u', [0x12] = 'u', [0x13] = 'u', [0x14] = 'u',        [0x15] = 'u',
    [0x16] = 'u',  [0x17] = 'u', [0x18] = 'u', [0x19] = 'u', [0x1A] = 'u',        [0x1B] = 'u',
    [0x1C] = 'u',  [0x1D] = 'u', [0x1E] = 'u', [0x1F] = 'u', [0x80 ... 0xFF] = 1,
};

/* Writes s[0..n) to out as one JSON string literal, quotes included, and returns its length
 * (at most JSONQ_BOUND(n): out must have that room; nothing is NUL-terminated). Clean words of
 * eight bytes are copied whole; '"', '\\' and \b \t \n \f \r get their two-byte escapes, the
 * other control characters \u00XX; valid UTF-8 sequences are copied, and each byte of an
 * invalid one becomes U+FFFD, so the result is always valid JSON and valid UTF-8. Cannot fail;
 * no allocation; reads nothing outside s[0..n). */
size_t jsonq_quote(char *out, const unsigned char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    char *o = out;
    size_t i = 0;
    *o++ = '"';
    while (i < n) {
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (needs_work(w)) break;
            memcpy(o, &w, 8);
            o += 8;
            i += 8;
        }
        while (i < n && !klass[s[i]])
            *o++ = (char)s[i++];
        if (i >= n) break;
        unsigned c = s[i];
        unsigned k = klass[c];
        if (k == 1) {
            size_t len = utf8_seq(s + i, n - i);
            if (len) {
                memcpy(o, s + i, len);
                o += len;
                i += len;
            } else {
                memcpy(o, "\xEF\xBF\xBD", 3);
                o += 3;
                i++;
            }
            continue;
        }
        *o++ = '\\';
        if (k == 'u') {
            memcpy(o, "u00", 3);
            o[3] = hex[c >> 4];
            o[4] = hex[c & 15];
            o += 5;
        } else {
            *o++ = (char)k;
        }
        i++;
    }
    *o++ = '"';
    return (size_t)(o - out);
}

int jsonq_utf8_valid(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t k = utf8_seq(s + i, n - i);
        if (!k) return 0;
        i += k;
    }
    return 1;
}

size_t jsonq_utf8_seq(const unsigned char *s, size_t n)
{
    return utf8_seq(s, n);
}

size_t jsonq_utf8_cut(const unsigned char *s, size_t n, size_t max)
{
    size_t k = max < n ? max : n;
    /* Look back at most three bytes for the lead of the sequence the prefix ends in. */
    for (size_t back = 1; back <= 3 && back <= k; back++) {
        unsigned c = s[k - back];
        if (c < 0x80) return k;             /* ASCII: the prefix ends on a whole character */
        if ((c & 0xC0) == 0x80) continue;   /* a continuation byte: keep looking */
        if (c < 0xC2 || c > 0xF4) return k; /* never a lead: invalid whatever follows */
        size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
        return back < need ? k - back : k;
    }
    return k;
}

size_t jsonq_message(char *out, size_t cap, const char *msg, size_t n)
{
    static const char head[] = "{\"message\":";
    size_t hl = sizeof head - 1;
    size_t room = (cap - hl - 4) / 6; /* input bytes whose quotes surely fit, with '}' and NUL */
    if (n > room) n = jsonq_utf8_cut((const unsigned char *)msg, n, room);
    memcpy(out, head, hl);
    size_t o = hl + jsonq_quote(out + hl, (const unsigned char *)msg, n);
    out[o++] = '}';
    out[o] = '\0';
    return o;
}
