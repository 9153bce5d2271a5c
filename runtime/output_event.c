/* output_event.c - decodes the data of an exec `output` event (see output_event.h).
 *
 * A hand-written scanner for one fixed object shape: it walks the text once, copying the data
 * string's bytes to the output as it goes, so an event costs one pass and no allocation. Any
 * deviation returns OUTPUT_NOT_SHAPE at once; correctness for odd input is the general decoder's
 * job, this file only has to be exact for the input it accepts.
 */
#include "output_event.h"

#include <stdint.h>
#include <string.h>

/* The word-at-a-time scan needs the first byte in memory to be the lowest of the word. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define WORDWISE 1
#else
#define WORDWISE 0
#endif

#define ONES  0x0101010101010101ull
#define HIGHS 0x8080808080808080ull

/* The flags (0x80 in each byte) of the bytes of w that are a quote, a backslash or below
 * 0x20: the classic "has a zero byte" test on w XOR the byte, and "has a byte less than n" for
 * the controls. A borrow may flag a byte above a real hit too, never one below the first: the
 * lowest flag is exact, which is all the scanner uses. */
static uint64_t specials8(uint64_t w)
{
    uint64_t q = w ^ (ONES * '"'), b = w ^ (ONES * '\\');
    return (((q - ONES) & ~q) | ((b - ONES) & ~b) | ((w - ONES * 0x20) & ~w)) & HIGHS;
}

static size_t skip_ws(const char *s, size_t i, size_t n)
{
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    return i;
}

static int hex4(const char *s, unsigned *v)
{
    unsigned x = 0;
    for (int k = 0; k < 4; k++) {
        unsigned char c = (unsigned char)s[k];
        unsigned d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if (c >= 'a' && c <= 'f')
            d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F')
            d = c - 'A' + 10;
        else
            return 0;
        x = x * 16 + d;
    }
    *v = x;
    return 1;
}

static size_t put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Decodes the JSON string whose opening quote is s[i-1]; writes its bytes to out (room for
 * n - i bytes) and their count to *len. Returns the index after the closing quote, or 0 when the
 * string is not one this decoder accepts. */
static size_t scan_string(const char *s, size_t i, size_t n, char *out, size_t *len)
{
    size_t o = 0;
    while (i < n) {
        /* the run of plain bytes up to the next quote, backslash or control character, eight
         * bytes at a time: each word is copied whole (o + 8 <= j + 8 <= n: within out), and the
         * first special byte in it, if any, ends the run (little-endian: the lowest flag is the
         * first byte) */
        size_t j = i;
        for (;;) {
            if (j + 8 > n || !WORDWISE) {
                while (j < n && s[j] != '"' && s[j] != '\\' && (unsigned char)s[j] >= 0x20) {
                    out[o + (j - i)] = s[j];
                    j++;
                }
                break;
            }
            uint64_t w;
            memcpy(&w, s + j, 8);
            memcpy(out + o + (j - i), &w, 8);
            uint64_t hit = specials8(w);
            if (hit) {
                j += (size_t)__builtin_ctzll(hit) / 8;
                break;
            }
            j += 8;
        }
        o += j - i;
        if (j == n) return 0;
        if (s[j] == '"') {
            *len = o;
            return j + 1;
        }
        if (s[j] != '\\') return 0; /* a raw control character */
        if (j + 1 >= n) return 0;
        char e = s[j + 1], c;
        i = j + 2;
        switch (e) {
        case '"':
        case '\\':
        case '/':
            c = e;
            break;
        case 'b':
            c = '\b';
            break;
        case 'f':
            c = '\f';
            break;
        case 'n':
            c = '\n';
            break;
        case 'r':
            c = '\r';
            break;
        case 't':
            c = '\t';
            break;
        case 'u': {
            unsigned cp;
            if (i + 4 > n || !hex4(s + i, &cp)) return 0;
            i += 4;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return 0; /* a low surrogate alone */
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (i + 6 > n || s[i] != '\\' || s[i + 1] != 'u' || !hex4(s + i + 2, &lo) ||
                    lo < 0xDC00 || lo > 0xDFFF)
                    return 0;
                i += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            o += put_utf8(out + o, cp);
            continue;
        }
        default:
            return 0;
        }
        out[o++] = c;
    }
    return 0;
}

/* Recognises exactly one shape, {"stream": "stdout"|"stderr", "data": "..."} with the two keys
 * in either order, each once, whitespace allowed between tokens, and decodes data's string
 * (scan_string: escapes, \u surrogate pairs) into out (room for n bytes; *out_len gets the
 * length). Anything else (another key, a key with an escape, a non-string value, trailing
 * bytes) is OUTPUT_NOT_SHAPE, and the caller falls back to a full JSON decode: this is the hot
 * path's shortcut, never the only judge. Returns OUTPUT_STDOUT, OUTPUT_STDERR or
 * OUTPUT_NOT_SHAPE; one pass, no allocation, never reads outside s[0..n). */
int output_event_decode(const char *s, size_t n, char *out, size_t *out_len)
{
    int stream = 0, have_data = 0;
    size_t i = skip_ws(s, 0, n);
    if (i >= n || s[i] != '{') return OUTPUT_NOT_SHAPE;
    i++;
    for (int field = 0; field < 2; field++) {
        i = skip_ws(s, i, n);
        if (i >= n || s[i] != '"') return OUTPUT_NOT_SHAPE;
        size_t key = i + 1, klen;
        /* keys are plain ASCII here: a key with an escape is not this shape */
        size_t end = key;
        while (end < n && s[end] != '"' && s[end] != '\\')
            end++;
        if (end >= n || s[end] != '"') return OUTPUT_NOT_SHAPE;
        klen = end - key;
        i = skip_ws(s, end + 1, n);
        if (i >= n || s[i] != ':') return OUTPUT_NOT_SHAPE;
        i = skip_ws(s, i + 1, n);
        if (i >= n || s[i] != '"') return OUTPUT_NOT_SHAPE;
        i++;
        if (klen == 6 && memcmp(s + key, "stream", 6) == 0 && !stream) {
            if (i + 7 <= n && memcmp(s + i, "stdout\"", 7) == 0)
                stream = OUTPUT_STDOUT;
            else if (i + 7 <= n && memcmp(s + i, "stderr\"", 7) == 0)
                stream = OUTPUT_STDERR;
            else
                return OUTPUT_NOT_SHAPE;
            i += 7;
        } else if (klen == 4 && memcmp(s + key, "data", 4) == 0 && !have_data) {
            size_t len;
            i = scan_string(s, i, n, out, &len);
            if (i == 0) return OUTPUT_NOT_SHAPE;
            *out_len = len;
            have_data = 1;
        } else {
            return OUTPUT_NOT_SHAPE;
        }
        i = skip_ws(s, i, n);
        if (i >= n) return OUTPUT_NOT_SHAPE;
        if (field == 0 && s[i] != ',') return OUTPUT_NOT_SHAPE;
        if (field == 1 && s[i] != '}') return OUTPUT_NOT_SHAPE;
        i++;
    }
    if (skip_ws(s, i, n) != n) return OUTPUT_NOT_SHAPE;
    return stream;
}
