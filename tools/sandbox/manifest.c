/* manifest.c - a layer's manifest: computing, formatting, parsing and writing it (manifest.h). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "manifest.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "linkmap.h"

#define WALK_DEPTH_MAX  512
#define XATTR_LIST_MAX_ 65536
#define LINKS_MEM_MAX   (16u << 20)

struct walk {
    sha256_ctx meta, tree;
    int contents;
    dev_t dev;
    linkmap links;
    struct manifest *out;
    struct manifest_error *e;
    unsigned char *buf; /* file data, XATTR values */
    char *names;        /* xattr name lists */
};

enum { BUF_LEN = 1 << 18 };

static int fail(struct walk *w, const char *step, const char *path, int err)
{
    snprintf(w->e->step, sizeof w->e->step, "%s", step);
    snprintf(w->e->path, sizeof w->e->path, "%s", path);
    w->e->err = err;
    return -1;
}

static void field(struct walk *w, const void *p, size_t len)
{
    unsigned char l[4] = {(unsigned char)(len >> 24), (unsigned char)(len >> 16),
                          (unsigned char)(len >> 8), (unsigned char)len};
    sha256_update(&w->meta, l, 4);
    sha256_update(&w->meta, p, len);
    if (w->contents) {
        sha256_update(&w->tree, l, 4);
        sha256_update(&w->tree, p, len);
    }
}

static void field_s(struct walk *w, const char *s)
{
    field(w, s, strlen(s));
}

static void field_n(struct walk *w, unsigned long long n)
{
    char b[32];
    snprintf(b, sizeof b, "%llu", n);
    field_s(w, b);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The extended attributes of name in the directory open on dirfd (name "." for dirfd itself),
 * sorted by name, into the records. */
static int xattrs(struct walk *w, int dirfd, const char *name, const char *rel)
{
    char path[64 + 4096];
    snprintf(path, sizeof path, "/proc/self/fd/%d/%s", dirfd, name);
    ssize_t len = llistxattr(path, w->names, XATTR_LIST_MAX_);
    if (len < 0 && errno != ENOTSUP) return fail(w, "listing the attributes of", rel, errno);
    if (len < 0) len = 0;
    char *sorted[XATTR_LIST_MAX_ / 2];
    size_t n = 0;
    for (char *p = w->names; p < w->names + len; p += strlen(p) + 1)
        sorted[n++] = p;
    qsort(sorted, n, sizeof *sorted, cmp_str);
    field_n(w, n);
    for (size_t i = 0; i < n; i++) {
        ssize_t vl = lgetxattr(path, sorted[i], w->buf, BUF_LEN);
        if (vl < 0) return fail(w, "reading an attribute of", rel, errno);
        field_s(w, sorted[i]);
        field(w, w->buf, (size_t)vl);
    }
    return 0;
}

/* Chunks of the content digest: a file is read as CHUNK-byte pieces at fixed offsets. */
enum { CHUNK = 1 << 16 };

/* Adds a run of zero bytes to the content digest: "Z" and its length (8 bytes). */
static void zero_run(sha256_ctx *c, unsigned long long n)
{
    unsigned char r[9] = {'Z'};
    for (int i = 0; i < 8; i++)
        r[1 + i] = (unsigned char)(n >> (56 - 8 * i));
    sha256_update(c, r, sizeof r);
}

static int all_zero(const unsigned char *p, size_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, n - 1) == 0);
}

/* The content digest of name (a regular file of size bytes) in the directory open on dirfd: the
 * sha256 of its contents read as CHUNK-byte pieces at fixed offsets, where each maximal run of
 * pieces that hold only zeros counts as "Z" and the run's length, and every other piece as "D",
 * its length (4 bytes) and its bytes. It is a function of the bytes alone, not of where the
 * filesystem keeps holes (a copy that keeps a hole as data, or the other way round, digests the
 * same), and a hole is skipped without being read: SEEK_DATA finds where data starts, so a
 * sparse 4 GiB file costs its data, not 4 GiB of zeros through sha256. */
