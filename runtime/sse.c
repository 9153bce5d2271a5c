/* sse.c - incremental Server-Sent Events parser (see sse.h for the contract).
 *
 * The parser is a small per-line state machine that never buffers a whole line: field-name
 * bytes are counted (the first few kept to recognise the field), and value bytes go straight to
 * the buffer of the field they belong to, or nowhere for comments and unknown fields. That keeps a
 * 4 MiB data line at one copy and lets any chunk boundary fall anywhere, including between the CR
 * and LF of one line end (after_cr carries that across feeds) and inside the UTF-8 BOM.
 *
 * Invariants between calls: value_len and name_len <= max_event_bytes; data.len <=
 * max_event_bytes; status != 0 means the parser is spent until sse_parser_init.
 * Called from the HTTP layer's write callbacks and from the tests and fuzz target; it never calls
 * anything but the event callback and the C library.
 */
#include "sse.h"

#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Where in the current line the next byte goes. */
enum {
    SSE_ST_NAME,        /* field name, or nothing yet at the start of a line */
    SSE_ST_VALUE_START, /* just after the colon, where one space is dropped */
    SSE_ST_VALUE,       /* value bytes until the line end */
};

/* Which field the current line's value belongs to. */
enum {
    SSE_FIELD_IGNORE, /* comments and unknown fields: counted, not stored */
    SSE_FIELD_DATA,
    SSE_FIELD_EVENT,
    SSE_FIELD_ID,
    SSE_FIELD_RETRY,
};

#define SSE_BOM_LEN 3
#define SSE_MIN_CAP 64 /* first allocation; small enough for keep-alive-only streams */

static const char sse_bom[SSE_BOM_LEN] = {'\xEF', '\xBB', '\xBF'};

/* Records that the stream broke the size limit while storing `what`, and returns the error. */
static int sse_too_large(sse_parser *p, const char *what)
{
    p->status = SSE_ERR_TOO_LARGE;
    snprintf(p->errmsg, sizeof p->errmsg, "SSE %s exceeds max_event_bytes (%zu bytes)", what,
             p->max_event_bytes);
    return p->status;
}

/* Appends n bytes to b, growing it geometrically but never past max_event_bytes; the caller has
 * already checked that b->len + n fits the limit. Returns 0 or SSE_ERR_NOMEM.
 *
 * Buffers double and are kept between events, so storing an n-byte stream costs O(n) amortised
 * and a steady stream of similar events stops allocating after the first one. A fixed buffer was
 * rejected: sized for Render's largest events (4 MiB output chunks, with no documented cap) it
 * would reserve megabytes for every concurrent exec stream that only ever carries small events,
 * and sized for the common case it would refuse legitimate large ones. */
static int sse_buf_append(sse_parser *p, sse_buf *b, const char *src, size_t n)
{
    if (n == 0) return 0;
    if (n > b->cap - b->len) {
        size_t need = b->len + n;
        size_t cap = b->cap ? b->cap : SSE_MIN_CAP;
        while (cap < need)
            cap = cap > SIZE_MAX / 2 ? need : cap * 2;
        if (cap > p->max_event_bytes)
            cap = p->max_event_bytes; /* still >= need, by the caller's check */
        char *ptr = realloc(b->ptr, cap);
        if (ptr == NULL) {
            p->status = SSE_ERR_NOMEM;
            snprintf(p->errmsg, sizeof p->errmsg,
                     "out of memory growing an SSE buffer to %zu bytes", cap);
            return p->status;
        }
        b->ptr = ptr;
        b->cap = cap;
    }
    memcpy(b->ptr + b->len, src, n);
    b->len += n;
    return 0;
}

/* Hands the current block to the callback if it had a data: or event: line (see sse.h for why
 * event: alone is enough), then clears the block; the last event id is kept. Returns 0 or the
 * callback's non-zero value, which becomes the sticky status. */
static int sse_dispatch(sse_parser *p)
{
    int rc = 0;

    if ((p->has_data || p->has_event) && p->fn != NULL) {
        sse_event ev;
        ev.event = p->event.len > 0 ? p->event.ptr : "message";
        ev.event_len = p->event.len > 0 ? p->event.len : strlen("message");
        ev.data = p->data.len > 0 ? p->data.ptr : "";
        ev.data_len = p->data.len;
        ev.id = p->id.len > 0 ? p->id.ptr : "";
        ev.id_len = p->id.len;
        ev.retry_ms = p->retry_ms;
        rc = p->fn(p->ud, &ev);
    }
    p->data.len = 0;
    p->event.len = 0;
    p->has_data = 0;
    p->has_event = 0;
    p->retry_ms = -1;
    if (rc != 0) {
        p->status = rc;
        snprintf(p->errmsg, sizeof p->errmsg, "SSE parsing stopped by the event callback (%d)", rc);
    }
    return rc;
}

