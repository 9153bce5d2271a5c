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

#endif