static int contents(struct walk *w, int dirfd, const char *name, const char *rel, off_t size,
                    unsigned char d[SHA256_BYTES])
{
    int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOATIME);
    if (fd < 0 && errno == EPERM)
        fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return fail(w, "opening", rel, errno);
    sha256_ctx c;
    sha256_init(&c);
    unsigned long long zeros = 0;
    off_t off = 0;
    int seekable = 1;
    while (off < size) {
        off_t len = size - off < CHUNK ? size - off : CHUNK;
        if (seekable) {
            off_t data = lseek(fd, off, SEEK_DATA);
            if (data < 0 && errno == ENXIO)
                data = size; /* only a hole is left */
            else if (data < 0)
                seekable = 0, data = off; /* no SEEK_DATA here: read it all */
            if (data >= off + len) {      /* whole pieces in a hole */
                off_t skip = (data < size ? data - off : size - off) / CHUNK * CHUNK;
                if (skip == 0) skip = len; /* the last, short piece */
                zeros += (unsigned long long)skip;
                off += skip;
                continue;
            }
        }
        off_t got = 0;
        while (got < len) {
            ssize_t n = pread(fd, w->buf + got, (size_t)(len - got), off + got);
            if (n < 0 && errno == EINTR) continue;
            if (n < 0) {
                int err = errno;
                close(fd);
                return fail(w, "reading", rel, err);
            }
            if (n == 0) break; /* it shrank: the digest says what was read */
            got += n;
        }
        if (got == 0) break;
        if (all_zero(w->buf, (size_t)got)) {
            zeros += (unsigned long long)got;
        } else {
            if (zeros) zero_run(&c, zeros);
            zeros = 0;
            unsigned char l[5] = {'D', (unsigned char)(got >> 24), (unsigned char)(got >> 16),
                                  (unsigned char)(got >> 8), (unsigned char)got};
            sha256_update(&c, l, sizeof l);
            sha256_update(&c, w->buf, (size_t)got);
        }
        if (got < len) break;
        off += len;
    }
    if (zeros) zero_run(&c, zeros);
    close(fd);
    sha256_final(&c, d);
    return 0;
}

static char type_of(mode_t m)
{
    return S_ISREG(m)    ? 'f'
           : S_ISDIR(m)  ? 'd'
           : S_ISLNK(m)  ? 'l'
           : S_ISCHR(m)  ? 'c'
           : S_ISBLK(m)  ? 'b'
           : S_ISFIFO(m) ? 'p'
                         : 's';
}

static int walk_dir(struct walk *w, int dirfd, const char *rel, int depth);

/* One entry: name in the directory open on dirfd ("." and rel "/" for the root). */
static int entry(struct walk *w, int dirfd, const char *name, const char *rel, int depth)
{
    struct stat st;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) return fail(w, "stat", rel, errno);
    char t = type_of(st.st_mode);
    field_s(w, rel);
    field(w, &t, 1);
    char mode[16];
    snprintf(mode, sizeof mode, "%o", (unsigned)(st.st_mode & 07777));
    field_s(w, mode);
    field_n(w, st.st_uid);
    field_n(w, st.st_gid);
    field_n(w, t == 'f' ? (unsigned long long)st.st_size : 0);
    field_n(w, t == 'd' ? 0 : (unsigned long long)st.st_nlink);
    char dev[32] = "";
    if (t == 'c' || t == 'b')
        snprintf(dev, sizeof dev, "%u:%u", major(st.st_rdev), minor(st.st_rdev));
    field_s(w, dev);
    if (t == 'l') {
        char target[4097];
        ssize_t l = readlinkat(dirfd, name, target, sizeof target - 1);
        if (l < 0) return fail(w, "readlink", rel, errno);
        field(w, target, (size_t)l);
    } else {
        field(w, "", 0);
    }
    if (xattrs(w, dirfd, name, rel) < 0) return -1;
    if (depth > 0) w->out->files++;
    if (t == 'f') {
        unsigned char d[SHA256_BYTES];
        const unsigned char *v = NULL;
        size_t vl = 0;
        int seen = 0;
        if (st.st_nlink > 1) {
            seen = linkmap_get(&w->links, st.st_dev, st.st_ino, &v, &vl);
            if (seen < 0) return fail(w, "the link table, at", rel, errno);
        }
        if (seen && w->contents) memcpy(d, v, SHA256_BYTES);
        if (!seen) {
            w->out->bytes += (unsigned long long)st.st_size;
            if (w->contents && contents(w, dirfd, name, rel, st.st_size, d) < 0) return -1;
            if (st.st_nlink > 1 &&
                linkmap_put(&w->links, st.st_dev, st.st_ino, d, w->contents ? SHA256_BYTES : 0) < 0)
                return fail(w, "the link table, at", rel, errno);
        }
        if (w->contents) {
            unsigned char l[4] = {0, 0, 0, SHA256_BYTES};
            sha256_update(&w->tree, l, 4);
            sha256_update(&w->tree, d, SHA256_BYTES);
        }
    } else if (t == 'd') {
        if (st.st_dev != w->dev) return fail(w, "walking", rel, EXDEV);
        int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NOATIME);
        if (fd < 0 && errno == EPERM)
            fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) return fail(w, "opening", rel, errno);
        int r = walk_dir(w, fd, rel, depth + 1);
        close(fd);
        return r;
    }
    return 0;
}

