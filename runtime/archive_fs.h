/* archive_fs.h - the small filesystem helpers the archive workers share.
 *
 * Plain functions of paths and directory fds, with no job and no libarchive: splitting a path,
 * reading a directory's names sorted, joining relative names, removing a staged tree without
 * following symlinks, and complete pwrites. Safe on any thread; internal to runtime/archive_*.c.
 */
#ifndef MOONBOX_ARCHIVE_FS_H
#define MOONBOX_ARCHIVE_FS_H

#include <stddef.h>
#include <sys/types.h>
#include <unistd.h>

static inline void archive_fs_close_quietly(int fd)
{
    if (fd >= 0) close(fd);
}

/* Splits path into a malloc'd directory ("." when there is none) and its malloc'd last
 * component *base. Trailing slashes are ignored; "/" gives ("/", ""). Returns 0, or -1 without
 * memory. */
int archive_fs_split_path(const char *path, char **dir, char **base);

/* Reads the names in the directory open as dirfd (except . and ..) into a sorted array; free it
 * with archive_fs_free_names. Returns 0, or -1 with errno set. dirfd stays open and unmoved. */
int archive_fs_read_names(int dirfd, char ***out, size_t *nout);
void archive_fs_free_names(char **names, size_t n);

/* prefix + name + suffix (prefix empty or ending in '/') as a new string, NULL without memory. */
char *archive_fs_join_rel(const char *prefix, const char *name, const char *suffix);

/* Removes the entry `name` of the directory dirfd, whatever it is, never following a symlink
 * (best effort; only for our private staging directory). */
void archive_fs_remove_entry(int dirfd, const char *name);

/* Writes all of buf at offset off of fd. Returns 0 or -1 with errno. */
int archive_fs_pwrite_all(int fd, const char *buf, size_t len, off_t off);

#endif
