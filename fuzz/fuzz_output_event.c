/* fuzz_output_event.c - libFuzzer target for runtime/output_event.c.
 *
 * The input is an output event's data as a backend could send it. The decoder's answer (shape
 * or not, stream, bytes) must equal that of a deliberately naive decoder written here straight
 * from the JSON rules, one byte at a time; its output buffer is exactly the input's size, so
 * ASan catches any write past what output_event.h promises. Seeds in corpus/output_event/.
 */
#include "output_event.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static size_t ws(const uint8_t *s, size_t i, size_t n)
{
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    return i;
}

static int hexval(uint8_t c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int hex4(const uint8_t *s, unsigned *v)
{
    unsigned x = 0;
    for (int k = 0; k < 4; k++) {
        int d = hexval(s[k]);
        if (d < 0) return 0;
        x = x * 16 + (unsigned)d;
    }
    *v = x;
    return 1;
}

/* The naive string decoder: returns the index after the closing quote or 0. */
static size_t naive_string(const uint8_t *s, size_t i, size_t n, uint8_t *out, size_t *len)
{
    size_t o = 0;
    for (;;) {
        if (i >= n) return 0;
        uint8_t c = s[i++];
        if (c == '"') break;
        if (c < 0x20) return 0;
        if (c != '\\') {
            out[o++] = c;
            continue;
        }
        if (i >= n) return 0;
        uint8_t e = s[i++];
        const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
        const char *p = e ? strchr(from, e) : NULL;
        if (p) {
            out[o++] = (uint8_t)to[p - from];
            continue;
        }
        if (e != 'u' || i + 4 > n) return 0;
        unsigned cp;
        if (!hex4(s + i, &cp)) return 0;
        i += 4;
        if (cp >= 0xDC00 && cp <= 0xDFFF) return 0;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            unsigned lo;
            if (i + 6 > n || s[i] != '\\' || s[i + 1] != 'u' || !hex4(s + i + 2, &lo) ||
                lo < 0xDC00 || lo > 0xDFFF)
                return 0;
            i += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        if (cp < 0x80) {
            out[o++] = (uint8_t)cp;
        } else if (cp < 0x800) {
            out[o++] = (uint8_t)(0xC0 | (cp >> 6));
            out[o++] = (uint8_t)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out[o++] = (uint8_t)(0xE0 | (cp >> 12));
            out[o++] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
            out[o++] = (uint8_t)(0x80 | (cp & 0x3F));
        } else {
            out[o++] = (uint8_t)(0xF0 | (cp >> 18));
            out[o++] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
            out[o++] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
            out[o++] = (uint8_t)(0x80 | (cp & 0x3F));
        }
    }
    *len = o;
    return i;
}

/* The naive object decoder: the same contract as output_event_decode. */
static int naive(const uint8_t *s, size_t n, uint8_t *out, size_t *out_len)
{
    int stream = 0, have_data = 0;
    size_t i = ws(s, 0, n);
    if (i >= n || s[i++] != '{') return OUTPUT_NOT_SHAPE;
    for (int field = 0; field < 2; field++) {
        i = ws(s, i, n);
        if (i >= n || s[i++] != '"') return OUTPUT_NOT_SHAPE;
        size_t key = i;
        while (i < n && s[i] != '"' && s[i] != '\\')
            i++;
        if (i >= n || s[i] != '"') return OUTPUT_NOT_SHAPE;
        size_t klen = i - key;
        i = ws(s, i + 1, n);
        if (i >= n || s[i++] != ':') return OUTPUT_NOT_SHAPE;
        i = ws(s, i, n);
        if (i >= n || s[i++] != '"') return OUTPUT_NOT_SHAPE;
        if (klen == 6 && memcmp(s + key, "stream", 6) == 0 && !stream) {
            if (i + 7 <= n && memcmp(s + i, "stdout\"", 7) == 0)
                stream = OUTPUT_STDOUT;
            else if (i + 7 <= n && memcmp(s + i, "stderr\"", 7) == 0)
                stream = OUTPUT_STDERR;
            else
                return OUTPUT_NOT_SHAPE;
            i += 7;
        } else if (klen == 4 && memcmp(s + key, "data", 4) == 0 && !have_data) {
            i = naive_string(s, i, n, out, out_len);
            if (i == 0) return OUTPUT_NOT_SHAPE;
            have_data = 1;
        } else {
            return OUTPUT_NOT_SHAPE;
        }
        i = ws(s, i, n);
        if (i >= n || s[i++] != (field == 0 ? ',' : '}')) return OUTPUT_NOT_SHAPE;
    }
    return ws(s, i, n) == n ? stream : OUTPUT_NOT_SHAPE;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *out = malloc(size ? size : 1);
    uint8_t *ref = malloc(size ? size : 1);
    size_t len = 0, ref_len = 0;
    int kind = output_event_decode((const char *)data, size, out, &len);
    int ref_kind = naive(data, size, ref, &ref_len);
    if (kind != ref_kind) abort();
    if (kind != OUTPUT_NOT_SHAPE && (len != ref_len || len > size || memcmp(out, ref, len) != 0))
        abort();
    free(out);
    free(ref);
    return 0;
}
