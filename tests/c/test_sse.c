/* test_sse.c - unit tests for runtime/sse.c, the SSE parser.
 *
 * Each check pins one framing rule. Events are recorded as one escaped text line each
 * ("event|data|id|retry"), so a failure prints both streams readably. Almost every input also
 * goes through expect_events(), which feeds it whole, split at every position, and byte by byte,
 * and requires identical events and result every time: chunking must never matter.
 * Prints "N passed, M failed" last and exits non-zero on any failure; ctest runs it as c_sse.
 */
#include "sse.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* A growable NUL-terminated string; the tests exit on allocation failure. */
typedef struct strbuf {
    char *s;
    size_t len, cap;
} strbuf;

static void sb_putn(strbuf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        b->s = realloc(b->s, cap);
        if (b->s == NULL) {
            perror("realloc");
            exit(2);
        }
        b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

static void sb_puts(strbuf *b, const char *s)
{
    sb_putn(b, s, strlen(s));
}

/* Appends s with LF, CR, backslash, '|' and non-printable bytes escaped, so one event is one
 * line and the fields stay apart. */
static void sb_put_escaped(strbuf *b, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char tmp[8];
        if (c == '\n')
            sb_puts(b, "\\n");
        else if (c == '\r')
            sb_puts(b, "\\r");
        else if (c == '\\' || c == '|')
            sb_puts(b, c == '|' ? "\\|" : "\\\\");
        else if (c >= 0x20 && c < 0x7f)
            sb_putn(b, (const char *)&c, 1);
        else {
            snprintf(tmp, sizeof tmp, "\\x%02x", c);
            sb_puts(b, tmp);
        }
    }
}

/* ---- recording events ---- */

typedef struct recorder {
    strbuf out;
    size_t limit;   /* max_event_bytes the parser was given */
    int events;     /* events seen so far */
    int stop_at;    /* the callback returns stop_value on this event (1-based); 0 never */
    int stop_value; /* what it then returns */
    int broken;     /* an event broke a contract of sse.h (NULL pointer, data over the limit) */
} recorder;

static int record_event(void *ud, const sse_event *ev)
{
    recorder *r = ud;
    char retry[32];

    r->events++;
    if (ev->event == NULL || ev->data == NULL || ev->id == NULL || ev->data_len > r->limit ||
        ev->retry_ms < -1) {
        r->broken = 1;
        return 0;
    }
    sb_put_escaped(&r->out, ev->event, ev->event_len);
    sb_puts(&r->out, "|");
    sb_put_escaped(&r->out, ev->data, ev->data_len);
    sb_puts(&r->out, "|");
    sb_put_escaped(&r->out, ev->id, ev->id_len);
    snprintf(retry, sizeof retry, "|%ld\n", ev->retry_ms);
    sb_puts(&r->out, retry);
    return r->events == r->stop_at ? r->stop_value : 0;
}

/* Starts recording: r zeroed, and p a parser of max_event_bytes `limit` whose events go to r. */
static void record_start(sse_parser *p, recorder *r, size_t limit)
{
    memset(r, 0, sizeof *r);
    r->limit = limit;
    sse_parser_init(p, limit, record_event, r);
}

/* What r recorded so far ("" for nothing). */
static const char *recorded(const recorder *r)
{
    return r->out.s ? r->out.s : "";
}

/* Ends recording: frees p and what r recorded. */
static void record_end(sse_parser *p, recorder *r)
{
    sse_parser_free(p);
    free(r->out.s);
}

/* Feeds a string literal (its length counted by the compiler). */
#define FEED(p, lit) sse_parser_feed((p), (lit), sizeof(lit) - 1)

/* Parses in[0..len) with the given limit, fed as the pieces [0,a) [a,b) [b,len) (or in pieces of
 * `step` bytes when step > 0), then finishes. Returns the recorded events followed by
 * "rc=N\n", N being the first non-zero result (or 0); the caller frees it. A result that is not
 * sticky, or a contract-breaking event, shows up as a "BROKEN" line. */
