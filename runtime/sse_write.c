/* sse_write.c - Server-Sent Events framing (see sse_write.h).
 *
 * Lines are found with memchr, which is vectorised: SSE data rarely has line breaks, often none
 * at all. Sizing walks the lines once more instead of bounding (a bound of one line per byte
 * would ask for eight times the data).
 */
#include "sse_write.h"

#include "jsonq.h"

#include <string.h>

#define OUTPUT_HEAD "event: output\ndata: {\"data\":"
#define OUTPUT_MID  ",\"stream\":"
#define OUTPUT_TAIL "}\n\n"

/* Writes prefix + line + "\n" into out for each line of s (split at \n, \r\n or \r); with
 * out NULL only counts; returns the bytes of prefix + line + "\n" over all lines. */
static size_t lines(char *out, const char *prefix, const char *s, size_t n)
{
    size_t pl = strlen(prefix), total = 0, i = 0;
    for (;;) {
        const char *nl = memchr(s + i, '\n', n - i);
        size_t j = nl ? (size_t)(nl - s) : n;
        const char *cr = memchr(s + i, '\r', j - i);
        if (cr) j = (size_t)(cr - s);
        if (out) {
            memcpy(out + total, prefix, pl);
            memcpy(out + total + pl, s + i, j - i);
            out[total + pl + (j - i)] = '\n';
        }
        total += pl + (j - i) + 1;
        if (j >= n) break;
        if (s[j] == '\r' && j + 1 < n && s[j + 1] == '\n') j++;
        i = j + 1;
    }
    return total;
}

/* "name: value\n" into out (when not NULL); returns its length, 0 when value is NULL. */
static size_t field(char *out, const char *name, const char *value)
{
    if (!value) return 0;
    size_t nl = strlen(name), vl = strlen(value);
    if (out) {
        memcpy(out, name, nl);
        memcpy(out + nl, value, vl);
        out[nl + vl] = '\n';
    }
    return nl + vl + 1;
}

size_t sse_event_size(const char *event, const char *id, const char *data, size_t n)
{
    return field(NULL, "event: ", event) + field(NULL, "id: ", id) +
           lines(NULL, "data: ", data, n) + 1;
}

size_t sse_write_event(char *out, const char *event, const char *id, const char *data, size_t n)
{
    size_t o = field(out, "event: ", event);
    o += field(out + o, "id: ", id);
    o += lines(out + o, "data: ", data, n);
    out[o++] = '\n';
    return o;
}

size_t sse_comment_size(const char *text, size_t n)
{
    return n ? lines(NULL, ": ", text, n) : 2;
}

size_t sse_write_comment(char *out, const char *text, size_t n)
{
    if (n) return lines(out, ": ", text, n);
    memcpy(out, ":\n", 2);
    return 2;
}

size_t sse_output_bound(size_t stream_len, size_t data_len)
{
    return sizeof OUTPUT_HEAD + sizeof OUTPUT_MID + sizeof OUTPUT_TAIL + JSONQ_BOUND(stream_len) +
           JSONQ_BOUND(data_len);
}

size_t sse_write_output(char *out, const unsigned char *stream, size_t sn,
                        const unsigned char *data, size_t dn)
{
    char *o = out;
    memcpy(o, OUTPUT_HEAD, sizeof OUTPUT_HEAD - 1);
    o += sizeof OUTPUT_HEAD - 1;
    o += jsonq_quote(o, data, dn);
    memcpy(o, OUTPUT_MID, sizeof OUTPUT_MID - 1);
    o += sizeof OUTPUT_MID - 1;
    o += jsonq_quote(o, stream, sn);
    memcpy(o, OUTPUT_TAIL, sizeof OUTPUT_TAIL - 1);
    o += sizeof OUTPUT_TAIL - 1;
    return (size_t)(o - out);
}
