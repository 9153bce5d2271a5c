/* archive_unpack.c - ARCHIVE_JOB_UNPACK: checks every member and writes it into staging.
 *
 * Owns the staging directory's contents: each member is checked (archive_names.c) before it is
 * written, every write goes through directory fds opened one component at a time with
 * O_NOFOLLOW from the staging fd, and directory modes, owners and times are applied last,
 * deepest first. Moving the finished tree into place is archive_commit.c's. Worker thread only.
 */
#include "archive_unpack.h"

#include "archive_commit.h"
#include "archive_fs.h"
#include "archive_names.h"
#include "archive_read.h"

#include <archive.h>
#include <archive_entry.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DIR_FIXUP_FIRST 64 /* first allocation of the directory fixup list */

/* Why unpack does not use archive_write_disk with ARCHIVE_EXTRACT_SECURE_SYMLINKS |
 * _SECURE_NODOTDOT | _SECURE_NOABSOLUTEPATHS: archive_write_disk changes process-wide state
 * from whatever thread calls it. It sets umask(0) and back around every header it writes
 * (_archive_write_disk_header), so for that moment every file the loop thread creates (a
 * recipe's io.open) would get mode 0666; it resolves names against the process's working
 * directory, so NOABSOLUTEPATHS could only be had by chdir() into staging, which would move
 * every relative path the loop thread uses; and for paths beyond PATH_MAX it chdir()s on its
 * own. Per-thread working directories (unshare(CLONE_FS)) would fix all three, but container
 * seccomp profiles commonly refuse unshare. So the three flags are replaced by stronger
 * equivalents, in two layers:
 *  - Our checks on each member's header (unpack_member): no absolute name, no `..` component,
 *    symlink targets that stay inside the tree, hard links only to earlier members, no device,
 *    fifo or socket. They run before anything is written, name the member in the error, and
 *    cover what libarchive never checks (where a symlink points, what a hard link names).
 *  - The kernel on each write: a member's parent directories are opened from the staging
 *    directory's fd with O_NOFOLLOW | O_DIRECTORY, so a symlink anywhere on the way (one the
 *    archive made earlier, or one raced in) fails the open instead of being followed; files
 *    are created O_EXCL | O_NOFOLLOW. That is what SECURE_SYMLINKS checks with lstat(), minus
 *    the window between check and use; NODOTDOT and NOABSOLUTEPATHS hold because only names
 *    that passed our checks are ever opened, and only relative to the staging fd.
 * Both layers are needed: the checks alone would trust that nothing changes between check and
 * write (and could not see links made by hard-linking a symlink), the kernel layer alone would
 * let a symlink pointing at /etc be created and only refuse writes through it. */

/* ---- writing into staging ------------------------------------------------------------------- */

/* A directory whose final mode, owner and time are applied after every member is written:
 * earlier, a read-only directory would refuse its own contents, and writing into a directory
 * changes its mtime. */
typedef struct dir_fixup {
    char *rel;
    size_t order; /* members applied in archive order when two name the same directory */
    int depth;
    mode_t mode;
    int has_mtime;
    struct timespec mtime;
    int chown;
    uid_t uid;
    gid_t gid;
} dir_fixup;

typedef struct unpack_state {
    archive_job *j;
    reader rd;
    int stagefd;
    /* The parent directory of the previous member, opened safely; reused when the next
     * member lives in the same directory (the common case), dropped whenever a directory
     * is removed or a link is made, since those are the only ways a name can change kind. */
    char *cache_rel;
    int cache_fd;
    int cache_stale;    /* dropped at the next lookup: the fd may be in use right now */
    const char *member; /* the current member's name as stored, for errors */
    dir_fixup *fix;
    size_t nfix, capfix;
    int root_set; /* the archive had a "." member: its mode applies to a fresh target */
    mode_t root_mode;
} unpack_state;

static void cache_drop(unpack_state *us)
{
    archive_fs_close_quietly(us->cache_fd);
    us->cache_fd = -1;
    free(us->cache_rel);
    us->cache_rel = NULL;
    us->cache_stale = 0;
}

