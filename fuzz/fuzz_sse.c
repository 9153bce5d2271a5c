/* fuzz_sse.c - libFuzzer target for runtime/sse.c.
 *
 * Input layout: byte 0 picks the size limit (low 3 bits, from a table of mostly tiny limits so
 * the error paths get exercised) and an event on which the callback stops the parser (high 5
 * bits, 0 = never); bytes 1-2 (big-endian) pick a split position; the rest is the stream.
 * Seeds in corpus/sse/ start with three printable control bytes for that reason.
 *
 * The stream is parsed fed whole, split in two, byte by byte, and stopped by the callback, and
 * every way must give the same events (a running digest of them), the same result and the same
 * sticky behaviour; when the limit cannot be hit, the events must also match a deliberately
 * naive whole-buffer parser written straight from the WHATWG rules. Any difference, or an event
 * breaking a contract of sse.h (NULL pointers, data longer than the limit), aborts.
 */
#include "sse.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STOP_VALUE 0x5a

static const size_t limits[8] = {(size_t)1 << 20, 0, 1, 3, 8, 16, 64, 300};

/* What one parse produced: a digest over all events, their count, the result, and the digest
 * as it stood right after event number stop_at (for comparing with a stopped run). */
typedef struct outcome {
    uint64_t digest;
    uint64_t digest_at_stop;
    unsigned events;
    unsigned stop_at;
    int stop;
    int rc;
    size_t limit;
} outcome;

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_sse: invariant violated: %s\n", what);
    abort();
}

static uint64_t mix(uint64_t h, const void *buf, size_t len)
{
    const unsigned char *s = buf;
    for (size_t i = 0; i < len; i++)
        h = (h ^ s[i]) * 0x100000001b3ull; /* FNV-1a */
    return h;
}

/* Folds one event into h; lengths go in first so field boundaries cannot shift unnoticed. */
static uint64_t mix_event(uint64_t h, const char *event, size_t event_len, const char *data,
                          size_t data_len, const char *id, size_t id_len, long retry_ms)
{
    h = mix(h, &event_len, sizeof event_len);
    h = mix(h, event, event_len);
    h = mix(h, &data_len, sizeof data_len);
    h = mix(h, data, data_len);
    h = mix(h, &id_len, sizeof id_len);
    h = mix(h, id, id_len);
    return mix(h, &retry_ms, sizeof retry_ms);
}

static int on_event(void *ud, const sse_event *ev)
{
    outcome *o = ud;

    if (ev->event == NULL || ev->data == NULL || ev->id == NULL) fail("NULL pointer in an event");
    if (ev->data_len > o->limit || ev->event_len > o->limit || ev->id_len > o->limit)
        fail("event field longer than max_event_bytes");
    if (ev->event_len == 0 || ev->retry_ms < -1) fail("empty event name or bad retry_ms");
    o->digest = mix_event(o->digest, ev->event, ev->event_len, ev->data, ev->data_len, ev->id,
                          ev->id_len, ev->retry_ms);
    o->events++;
    if (o->events == o->stop_at) {
        o->digest_at_stop = o->digest;
        if (o->stop) return STOP_VALUE;
    }
    return 0;
}

/* Parses s[0..n) as pieces [0,split) and [split,n), or byte by byte when split is SIZE_MAX,
 * then finishes; checks that a non-zero result is sticky. */
static void parse(outcome *o, const unsigned char *s, size_t n, size_t split)
{
    sse_parser p;
    const char *in = (const char *)s;
    int rc = 0;

    sse_parser_init(&p, o->limit, on_event, o);
    if (split == SIZE_MAX) {
        for (size_t i = 0; i < n && rc == 0; i++)
            rc = sse_parser_feed(&p, in + i, 1);
    } else {
        rc = sse_parser_feed(&p, in, split);
        if (rc == 0) rc = sse_parser_feed(&p, in + split, n - split);
    }
    if (rc == 0) rc = sse_parser_finish(&p);
    if (rc != 0) {
        unsigned events = o->events;
        if (sse_parser_feed(&p, "data: x\n\n", 9) != rc || sse_parser_finish(&p) != rc ||
            o->events != events)
            fail("a non-zero result is not sticky");
        if (rc < 0 && strstr(sse_parser_error(&p), "SSE") == NULL &&
            strstr(sse_parser_error(&p), "memory") == NULL)
            fail("error without a readable message");
    }
    o->rc = rc;
    sse_parser_free(&p);
    sse_parser_free(&p);
}

/* The oracle: one pass over the whole buffer, line by line, straight from the WHATWG
 * "interpreting an event stream" steps plus the two sse.h rules (event: alone dispatches;
 * end of stream dispatches). Valid only when no limit can be reached. */