/* Adds n bytes to the current line's field name; only the first sizeof p->name are kept, which
 * is all that recognising "data", "event", "id" and "retry" needs. Returns 0 or
 * SSE_ERR_TOO_LARGE. */
static int sse_take_name(sse_parser *p, const char *s, size_t n)
{
    if (n > p->max_event_bytes - p->name_len) return sse_too_large(p, "field name");
    if (p->name_len < sizeof p->name) {
        size_t keep = sizeof p->name - p->name_len;
        memcpy(p->name + p->name_len, s, n < keep ? n : keep);
    }
    p->name_len += n;
    return 0;
}

/* Resolves the field named so far and prepares its destination, at the colon or at the line end
 * of a line without one. A data: line after the first adds the joining LF here, so the data
 * never needs a trailing LF stripped. Returns 0 or SSE_ERR_TOO_LARGE / SSE_ERR_NOMEM. */
static int sse_begin_field(sse_parser *p)
{
    const char *name = p->name;
    size_t n = p->name_len;

    p->value_len = 0;
    p->field = SSE_FIELD_IGNORE;
    if (n == 4 && memcmp(name, "data", 4) == 0) {
        p->field = SSE_FIELD_DATA;
        if (p->has_data) {
            if (p->data.len >= p->max_event_bytes) return sse_too_large(p, "event data");
            if (sse_buf_append(p, &p->data, "\n", 1) != 0) return p->status;
        }
        p->has_data = 1;
    } else if (n == 5 && memcmp(name, "event", 5) == 0) {
        p->field = SSE_FIELD_EVENT;
        p->event.len = 0;
        p->has_event = 1;
    } else if (n == 2 && memcmp(name, "id", 2) == 0) {
        p->field = SSE_FIELD_ID;
        p->id_pending.len = 0;
        p->id_has_nul = 0;
    } else if (n == 5 && memcmp(name, "retry", 5) == 0) {
        p->field = SSE_FIELD_RETRY;
        p->retry_value = 0;
        p->retry_valid = 1;
    }
    return 0;
}

/* Adds n value bytes to the current field. Data is limited by the event's total (which already
 * bounds the line); every other value, comments included, by the per-line limit, so a server
 * cannot hold the parser in one endless line. Returns 0 or SSE_ERR_TOO_LARGE / SSE_ERR_NOMEM. */
static int sse_take_value(sse_parser *p, const char *s, size_t n)
{
    if (n == 0) return 0;
    if (p->field == SSE_FIELD_DATA) {
        if (n > p->max_event_bytes - p->data.len) return sse_too_large(p, "event data");
    } else if (n > p->max_event_bytes - p->value_len) {
        return sse_too_large(p, "line");
    }
    p->value_len += n;
    switch (p->field) {
    case SSE_FIELD_DATA:
        return sse_buf_append(p, &p->data, s, n);
    case SSE_FIELD_EVENT:
        return sse_buf_append(p, &p->event, s, n);
    case SSE_FIELD_ID:
        if (memchr(s, '\0', n) != NULL) p->id_has_nul = 1;
        return sse_buf_append(p, &p->id_pending, s, n);
    case SSE_FIELD_RETRY:
        for (size_t i = 0; i < n && p->retry_valid; i++) {
            int digit = s[i] - '0';
            if (digit < 0 || digit > 9)
                p->retry_valid = 0;
            else if (p->retry_value > (LONG_MAX - digit) / 10)
                p->retry_value = LONG_MAX; /* a reconnection time past LONG_MAX ms is "forever" */
            else
                p->retry_value = p->retry_value * 10 + digit;
        }
        return 0;
    default:
        return 0;
    }
}

/* Completes the current line at its line end: a blank line dispatches, any other line commits
 * its field (id and retry only take effect once their whole value is known to be valid).
 * Returns 0, an SSE_ERR_*, or the callback's stop value. */
static int sse_end_line(sse_parser *p)
{
    if (p->state == SSE_ST_NAME) {
        if (p->name_len == 0) return sse_dispatch(p);
        if (sse_begin_field(p) != 0) /* a line without a colon: the field with an empty value */
            return p->status;
    }
    if (p->field == SSE_FIELD_ID && !p->id_has_nul) {
        sse_buf last = p->id; /* swap rather than copy; the old buffer is reused next time */
        p->id = p->id_pending;
        p->id_pending = last;
    } else if (p->field == SSE_FIELD_RETRY && p->retry_valid && p->value_len > 0) {
        p->retry_ms = p->retry_value;
    }
    p->state = SSE_ST_NAME;
    p->field = SSE_FIELD_IGNORE;
    p->name_len = 0;
    p->value_len = 0;
    return 0;
}

