/* sse.h - incremental Server-Sent Events parser.
 *
 * Owns the framing of one text/event-stream: bytes go in through sse_parser_feed() in chunks of
 * any size (a curl write callback's, or one byte at a time) and come out as whole events through
 * a callback. Chunking never changes the events: feeding a stream whole, split anywhere, or byte
 * by byte dispatches the same events and reports the same error at the same point.
 *
 * Framing follows the WHATWG EventSource rules, with one deliberate difference for Render: a
 * blank line dispatches an event when the block had a data: line OR an event: line, so an
 * `event: exit` with no data still arrives (with empty data) instead of being dropped. Blocks
 * with neither (only id:, retry:, comments or unknown fields) are not dispatched; an id: in them
 * still becomes the last event id, and a retry: in them is lost, because retry_ms belongs to the
 * event that carried it. End of stream (sse_parser_finish) dispatches a final unterminated block.
 *
 * Memory is bounded by max_event_bytes: no single line (field name, or value after the colon)
 * and no event's joined data may exceed it, so at most four buffers of that size exist (data,
 * event name, last id, the id being read). Comments and unknown fields are counted, not stored.
 *
 * Not thread-safe; one parser belongs to one stream. No Lua here: bindings/ wraps it.
 */
#ifndef MOONBOX_SSE_H
#define MOONBOX_SSE_H

#include <stddef.h>

typedef struct sse_event {
    const char *event; /* "message" when the event had no (or an empty) event: field */
    size_t event_len;
    const char *data; /* data: lines joined by "\n", no trailing newline; never NULL */
    size_t data_len;
    const char *id; /* last id seen, possibly from an earlier event; never NULL */
    size_t id_len;  /* 0 when no id was ever seen, or the last one was empty */
    long retry_ms;  /* -1 unless this event carried a valid (all ASCII digits) retry: */
} sse_event;

/* Called once per dispatched event; the pointers in ev are valid only during the call, and the
 * callback must not call back into the same parser. Return 0 to go on; any other value stops the
 * feed, which returns that value (use positive values so they cannot be mistaken for
 * SSE_ERR_*). A stop is final: the bytes after the event are not parsed. */
typedef int (*sse_event_fn)(void *ud, const sse_event *ev);

/* A growable byte buffer; len <= cap, ptr is NULL until the first byte is stored. */
typedef struct sse_buf {
    char *ptr;
    size_t len;
    size_t cap;
} sse_buf;

/* Public only so the parser can be embedded in the struct that owns the stream (no separate
 * allocation); callers use the functions below and never touch the fields. */
typedef struct sse_parser {
    sse_event_fn fn;
    void *ud;
    size_t max_event_bytes;
    sse_buf data;       /* joined data of the current block */
    sse_buf event;      /* event name of the current block */
    sse_buf id;         /* last event id; survives dispatch and finish */
    sse_buf id_pending; /* id: value being read; swapped into id at line end unless it had NUL */
    size_t name_len;    /* bytes of the current line's field name so far */
    size_t value_len;   /* bytes of the current line's value so far */
    char name[8];       /* first bytes of the field name; enough to recognise every known one */
    int state;          /* where in a line we are: SSE_ST_* in sse.c */
    int field;          /* which field the current value belongs to: SSE_FIELD_* in sse.c */
    int bom_seen;       /* bytes of a UTF-8 BOM matched at stream start; 3 once past it */
    int after_cr;       /* the previous byte was CR, so an LF next is the same line end */
    int has_data;       /* the current block had a data: line */
    int has_event;      /* the current block had an event: line */
    int id_has_nul;     /* the id: value being read contains NUL and will be ignored */
    int retry_valid;    /* the retry: value being read is all digits so far */
    long retry_value;   /* that value, saturated at LONG_MAX */
    long retry_ms;      /* retry of the current block, -1 when none */
    int status;         /* 0, or the sticky SSE_ERR_* / callback value that stopped the parser */
    char errmsg[96];
} sse_parser;

#define SSE_ERR_TOO_LARGE (-1) /* an event (or one line) grew past max_event_bytes */
#define SSE_ERR_NOMEM     (-2) /* a buffer could not grow */

/* Prepares p for a new stream whose events and lines stay within max_event_bytes, calling fn(ud,
 * ev) for each event (fn may be NULL to only validate framing). Allocates nothing and cannot
 * fail; buffers are allocated on first use. */
void sse_parser_init(sse_parser *p, size_t max_event_bytes, sse_event_fn fn, void *ud);

/* Parses len bytes of the stream, dispatching every event the bytes complete. Returns 0, a
 * negative SSE_ERR_* (see sse_parser_error), or the callback's non-zero value. Any non-zero
 * result is sticky: later feeds and finish return it again without parsing. O(len) amortised. */
int sse_parser_feed(sse_parser *p, const char *buf, size_t len);

/* Ends the stream: a line without a line end is completed and a block without a trailing blank
 * line is dispatched. Same returns as sse_parser_feed. On 0 the parser is ready for a new stream
 * (a reconnect) and keeps the last event id and its buffers. */
int sse_parser_finish(sse_parser *p);

/* Returns a readable description of why the parser stopped, or "no error"; the text lives in p
 * and is valid until the next call on p. */
const char *sse_parser_error(const sse_parser *p);

/* Releases the buffers. Safe to call twice; sse_parser_init makes p usable again. */
void sse_parser_free(sse_parser *p);

#endif
