/* test_manifest.c - unit tests for tools/sandbox/manifest.c, the manifests of snapshot layers.
 *
 * The text form (round trip, and every malformed line refused), and manifest_compute over small
 * trees made here: a one-file tree's meta and tree digests rebuilt by hand from manifest.h's
 * record format (so the documented format is the implemented one), hard links counted once,
 * the walk's order independent of creation order, and which changes move meta and which move
 * only tree. ctest runs it as c_manifest.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "manifest.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"

static void text_form(void)
{
    struct manifest m = {.files = 12, .bytes = 345};
    for (int i = 0; i < SHA256_BYTES; i++) {
        m.meta[i] = (unsigned char)i;
        m.tree[i] = (unsigned char)(255 - i);
    }
    char text[512];
    manifest_format(&m, text, sizeof text);
    CHECK_STR("moonbox-manifest 1\nfiles 12\nbytes 345\n"
              "meta 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n"
              "tree fffefdfcfbfaf9f8f7f6f5f4f3f2f1f0efeeedecebeae9e8e7e6e5e4e3e2e1e0\n",
              text);
    struct manifest back;
    const char *why = NULL;
    CHECK_INT(0, manifest_parse(text, &back, &why));
    CHECK_INT(12, back.files);
    CHECK_INT(345, back.bytes);
    CHECK(memcmp(back.meta, m.meta, SHA256_BYTES) == 0);
    CHECK(memcmp(back.tree, m.tree, SHA256_BYTES) == 0);

    const char *hex = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    char bad[1024];
    const char *cases[][2] = {
        {"moonbox-manifest 2\nfiles 1\nbytes 1\nmeta %s\ntree %s\n", "first line"},
        {"moonbox-manifest 1\nfiles x\nbytes 1\nmeta %s\ntree %s\n", "files"},
        {"moonbox-manifest 1\nfiles 1\nbytes -1\nmeta %s\ntree %s\n", "bytes"},
        {"moonbox-manifest 1\nfiles 1\nbytes 99999999999999999999999\nmeta %s\ntree %s\n", "bytes"},
        {"moonbox-manifest 1\nfiles 1\nbytes 1\nmeta %.63s\ntree %s\n", "meta"},
        {"moonbox-manifest 1\nfiles 1\nbytes 1\nmeta %sX\ntree %s\n", "meta"},
        {"moonbox-manifest 1\nfiles 1\nbytes 1\nmeta %s\ntree %s\nmore\n", "after"},
        {"moonbox-manifest 1\nfiles 1\nbytes 1\nmeta %s\ntree %s", "tree"},
        {"moonbox-manifest 1\nbytes 1\nfiles 1\nmeta %s\ntree %s\n", "files"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(bad, sizeof bad, cases[i][0], hex, hex);
        why = NULL;
        CHECK_INT(-1, manifest_parse(bad, &back, &why));
        CHECK(why && strstr(why, cases[i][1]));
    }
    /* upper-case hex is not what we write, so not what we read */
    snprintf(bad, sizeof bad, "moonbox-manifest 1\nfiles 1\nbytes 1\nmeta %s\ntree %s\n",
             "000102030405060708090A0B0C0D0E0F101112131415161718191A1B1C1D1E1F", hex);
    CHECK_INT(-1, manifest_parse(bad, &back, &why));
}

static char root[64];

static void mk(const char *rel, const char *text, mode_t mode)
{
    char p[256];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, mode);
    CHECK(fd >= 0);
    if (fd < 0) return;
    CHECK((ssize_t)strlen(text) == write(fd, text, strlen(text)));
    close(fd);
    chmod(p, mode);
}

static void new_root(void)
{
    snprintf(root, sizeof root, "/tmp/moonbox-manifest-XXXXXX");
    CHECK(mkdtemp(root) != NULL);
}

static void rm_root(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    CHECK(system(cmd) == 0);
}

static int compute(int contents, struct manifest *m)
{
    int fd = open(root, O_RDONLY | O_DIRECTORY);
    int spill = open("/tmp", O_RDONLY | O_DIRECTORY);
    struct manifest_error e;
    int r = manifest_compute(fd, contents, spill, m, &e);
    if (r < 0) fprintf(stderr, "manifest_compute: %s %s: %s\n", e.step, e.path, strerror(e.err));
    close(fd);
    close(spill);
    return r;
}

static void field(sha256_ctx *c, const void *p, size_t len)
{
    unsigned char l[4] = {(unsigned char)(len >> 24), (unsigned char)(len >> 16),
                          (unsigned char)(len >> 8), (unsigned char)len};
    sha256_update(c, l, 4);
    sha256_update(c, p, len);
}

static void fields(sha256_ctx *c, const char *const *f, int n)
{
    for (int i = 0; i < n; i++)
        field(c, f[i], strlen(f[i]));
}