static int add_fixup(unpack_state *us, const char *rel, mode_t mode, struct archive_entry *e)
{
    if (us->nfix == us->capfix) {
        size_t ncap = us->capfix ? us->capfix * 2 : DIR_FIXUP_FIRST;
        dir_fixup *grown = (dir_fixup *)realloc(us->fix, ncap * sizeof *grown);
        if (!grown) return archive_job_fail_nomem(us->j);
        us->fix = grown;
        us->capfix = ncap;
    }
    dir_fixup *f = &us->fix[us->nfix];
    memset(f, 0, sizeof *f);
    if (!(f->rel = strdup(rel))) return archive_job_fail_nomem(us->j);
    f->order = us->nfix;
    for (const char *s = rel; *s; s++)
        if (*s == '/') f->depth++;
    f->mode = mode;
    if (e && archive_entry_mtime_is_set(e)) {
        f->has_mtime = 1;
        f->mtime.tv_sec = archive_entry_mtime(e);
        f->mtime.tv_nsec = archive_entry_mtime_nsec(e);
    }
    if (e && us->j->owner) {
        f->chown = 1;
        f->uid = (uid_t)archive_entry_uid(e);
        f->gid = (gid_t)archive_entry_gid(e);
    }
    us->nfix++;
    return ARCHIVE_JOB_OK;
}

/* Why open_dir_rel failed, and at which prefix of the path. */
enum walk_failure { WALK_SYMLINK = 1, WALK_NOT_DIR, WALK_MISSING, WALK_OTHER };

typedef struct walk_error {
    int kind;   /* enum walk_failure */
    int err;    /* errno, for WALK_OTHER */
    size_t len; /* the failing component ends at rel[len] */
} walk_error;

/* Opens the directory rel (a normalised relative path, "" for the staging root) below the
 * staging directory, one component at a time with O_NOFOLLOW, so no symlink is ever followed.
 * With create, missing directories are made (0700 now, 0777 & ~umask at the end, as tar
 * does for directories an archive does not list). Returns the fd, or -1 with *we saying
 * which component was a symlink, not a directory, missing, or failed otherwise. */
static int open_dir_rel(unpack_state *us, const char *rel, int create, walk_error *we)
{
    const int dflags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    int cur = openat(us->stagefd, ".", dflags);
    memset(we, 0, sizeof *we);
    if (cur < 0) {
        we->kind = WALK_OTHER;
        we->err = errno;
        return -1;
    }
    const char *p = rel;
    char comp[NAME_MAX + 1];
    while (*p) {
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        we->len = (size_t)(p - rel) + n;
        int next = -1;
        errno = ENAMETOOLONG;
        if (n <= NAME_MAX) {
            memcpy(comp, p, n);
            comp[n] = '\0';
            next = openat(cur, comp, dflags);
            if (next < 0 && errno == ENOENT && create) {
                if (mkdirat(cur, comp, 0700) == 0) {
                    char *sofar = strndup(rel, we->len);
                    int ok =
                        sofar && add_fixup(us, sofar, 0777 & ~us->j->umask, NULL) == ARCHIVE_JOB_OK;
                    free(sofar);
                    if (!ok) {
                        close(cur);
                        we->kind = WALK_OTHER;
                        we->err = ENOMEM;
                        return -1;
                    }
                }
                next = openat(cur, comp, dflags);
            }
        }
        if (next < 0) {
            struct stat st;
            we->err = errno;
            if (n <= NAME_MAX && fstatat(cur, comp, &st, AT_SYMLINK_NOFOLLOW) == 0)
                we->kind = S_ISLNK(st.st_mode)   ? WALK_SYMLINK
                           : S_ISDIR(st.st_mode) ? WALK_OTHER
                                                 : WALK_NOT_DIR;
            else
                we->kind = we->err == ENOENT ? WALK_MISSING : WALK_OTHER;
            close(cur);
            return -1;
        }
        close(cur);
        cur = next;
        p += n;
        if (*p == '/') p++;
    }
    return cur;
}