static char *parse_pieces(const char *in, size_t len, size_t limit, size_t a, size_t b, size_t step)
{
    sse_parser p;
    recorder r = {0};
    int rc = 0;
    char tail[48];

    r.limit = limit;
    sse_parser_init(&p, limit, record_event, &r);
    if (step > 0) {
        for (size_t i = 0; i < len && rc == 0; i += step)
            rc = sse_parser_feed(&p, in + i, len - i < step ? len - i : step);
    } else {
        rc = sse_parser_feed(&p, in, a);
        if (rc == 0) rc = sse_parser_feed(&p, in + a, b - a);
        if (rc == 0) rc = sse_parser_feed(&p, in + b, len - b);
    }
    if (rc == 0) rc = sse_parser_finish(&p);
    if (rc != 0 && (FEED(&p, "data: x\n\n") != rc || sse_parser_finish(&p) != rc)) r.broken = 1;
    if (r.broken) sb_puts(&r.out, "BROKEN\n");
    snprintf(tail, sizeof tail, "rc=%d\n", rc);
    sb_puts(&r.out, tail);
    sse_parser_free(&p);
    return r.out.s;
}

/* Requires that in[0..len) parses to exactly `events` with result `rc`, fed whole, split in two
 * at every position, and byte by byte; with split3 also in three pieces at every pair of
 * positions (quadratic, so only for short inputs). */
static void expect_chunked(const char *file, int line, const char *in, size_t len, size_t limit,
                           const char *events, int rc, int split3)
{
    strbuf want = {0};
    char tail[48];
    char *got;
    int before = check_failures;

    sb_puts(&want, events);
    snprintf(tail, sizeof tail, "rc=%d\n", rc);
    sb_puts(&want, tail);

    got = parse_pieces(in, len, limit, len, len, 0);
    check_str(file, line, "fed whole", want.s, got);
    free(got);
    got = parse_pieces(in, len, limit, 0, 0, 1);
    check_str(file, line, "fed byte by byte", want.s, got);
    free(got);
    for (size_t a = 0; a <= len && check_failures == before; a++) {
        for (size_t b = split3 ? a : len; b <= len && check_failures == before; b++) {
            got = parse_pieces(in, len, limit, a, b, 0);
            if (strcmp(want.s, got) != 0) {
                fprintf(stderr, "%s:%d: fed as [0,%zu) [%zu,%zu) [%zu,%zu):\n", file, line, a, a, b,
                        b, len);
                check_str(file, line, "split feed", want.s, got);
            }
            free(got);
        }
    }
    free(want.s);
}

/* in is a string literal; its length comes from sizeof, so it may contain NUL bytes. */
#define EXPECT_EVENTS(in, events)                                                                  \
    expect_chunked(__FILE__, __LINE__, in, sizeof(in) - 1, 1 << 20, events, 0, 1)
#define EXPECT_EVENTS_LIMIT(in, limit, events, rc)                                                 \
    expect_chunked(__FILE__, __LINE__, in, sizeof(in) - 1, limit, events, rc, 1)

/* ---- the checks ---- */

static void lf_ends_lines(void)
{
    EXPECT_EVENTS("data: a\n\ndata: b\n\n", "message|a||-1\n"
                                            "message|b||-1\n");
}

static void crlf_ends_lines(void)
{
    EXPECT_EVENTS("event: x\r\ndata: a\r\n\r\ndata: b\r\n\r\n", "x|a||-1\n"
                                                                "message|b||-1\n");
}

static void lone_cr_ends_lines(void)
{
    EXPECT_EVENTS("data: a\rdata: b\r\rdata: c\r\r", "message|a\\nb||-1\n"
                                                     "message|c||-1\n");
}