/* The entries of the directory open on dirfd (path rel), sorted by name. */
static int walk_dir(struct walk *w, int dirfd, const char *rel, int depth)
{
    if (depth > WALK_DEPTH_MAX) return fail(w, "walking (too deep)", rel, ELOOP);
    DIR *d = fdopendir(dup(dirfd));
    if (!d) return fail(w, "reading", rel, errno);
    char *arena = NULL, **names = NULL;
    size_t alen = 0, acap = 0, n = 0, ncap = 0;
    int r = 0;
    struct dirent *de;
    errno = 0;
    while ((de = readdir(d))) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        size_t l = strlen(de->d_name) + 1;
        if (alen + l > acap) {
            size_t nc = acap ? acap * 2 : 4096;
            while (nc < alen + l)
                nc *= 2;
            char *na = realloc(arena, nc);
            if (!na) {
                r = fail(w, "reading", rel, ENOMEM);
                goto out;
            }
            arena = na;
            acap = nc;
        }
        memcpy(arena + alen, de->d_name, l);
        if (n == ncap) {
            ncap = ncap ? ncap * 2 : 64;
            char **nn = realloc(names, ncap * sizeof *names);
            if (!nn) {
                r = fail(w, "reading", rel, ENOMEM);
                goto out;
            }
            names = nn;
        }
        names[n++] = (char *)(uintptr_t)alen; /* an offset until the arena stops moving */
        alen += l;
        errno = 0;
    }
    if (errno) {
        r = fail(w, "reading", rel, errno);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        names[i] = arena + (uintptr_t)names[i];
    qsort(names, n, sizeof *names, cmp_str);
    size_t rl = strlen(rel);
    char *sub = malloc(rl + 258);
    if (!sub) {
        r = fail(w, "reading", rel, ENOMEM);
        goto out;
    }
    for (size_t i = 0; i < n && r == 0; i++) {
        snprintf(sub, rl + 258, "%s/%s", depth == 1 ? "" : rel, names[i]);
        r = entry(w, dirfd, names[i], sub, depth);
    }
    free(sub);
out:
    free(arena);
    free(names);
    closedir(d);
    return r;
}

int manifest_compute(int dirfd, int with_contents, int spill_dirfd, struct manifest *out,
                     struct manifest_error *e)
{
    struct walk w = {.contents = with_contents, .out = out, .e = e};
    memset(out, 0, sizeof *out);
    memset(e, 0, sizeof *e);
    struct stat st;
    if (fstat(dirfd, &st) < 0) return fail(&w, "stat", "/", errno);
    w.dev = st.st_dev;
    sha256_init(&w.meta);
    sha256_init(&w.tree);
    linkmap_init(&w.links, LINKS_MEM_MAX, spill_dirfd);
    w.buf = malloc(BUF_LEN);
    w.names = malloc(XATTR_LIST_MAX_);
    int r = -1;
    if (!w.buf || !w.names)
        fail(&w, "walking", "/", ENOMEM);
    else
        r = entry(&w, dirfd, ".", "/", 0);
    /* entry() of the root: its record with depth 0, then its directory at depth 1 */
    free(w.buf);
    free(w.names);
    linkmap_free(&w.links);
    if (r < 0) return -1;
    sha256_final(&w.meta, out->meta);
    sha256_final(&w.tree, out->tree);
    out->has_tree = with_contents;
    return 0;
}