/* Records the failure of the walk to the parent directory `rel` of member. */
static int fail_walk(unpack_state *us, const walk_error *we, const char *member, const char *rel)
{
    archive_job *j = us->j;
    int len = (int)we->len;
    switch (we->kind) {
    case WALK_SYMLINK:
        return archive_job_fail(
            j, ARCHIVE_JOB_UNSAFE, member, NULL,
            "refusing %s: member '%s' would be written through the symlink '%.*s' "
            "extracted before it",
            j->src, member, len, rel);
    case WALK_NOT_DIR:
    case WALK_MISSING:
        return archive_job_fail(
            j, ARCHIVE_JOB_CORRUPT, member, NULL,
            "member '%s' of %s needs '%.*s' to be a directory, but an earlier member "
            "made it something else",
            member, j->src, len, rel);
    default:
        return archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, member, NULL,
                                "cannot open '%.*s' while unpacking %s into %s: %s", len, rel,
                                j->src, j->dst, strerror(we->err));
    }
}

/* The parent directory of the normalised member name `rel`, opened (and created) safely;
 * *base points at the last component. The returned fd belongs to the cache: do not close. */
static int member_parent(unpack_state *us, const char *rel, const char **base)
{
    const char *slash = strrchr(rel, '/');
    size_t plen = slash ? (size_t)(slash - rel) : 0;
    *base = slash ? slash + 1 : rel;
    if (us->cache_rel && !us->cache_stale && strlen(us->cache_rel) == plen &&
        memcmp(us->cache_rel, rel, plen) == 0)
        return us->cache_fd;
    cache_drop(us);
    char *prel = strndup(rel, plen);
    if (!prel) {
        archive_job_fail_nomem(us->j);
        return -1;
    }
    walk_error we;
    int fd = open_dir_rel(us, prel, 1, &we);
    if (fd < 0) {
        fail_walk(us, &we, us->member, prel);
        free(prel);
        return -1;
    }
    us->cache_rel = prel;
    us->cache_fd = fd;
    return fd;
}

/* Makes room for a new member `base` in dirfd: removes a non-directory there, or an empty
 * directory (tar semantics: a later member replaces an earlier one of the same name). A
 * non-empty directory is not replaced: that archive is CORRUPT. */
static int make_room(unpack_state *us, int dirfd, const char *base)
{
    struct stat st;
    if (fstatat(dirfd, base, &st, AT_SYMLINK_NOFOLLOW) != 0) return ARCHIVE_JOB_OK;
    if (!S_ISDIR(st.st_mode)) {
        if (unlinkat(dirfd, base, 0) != 0)
            return archive_job_fail_errno(us->j, errno, "cannot replace", us->member);
        return ARCHIVE_JOB_OK;
    }
    us->cache_stale = 1;
    if (unlinkat(dirfd, base, AT_REMOVEDIR) != 0)
        return archive_job_fail(
            us->j, ARCHIVE_JOB_CORRUPT, us->member, NULL,
            "member '%s' of %s would replace a directory an earlier member filled", us->member,
            us->j->src);
    return ARCHIVE_JOB_OK;
}

/* The mode a member gets: the archive's permission bits without setuid/setgid (unless
 * ownership is restored too) and without the umask bits; opts.file_mode for regular files. */
static mode_t member_mode(archive_job *j, struct archive_entry *e, int regular)
{
    if (regular && j->file_mode >= 0) return (mode_t)j->file_mode;
    mode_t m = archive_entry_perm(e) & 07777;
    if (!j->owner) m &= ~(mode_t)(S_ISUID | S_ISGID);
    return m & ~j->umask;
}

/* Writes the regular-file member e as `base` in dirfd (rel: its path in the archive, for
 * messages): created O_EXCL | O_NOFOLLOW 0600 after make_room (so nothing already there, and no
 * symlink, is written through), filled block by block at the blocks' offsets (sparse holes
 * stay holes; data beyond the declared size is CORRUPT), sized to the declared size, then
 * owner (with j->owner; before the mode, since chown clears setuid), mode (member_mode) and
 * mtime. Adds the size to j->res.bytes. Returns ARCHIVE_JOB_OK or the failure status with its
 * sentence on j; the fd is always closed. Worker thread only. */