static void mixed_line_ends_in_one_stream(void)
{
    EXPECT_EVENTS("data: a\r\ndata: b\rdata: c\n\r\n", "message|a\\nb\\nc||-1\n");
}

static void crlf_split_across_feeds_is_one_line_end(void)
{
    sse_parser p;
    recorder r;

    record_start(&p, &r, 64);
    /* Were the LF after a chunk-final CR a second line end, "a" would be dispatched alone. */
    CHECK_INT(0, FEED(&p, "data: a\r"));
    CHECK_INT(0, FEED(&p, "\ndata: b\r"));
    CHECK_INT(0, FEED(&p, "\n"));
    CHECK_INT(0, r.events);
    CHECK_INT(0, FEED(&p, "\r"));
    CHECK_INT(1, r.events);
    CHECK_INT(0, FEED(&p, "\n")); /* the LF of that CRLF: no second dispatch */
    CHECK_INT(0, FEED(&p, "\r\n"));
    CHECK_INT(0, sse_parser_finish(&p));
    CHECK_STR("message|a\\nb||-1\n", recorded(&r));
    record_end(&p, &r);
}

static void every_split_and_byte_by_byte_match_whole_feed(void)
{
    /* Streams with something at every boundary that could go wrong: CRLF pairs, a BOM, comments,
     * a NUL in an id, a stop at the size limit. expect_chunked tries every 2- and 3-way split. */
    EXPECT_EVENTS("\xEF\xBB\xBF"
                  ": hi\r\nevent: output\r\ndata: {\"a\":\r\ndata: 1}\r\nid: 7\r\n\r\n"
                  "retry: 10\rdata\r\r",
                  "output|{\"a\":\\n1}|7|-1\n"
                  "message||7|10\n");
    EXPECT_EVENTS("id: 1\0\ndata:x\n\n\n\r\r\n\nevent:e\r", "message|x||-1\n"
                                                            "e|||-1\n");
    EXPECT_EVENTS_LIMIT("data: 12\ndata: 3\n\ndata: 123456\n", 5, "message|12\\n3||-1\n",
                        SSE_ERR_TOO_LARGE);
}

static void comments_are_ignored(void)
{
    EXPECT_EVENTS(":keep-alive\n\n: data: no\ndata: a\n:x\n\n:\n\n", "message|a||-1\n");
}

static void exactly_one_leading_space_is_stripped(void)
{
    EXPECT_EVENTS("data: a\n\n"
                  "data:b\n\n"
                  "data:  c\n\n"
                  "data: \n\n"
                  "data:\t d\n\n"
                  "event:  e\ndata: f \n\n",
                  "message|a||-1\n"
                  "message|b||-1\n"
                  "message| c||-1\n"
                  "message|||-1\n"
                  "message|\\x09 d||-1\n"
                  " e|f ||-1\n");
}

static void line_without_colon_is_field_with_empty_value(void)
{
    EXPECT_EVENTS("data\n\n"
                  "data\ndata\n\n"
                  "event: x\nevent\ndata: y\n\n"
                  "id: 5\nid\ndata: z\n\n"
                  "foo\n\n",
                  "message|||-1\n"
                  "message|\\n||-1\n"
                  "message|y||-1\n"
                  "message|z||-1\n");
}

static void multi_line_data_is_joined_with_lf(void)
{
    EXPECT_EVENTS("data: a\ndata: b\ndata: c\n\n"
                  "data:\ndata:\n\n"
                  "data: x\nevent: e\ndata: y\n\n",
                  "message|a\\nb\\nc||-1\n"
                  "message|\\n||-1\n"
                  "e|x\\ny||-1\n");
}

