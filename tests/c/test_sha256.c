/* test_sha256.c - unit tests for tools/sandbox/sha256.c, the digest of layer manifests.
 *
 * The vectors of FIPS 180-2's appendix B (one block, two blocks, a million 'a's) and the empty
 * message, each also fed in every split into two updates and byte by byte, so that the
 * buffering across block boundaries is covered as well as the padding of every length mod 64.
 * ctest runs it as c_sha256.
 */
#include "sha256.h"

#include <stdlib.h>
#include <string.h>

#include "check.h"

static const char *hex_of(const void *msg, size_t len)
{
    static char hex[2 * SHA256_BYTES + 1];
    unsigned char d[SHA256_BYTES];
    sha256_ctx c;
    sha256_init(&c);
    sha256_update(&c, msg, len);
    sha256_final(&c, d);
    sha256_hex(d, hex);
    return hex;
}

static const char *ABC448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";

static void vectors(void)
{
    CHECK_STR("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", hex_of("", 0));
    CHECK_STR("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", hex_of("abc", 3));
    CHECK_STR("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
              hex_of(ABC448, strlen(ABC448)));
    char *a = malloc(1000000);
    CHECK(a != NULL);
    if (!a) return;
    memset(a, 'a', 1000000);
    CHECK_STR("cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0",
              hex_of(a, 1000000));
    free(a);
}

/* Every split of the 448-bit message into two updates, and one byte at a time. */
static void splits(void)
{
    size_t n = strlen(ABC448);
    for (size_t k = 0; k <= n; k++) {
        unsigned char d[SHA256_BYTES];
        char hex[2 * SHA256_BYTES + 1];
        sha256_ctx c;
        sha256_init(&c);
        sha256_update(&c, ABC448, k);
        sha256_update(&c, ABC448 + k, n - k);
        sha256_final(&c, d);
        sha256_hex(d, hex);
        CHECK_STR("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1", hex);
    }
    unsigned char d[SHA256_BYTES];
    char hex[2 * SHA256_BYTES + 1];
    sha256_ctx c;
    sha256_init(&c);
    for (size_t i = 0; i < n; i++)
        sha256_update(&c, ABC448 + i, 1);
    CHECK_INT(n, c.len);
    sha256_final(&c, d);
    sha256_hex(d, hex);
    CHECK_STR("248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1", hex);
}

/* Lengths 0..200 against the same message hashed in one update: padding at every length mod
 * 64, with 55, 56, 63 and 64 (where the length no longer fits the last block) among them. */
static void lengths(void)
{
    unsigned char msg[200];
    for (int i = 0; i < 200; i++)
        msg[i] = (unsigned char)(i * 7 + 1);
    for (size_t n = 0; n <= sizeof msg; n++) {
        char one[2 * SHA256_BYTES + 1], two[2 * SHA256_BYTES + 1];
        snprintf(one, sizeof one, "%s", hex_of(msg, n));
        unsigned char d[SHA256_BYTES];
        sha256_ctx c;
        sha256_init(&c);
        sha256_update(&c, msg, n / 3);
        sha256_update(&c, msg + n / 3, n - n / 3);
        sha256_final(&c, d);
        sha256_hex(d, two);
        CHECK_STR(one, two);
    }
    /* 55 and 56 bytes: pinned (one and two final blocks). */
    CHECK_STR("9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318",
              hex_of("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 55));
    CHECK_STR("b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a",
              hex_of("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", 56));
}

int main(void)
{
    RUN(vectors);
    RUN(splits);
    RUN(lengths);
    return check_summary();
}
