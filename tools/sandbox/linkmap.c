/* linkmap.c - the hard-link table of moonbox-sandbox's copies (see linkmap.h). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "linkmap.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define DISK_SLOT 24 /* ino 8, dev 4, len + 1 4 (0: free), off 8; little-endian as in memory */

static uint32_t dev32(dev_t dev)
{
    return (uint32_t)(major(dev) & 0xfff) << 20 | (uint32_t)(minor(dev) & 0xfffff);
}

static uint64_t hash(uint64_t ino, uint32_t dev)
{
    uint64_t x = ino ^ ((uint64_t)dev << 40) ^ 0x9e3779b97f4a7c15u;
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9u;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebu;
    return x ^ (x >> 31);
}

void linkmap_init(linkmap *m, size_t mem_max, int dirfd)
{
    memset(m, 0, sizeof *m);
    m->spill = 1;
    m->spill_dir = dirfd;
    m->mem_max = mem_max;
}

int linkmap_spilled(const linkmap *m)
{
    return m->spilled;
}

/* ---- on disk ---------------------------------------------------------------------------- */

static int pread_all(int fd, void *buf, size_t len, uint64_t off)
{
    unsigned char *p = buf;
    while (len) {
        ssize_t n = pread(fd, p, len, (off_t)off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        if (n == 0) { /* past the end: never written, so zeros (a free slot) */
            memset(p, 0, len);
            return 0;
        }
        p += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

static int pwrite_all(int fd, const void *buf, size_t len, uint64_t off)
{
    const unsigned char *p = buf;
    while (len) {
        ssize_t n = pwrite(fd, p, len, (off_t)off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -1;
        p += n;
        len -= (size_t)n;
        off += (uint64_t)n;
    }
    return 0;
}

static int tmpfile_in(int dirfd)
{
    int fd = openat(dirfd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0 || (errno != EOPNOTSUPP && errno != EISDIR)) return fd;
    /* No O_TMPFILE on this filesystem: a named file, unlinked at once. */
    char name[64];
    for (int i = 0; i < 100; i++) {
        snprintf(name, sizeof name, ".moonbox-linkmap-%d-%d", (int)getpid(), i);
        fd = openat(dirfd, name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (fd >= 0) {
            unlinkat(dirfd, name, 0);
            return fd;
        }
        if (errno != EEXIST) return -1;
    }
    return -1;
}

static void slot_decode(const unsigned char *s, linkmap_entry *e, uint32_t *used)
{
    memcpy(&e->ino, s, 8);
    memcpy(&e->dev, s + 8, 4);
    memcpy(used, s + 12, 4);
    e->len = *used ? *used - 1 : 0;
    memcpy(&e->off, s + 16, 8);
}

/* Finds (ino, dev) in the table file fd of cap slots: 1 with *e and *slot, or 0 with *slot the
 * free slot where it goes; -1 on an I/O error. */
static int disk_probe(int fd, uint64_t cap, uint64_t ino, uint32_t dev, linkmap_entry *e,
                      uint64_t *slot)
{
    for (uint64_t h = hash(ino, dev) & (cap - 1);; h = (h + 1) & (cap - 1)) {
        unsigned char s[DISK_SLOT];
        uint32_t used;
        if (pread_all(fd, s, sizeof s, h * DISK_SLOT) < 0) return -1;
        slot_decode(s, e, &used);
        *slot = h;
        if (!used) return 0;
        if (e->ino == ino && e->dev == dev) return 1;
    }
}

static int disk_insert(int fd, uint64_t cap, const linkmap_entry *e)
{
    linkmap_entry old;
    uint64_t slot;
    int r = disk_probe(fd, cap, e->ino, e->dev, &old, &slot);
    if (r < 0) return -1;
    unsigned char s[DISK_SLOT];
    uint32_t used = e->len + 1;
    memcpy(s, &e->ino, 8);
    memcpy(s + 8, &e->dev, 4);
    memcpy(s + 12, &used, 4);
    memcpy(s + 16, &e->off, 8);
    return pwrite_all(fd, s, sizeof s, slot * DISK_SLOT);
}

/* A new table file of cap slots holding every entry of the current one (or of memory). */
static int disk_rebuild(linkmap *m, uint64_t cap)
{
    int fd = tmpfile_in(m->spill_dir);
    if (fd < 0) return -1;
    if (!m->spilled) {
        for (size_t i = 0; i < m->n; i++)
            if (disk_insert(fd, cap, &m->entries[i]) < 0) goto fail;
    } else {
        unsigned char chunk[DISK_SLOT * 2048];
        for (uint64_t at = 0; at < m->disk_cap; at += 2048) {
            uint64_t k = m->disk_cap - at < 2048 ? m->disk_cap - at : 2048;
            if (pread_all(m->table_fd, chunk, (size_t)k * DISK_SLOT, at * DISK_SLOT) < 0) goto fail;
            for (uint64_t j = 0; j < k; j++) {
                linkmap_entry e;
                uint32_t used;
                slot_decode(chunk + j * DISK_SLOT, &e, &used);
                if (used && disk_insert(fd, cap, &e) < 0) goto fail;
            }
        }
        close(m->table_fd);
    }
    m->table_fd = fd;
    m->disk_cap = cap;
    return 0;
fail:;
    int e = errno;
    close(fd);
    errno = e;
    return -1;
}

/* Moves the map from memory into its spill files. */
static int spill(linkmap *m)
{
    int afd = tmpfile_in(m->spill_dir);
    if (afd < 0) return -1;
    if (pwrite_all(afd, m->arena, m->arena_len, 0) < 0) {
        int e = errno;
        close(afd);
        errno = e;
        return -1;
    }
    uint64_t cap = 1024;
    while (cap < 4 * (uint64_t)m->n)
        cap *= 2;
    if (disk_rebuild(m, cap) < 0) {
        int e = errno;
        close(afd);
        errno = e;
        return -1;
    }
    m->arena_fd = afd;
    m->disk_n = m->n;
    m->disk_arena_len = m->arena_len;
    free(m->index);
    free(m->entries);
    free(m->arena);
    m->index = NULL;
    m->entries = NULL;
    m->arena = NULL;
    m->cap = m->n = m->entries_cap = m->arena_len = m->arena_cap = 0;
    m->spilled = 1;
    return 0;
}

/* ---- the map ------------------------------------------------------------------------------ */

static int value_out(linkmap *m, const void *src, int fd, const linkmap_entry *e,
                     const unsigned char **val, size_t *len)
{
    if (src)
        memcpy(m->value, src, e->len);
    else if (pread_all(fd, m->value, e->len, e->off) < 0)
        return -1;
    m->value[e->len] = 0;
    *val = m->value;
    *len = e->len;
    return 1;
}

int linkmap_get(linkmap *m, dev_t dev, ino_t ino, const unsigned char **val, size_t *len)
{
    uint32_t d = dev32(dev);
    if (m->spilled) {
        linkmap_entry e;
        uint64_t slot;
        int r = disk_probe(m->table_fd, m->disk_cap, ino, d, &e, &slot);
        if (r <= 0) return r;
        return value_out(m, NULL, m->arena_fd, &e, val, len);
    }
    if (!m->cap) return 0;
    for (size_t h = hash(ino, d) & (m->cap - 1); m->index[h]; h = (h + 1) & (m->cap - 1)) {
        const linkmap_entry *e = &m->entries[m->index[h] - 1];
        if (e->ino == ino && e->dev == d) return value_out(m, m->arena + e->off, -1, e, val, len);
    }
    return 0;
}

static int grow_index(linkmap *m)
{
    size_t ncap = m->cap ? m->cap * 2 : 256;
    uint32_t *ni = calloc(ncap, sizeof *ni);
    if (!ni) return -1;
    for (size_t i = 0; i < m->n; i++) {
        const linkmap_entry *e = &m->entries[i];
        size_t h = hash(e->ino, e->dev) & (ncap - 1);
        while (ni[h])
            h = (h + 1) & (ncap - 1);
        ni[h] = (uint32_t)i + 1;
    }
    free(m->index);
    m->index = ni;
    m->cap = ncap;
    return 0;
}

static int reserve(void **p, size_t *cap, size_t need, size_t unit)
{
    if (need <= *cap) return 0;
    size_t ncap = *cap ? *cap : 64;
    while (ncap < need)
        ncap *= 2;
    void *np = realloc(*p, ncap * unit);
    if (!np) return -1;
    *p = np;
    *cap = ncap;
    return 0;
}

int linkmap_put(linkmap *m, dev_t dev, ino_t ino, const void *val, size_t len)
{
    if (len > LINKMAP_VALUE_MAX) {
        errno = ENAMETOOLONG;
        return -1;
    }
    linkmap_entry e = {.ino = ino, .dev = dev32(dev), .len = (uint32_t)len};
    if (!m->spilled && m->spill) {
        /* What memory would hold after this put, growth included: spill first if too much. */
        size_t idx = (m->n + 1) * 2 > m->cap ? (m->cap ? m->cap * 2 : 256) : m->cap;
        size_t ents =
            m->n + 1 > m->entries_cap ? (m->entries_cap ? m->entries_cap * 2 : 64) : m->entries_cap;
        size_t ar = m->arena_cap;
        while (m->arena_len + len > ar)
            ar = ar ? ar * 2 : 4096;
        size_t after = idx * sizeof *m->index + ents * sizeof *m->entries + ar;
        if ((after > m->mem_max || m->n >= UINT32_MAX - 1) && spill(m) < 0) return -1;
    }
    if (m->spilled) {
        if ((m->disk_n + 1) * 2 > m->disk_cap && disk_rebuild(m, m->disk_cap * 2) < 0) return -1;
        e.off = m->disk_arena_len;
        if (pwrite_all(m->arena_fd, val, len, e.off) < 0) return -1;
        if (disk_insert(m->table_fd, m->disk_cap, &e) < 0) return -1;
        m->disk_arena_len += len;
        m->disk_n++;
        return 0;
    }
    if ((m->n + 1) * 2 > m->cap && grow_index(m) < 0) return -1;
    if (reserve((void **)&m->entries, &m->entries_cap, m->n + 1, sizeof *m->entries) < 0 ||
        reserve((void **)&m->arena, &m->arena_cap, m->arena_len + len + 1, 1) < 0) {
        errno = ENOMEM;
        return -1;
    }
    e.off = m->arena_len;
    memcpy(m->arena + m->arena_len, val, len);
    m->arena_len += len;
    m->entries[m->n] = e;
    size_t h = hash(e.ino, e.dev) & (m->cap - 1);
    while (m->index[h])
        h = (h + 1) & (m->cap - 1);
    m->index[h] = (uint32_t)++m->n;
    return 0;
}

void linkmap_free(linkmap *m)
{
    free(m->index);
    free(m->entries);
    free(m->arena);
    if (m->spilled) {
        close(m->table_fd);
        close(m->arena_fd);
    }
    memset(m, 0, sizeof *m);
}

const char *linkmap_find(linkmap *m, const struct stat *st)
{
    const unsigned char *v;
    size_t len;
    return linkmap_get(m, st->st_dev, st->st_ino, &v, &len) == 1 ? (const char *)v : NULL;
}

int linkmap_add(linkmap *m, const struct stat *st, const char *path)
{
    return linkmap_put(m, st->st_dev, st->st_ino, path, strlen(path));
}