static void render_wire_example_from_section_5_2(void)
{
    EXPECT_EVENTS("event: output\n"
                  "data: {\"stream\":\"stdout\",\"data\":\"hi\\n\"}\n"
                  "\n"
                  "event: output\n"
                  "data: {\"stream\":\"stderr\",\"data\":\"warn\\n\"}\n"
                  "\n"
                  "event: exit\n"
                  "data: {\"exit_code\":7}\n"
                  "\n",
                  "output|{\"stream\":\"stdout\",\"data\":\"hi\\\\n\"}||-1\n"
                  "output|{\"stream\":\"stderr\",\"data\":\"warn\\\\n\"}||-1\n"
                  "exit|{\"exit_code\":7}||-1\n");
}

static void render_multi_line_exit_vector(void)
{
    EXPECT_EVENTS("event: exit\ndata: {\"exit_code\":\ndata: 3}\n\n",
                  "exit|{\"exit_code\":\\n3}||-1\n");
}

/* Captures the single event of the 4 MiB check without escaping it. */
typedef struct big_event {
    int events;
    char event[16];
    char *data;
    size_t data_len;
} big_event;

static int keep_big_event(void *ud, const sse_event *ev)
{
    big_event *b = ud;

    b->events++;
    snprintf(b->event, sizeof b->event, "%.*s", (int)ev->event_len, ev->event);
    free(b->data);
    b->data = malloc(ev->data_len ? ev->data_len : 1);
    if (b->data == NULL) exit(2);
    memcpy(b->data, ev->data, ev->data_len);
    b->data_len = ev->data_len;
    return 0;
}

static void render_4mib_output_event(void)
{
    const size_t data_len = (size_t)4 << 20;
    const char *head = "event: output\ndata: {\"stream\":\"stdout\",\"data\":\"";
    const char *tail = "\"}\n\n";
    size_t prefix = strlen("event: output\ndata: ");
    size_t json_head = strlen(head) - prefix;
    size_t len = strlen(head) + (data_len - json_head - 2) + strlen(tail);
    char *in = malloc(len);
    const size_t steps[] = {0, 1, 16384, 65537};

    if (in == NULL) exit(2);
    memcpy(in, head, strlen(head));
    memset(in + strlen(head), 'A', data_len - json_head - 2);
    memcpy(in + len - strlen(tail), tail, strlen(tail));
    /* The data is exactly 4 MiB, and so is the limit: the boundary itself must be allowed. */
    for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
        big_event b = {0};
        sse_parser p;
        int rc = 0;

        sse_parser_init(&p, data_len, keep_big_event, &b);
        if (steps[k] == 0) {
            rc = sse_parser_feed(&p, in, len);
        } else {
            for (size_t i = 0; i < len && rc == 0; i += steps[k])
                rc = sse_parser_feed(&p, in + i, len - i < steps[k] ? len - i : steps[k]);
        }
        CHECK_INT(0, rc);
        CHECK_INT(0, sse_parser_finish(&p));
        CHECK_INT(1, b.events);
        CHECK_STR("output", b.event);
        CHECK_INT(data_len, b.data_len);
        CHECK(b.data != NULL && memcmp(b.data, in + prefix, data_len) == 0);
        sse_parser_free(&p);
        free(b.data);
    }
    free(in);
}

static void unknown_fields_are_ignored(void)
{
    EXPECT_EVENTS("foo: bar\ndata: a\nDATA: b\nData: c\n dat: d\ndata : e\nevents: f\n\n"
                  "event: x\nfoo\n\n"
                  "idx: 9\nretryy: 5\nd\n\n",
                  "message|a||-1\n"
                  "x|||-1\n");
}

static void retry_with_digits_is_reported_on_its_event(void)
{
    EXPECT_EVENTS("retry: 1500\ndata: a\n\n"
                  "data: b\n\n"
                  "retry:0\nretry: 007\ndata: c\n\n",
                  "message|a||1500\n"
                  "message|b||-1\n"
                  "message|c||7\n");
}

/* A retry: too large for a long saturates instead of wrapping. */
#if LONG_MAX == 9223372036854775807L
#define LONG_MAX_TEXT "9223372036854775807"
#else
#define LONG_MAX_TEXT "2147483647"
#endif