static int write_file(unpack_state *us, int dirfd, const char *base, const char *rel,
                      struct archive_entry *e)
{
    archive_job *j = us->j;
    int rc = make_room(us, dirfd, base);
    if (rc != ARCHIVE_JOB_OK) return rc;
    int fd = openat(dirfd, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return archive_job_fail_errno(j, errno, "cannot create", rel);
    int64_t size = archive_entry_size_is_set(e) ? archive_entry_size(e) : 0;
    for (;;) {
        const void *buf;
        size_t len;
        la_int64_t off;
        int r = archive_read_data_block(us->rd.a, &buf, &len, &off);
        if (r == ARCHIVE_EOF) break;
        if (r < ARCHIVE_WARN) {
            rc = archive_reader_fail(j, &us->rd);
            goto out;
        }
        if (archive_job_cancelled(j)) {
            rc = archive_job_fail_cancelled(j);
            goto out;
        }
        if (off < 0 || (int64_t)len > size || off > size - (int64_t)len) {
            rc = archive_job_fail(j, ARCHIVE_JOB_CORRUPT, us->member, NULL,
                                  "member '%s' of %s has more data than its declared size",
                                  us->member, j->src);
            goto out;
        }
        if (archive_fs_pwrite_all(fd, (const char *)buf, len, (off_t)off) != 0) {
            rc = archive_job_fail_errno(j, errno, "cannot write", rel);
            goto out;
        }
    }
    /* Sparse members end in a hole that no data block covers. */
    if (ftruncate(fd, (off_t)size) != 0) {
        rc = archive_job_fail_errno(j, errno, "cannot size", rel);
        goto out;
    }
    /* chown before chmod: chown clears setuid/setgid bits. */
    if (j->owner && fchown(fd, (uid_t)archive_entry_uid(e), (gid_t)archive_entry_gid(e)) != 0) {
        rc = archive_job_fail_errno(j, errno, "cannot change the owner of", rel);
        goto out;
    }
    if (fchmod(fd, member_mode(j, e, 1)) != 0) {
        rc = archive_job_fail_errno(j, errno, "cannot set the mode of", rel);
        goto out;
    }
    if (archive_entry_mtime_is_set(e)) {
        struct timespec ts[2] = {{0, UTIME_OMIT},
                                 {archive_entry_mtime(e), archive_entry_mtime_nsec(e)}};
        futimens(fd, ts);
    }
    j->res.bytes += (uint64_t)size;
out:
    close(fd);
    return rc;
}

static int write_dir(unpack_state *us, int dirfd, const char *base, const char *rel,
                     struct archive_entry *e)
{
    struct stat st;
    if (fstatat(dirfd, base, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(st.st_mode)) {
        int rc = make_room(us, dirfd, base);
        if (rc != ARCHIVE_JOB_OK) return rc;
        if (mkdirat(dirfd, base, 0700) != 0)
            return archive_job_fail_errno(us->j, errno, "cannot create the directory", rel);
    }
    return add_fixup(us, rel, member_mode(us->j, e, 0), e);
}

static int write_symlink(unpack_state *us, int dirfd, const char *base, const char *rel,
                         struct archive_entry *e, const char *target)
{
    archive_job *j = us->j;
    int rc = make_room(us, dirfd, base);
    if (rc != ARCHIVE_JOB_OK) return rc;
    us->cache_stale = 1;
    if (symlinkat(target, dirfd, base) != 0)
        return archive_job_fail_errno(j, errno, "cannot create the symlink", rel);
    if (j->owner && fchownat(dirfd, base, (uid_t)archive_entry_uid(e), (gid_t)archive_entry_gid(e),
                             AT_SYMLINK_NOFOLLOW) != 0)
        return archive_job_fail_errno(j, errno, "cannot change the owner of", rel);
    if (archive_entry_mtime_is_set(e)) {
        struct timespec ts[2] = {{0, UTIME_OMIT},
                                 {archive_entry_mtime(e), archive_entry_mtime_nsec(e)}};
        utimensat(dirfd, base, ts, AT_SYMLINK_NOFOLLOW);
    }
    return ARCHIVE_JOB_OK;
}

/* A hard link may only name an earlier member: a regular file, or a symlink whose target is
 * then checked again from the link's own directory (the same link text means something else
 * one level up). The target's directories are opened like any member's, so a link cannot
 * reach out through a symlink either. */
static int write_hardlink(unpack_state *us, int dirfd, const char *base, const char *rel,
                          const char *target_raw)
{
    archive_job *j = us->j;
    const char *why;
    char *target = archive_normalize_name(target_raw, &why);
    if (!target)
        return archive_job_fail(j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
                                "refusing %s: member '%s' is a hard link to '%s', which %s", j->src,
                                us->member, target_raw, why);
    int rc = ARCHIVE_JOB_OK, tdir = -1;
    if (strcmp(target, rel) == 0) goto out; /* a link to itself: nothing to do */
    const char *slash = strrchr(target, '/');
    const char *tbase = slash ? slash + 1 : target;
    char *tparent = strndup(target, slash ? (size_t)(slash - target) : 0);
    if (!tparent) {
        rc = archive_job_fail_nomem(j);
        goto out;
    }
    struct stat st;
    walk_error we;
    tdir = open_dir_rel(us, tparent, 0, &we);
    if (tdir < 0 && we.kind == WALK_SYMLINK) {
        rc = archive_job_fail(
            j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
            "refusing %s: member '%s' is a hard link to '%s', which lies beyond the "
            "symlink '%.*s'",
            j->src, us->member, target_raw, (int)we.len, tparent);
        free(tparent);
        goto out;
    }
    if (tdir < 0 && we.kind == WALK_OTHER) {
        rc = fail_walk(us, &we, us->member, tparent);
        free(tparent);
        goto out;
    }
    free(tparent);
    if (tdir < 0 || fstatat(tdir, tbase, &st, AT_SYMLINK_NOFOLLOW) != 0 || S_ISDIR(st.st_mode)) {
        rc =
            archive_job_fail(j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
                             "refusing %s: member '%s' is a hard link to '%s', which is not a file "
                             "extracted before it",
                             j->src, us->member, target_raw);
        goto out;
    }
    if (S_ISLNK(st.st_mode)) {
        char text[PATH_MAX];
        ssize_t n = readlinkat(tdir, tbase, text, sizeof text - 1);
        if (n < 0) {
            rc = archive_job_fail_errno(j, errno, "cannot read the symlink", target);
            goto out;
        }
        text[n] = '\0';
        const char *problem = archive_symlink_problem(rel, text);
        if (problem) {
            rc = archive_job_fail(
                j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
                "refusing %s: member '%s' is a hard link to the symlink '%s', which "
                "from the hard link's directory %s",
                j->src, us->member, target_raw, problem);
            goto out;
        }
    } else if (!S_ISREG(st.st_mode)) {
        rc =
            archive_job_fail(j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
                             "refusing %s: member '%s' is a hard link to '%s', which is not a file",
                             j->src, us->member, target_raw);
        goto out;
    }
    if ((rc = make_room(us, dirfd, base)) != ARCHIVE_JOB_OK) goto out;
    us->cache_stale = 1;
    if (linkat(tdir, tbase, dirfd, base, 0) != 0)
        rc = archive_job_fail_errno(j, errno, "cannot link", rel);
out:
    archive_fs_close_quietly(tdir);
    free(target);
    return rc;
}

/* Checks one member against the rules and writes it into staging. */
static int unpack_member(unpack_state *us, struct archive_entry *e)
{
    archive_job *j = us->j;
    const char *raw = archive_entry_pathname(e);
    if (!raw) raw = archive_entry_pathname_utf8(e);
    if (!raw)
        return archive_job_fail(j, ARCHIVE_JOB_CORRUPT, NULL, NULL,
                                "%s has a member without a name", j->src);
    const char *why;
    char *rel = archive_normalize_name(raw, &why);
    us->member = raw;
    if (!rel)
        return archive_job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL, "refusing %s: member '%s' %s",
                                j->src, raw, why);
    int rc = ARCHIVE_JOB_OK;
    const char *hardlink = archive_entry_hardlink(e);
    mode_t type = archive_entry_filetype(e);
    if (strlen(rel) >= PATH_MAX) {
        rc = archive_job_fail(j, ARCHIVE_JOB_TOO_LARGE, raw, "path_length",
                              "member '%.64s...' of %s has a name longer than %d bytes", raw,
                              j->src, PATH_MAX - 1);
        goto out;
    }
    if (!hardlink && type != AE_IFREG && type != AE_IFDIR && type != AE_IFLNK) {
        const char *what = type == AE_IFCHR    ? "a character device"
                           : type == AE_IFBLK  ? "a block device"
                           : type == AE_IFIFO  ? "a fifo"
                           : type == AE_IFSOCK ? "a socket"
                                               : "of an unknown type";
        rc = archive_job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL, "refusing %s: member '%s' is %s",
                              j->src, raw, what);
        goto out;
    }
    if (!*rel) { /* ".": the target directory itself */
        if (hardlink || type != AE_IFDIR) {
            rc = archive_job_fail(
                j, ARCHIVE_JOB_UNSAFE, raw, NULL,
                "refusing %s: member '%s' would replace the target directory itself", j->src, raw);
        } else {
            us->root_set = 1;
            us->root_mode = member_mode(j, e, 0);
        }
        goto out;
    }
    const char *target = type == AE_IFLNK && !hardlink ? archive_entry_symlink(e) : NULL;
    if (type == AE_IFLNK && !hardlink) {
        const char *problem = archive_symlink_problem(rel, target ? target : "");
        if (problem) {
            rc = archive_job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL,
                                  "refusing %s: member '%s' is a symlink that %s (-> %s)", j->src,
                                  raw, problem, target ? target : "");
            goto out;
        }
    }
    if (type == AE_IFREG && !hardlink) {
        int64_t size = archive_entry_size(e);
        if (size < 0 || (uint64_t)size > j->max_bytes - j->res.bytes) {
            rc = archive_job_fail(j, ARCHIVE_JOB_TOO_LARGE, raw, "max_bytes",
                                  "%s holds more than max_bytes (%llu) bytes of files", j->src,
                                  (unsigned long long)j->max_bytes);
            goto out;
        }
    }
    const char *base;
    int dirfd = member_parent(us, rel, &base);
    if (dirfd < 0) {
        rc = j->res.status;
        goto out;
    }
    if (hardlink)
        rc = write_hardlink(us, dirfd, base, rel, hardlink);
    else if (type == AE_IFDIR)
        rc = write_dir(us, dirfd, base, rel, e);
    else if (type == AE_IFLNK)
        rc = write_symlink(us, dirfd, base, rel, e, target);
    else
        rc = write_file(us, dirfd, base, rel, e);
