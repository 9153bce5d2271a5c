/* sse_write.h - the one Server-Sent Events writer: framing events, comments and exec output.
 *
 * The writing side of runtime/sse.c's parser: an event is "event: NAME\n" (optional),
 * "id: ID\n" (optional), "data: LINE\n" per line of its data (split at \n, \r\n or \r) and a
 * blank line; a comment is ": LINE\n" per line. Each writer has an exact size function: callers
 * size the buffer with it, then write. Output events quote with runtime/jsonq.c. Plain functions,
 * any thread; bindings/httpd.c (w:sse, w:comment, w:sse_output) is the caller.
 */
#ifndef MOONBOX_SSE_WRITE_H
#define MOONBOX_SSE_WRITE_H

#include <stddef.h>

/* Exact bytes sse_write_event writes; event and id may be NULL (left out). Neither may hold a
 * line break (the caller checks). */
size_t sse_event_size(const char *event, const char *id, const char *data, size_t n);
size_t sse_write_event(char *out, const char *event, const char *id, const char *data, size_t n);

/* Exact bytes sse_write_comment writes: ": LINE\n" per line of text, or ":\n" when n is 0. */
size_t sse_comment_size(const char *text, size_t n);
size_t sse_write_comment(char *out, const char *text, size_t n);

/* The most bytes sse_write_output writes. */
size_t sse_output_bound(size_t stream_len, size_t data_len);

/* The event an exec's output chunk travels in, exactly what an "output" event with data
 * {"data": data, "stream": stream} (keys sorted, both quoted by jsonq) is. Returns its length. */
size_t sse_write_output(char *out, const unsigned char *stream, size_t sn,
                        const unsigned char *data, size_t dn);

#endif
