/* archive_pack.c - ARCHIVE_JOB_PACK: walks a directory tree and writes it as a (gzip'd) tar.
 *
 * Every object is opened with O_NOFOLLOW before it is described, and described from fstat of
 * what was opened, so nothing swapped in mid-walk is followed; depth is bounded by
 * ARCHIVE_MAX_DEPTH; the output file is never packed into itself. Worker thread only.
 */
#include "archive_pack.h"

#include "archive_fs.h"

#include <archive.h>
#include <archive_entry.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct pack_state {
    archive_job *j;
    struct archive *a;
    struct archive_entry_linkresolver *links;
    dev_t out_dev; /* the temporary output file: never packed into itself */
    ino_t out_ino;
    char *buf;
} pack_state;

static int pack_dir(pack_state *ps, int dirfd, const char *prefix, int depth);

static int pack_write_header(pack_state *ps, struct archive_entry *e, const char *rel)
{
    int r = archive_write_header(ps->a, e);
    if (r < ARCHIVE_WARN)
        return archive_job_fail(ps->j, ARCHIVE_JOB_IO_ERROR, rel, NULL,
                                "writing the entry %s to %s: %s", rel, ps->j->dst,
                                archive_error_string(ps->a));
    ps->j->res.entries++;
    return ARCHIVE_JOB_OK;
}

/* Copies up to size bytes of the open file fd as the current entry's data. A file that shrank
 * meanwhile is padded with zeros by libarchive; bytes appended meanwhile are left out. */
static int pack_copy(pack_state *ps, int fd, int64_t size, const char *rel)
{
    archive_job *j = ps->j;
    while (size > 0) {
        if (archive_job_cancelled(j)) return archive_job_fail_cancelled(j);
        size_t want = size > COPY_BLOCK ? COPY_BLOCK : (size_t)size;
        ssize_t n = read(fd, ps->buf, want);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return archive_job_fail_errno(j, errno, "reading", rel);
        if (n == 0) break;
        if (archive_write_data(ps->a, ps->buf, (size_t)n) < 0)
            return archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "writing %s: %s", j->dst,
                                    archive_error_string(ps->a));
        size -= n;
        j->res.bytes += (uint64_t)n;
    }
    return ARCHIVE_JOB_OK;
}

/* A fresh entry for rel with st's type, mode, ids, size and whole-second mtime. Access and
 * change times are left out: they differ on every read and would make archives differ. */
static struct archive_entry *pack_entry(const char *rel, const struct stat *st)
{
    struct archive_entry *e = archive_entry_new();
    if (!e) return NULL;
    archive_entry_copy_stat(e, st);
    archive_entry_unset_atime(e);
    archive_entry_unset_ctime(e);
    archive_entry_unset_birthtime(e);
    archive_entry_set_mtime(e, st->st_mtime, 0);
    archive_entry_copy_pathname(e, rel);
    if (!S_ISREG(st->st_mode)) archive_entry_set_size(e, 0);
    return e;
}

/* Packs the entry `name` of dirfd. Each object is opened (O_NOFOLLOW) before it is described,
 * and described from fstat of what was opened, so a file swapped for a symlink mid-walk is
 * never followed: an entry that vanished or changed type under us is left out. */