out:
    free(rel);
    return rc;
}

static int cmp_fixups(const void *a, const void *b)
{
    const dir_fixup *x = (const dir_fixup *)a, *y = (const dir_fixup *)b;
    if (x->depth != y->depth) return y->depth - x->depth; /* deepest first */
    return x->order < y->order ? -1 : x->order > y->order;
}

/* Applies directory modes, owners and times, deepest first so a directory is closed off only
 * after everything below it is final. A directory replaced later in the archive is skipped. */
static int apply_fixups(unpack_state *us)
{
    archive_job *j = us->j;
    if (us->nfix > 1) qsort(us->fix, us->nfix, sizeof *us->fix, cmp_fixups);
    cache_drop(us);
    for (size_t i = 0; i < us->nfix; i++) {
        dir_fixup *f = &us->fix[i];
        walk_error we;
        int fd = open_dir_rel(us, f->rel, 0, &we);
        if (fd < 0 && we.kind != WALK_OTHER) continue; /* replaced later by a non-directory */
        if (fd < 0) return fail_walk(us, &we, f->rel, f->rel);
        if (f->chown && fchown(fd, f->uid, f->gid) != 0) {
            close(fd);
            return archive_job_fail_errno(j, errno, "cannot change the owner of", f->rel);
        }
        if (fchmod(fd, f->mode) != 0) {
            close(fd);
            return archive_job_fail_errno(j, errno, "cannot set the mode of", f->rel);
        }
        if (f->has_mtime) {
            struct timespec ts[2] = {{0, UTIME_OMIT}, f->mtime};
            futimens(fd, ts);
        }
        close(fd);
    }
    return ARCHIVE_JOB_OK;
}
/* ---- the job -------------------------------------------------------------------------------- */