/* The documented record format, written out for a root holding one file "a". */
static void pinned_format(void)
{
    new_root();
    mk("a", "hi\n", 0640);
    struct stat rs, fs;
    char path[128];
    snprintf(path, sizeof path, "%s/a", root);
    CHECK(stat(root, &rs) == 0 && stat(path, &fs) == 0);
    char rmode[16], ruid[16], rgid[16], fuid[16], fgid[16];
    snprintf(rmode, sizeof rmode, "%o", (unsigned)(rs.st_mode & 07777));
    snprintf(ruid, sizeof ruid, "%u", (unsigned)rs.st_uid);
    snprintf(rgid, sizeof rgid, "%u", (unsigned)rs.st_gid);
    snprintf(fuid, sizeof fuid, "%u", (unsigned)fs.st_uid);
    snprintf(fgid, sizeof fgid, "%u", (unsigned)fs.st_gid);
    const char *rootrec[] = {"/", "d", rmode, ruid, rgid, "0", "0", "", "", "0"};
    const char *filerec[] = {"/a", "f", "640", fuid, fgid, "3", "1", "", "", "0"};
    sha256_ctx meta, tree;
    sha256_init(&meta);
    sha256_init(&tree);
    fields(&meta, rootrec, 10);
    fields(&meta, filerec, 10);
    fields(&tree, rootrec, 10);
    fields(&tree, filerec, 10);
    unsigned char content[SHA256_BYTES], want_meta[SHA256_BYTES], want_tree[SHA256_BYTES];
    sha256_ctx c;
    sha256_init(&c);
    sha256_update(&c, "D\0\0\0\3hi\n", 8); /* a piece that is not all zeros: "D", length, bytes */
    sha256_final(&c, content);
    field(&tree, content, SHA256_BYTES);
    sha256_final(&meta, want_meta);
    sha256_final(&tree, want_tree);
    struct manifest m;
    CHECK_INT(0, compute(1, &m));
    CHECK_INT(1, m.files);
    CHECK_INT(3, m.bytes);
    CHECK(memcmp(m.meta, want_meta, SHA256_BYTES) == 0);
    CHECK(memcmp(m.tree, want_tree, SHA256_BYTES) == 0);
    rm_root();
}

/* The same tree made in two orders sums up the same; a hard link's bytes count once. */
static void order_and_links(void)
{
    struct manifest one, two;
    char p[256], q[256];
    for (int pass = 0; pass < 2; pass++) {
        new_root();
        const char *names[] = {"b", "a", "c", "a.c"};
        for (int i = 0; i < 4; i++) {
            int k = pass ? 3 - i : i;
            mk(names[k], names[k], 0644);
        }
        snprintf(p, sizeof p, "%s/a", root);
        snprintf(q, sizeof q, "%s/d", root);
        CHECK(mkdir(q, 0755) == 0);
        snprintf(q, sizeof q, "%s/d/a2", root);
        CHECK(link(p, q) == 0);
        snprintf(q, sizeof q, "%s/l", root);
        CHECK(symlink("a", q) == 0);
        CHECK_INT(0, compute(1, pass ? &two : &one));
        rm_root();
    }
    CHECK_INT(7, one.files); /* a a.c b c d d/a2 l */
    CHECK_INT(1 + 3 + 1 + 1, one.bytes);
    CHECK(memcmp(one.meta, two.meta, SHA256_BYTES) == 0);
    CHECK(memcmp(one.tree, two.tree, SHA256_BYTES) == 0);
}

/* Contents move tree only; a mode moves both; quick (no contents) gives the same meta. */
static void what_moves(void)
{
    new_root();
    mk("f", "same size 1", 0644);
    struct manifest a, b, c, quick;
    CHECK_INT(0, compute(1, &a));
    CHECK_INT(0, compute(0, &quick));
    CHECK(memcmp(a.meta, quick.meta, SHA256_BYTES) == 0);
    mk("f", "same size 2", 0644);
    CHECK_INT(0, compute(1, &b));
    CHECK(memcmp(a.meta, b.meta, SHA256_BYTES) == 0);
    CHECK(memcmp(a.tree, b.tree, SHA256_BYTES) != 0);
    mk("f", "same size 2", 0600);
    CHECK_INT(0, compute(1, &c));
    CHECK(memcmp(b.meta, c.meta, SHA256_BYTES) != 0);
    CHECK(memcmp(b.tree, c.tree, SHA256_BYTES) != 0);
    rm_root();
}

/* Makes root/a: a file of zeros of size bytes then "x", the zeros a hole (sparse) or written. */
static void mk_zeros(off_t size, int sparse)
{
    char p[256];
    snprintf(p, sizeof p, "%s/a", root);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    if (fd < 0) return;
    if (sparse) {
        CHECK(ftruncate(fd, size) == 0);
    } else {
        static char zero[1 << 16];
        for (off_t done = 0; done < size; done += (off_t)sizeof zero)
            CHECK((ssize_t)sizeof zero == write(fd, zero, sizeof zero));
    }
    CHECK(pwrite(fd, "x", 1, size) == 1);
    close(fd);
}

/* The content digest is the bytes', not the holes': a hole and written zeros digest the same, and
 * a 64 GiB hole is not read (this test would take minutes if it were). */
static void holes_and_zeros(void)
{
    struct manifest sparse, dense, huge, other;
    new_root();
    mk_zeros(8 << 20, 1);
    CHECK_INT(0, compute(1, &sparse));
    mk_zeros(8 << 20, 0);
    CHECK_INT(0, compute(1, &dense));
    CHECK(memcmp(sparse.tree, dense.tree, SHA256_BYTES) == 0);
    mk_zeros((off_t)64 << 30, 1);
    CHECK_INT(0, compute(1, &huge));
    CHECK(memcmp(huge.tree, sparse.tree, SHA256_BYTES) != 0);
    mk_zeros((8 << 20) + 1, 1); /* one zero more: another tree */
    CHECK_INT(0, compute(1, &other));
    CHECK(memcmp(other.tree, sparse.tree, SHA256_BYTES) != 0);
    rm_root();
}

int main(void)
{
    RUN(text_form);
    RUN(pinned_format);
    RUN(order_and_links);
    RUN(what_moves);
    RUN(holes_and_zeros);
    return check_summary();
}
