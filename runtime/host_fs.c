/* host_fs.c - removing a tree and unmounting, on any thread (see host_fs.h).
 *
 * The tree removal walks with descriptors, never with whole paths: nftw builds paths and fails
 * past PATH_MAX, which a sandbox can nest beyond. It was written three times (the local
 * backend's sys jobs, the archive staging cleanup); this is the strictest of them, the one left.
 */
#include "host_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <endian.h>
#include <linux/btrfs.h>
#include <linux/btrfs_tree.h>
#include <linux/magic.h>
#include <sys/ioctl.h>
#include <sys/vfs.h>

/* Directory levels whose open stream is kept while their children are removed; deeper ones
 * are closed on the way down and scanned again on the way up (only what is left, since every
 * entry seen was removed). A tree of any depth is removed with at most this many descriptors. */
#define REMOVE_KEEP_OPEN 64

typedef struct rm_level {
    char *name; /* the directory's name in its parent */
    DIR *dir;   /* the parent's open stream, or NULL once closed (deep levels) */
} rm_level;

/* What a removal reports: the errno and the entry it stopped at. */
typedef struct rm_job {
    const char *path;
    int flags;
    int err;
    char *failed;
    size_t cap;
} rm_job;

/* Records the failure at name in the directory the stack leads to: its whole path when that
 * fits in j->failed, else the top, an ellipsis and the name. */
static void rm_fail(rm_job *j, int err, const rm_level *stack, size_t depth, const char *name)
{
    j->err = err;
    if (!j->cap) return;
    size_t len = (size_t)snprintf(j->failed, j->cap, "%s", j->path);
    for (size_t i = 0; i < depth && len < j->cap; i++)
        len += (size_t)snprintf(j->failed + len, j->cap - len, "/%s", stack[i].name);
    if (name && len < j->cap) len += (size_t)snprintf(j->failed + len, j->cap - len, "/%s", name);
    if (len >= j->cap) snprintf(j->failed, j->cap, "%s/.../%s", j->path, name ? name : "");
}

/* Removes the tree at j->path (relative to at) without ever building a path longer than one
 * name: each directory is entered with openat(O_NOFOLLOW | O_DIRECTORY) from its parent's
 * descriptor, emptied, left through "..", and removed with unlinkat relative to its parent, so
 * depth and name lengths are unbounded (nftw builds whole paths and fails past PATH_MAX, which a
 * sandbox can nest beyond). Never follows a symlink and never crosses onto another filesystem
 * (EXDEV, as rm --one-file-system). Meant for trees nobody writes to meanwhile (a terminated
 * sandbox's). O(entries), plus rescans of what is left in levels deeper than REMOVE_KEEP_OPEN. */
