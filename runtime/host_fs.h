/* host_fs.h - the host filesystem chores of `moonbox local`, as plain system calls.
 *
 * Owns the one directory-tree removal of moonbox (as `rm -rf --one-file-system`: never follows
 * a symlink, never crosses onto another filesystem, any depth and name length), the unmount
 * with its lazy fallback, the overlay mount (its options) and mkdir -p. Safe on any thread:
 * bindings/sys.c runs the slow ones (removal, unmount) on a worker job (runtime/worker_job.c)
 * and the others inline; runtime/archive_fs.c removes its staging trees with the removal.
 */
#ifndef MOONBOX_HOST_FS_H
#define MOONBOX_HOST_FS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* host_fs_remove_tree flag: make a directory the owner may not enter or empty 0700 first (trees
 * unpacked from an archive, whose modes came from its headers). */
#define HOST_FS_OPEN_MODES 1

/* Removes path (relative to dirfd, or AT_FDCWD) and everything below it. A missing path is not
 * an error. Returns 0, or the errno of the first failure, which stops it; then failed (cap
 * bytes, may be 0) names the entry that could not be removed, as path/.../name when long. */
int host_fs_remove_tree(int dirfd, const char *path, int flags, char *failed, size_t cap);

/* Creates the directory buf and its missing parents; parents get 0755 (less the umask, as
 * mkdir -p), buf itself gets exactly mode when this call creates it (as mkdir -p -m; an
 * existing directory is left alone). Returns 0, or an errno with buf cut to the failing prefix.
 * A few mkdir/stat calls: metadata only, fine on the loop thread. */
int host_fs_mkdir_p(char *buf, mode_t mode);

/* The kernel's limit on mount options: one page. */
#define HOST_FS_MOUNT_OPTIONS_MAX 4096

/* Writes the options of an overlay mount into buf (cap bytes, NUL-terminated when it fits):
 * lowerdir (lowers[0..n), topmost first, joined by ':'), upperdir, workdir, and always
 * index=off,redirect_dir=off,metacopy=off (an upper directory stays self-contained and reusable
 * as a lower layer). Returns the options' length; when that is >= cap, buf holds no options. */
size_t host_fs_overlay_options(char *buf, size_t cap, const char *const *lowers, size_t n,
                               const char *upper, const char *work);

/* Mounts an overlay filesystem named source at target with options (readonly: MS_RDONLY).
 * Returns 0 or the errno. Inline-safe: it looks up a few directories just used (cached) and
 * creates work/work; no data is written back. */
int host_fs_mount_overlay(const char *source, const char *target, int readonly,
                          const char *options);

/* Unmounts target; when that fails and detach_fallback is set, detaches it lazily instead (as
 * `umount || umount -l`). Returns 0 with *how 1 (unmounted) or 2 (detached), or the errno of
 * the plain unmount. */
int host_fs_umount(const char *target, int detach_fallback, int *how);

/* What the quota group of the btrfs subvolume at path holds (used, bytes) and may hold (limit,
 * bytes; UINT64_MAX when unlimited). Returns 0, or an errno (ENOTTY/EINVAL: not btrfs, or quotas
 * off). Two metadata ioctls reading cached btree pages: fine on the loop thread. */
int host_fs_qgroup(const char *path, uint64_t *used, uint64_t *limit);

/* The bytes a write under path can still take: the filesystem's available space (statvfs
 * f_bavail) and, when path is a btrfs subvolume with a quota limit, no more than that limit
 * less what it holds. Returns 0, or the errno of statvfs. A statfs and at most two metadata
 * ioctls: fine on the loop thread (the HTTP server asks it before reading an upload's body). */
int host_fs_room(const char *path, uint64_t *room);

#endif
