/* jsonq.h - JSON string literals from arbitrary bytes, fast.
 *
 * Owns the one escaping rule every JSON string moonbox writes follows (exec output on its way
 * into SSE events above all): '"', '\' and control characters are escaped, valid UTF-8 is kept
 * as is, and every byte that is not part of a valid UTF-8 sequence (RFC 3629: no overlong forms,
 * no surrogates, nothing above U+10FFFF) becomes U+FFFD. The output is always valid UTF-8 and
 * valid JSON, whatever the input.
 *
 * The caller owns the output buffer and sizes it with JSONQ_BOUND; nothing here allocates.
 * No Lua here: bindings/strings.c and bindings/httpd.c wrap it.
 */
#ifndef MOONBOX_JSONQ_H
#define MOONBOX_JSONQ_H

#include <stddef.h>

/* The most bytes jsonq_quote writes for n input bytes: the quotes, and six per byte (a control
 * character as \u00XX; an invalid byte takes three, U+FFFD). */
#define JSONQ_BOUND(n) (2 + 6 * (size_t)(n))

/* Writes s[0..n) as a JSON string literal, quotes included, to out (at least JSONQ_BOUND(n)
 * bytes) and returns the bytes written. */
size_t jsonq_quote(char *out, const unsigned char *s, size_t n);

/* Whether s[0..n) is entirely valid UTF-8 (as jsonq_quote judges it). */
int jsonq_utf8_valid(const unsigned char *s, size_t n);

/* Length of the valid UTF-8 sequence starting at s[0..n) (1 to 4), or 0 when the bytes there
 * are not one (as jsonq_quote judges it; such a byte becomes U+FFFD). n must be at least 1. */
size_t jsonq_utf8_seq(const unsigned char *s, size_t n);

/* The one UTF-8 boundary cut: the length of the longest prefix of s[0..n), at most max bytes,
 * that does not end inside a multi-byte sequence. A lead byte whose sequence would not fit is
 * left out with its continuation bytes; bytes that are invalid anyway stay (jsonq_quote turns
 * them into U+FFFD). With max >= n it splits off an incomplete sequence at the end, for the
 * next chunk to complete. */
size_t jsonq_utf8_cut(const unsigned char *s, size_t n, size_t max);

/* Writes {"message":"<msg>"} (msg quoted as jsonq_quote does) into out, NUL-terminated, and
 * returns its length. A message too long for cap bytes is cut at a UTF-8 boundary first. cap
 * must be at least 16. */
size_t jsonq_message(char *out, size_t cap, const char *msg, size_t n);

#endif