static void retry_with_non_digits_is_ignored(void)
{
    EXPECT_EVENTS("retry: 15a\ndata: a\n\n"
                  "retry: -1\ndata: b\n\n"
                  "retry: 1.5\ndata: c\n\n"
                  "retry:  15\ndata: d\n\n"
                  "retry:\nretry\ndata: e\n\n"
                  "retry: 10\nretry: x\ndata: f\n\n"
                  "retry: 99999999999999999999999999\ndata: g\n\n",
                  "message|a||-1\n"
                  "message|b||-1\n"
                  "message|c||-1\n"
                  "message|d||-1\n"
                  "message|e||-1\n"
                  "message|f||10\n"
                  "message|g||" LONG_MAX_TEXT "\n");
}

static void id_is_last_seen_and_survives_events(void)
{
    EXPECT_EVENTS("id: 1\ndata: a\n\n"
                  "data: b\n\n"
                  "id: 7\n\n"
                  "data: c\n\n"
                  "id\ndata: d\n\n"
                  "id:  x y\ndata: e\nid: z\n\n",
                  "message|a|1|-1\n"
                  "message|b|1|-1\n"
                  "message|c|7|-1\n"
                  "message|d||-1\n"
                  "message|e|z|-1\n");
}

static void id_containing_nul_is_ignored(void)
{
    EXPECT_EVENTS("id: 1\ndata: a\n\nid: 2\0x\ndata: b\n\nid: \0\ndata: c\n\n", "message|a|1|-1\n"
                                                                                "message|b|1|-1\n"
                                                                                "message|c|1|-1\n");
}

static void bom_at_stream_start_is_skipped(void)
{
    EXPECT_EVENTS("\xEF\xBB\xBF"
                  "data: a\n\n",
                  "message|a||-1\n");
    /* Only one BOM, and only at the start: anywhere else it is part of a field name. */
    EXPECT_EVENTS("\xEF\xBB\xBF\xEF\xBB\xBF"
                  "data: a\n\n",
                  "");
    EXPECT_EVENTS("data: a\n\n\xEF\xBB\xBF"
                  "data: b\n\n",
                  "message|a||-1\n");
    /* A partial BOM is ordinary content, and so are its bytes inside a value. */
    EXPECT_EVENTS("\xEF\xBB"
                  "data: a\n\n",
                  "");
    EXPECT_EVENTS("\xEF\xBB\xBF"
                  "data: \xEF\xBB\xBF\n\n",
                  "message|\\xef\\xbb\\xbf||-1\n");
    EXPECT_EVENTS("\xEF", "");
}

static void finish_dispatches_final_event_without_blank_line(void)
{
    EXPECT_EVENTS("data: a", "message|a||-1\n");
    EXPECT_EVENTS("data: a\n", "message|a||-1\n");
    EXPECT_EVENTS("event: exit\ndata: {\"exit_code\":0}\r", "exit|{\"exit_code\":0}||-1\n");
    EXPECT_EVENTS("event: exit", "exit|||-1\n");
    EXPECT_EVENTS("data: a\n\n", "message|a||-1\n"); /* exactly once */
    EXPECT_EVENTS("id: 3", "");
    EXPECT_EVENTS("", "");
}

static void finish_readies_parser_for_a_reconnect(void)
{
    sse_parser p;
    recorder r;

    record_start(&p, &r, 64);
    CHECK_INT(0, FEED(&p, "id: 4\ndata: a\r"));
    CHECK_INT(0, sse_parser_finish(&p));
    /* A new stream may start with its own BOM and its own LF; the last id carries over. */
    CHECK_INT(0, FEED(&p, "\xEF\xBB\xBF\ndata: b\n\n"));
    CHECK_INT(0, sse_parser_finish(&p));
    CHECK_STR("message|a|4|-1\n"
              "message|b|4|-1\n",
              recorded(&r));
    record_end(&p, &r);
}