/* The unpack job, on the worker thread: resolves the target (archive_resolve_target), unpacks
 * every member of j->src into a fresh 0700 staging directory beside it (unpack_member: names
 * normalised, symlinks checked, nothing followed; at most max_entries members), applies the
 * directory fixups (modes and times set last), and only then moves the complete tree into
 * place (archive_commit: a rename, or a merge with j->merge). Cancellation is honoured up to
 * the commit, never during it: a half-merged target is worse than a complete one. Returns
 * ARCHIVE_JOB_OK, or the failure status with its sentence (and member) on j; on any failure
 * the staging directory is removed and the target is as it was. Blocks: never on the loop. */
int archive_unpack_run(archive_job *j)
{
    target_info ti = {NULL, NULL, -1, 0};
    unpack_state us;
    memset(&us, 0, sizeof us);
    us.j = j;
    us.stagefd = us.cache_fd = us.rd.s.fd = -1;
    char *stage = NULL;
    int moved = 0, rc;

    if ((rc = archive_resolve_target(j, &ti)) != ARCHIVE_JOB_OK) goto out;
    if ((rc = archive_reader_open(j, &us.rd)) != ARCHIVE_JOB_OK) goto out;
    size_t sl = strlen(ti.parent) + strlen(ti.base) + 40;
    if (!(stage = (char *)malloc(sl))) {
        rc = archive_job_fail_nomem(j);
        goto out;
    }
    snprintf(stage, sl, "%s/.%.*s.moonbox-staging-XXXXXX", strcmp(ti.parent, "/") ? ti.parent : "",
             STAGE_BASE_MAX, ti.base);
    if (!mkdtemp(stage)) { /* 0700 */
        free(stage);
        stage = NULL;
        rc = archive_job_fail_errno(j, errno, "cannot create a staging directory beside", j->dst);
        goto out;
    }
    const char *stage_name = strrchr(stage, '/') + 1;
    us.stagefd = openat(ti.parentfd, stage_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (us.stagefd < 0) {
        rc = archive_job_fail_errno(j, errno, "cannot open", stage);
        goto out;
    }
    for (;;) {
        struct archive_entry *e;
        if ((rc = archive_reader_next(j, &us.rd, &e)) != ARCHIVE_JOB_OK) goto out;
        if (!e) break; /* the last member was read and the gzip trailer checked */
        if ((rc = unpack_member(&us, e)) != ARCHIVE_JOB_OK) goto out;
    }
    if ((rc = apply_fixups(&us)) != ARCHIVE_JOB_OK) goto out;
    if (archive_job_cancelled(j)) {
        rc = archive_job_fail_cancelled(j);
        goto out;
    }
    /* From here on the job runs to its end even if cancelled: a half-merged target is worse
     * than a complete one. */
    rc = archive_commit(j, &ti, us.stagefd, stage_name,
                        us.root_set ? us.root_mode : 0777 & ~j->umask, &moved);

out:
    cache_drop(&us);
    archive_reader_close(&us.rd);
    archive_fs_close_quietly(us.stagefd);
    if (stage && !moved) archive_fs_remove_entry(ti.parentfd, strrchr(stage, '/') + 1);
    for (size_t i = 0; i < us.nfix; i++)
        free(us.fix[i].rel);
    free(us.fix);
    free(stage);
    archive_fs_close_quietly(ti.parentfd);
    free(ti.parent);
    free(ti.base);
    return rc;
}