static int pack_one(pack_state *ps, int dirfd, const char *name, const char *prefix, int depth)
{
    archive_job *j = ps->j;
    struct stat st;
    int rc = ARCHIVE_JOB_OK;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
        if (errno == ENOENT) return ARCHIVE_JOB_OK;
        char *rel = archive_fs_join_rel(prefix, name, "");
        rc = archive_job_fail_errno(j, errno, "cannot stat", rel ? rel : name);
        free(rel);
        return rc;
    }
    if (st.st_dev == ps->out_dev && st.st_ino == ps->out_ino) return ARCHIVE_JOB_OK;
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
        j->res.skipped++; /* devices, fifos, sockets: nothing a tar can carry usefully */
        return ARCHIVE_JOB_OK;
    }
    char *rel = archive_fs_join_rel(prefix, name, "");
    if (!rel) return archive_job_fail_nomem(j);
    struct archive_entry *e = NULL;
    int fd = -1;

    if (S_ISLNK(st.st_mode)) {
        char target[PATH_MAX];
        ssize_t n = readlinkat(dirfd, name, target, sizeof target - 1);
        if (n < 0) {
            if (errno != ENOENT && errno != EINVAL)
                rc = archive_job_fail_errno(j, errno, "cannot read the symlink", rel);
            goto done;
        }
        target[n] = '\0';
        if (!(e = pack_entry(rel, &st))) goto nomem;
        archive_entry_copy_symlink(e, target);
        rc = pack_write_header(ps, e, rel);
        goto done;
    }

    int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC;
    flags |= S_ISDIR(st.st_mode) ? O_DIRECTORY : O_NONBLOCK; /* a fifo swapped in must not block */
    fd = openat(dirfd, name, flags);
    if (fd < 0) {
        if (errno != ENOENT && errno != ELOOP && errno != ENOTDIR)
            rc = archive_job_fail_errno(j, errno, "cannot open", rel);
        goto done;
    }
    if (fstat(fd, &st) != 0) {
        rc = archive_job_fail_errno(j, errno, "cannot stat", rel);
        goto done;
    }
    if (S_ISDIR(st.st_mode)) {
        if (depth >= ARCHIVE_MAX_DEPTH) {
            rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, rel, NULL,
                                  "%s/%s is nested more than %d directories deep", j->src, rel,
                                  ARCHIVE_MAX_DEPTH);
            goto done;
        }
        if (!(e = pack_entry(rel, &st))) goto nomem;
        rc = pack_write_header(ps, e, rel);
        if (rc == ARCHIVE_JOB_OK) {
            char *sub = archive_fs_join_rel(rel, "/", "");
            if (!sub) goto nomem;
            rc = pack_dir(ps, fd, sub, depth + 1);
            free(sub);
        }
        goto done;
    }
    if (!S_ISREG(st.st_mode)) {
        j->res.skipped++;
        goto done;
    }
    if (!(e = pack_entry(rel, &st))) goto nomem;
    /* The first path of a multiply-linked file carries the data; later ones become hard links
     * to it (size 0), as tar does. Links to files outside src_dir stay copies. */
    struct archive_entry *spare = NULL;
    archive_entry_linkify(ps->links, &e, &spare);
    archive_entry_free(spare);
    if (!e) goto done;
    rc = pack_write_header(ps, e, rel);
    if (rc == ARCHIVE_JOB_OK && archive_entry_hardlink(e) == NULL)
        rc = pack_copy(ps, fd, archive_entry_size(e), rel);
    goto done;

nomem:
    rc = archive_job_fail_nomem(j);
done:
    archive_fs_close_quietly(fd);
    archive_entry_free(e);
    free(rel);
    return rc;
}

static int pack_dir(pack_state *ps, int dirfd, const char *prefix, int depth)
{
    char **names;
    size_t n;
    if (archive_fs_read_names(dirfd, &names, &n) != 0)
        return archive_job_fail_errno(ps->j, errno, "cannot read the directory",
                                      *prefix ? prefix : ps->j->src);
    int rc = ARCHIVE_JOB_OK;
    for (size_t i = 0; i < n && rc == ARCHIVE_JOB_OK; i++) {
        if (archive_job_cancelled(ps->j))
            rc = archive_job_fail_cancelled(ps->j);
        else
            rc = pack_one(ps, dirfd, names[i], prefix, depth);
    }
    archive_fs_free_names(names, n);
    return rc;
}

/* The pack job, on the worker thread: the directory tree j->src as a tar (gzip'd when j->gzip)
 * at j->dst. Checks first that dst names a file in an existing directory and src is a
 * directory; writes a 0600 ".NAME.partial-XXXXXX" beside dst (pax-restricted headers, hard
 * links kept as links), walks src without following symlinks (pack_dir, skipping the output
 * file itself), fsyncs, and renames it onto dst only when complete and not cancelled.
 * Returns ARCHIVE_JOB_OK, or the failure status with its sentence recorded on j
 * (archive_job_fail*: the path and the system's reason; cancellation is ARCHIVE_JOB_CANCELLED);
 * on any failure the partial file is removed and dst is untouched. Blocks (file I/O): never on
 * the loop thread. */