/* Runs len bytes (past any BOM) through the line state machine. Each step consumes a whole run
 * of name or value bytes at once, so the cost is O(len) plus one call per line. Returns 0, an
 * SSE_ERR_*, or the callback's stop value. */
static int sse_parse(sse_parser *p, const char *buf, size_t len)
{
    size_t i = 0;

    while (i < len) {
        size_t j = i;
        int rc;

        if (p->after_cr) {
            p->after_cr = 0;
            if (buf[i] == '\n') { /* the LF of a CRLF whose CR ended the line already */
                i++;
                continue;
            }
        }
        switch (p->state) {
        case SSE_ST_NAME:
            while (j < len && buf[j] != ':' && buf[j] != '\r' && buf[j] != '\n')
                j++;
            if ((rc = sse_take_name(p, buf + i, j - i)) != 0) return rc;
            if (j == len) return 0;
            if (buf[j] == ':') {
                if (p->name_len == 0) { /* a comment: the rest of the line is ignored */
                    p->field = SSE_FIELD_IGNORE;
                    p->value_len = 0;
                    p->state = SSE_ST_VALUE;
                } else {
                    if ((rc = sse_begin_field(p)) != 0) return rc;
                    p->state = SSE_ST_VALUE_START;
                }
                i = j + 1;
                continue;
            }
            break;
        case SSE_ST_VALUE_START:
            if (buf[i] == ' ') i++;
            p->state = SSE_ST_VALUE;
            continue;
        default: {
            /* Values are long (a 64 KiB output event is one data line): find the line end with
             * memchr, which scans a word or a vector at a time, not byte by byte. */
            const char *lf = memchr(buf + i, '\n', len - i);
            size_t end = lf ? (size_t)(lf - buf) : len;
            const char *cr = memchr(buf + i, '\r', end - i);
            j = cr ? (size_t)(cr - buf) : end;
        }
            if ((rc = sse_take_value(p, buf + i, j - i)) != 0) return rc;
            if (j == len) return 0;
            break;
        }
        /* buf[j] ends the line; a CR may be followed by an LF in this feed or the next. */
        p->after_cr = buf[j] == '\r';
        if ((rc = sse_end_line(p)) != 0) return rc;
        i = j + 1;
    }
    return 0;
}

void sse_parser_init(sse_parser *p, size_t max_event_bytes, sse_event_fn fn, void *ud)
{
    memset(p, 0, sizeof *p);
    p->fn = fn;
    p->ud = ud;
    p->max_event_bytes = max_event_bytes;
    p->state = SSE_ST_NAME;
    p->field = SSE_FIELD_IGNORE;
    p->retry_ms = -1;
}

int sse_parser_feed(sse_parser *p, const char *buf, size_t len)
{
    size_t i = 0;

    if (p->status != 0 || len == 0) return p->status;
    /* The BOM is matched byte by byte because a chunk may end inside it; on a mismatch the bytes
     * matched so far were ordinary content and are parsed before the current byte. */
    while (p->bom_seen < SSE_BOM_LEN && i < len) {
        if (buf[i] == sse_bom[p->bom_seen]) {
            p->bom_seen++;
            i++;
        } else {
            size_t matched = (size_t)p->bom_seen;
            int rc;
            p->bom_seen = SSE_BOM_LEN;
            if ((rc = sse_parse(p, sse_bom, matched)) != 0) return rc;
        }
    }
    return sse_parse(p, buf + i, len - i);
}

int sse_parser_finish(sse_parser *p)
{
    int rc;

    if (p->status != 0) return p->status;
    if (p->bom_seen < SSE_BOM_LEN) { /* the stream was a strict prefix of a BOM */
        size_t matched = (size_t)p->bom_seen;
        p->bom_seen = SSE_BOM_LEN;
        if ((rc = sse_parse(p, sse_bom, matched)) != 0) return rc;
    }
    if (p->state != SSE_ST_NAME || p->name_len > 0) {
        if ((rc = sse_end_line(p)) != 0) return rc;
    }
    if ((rc = sse_dispatch(p)) != 0) return rc;
    p->bom_seen = 0;
    p->after_cr = 0;
    return 0;
}

const char *sse_parser_error(const sse_parser *p)
{
    return p->status != 0 ? p->errmsg : "no error";
}

void sse_parser_free(sse_parser *p)
{
    sse_buf *bufs[] = {&p->data, &p->event, &p->id, &p->id_pending};

    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        free(bufs[i]->ptr);
        bufs[i]->ptr = NULL;
        bufs[i]->len = 0;
        bufs[i]->cap = 0;
    }
}