static void event_line_without_data_is_dispatched(void)
{
    EXPECT_EVENTS("event: exit\n\n"
                  "event:\n\n"
                  "id: 3\n\n"
                  "retry: 5\n\n"
                  "foo: bar\n\n"
                  "event: exit\ndata: {}\n\n",
                  "exit|||-1\n"
                  "message|||-1\n"
                  "exit|{}|3|-1\n");
}

static void callback_stop_value_is_returned_and_sticky(void)
{
    const char *in = "data: 1\n\ndata: 2\n\ndata: 3\n\n";
    sse_parser p;
    recorder r;

    record_start(&p, &r, 64);
    r.stop_at = 2;
    r.stop_value = 42;
    CHECK_INT(42, sse_parser_feed(&p, in, strlen(in)));
    CHECK_INT(2, r.events); /* the third event is never parsed */
    CHECK_INT(42, FEED(&p, "data: 4\n\n"));
    CHECK_INT(42, sse_parser_finish(&p));
    CHECK_INT(2, r.events);
    CHECK(strstr(sse_parser_error(&p), "42") != NULL);
    record_end(&p, &r);

    /* A stop from the event that finish dispatches is returned by finish. */
    record_start(&p, &r, 64);
    r.stop_at = 1;
    r.stop_value = 7;
    CHECK_INT(0, FEED(&p, "event: exit"));
    CHECK_INT(7, sse_parser_finish(&p));
    CHECK_INT(1, r.events);
    record_end(&p, &r);
}

static void size_limit_is_an_error_naming_the_limit(void)
{
    sse_parser p;

    /* The limit itself fits; one byte more does not, counting the LFs that join data lines. */
    EXPECT_EVENTS_LIMIT("data: 12345678\n\n", 8, "message|12345678||-1\n", 0);
    EXPECT_EVENTS_LIMIT("data: 123456789\n\n", 8, "", SSE_ERR_TOO_LARGE);
    EXPECT_EVENTS_LIMIT("data: 1234\ndata: 567\n\n", 8, "message|1234\\n567||-1\n", 0);
    EXPECT_EVENTS_LIMIT("data: 1234\ndata: 5678\n\n", 8, "", SSE_ERR_TOO_LARGE);
    EXPECT_EVENTS_LIMIT("data: 12345678\ndata\n\n", 8, "", SSE_ERR_TOO_LARGE);
    /* Events before the breaking one are still delivered. */
    EXPECT_EVENTS_LIMIT("data: ok\n\ndata: too long\n\n", 4, "message|ok||-1\n", SSE_ERR_TOO_LARGE);
    /* Lines that are never stored are bounded too, so one endless line cannot stall a stream. */
    EXPECT_EVENTS_LIMIT(": 123456789\n\n", 8, "", SSE_ERR_TOO_LARGE);
    EXPECT_EVENTS_LIMIT("123456789: x\n\n", 8, "", SSE_ERR_TOO_LARGE);
    EXPECT_EVENTS_LIMIT("event: 123456789\n\n", 8, "", SSE_ERR_TOO_LARGE);
    EXPECT_EVENTS_LIMIT("id: 123456789\n\n", 8, "", SSE_ERR_TOO_LARGE);

    sse_parser_init(&p, 4194304, NULL, NULL);
    CHECK_STR("no error", sse_parser_error(&p));
    sse_parser_free(&p);
    sse_parser_init(&p, 8, NULL, NULL);
    CHECK_INT(SSE_ERR_TOO_LARGE, FEED(&p, "data: 123456789"));
    CHECK(strstr(sse_parser_error(&p), "8 bytes") != NULL);
    CHECK(strstr(sse_parser_error(&p), "max_event_bytes") != NULL);
    CHECK_INT(SSE_ERR_TOO_LARGE, FEED(&p, "\n\n")); /* sticky */
    CHECK_INT(SSE_ERR_TOO_LARGE, sse_parser_finish(&p));
    sse_parser_free(&p);
}

