/* output_event.h - the payload of an exec stream's `output` event, decoded without a JSON library.
 *
 * Owns one question: is an event's data exactly {"stream":"stdout"|"stderr","data":"<string>"}
 * (the two keys once each, in either order, JSON whitespace allowed), and if so, what bytes
 * does the string stand for. That is every output event Render and moonbox local send, and
 * decoding it here hands the caller the bytes without building a JSON value per event. Anything
 * else (another key, a value that is not a string, an escape it does not accept) is reported as
 * "not this shape", and the caller decodes the data with its general JSON decoder instead, so
 * unusual input gets exactly the general decoder's answer, errors included.
 *
 * The string is decoded as JSON says: the two-character escapes, \uXXXX to UTF-8 (a surrogate
 * pair to one 4-byte sequence, \u0000 to a NUL byte), other bytes copied as they are (invalid
 * UTF-8 included). A lone surrogate, a raw control character or a bad escape is "not this shape".
 * No Lua here: bindings/http.c and bindings/sse.c use it.
 */
#ifndef MOONBOX_OUTPUT_EVENT_H
#define MOONBOX_OUTPUT_EVENT_H

#include <stddef.h>

enum { OUTPUT_NOT_SHAPE = 0, OUTPUT_STDOUT = 1, OUTPUT_STDERR = 2 };

/* Decodes json[0..n) into out, which must have room for n bytes (the decoded string is never
 * longer than its JSON text); *out_len receives the byte count. Returns OUTPUT_STDOUT or
 * OUTPUT_STDERR, or OUTPUT_NOT_SHAPE (out's contents are then unspecified). O(n), no allocation. */
int output_event_decode(const char *json, size_t n, char *out, size_t *out_len);

#endif