static void parse_naive(outcome *o, const unsigned char *s, size_t n)
{
    char *data = malloc(n + 1), *event = malloc(n + 1), *id = malloc(n + 1);
    size_t data_len = 0, event_len = 0, id_len = 0, pos = 0;
    int has_data = 0, has_event = 0;
    long retry = -1;

    if (data == NULL || event == NULL || id == NULL) abort();
    if (n >= 3 && memcmp(s, "\xEF\xBB\xBF", 3) == 0) pos = 3;
    for (;;) {
        size_t start = pos, end = pos;
        int at_eof;
        while (end < n && s[end] != '\r' && s[end] != '\n')
            end++;
        at_eof = end == n;
        pos = end + 1;
        if (!at_eof && s[end] == '\r' && end + 1 < n && s[end + 1] == '\n') pos++;

        const char *line = (const char *)s + start;
        size_t len = end - start;
        if (len == 0) {
            if (has_data || has_event)
                on_event(o, &(sse_event){has_event && event_len ? event : "message",
                                         has_event && event_len ? event_len : 7, data, data_len, id,
                                         id_len, retry});
            data_len = event_len = 0;
            has_data = has_event = 0;
            retry = -1;
        } else if (line[0] != ':') {
            const char *colon = memchr(line, ':', len);
            size_t name_len = colon ? (size_t)(colon - line) : len;
            const char *value = colon ? colon + 1 : line + len;
            size_t value_len = colon ? len - name_len - 1 : 0;
            if (value_len > 0 && value[0] == ' ') value++, value_len--;
            if (name_len == 4 && memcmp(line, "data", 4) == 0) {
                if (has_data) data[data_len++] = '\n';
                memcpy(data + data_len, value, value_len);
                data_len += value_len;
                has_data = 1;
            } else if (name_len == 5 && memcmp(line, "event", 5) == 0) {
                memcpy(event, value, value_len);
                event_len = value_len;
                has_event = 1;
            } else if (name_len == 2 && memcmp(line, "id", 2) == 0) {
                if (memchr(value, '\0', value_len) == NULL) {
                    memcpy(id, value, value_len);
                    id_len = value_len;
                }
            } else if (name_len == 5 && memcmp(line, "retry", 5) == 0 && value_len > 0) {
                long v = 0;
                size_t i = 0;
                for (; i < value_len && value[i] >= '0' && value[i] <= '9'; i++)
                    v = v > (LONG_MAX - (value[i] - '0')) / 10 ? LONG_MAX
                                                               : v * 10 + (value[i] - '0');
                if (i == value_len) retry = v;
            }
        }
        if (at_eof) break;
    }
    if (has_data || has_event)
        on_event(o, &(sse_event){has_event && event_len ? event : "message",
                                 has_event && event_len ? event_len : 7, data, data_len, id, id_len,
                                 retry});
    o->rc = 0;
    free(data);
    free(event);
    free(id);
}

static void expect_same(const outcome *a, const outcome *b, const char *what)
{
    if (a->digest != b->digest || a->events != b->events || a->rc != b->rc) {
        fprintf(stderr, "fuzz_sse: %s: events %u vs %u, rc %d vs %d\n", what, a->events, b->events,
                a->rc, b->rc);
        fail(what);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *buf, size_t size)
{
    if (size < 3) return 0;
    const unsigned char *s = buf + 3;
    size_t n = size - 3;
    outcome base = {0};
    base.limit = limits[buf[0] & 7];
    base.stop_at = buf[0] >> 3;
    size_t split = (((size_t)buf[1] << 8) | buf[2]) % (n + 1);

    outcome whole = base, halves = base, bytes = base, stopped = base;
    parse(&whole, s, n, n);
    parse(&halves, s, n, split);
    expect_same(&whole, &halves, "split feed differs from whole feed");
    parse(&bytes, s, n, SIZE_MAX);
    expect_same(&whole, &bytes, "byte-by-byte feed differs from whole feed");

    /* Stopping at event k must return the stop value with exactly the first k events. */
    stopped.stop = 1;
    parse(&stopped, s, n, split);
    if (base.stop_at > 0 && whole.events >= base.stop_at) {
        if (stopped.rc != STOP_VALUE || stopped.events != base.stop_at ||
            stopped.digest != whole.digest_at_stop)
            fail("a callback stop did not end the parse at that event");
    } else {
        expect_same(&whole, &stopped, "a stop that never fired changed the parse");
    }

    /* Every stored line and the joined data are shorter than the stream, so a limit of at least
     * n can never be hit, and the result must match the naive parser exactly. */
    if (base.limit >= n) {
        outcome naive = base;
        parse_naive(&naive, s, n);
        expect_same(&whole, &naive, "incremental parser differs from the naive one");
    }
    return 0;
}