static void free_twice_is_safe_and_init_reuses(void)
{
    sse_parser p;
    recorder r = {0};

    sse_parser_init(&p, 64, NULL, NULL);
    sse_parser_free(&p); /* nothing allocated yet */
    sse_parser_free(&p);

    r.limit = 64;
    sse_parser_init(&p, 64, record_event, &r);
    CHECK_INT(0, FEED(&p, "id: 1\nevent: e\ndata: x"));
    sse_parser_free(&p);
    sse_parser_free(&p);
    sse_parser_init(&p, 64, record_event, &r);
    CHECK_INT(0, FEED(&p, "data: y\n\n"));
    CHECK_INT(0, sse_parser_finish(&p));
    CHECK_STR("message|y||-1\n", recorded(&r));
    sse_parser_free(&p);
    record_end(&p, &r);
}

static void empty_feed_and_null_callback_are_allowed(void)
{
    sse_parser p;

    sse_parser_init(&p, 64, NULL, NULL);
    CHECK_INT(0, sse_parser_feed(&p, NULL, 0));
    CHECK_INT(0, FEED(&p, "data: a\n\n"));
    CHECK_INT(0, sse_parser_finish(&p));
    sse_parser_free(&p);
}

static void many_events_reuse_their_buffers(void)
{
    /* Not a timing test: it runs 100k events through one parser so ASan and valgrind see every
     * buffer reuse and swap of the id buffers. */
    const char *chunk = "id: 12\nevent: output\ndata: {\"stream\":\"stdout\",\"data\":\"x\"}\n\n";
    sse_parser p;
    recorder r = {0};
    int rc = 0;

    r.limit = 256;
    sse_parser_init(&p, 256, NULL, NULL);
    for (int i = 0; i < 100000 && rc == 0; i++)
        rc = sse_parser_feed(&p, chunk, strlen(chunk));
    CHECK_INT(0, rc);
    sse_parser_free(&p);
    sse_parser_init(&p, 256, record_event, &r);
    CHECK_INT(0, sse_parser_feed(&p, chunk, strlen(chunk)));
    CHECK_STR("output|{\"stream\":\"stdout\",\"data\":\"x\"}|12|-1\n", recorded(&r));
    record_end(&p, &r);
}

int main(void)
{
    RUN(lf_ends_lines);
    RUN(crlf_ends_lines);
    RUN(lone_cr_ends_lines);
    RUN(mixed_line_ends_in_one_stream);
    RUN(crlf_split_across_feeds_is_one_line_end);
    RUN(every_split_and_byte_by_byte_match_whole_feed);
    RUN(comments_are_ignored);
    RUN(exactly_one_leading_space_is_stripped);
    RUN(line_without_colon_is_field_with_empty_value);
    RUN(multi_line_data_is_joined_with_lf);
    RUN(render_wire_example_from_section_5_2);
    RUN(render_multi_line_exit_vector);
    RUN(render_4mib_output_event);
    RUN(unknown_fields_are_ignored);
    RUN(retry_with_digits_is_reported_on_its_event);
    RUN(retry_with_non_digits_is_ignored);
    RUN(id_is_last_seen_and_survives_events);
    RUN(id_containing_nul_is_ignored);
    RUN(bom_at_stream_start_is_skipped);
    RUN(finish_dispatches_final_event_without_blank_line);
    RUN(finish_readies_parser_for_a_reconnect);
    RUN(event_line_without_data_is_dispatched);
    RUN(callback_stop_value_is_returned_and_sticky);
    RUN(size_limit_is_an_error_naming_the_limit);
    RUN(free_twice_is_safe_and_init_reuses);
    RUN(empty_feed_and_null_callback_are_allowed);
    RUN(many_events_reuse_their_buffers);
    return check_summary();
}
