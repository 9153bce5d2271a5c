/* sha256.h - SHA-256 (FIPS 180-4) for moonbox-sandbox's layer manifests (manifest.c).
 *
 * Our own because the helper is linked statically against musl and no Debian package ships a
 * static digest library built for it. Plain C, no state outside the context; the test vectors
 * of FIPS 180-4 and NIST's examples are checked by tests/c/test_sha256.c.
 */
#ifndef MOONBOX_SANDBOX_SHA256_H
#define MOONBOX_SANDBOX_SHA256_H

#include <stddef.h>
#include <stdint.h>

#define SHA256_BYTES 32

typedef struct sha256_ctx {
    uint32_t h[8];
    uint64_t len; /* bytes hashed so far */
    unsigned char buf[64];
    size_t fill; /* bytes in buf */
} sha256_ctx;

void sha256_init(sha256_ctx *c);
void sha256_update(sha256_ctx *c, const void *data, size_t len);
void sha256_final(sha256_ctx *c, unsigned char out[SHA256_BYTES]);

/* Writes the 64 lower-case hex digits of d and a NUL to hex. */
void sha256_hex(const unsigned char d[SHA256_BYTES], char hex[2 * SHA256_BYTES + 1]);

#endif
