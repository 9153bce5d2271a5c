/* linkmap.h - files with several hard links, by device and inode, and a value for each (the
 * relative path of the first copy, or the digest of its contents).
 *
 * The one table behind "later links of a file become hard links again" in moonbox-sandbox's
 * copies (fileops.c's pack, shift.c's capture) and behind counting a linked file once
 * (manifest.c). O(1) per file (a list made a layer of many links quadratic), and a fixed, small
 * cost per inode: a dense array of 24-byte entries (device, inode, where and how long its value
 * is), an index of 4-byte entry numbers kept at most half full, and an arena of the values at
 * their exact length; ~30 bytes plus the value per inode, nothing per link after the first.
 *
 * Bounded memory: a map given a spill directory (linkmap_init) keeps at most mem_max bytes in
 * memory; when it would need more it moves everything into two unnamed files (O_TMPFILE) in
 * that directory, an open-addressing table read and written with pread/pwrite and the values'
 * arena, and works from them from then on (the page cache holds what is hot; the process's own
 * memory stays at the 8 KiB value buffer). Unnamed files vanish when the process ends, killed or
 * not. A map without a spill directory (a zeroed struct, as fileops.c uses) never spills.
 * One map per walk; single-threaded.
 */
#ifndef MOONBOX_SANDBOX_LINKMAP_H
#define MOONBOX_SANDBOX_LINKMAP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>

#define LINKMAP_VALUE_MAX 8192

typedef struct linkmap_entry {
    uint64_t ino;
    uint32_t dev; /* new_encode_dev form: major 12 bits, minor 20 */
    uint32_t len; /* of the value */
    uint64_t off; /* of the value in the arena */
} linkmap_entry;

typedef struct linkmap {
    /* in memory */
    uint32_t *index; /* entry number + 1, 0: free; cap slots, a power of two */
    linkmap_entry *entries;
    size_t cap, n, entries_cap;
    unsigned char *arena;
    size_t arena_len, arena_cap;
    /* bounds */
    int spill;      /* whether it may spill (linkmap_init with a directory) */
    int spill_dir;  /* the directory of the spill files */
    size_t mem_max; /* bytes of memory before spilling */
    /* spilled */
    int spilled, table_fd, arena_fd;
    uint64_t disk_cap, disk_n, disk_arena_len;
    unsigned char value[LINKMAP_VALUE_MAX + 1]; /* the last value found (NUL-terminated) */
} linkmap;

/* A map that keeps at most mem_max bytes in memory and then spills into unnamed files in the
 * directory open on dirfd (which must stay open while the map is used). */
void linkmap_init(linkmap *m, size_t mem_max, int dirfd);

/* The value recorded for (dev, ino): 1 and *val, *len set (valid until the next call on m;
 * NUL-terminated), 0 when there is none, -1 with errno on an I/O error of the spill files. */
int linkmap_get(linkmap *m, dev_t dev, ino_t ino, const unsigned char **val, size_t *len);

/* Records val (at most LINKMAP_VALUE_MAX bytes) for (dev, ino), which has none yet. Returns 0,
 * or -1 with errno (ENOMEM, or an error of the spill files; nothing recorded). */
int linkmap_put(linkmap *m, dev_t dev, ino_t ino, const void *val, size_t len);

/* Whether the map has moved to its spill files. */
int linkmap_spilled(const linkmap *m);

/* Frees the memory and closes the spill files (which vanish); m is zeroed. */
void linkmap_free(linkmap *m);

/* The path form fileops.c uses: the path recorded for st's device and inode, or NULL. */
const char *linkmap_find(linkmap *m, const struct stat *st);

/* Records path for st's device and inode (not recorded yet). Returns 0, or -1 (nothing
 * recorded). */
int linkmap_add(linkmap *m, const struct stat *st, const char *path);

#endif