static void remove_tree(rm_job *j, int at, dev_t dev)
{
    int top = openat(at, j->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (top < 0) {
        if (errno == ENOTDIR || errno == ELOOP) {
            if (unlinkat(at, j->path, 0) != 0) rm_fail(j, errno, NULL, 0, NULL);
        } else if (errno != ENOENT) {
            rm_fail(j, errno, NULL, 0, NULL);
        }
        return;
    }
    rm_level *stack = NULL;
    size_t depth = 0, cap = 0;
    DIR *cur = fdopendir(top);
    if (!cur) {
        rm_fail(j, errno, NULL, 0, NULL);
        close(top);
        return;
    }
    for (;;) {
        struct dirent *de;
        int descended = 0, read_err = 0;
        while (!descended) {
            errno = 0;
            if (!(de = readdir(cur))) {
                read_err = errno;
                break;
            }
            const char *n = de->d_name;
            if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0) continue;
            struct stat st;
            int fd = dirfd(cur);
            if (fstatat(fd, n, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                if (errno == ENOENT) continue;
                rm_fail(j, errno, stack, depth, n);
                goto out;
            }
            if (st.st_dev != dev) {
                rm_fail(j, EXDEV, stack, depth, n);
                goto out;
            }
            if (!S_ISDIR(st.st_mode)) {
                if (unlinkat(fd, n, 0) != 0 && errno != ENOENT) {
                    rm_fail(j, errno, stack, depth, n);
                    goto out;
                }
                continue;
            }
            if ((j->flags & HOST_FS_OPEN_MODES) && (st.st_mode & 0700) != 0700)
                fchmodat(fd, n, 0700, 0);
            int sub = openat(fd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            DIR *d = sub >= 0 ? fdopendir(sub) : NULL;
            if (!d) {
                if (sub >= 0) close(sub);
                rm_fail(j, errno, stack, depth, n);
                goto out;
            }
            if (depth == cap) {
                size_t nc = cap ? cap * 2 : 64;
                rm_level *ns = realloc(stack, nc * sizeof *ns);
                if (!ns) {
                    closedir(d);
                    rm_fail(j, ENOMEM, stack, depth, n);
                    goto out;
                }
                stack = ns;
                cap = nc;
            }
            stack[depth].name = strdup(n);
            stack[depth].dir = cur;
            if (!stack[depth].name) {
                closedir(d);
                rm_fail(j, ENOMEM, stack, depth, n);
                goto out;
            }
            if (depth >= REMOVE_KEEP_OPEN) { /* deep: let go of the parent's stream */
                closedir(cur);
                stack[depth].dir = NULL;
            }
            depth++;
            cur = d;
            descended = 1;
        }
        if (descended) continue;
        if (read_err) {
            rm_fail(j, read_err, stack, depth, NULL);
            goto out;
        }
        /* cur is empty: go up and remove it from its parent */
        if (depth == 0) break;
        rm_level lv = stack[--depth];
        DIR *parent = lv.dir;
        if (!parent) {
            int up = openat(dirfd(cur), "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            parent = up >= 0 ? fdopendir(up) : NULL;
            if (!parent) {
                if (up >= 0) close(up);
                rm_fail(j, errno, stack, depth, lv.name);
                free(lv.name);
                goto out;
            }
        }
        closedir(cur);
        cur = parent;
        if (unlinkat(dirfd(cur), lv.name, AT_REMOVEDIR) != 0 && errno != ENOENT) {
            rm_fail(j, errno, stack, depth, lv.name);
            free(lv.name);
            goto out;
        }
        free(lv.name);
        if (!lv.dir) rewinddir(cur); /* a reopened stream starts over: only what is left */
    }
    closedir(cur);
    cur = NULL;
    if (unlinkat(at, j->path, AT_REMOVEDIR) != 0 && errno != ENOENT)
        rm_fail(j, errno, NULL, 0, NULL);
out:
    if (cur) closedir(cur);
    while (depth > 0) {
        depth--;
        if (stack[depth].dir) closedir(stack[depth].dir);
        free(stack[depth].name);
    }
    free(stack);
}

int host_fs_remove_tree(int dirfd, const char *path, int flags, char *failed, size_t cap)
{
    rm_job j = {path, flags, 0, failed, cap};
    if (cap) failed[0] = '\0';
    struct stat st;
    if (fstatat(dirfd, path, &st, AT_SYMLINK_NOFOLLOW) != 0)
        return errno == ENOENT ? 0 : errno; /* already gone: done, as rm -rf */
    if ((flags & HOST_FS_OPEN_MODES) && S_ISDIR(st.st_mode) && (st.st_mode & 0700) != 0700)
        fchmodat(dirfd, path, 0700, 0);
    remove_tree(&j, dirfd, st.st_dev);
    return j.err;
}

int host_fs_mkdir_p(char *buf, mode_t mode)
{
    size_t n = strlen(buf);
    while (n > 1 && buf[n - 1] == '/')
        buf[--n] = '\0';
    /* The usual cases first, without one failing mkdir per existing level: the directory exists,
     * or the parents do, or the nearest existing ancestor is a few levels up (found from the
     * leaf upwards). Anything unusual takes the walk from the root, which names the failing
     * prefix. */
    if (mkdir(buf, mode) == 0) return chmod(buf, mode) != 0 ? errno : 0;
    struct stat st0;
    if (errno == EEXIST && stat(buf, &st0) == 0 && S_ISDIR(st0.st_mode)) return 0;
    char *start = buf + 1; /* where the walk below begins: after the nearest existing ancestor */
    if (errno == ENOENT) {
        char *cut = strrchr(buf, '/');
        while (cut && cut > buf) {
            *cut = '\0';
            int rc = mkdir(buf, 0755), e = errno;
            *cut = '/';
            if (rc == 0 || e == EEXIST) {
                start = cut; /* buf up to cut exists now (or is not a directory: the walk says) */
                break;
            }
            if (e != ENOENT) break;
            char *prev = cut - 1;
            while (prev > buf && *prev != '/')
                prev--;
            cut = prev;
        }
    }
    for (char *p = start;; p++) {
        if (*p != '/' && *p != '\0') continue;
        char saved = *p;
        *p = '\0';
        int last = saved == '\0';
        struct stat st;
        if (mkdir(buf, last ? mode : 0755) == 0) {
            if (last && chmod(buf, mode) != 0) return errno;
        } else {
            int e = errno;
            if (e != EEXIST) return e;
            if (stat(buf, &st) != 0) return errno;
            if (!S_ISDIR(st.st_mode)) return ENOTDIR;
        }
        if (last) return 0;
        *p = saved;
        while (p[1] == '/')
            p++;
    }
}

size_t host_fs_overlay_options(char *buf, size_t cap, const char *const *lowers, size_t n,
                               const char *upper, const char *work)
{
    static const char tail[] = ",index=off,redirect_dir=off,metacopy=off";
    size_t len = strlen("lowerdir=") + strlen(",upperdir=") + strlen(upper) + strlen(",workdir=") +
                 strlen(work) + strlen(tail);
    for (size_t i = 0; i < n; i++)
        len += strlen(lowers[i]) + (i > 0);
    if (len >= cap) {
        if (cap) buf[0] = '\0';
        return len;
    }
    size_t o = (size_t)snprintf(buf, cap, "lowerdir=");
    for (size_t i = 0; i < n; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%s", i > 0 ? ":" : "", lowers[i]);
    snprintf(buf + o, cap - o, ",upperdir=%s,workdir=%s%s", upper, work, tail);
    return len;
}

int host_fs_mount_overlay(const char *source, const char *target, int readonly, const char *options)
{
    if (mount(source, target, "overlay", readonly ? MS_RDONLY : 0, options) != 0) return errno;
    return 0;
}

int host_fs_umount(const char *target, int detach_fallback, int *how)
{
    if (umount2(target, 0) == 0) {
        *how = 1;
        return 0;
    }
    int first = errno; /* the one to report: why the plain unmount failed */
    if (detach_fallback && umount2(target, MNT_DETACH) == 0) {
        *how = 2;
        return 0;
    }
    return first;
}

/* ---- room: free space and btrfs quota groups ----------------------------------------------- */

int host_fs_qgroup(const char *path, uint64_t *used, uint64_t *limit)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    struct btrfs_ioctl_ino_lookup_args il;
    memset(&il, 0, sizeof il);
    il.objectid = BTRFS_FIRST_FREE_OBJECTID;
    if (ioctl(fd, BTRFS_IOC_INO_LOOKUP, &il) != 0) {
        int e = errno;
        close(fd);
        return e;
    }
    /* The quota tree's items of qgroup 0/treeid: INFO (generation, rfer, ...) then LIMIT
     * (flags, max_rfer, ...), keyed (0, type, qgroupid). */
    struct btrfs_ioctl_search_args sa;
    memset(&sa, 0, sizeof sa);
    sa.key.tree_id = BTRFS_QUOTA_TREE_OBJECTID;
    sa.key.min_type = BTRFS_QGROUP_INFO_KEY;
    sa.key.max_type = BTRFS_QGROUP_LIMIT_KEY;
    sa.key.min_offset = sa.key.max_offset = il.treeid;
    sa.key.max_transid = UINT64_MAX;
    sa.key.nr_items = 4;
    int rc = ioctl(fd, BTRFS_IOC_TREE_SEARCH, &sa);
    int e = errno;
    close(fd);
    if (rc != 0) return e;
    *used = 0;
    *limit = UINT64_MAX;
    size_t off = 0;
    for (uint32_t i = 0; i < sa.key.nr_items; i++) {
        struct btrfs_ioctl_search_header h;
        if (off + sizeof h > sizeof sa.buf) break;
        memcpy(&h, sa.buf + off, sizeof h);
        off += sizeof h;
        if (off + h.len > sizeof sa.buf) break;
        uint64_t v[2];
        if (h.len >= sizeof v && h.offset == il.treeid) {
            memcpy(v, sa.buf + off, sizeof v);
            if (h.type == BTRFS_QGROUP_INFO_KEY) *used = le64toh(v[1]);
            if (h.type == BTRFS_QGROUP_LIMIT_KEY && (le64toh(v[0]) & BTRFS_QGROUP_LIMIT_MAX_RFER))
                *limit = le64toh(v[1]);
        }
        off += h.len;
    }
    return 0;
}

int host_fs_room(const char *path, uint64_t *room)
{
    struct statfs sf;
    if (statfs(path, &sf) != 0) return errno;
    uint64_t avail = (uint64_t)sf.f_bavail * (uint64_t)sf.f_bsize;
    uint64_t used, limit;
    if ((unsigned long)sf.f_type == BTRFS_SUPER_MAGIC && host_fs_qgroup(path, &used, &limit) == 0 &&
        limit != UINT64_MAX) {
        uint64_t left = used < limit ? limit - used : 0;
        if (left < avail) avail = left;
    }
    *room = avail;
    return 0;
}