void manifest_format(const struct manifest *m, char *buf, size_t len)
{
    char meta[2 * SHA256_BYTES + 1], tree[2 * SHA256_BYTES + 1];
    sha256_hex(m->meta, meta);
    sha256_hex(m->tree, tree);
    snprintf(buf, len, "%s\nfiles %llu\nbytes %llu\nmeta %s\ntree %s\n", MANIFEST_HEADER, m->files,
             m->bytes, meta, tree);
}

static int unhex(const char *s, unsigned char out[SHA256_BYTES])
{
    for (int i = 0; i < 2 * SHA256_BYTES; i++) {
        char c = s[i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0) return -1;
        if (i % 2 == 0)
            out[i / 2] = (unsigned char)(v << 4);
        else
            out[i / 2] |= (unsigned char)v;
    }
    return s[2 * SHA256_BYTES] == '\n' ? 0 : -1;
}

static int number_line(const char **p, const char *key, unsigned long long *v)
{
    size_t kl = strlen(key);
    if (strncmp(*p, key, kl) != 0 || (*p)[kl] != ' ') return -1;
    const char *s = *p + kl + 1;
    if (*s < '0' || *s > '9') return -1;
    char *end;
    errno = 0;
    *v = strtoull(s, &end, 10);
    if (errno || *end != '\n') return -1;
    *p = end + 1;
    return 0;
}

static int hex_line(const char **p, const char *key, unsigned char out[SHA256_BYTES])
{
    size_t kl = strlen(key);
    if (strncmp(*p, key, kl) != 0 || (*p)[kl] != ' ') return -1;
    if (strnlen(*p + kl + 1, 2 * SHA256_BYTES + 1) < 2 * SHA256_BYTES + 1) return -1;
    if (unhex(*p + kl + 1, out) < 0) return -1;
    *p += kl + 1 + 2 * SHA256_BYTES + 1;
    return 0;
}

int manifest_parse(const char *text, struct manifest *m, const char **why)
{
    memset(m, 0, sizeof *m);
    const char *p = text;
    size_t hl = strlen(MANIFEST_HEADER);
    if (strncmp(p, MANIFEST_HEADER, hl) != 0 || p[hl] != '\n') {
        *why = "its first line is not \"" MANIFEST_HEADER "\"";
        return -1;
    }
    p += hl + 1;
    if (number_line(&p, "files", &m->files) < 0) {
        *why = "no valid \"files N\" line";
        return -1;
    }
    if (number_line(&p, "bytes", &m->bytes) < 0) {
        *why = "no valid \"bytes B\" line";
        return -1;
    }
    if (hex_line(&p, "meta", m->meta) < 0) {
        *why = "no valid \"meta HEX\" line";
        return -1;
    }
    if (hex_line(&p, "tree", m->tree) < 0) {
        *why = "no valid \"tree HEX\" line";
        return -1;
    }
    if (*p) {
        *why = "text after the tree line";
        return -1;
    }
    m->has_tree = 1;
    return 0;
}

int manifest_write(int dirfd, const char *name, const struct manifest *m)
{
    char tmp[4096 + 8], text[512];
    snprintf(tmp, sizeof tmp, "%s.tmp", name);
    manifest_format(m, text, sizeof text);
    int fd = openat(dirfd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return errno;
    size_t len = strlen(text);
    const char *p = text;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            int e = errno;
            close(fd);
            unlinkat(dirfd, tmp, 0);
            return e;
        }
        p += n;
        len -= (size_t)n;
    }
    if (fsync(fd) < 0 || close(fd) < 0) {
        int e = errno;
        unlinkat(dirfd, tmp, 0);
        return e;
    }
    if (renameat(dirfd, tmp, dirfd, name) < 0) {
        int e = errno;
        unlinkat(dirfd, tmp, 0);
        return e;
    }
    if (fsync(dirfd) < 0) return errno;
    return 0;
}