int archive_pack_run(archive_job *j)
{
    char *dir = NULL, *base = NULL, *tmp = NULL;
    int outdirfd = -1, rootfd = -1, fd = -1, rc;
    pack_state ps;
    memset(&ps, 0, sizeof ps);
    ps.j = j;

    if (archive_fs_split_path(j->dst, &dir, &base) != 0) return archive_job_fail_nomem(j);
    if (!*base) {
        rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is not a file name", j->dst);
        goto out;
    }
    outdirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (outdirfd < 0) {
        rc = archive_job_fail_errno(j, errno, "cannot open the directory of the archive", dir);
        goto out;
    }
    struct stat st;
    if (fstatat(outdirfd, base, &st, 0) == 0 && S_ISDIR(st.st_mode)) {
        rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is a directory", j->dst);
        goto out;
    }
    rootfd = open(j->src, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) {
        rc = errno == ENOTDIR
                 ? archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is not a directory",
                                    j->src)
                 : archive_job_fail_errno(j, errno, "cannot open the directory", j->src);
        goto out;
    }
    size_t tl = strlen(dir) + strlen(base) + 32;
    if (!(tmp = (char *)malloc(tl))) {
        rc = archive_job_fail_nomem(j);
        goto out;
    }
    snprintf(tmp, tl, "%s/.%.*s.partial-XXXXXX", dir, STAGE_BASE_MAX, base);
    fd = mkostemp(tmp, O_CLOEXEC); /* 0600 */
    if (fd < 0) {
        rc = archive_job_fail_errno(j, errno, "cannot create", tmp);
        goto out;
    }
    if (fstat(fd, &st) == 0) {
        ps.out_dev = st.st_dev;
        ps.out_ino = st.st_ino;
    }
    ps.a = archive_write_new();
    ps.links = archive_entry_linkresolver_new();
    ps.buf = (char *)malloc(COPY_BLOCK);
    if (!ps.a || !ps.links || !ps.buf) {
        rc = archive_job_fail_nomem(j);
        goto out;
    }
    archive_entry_linkresolver_set_strategy(ps.links, ARCHIVE_FORMAT_TAR_PAX_RESTRICTED);
    /* ustar headers, with pax extensions only where ustar cannot say it (long names, big
     * sizes or ids): the most widely readable choice. */
    if (archive_write_set_format_pax_restricted(ps.a) != ARCHIVE_OK ||
        (j->gzip && archive_write_add_filter_gzip(ps.a) != ARCHIVE_OK) ||
        archive_write_open_fd(ps.a, fd) != ARCHIVE_OK) {
        rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "cannot start writing %s: %s",
                              j->dst, archive_error_string(ps.a));
        goto out;
    }
    rc = pack_dir(&ps, rootfd, "", 1);
    if (rc == ARCHIVE_JOB_OK && archive_write_close(ps.a) != ARCHIVE_OK)
        rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "finishing %s: %s", j->dst,
                              archive_error_string(ps.a));
    if (rc == ARCHIVE_JOB_OK && fsync(fd) != 0)
        rc = archive_job_fail_errno(j, errno, "cannot sync", tmp);
    if (rc == ARCHIVE_JOB_OK && archive_job_cancelled(j)) rc = archive_job_fail_cancelled(j);
    if (rc == ARCHIVE_JOB_OK && renameat(outdirfd, strrchr(tmp, '/') + 1, outdirfd, base) != 0)
        rc = archive_job_fail_errno(j, errno, "cannot move the archive into place at", j->dst);

out:
    if (ps.a) archive_write_free(ps.a); /* after a failure this may flush into tmp: removed next */
    if (fd >= 0) {
        close(fd);
        if (rc != ARCHIVE_JOB_OK) unlinkat(outdirfd, strrchr(tmp, '/') + 1, 0);
    }
    if (ps.links) archive_entry_linkresolver_free(ps.links);
    free(ps.buf);
    archive_fs_close_quietly(rootfd);
    archive_fs_close_quietly(outdirfd);
    free(tmp);
    free(dir);
    free(base);
    return rc;
}
