/* linkmap.h - files with several hard links, by device and inode, and the path of the first.
 *
 * The one table behind "later links of a file become hard links again" in moonbox-sandbox's
 * copies (fileops.c's pack, shift.c's capture): open addressing, grown at half full, O(1) per
 * file (a list made a layer of many links quadratic). One map per walk; single-threaded.
 */
#ifndef MOONBOX_SANDBOX_LINKMAP_H
#define MOONBOX_SANDBOX_LINKMAP_H

#include <stddef.h>
#include <sys/stat.h>

typedef struct linkmap_slot {
    dev_t dev;
    ino_t ino;
    char *path; /* NULL: free */
} linkmap_slot;

typedef struct linkmap {
    linkmap_slot *slots;
    size_t cap, n;
} linkmap;

/* The path recorded for st's device and inode, or NULL. */
const char *linkmap_find(const linkmap *m, const struct stat *st);

/* Records a copy of path for st's device and inode (not recorded yet). Returns 0, or -1
 * without memory (nothing recorded). */
int linkmap_add(linkmap *m, const struct stat *st, const char *path);

#endif
