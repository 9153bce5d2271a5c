/* host_fs.h - the host filesystem chores that may block: removing a tree, unmounting.
 *
 * Owns the one directory-tree removal of moonbox (as `rm -rf --one-file-system`: never follows
 * a symlink, never crosses onto another filesystem, any depth and name length) and the unmount
 * with its lazy fallback. Plain blocking calls, safe on any thread: bindings/sys.c runs them on
 * a worker job (runtime/worker_job.c), runtime/archive_fs.c removes its staging trees with it.
 */
#ifndef MOONBOX_HOST_FS_H
#define MOONBOX_HOST_FS_H

#include <stddef.h>

/* host_fs_remove_tree flag: make a directory the owner may not enter or empty 0700 first (trees
 * unpacked from an archive, whose modes came from its headers). */
#define HOST_FS_OPEN_MODES 1

/* Removes path (relative to dirfd, or AT_FDCWD) and everything below it. A missing path is not
 * an error. Returns 0, or the errno of the first failure, which stops it; then failed (cap
 * bytes, may be 0) names the entry that could not be removed, as path/.../name when long. */
int host_fs_remove_tree(int dirfd, const char *path, int flags, char *failed, size_t cap);

/* Unmounts target; when that fails and detach_fallback is set, detaches it lazily instead (as
 * `umount || umount -l`). Returns 0 with *how 1 (unmounted) or 2 (detached), or the errno of
 * the plain unmount. */
int host_fs_umount(const char *target, int detach_fallback, int *how);

#endif
