/* archive_commit.c - moves a staged unpack into place: a rename, or a merge (see archive_commit.h).
 *
 * Both trees are walked through O_NOFOLLOW fds, so a symlink already in the target (or raced
 * in) is replaced, never traversed; a merge that would put a non-directory over a directory is
 * refused before anything moves. Worker thread only.
 */
#include "archive_commit.h"

#include "archive_fs.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Renames sfd/name to tfd/name. Moving a directory to another parent rewrites its "..", which
 * needs write permission on it: a read-only one (a mode from the archive) gets it for the
 * move and its mode back afterwards. */
static int move_entry(archive_job *j, int sfd, int tfd, const char *name, const struct stat *s,
                      const char *rel)
{
    if (renameat(sfd, name, tfd, name) == 0) return ARCHIVE_JOB_OK;
    if (errno == EACCES && S_ISDIR(s->st_mode) && fchmodat(sfd, name, 0700, 0) == 0) {
        if (renameat(sfd, name, tfd, name) == 0) {
            fchmodat(tfd, name, s->st_mode & 07777, 0);
            return ARCHIVE_JOB_OK;
        }
        fchmodat(sfd, name, s->st_mode & 07777, 0);
    }
    return archive_job_fail_errno(j, errno, "cannot move into place", rel);
}

/* Walks the staged tree against the target (check = 1: only looks for conflicts; check = 0:
 * moves). Directories present on both sides are merged; everything else is moved over
 * whatever the target has there (a file, or a symlink, which is replaced and never followed);
 * a staged non-directory over a target directory is a conflict, found by the check pass
 * before anything moves. Both sides are walked through O_NOFOLLOW fds, so a symlink that
 * already is in the target (or is raced in) is never traversed. */
static int merge_walk(archive_job *j, int sfd, int tfd, const char *prefix, int depth, int check)
{
    char **names;
    size_t n;
    if (archive_fs_read_names(sfd, &names, &n) != 0)
        return archive_job_fail_errno(j, errno, "cannot read the staging directory for", j->dst);
    int rc = ARCHIVE_JOB_OK;
    for (size_t i = 0; i < n && rc == ARCHIVE_JOB_OK; i++) {
        const char *name = names[i];
        struct stat s, t;
        char *rel = archive_fs_join_rel(prefix, name, "");
        if (!rel) {
            rc = archive_job_fail_nomem(j);
            break;
        }
        int have_t = fstatat(tfd, name, &t, AT_SYMLINK_NOFOLLOW) == 0;
        if (fstatat(sfd, name, &s, AT_SYMLINK_NOFOLLOW) != 0) {
            rc = archive_job_fail_errno(j, errno, "cannot stat the staged", rel);
        } else if (S_ISDIR(s.st_mode) && have_t && S_ISDIR(t.st_mode)) {
            if (depth >= ARCHIVE_MAX_DEPTH) {
                rc = archive_job_fail(
                    j, ARCHIVE_JOB_IO_ERROR, rel, NULL,
                    "cannot merge %s: '%s' is nested more than %d directories deep", j->dst, rel,
                    ARCHIVE_MAX_DEPTH);
            } else {
                /* The staged directory is emptied and discarded: make sure we may. */
                fchmodat(sfd, name, 0700, 0);
                int sub_s = openat(sfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                int sub_t = openat(tfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                char *sub = archive_fs_join_rel(rel, "/", "");
                if (sub_s < 0 || sub_t < 0)
                    rc = archive_job_fail_errno(j, errno, "cannot open", rel);
                else if (!sub)
                    rc = archive_job_fail_nomem(j);
                else
                    rc = merge_walk(j, sub_s, sub_t, sub, depth + 1, check);
                free(sub);
                archive_fs_close_quietly(sub_s);
                archive_fs_close_quietly(sub_t);
            }
        } else if (have_t && S_ISDIR(t.st_mode)) {
            rc = archive_job_fail(
                j, ARCHIVE_JOB_MERGE_CONFLICT, rel, NULL,
                "cannot merge %s into %s: '%s' is a directory there and not in the "
                "archive; nothing was changed",
                j->src, j->dst, rel);
        } else if (!check) {
            if (have_t && S_ISDIR(s.st_mode) && unlinkat(tfd, name, 0) != 0)
                rc = archive_job_fail_errno(j, errno, "cannot replace", rel);
            else
                rc = move_entry(j, sfd, tfd, name, &s, rel);
        }
        free(rel);
    }
    archive_fs_free_names(names, n);
    return rc;
}

/* Where an unpack into j->dst goes, decided before anything is staged: an existing dst
 * (allowed only with j->merge, and only a directory) is resolved through realpath; a missing
 * one needs an existing parent and a real name (not "", "." or ".."); "/" is refused. On
 * ARCHIVE_JOB_OK ti holds the canonical parent, the base name, whether it exists and an open
 * parentfd (the caller frees and closes them, also after a failure: whatever was set). Other
 * returns are the failure status with its sentence on j (archive_job_fail*): TARGET_EXISTS,
 * NOT_FOUND for a missing parent, IO_ERROR. Blocks (lstat, realpath): worker thread only. */
int archive_resolve_target(archive_job *j, target_info *ti)
{
    struct stat st;
    char *canon = NULL, *dir = NULL;
    if (lstat(j->dst, &st) == 0) {
        if (!j->merge)
            return archive_job_fail(j, ARCHIVE_JOB_TARGET_EXISTS, NULL, NULL,
                                    "%s already exists (pass merge = true to merge into it)",
                                    j->dst);
        if (!(canon = realpath(j->dst, NULL)))
            return archive_job_fail_errno(j, errno, "cannot resolve", j->dst);
        if (stat(canon, &st) != 0 || !S_ISDIR(st.st_mode)) {
            free(canon);
            return archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is not a directory",
                                    j->dst);
        }
        ti->exists = 1;
        int r = archive_fs_split_path(canon, &ti->parent, &ti->base);
        free(canon);
        if (r != 0) return archive_job_fail_nomem(j);
    } else if (errno == ENOENT) {
        char *base;
        if (archive_fs_split_path(j->dst, &dir, &base) != 0) return archive_job_fail_nomem(j);
        ti->base = base;
        ti->parent = realpath(dir, NULL);
        int e = errno;
        if (!ti->parent) {
            int rc = archive_job_fail(j, e == ENOENT ? ARCHIVE_JOB_NOT_FOUND : ARCHIVE_JOB_IO_ERROR,
                                      NULL, NULL, "cannot unpack into %s: its directory %s %s",
                                      j->dst, dir, e == ENOENT ? "does not exist" : strerror(e));
            free(dir);
            return rc;
        }
        free(dir);
        if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
            return archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL,
                                    "%s is not a directory name", j->dst);
    } else {
        return archive_job_fail_errno(j, errno, "cannot examine", j->dst);
    }
    if (!*ti->base)
        return archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "refusing to unpack onto /");
    ti->parentfd = open(ti->parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (ti->parentfd < 0) return archive_job_fail_errno(j, errno, "cannot open", ti->parent);
    return ARCHIVE_JOB_OK;
}

/* Moves a complete staging directory into place: one rename onto a missing target (refusing
 * to replace anything that appeared meanwhile), or a merge into an existing one. */
int archive_commit(archive_job *j, const target_info *ti, int stagefd, const char *stage_name,
                   mode_t fresh_mode, int *moved)
{
    if (!ti->exists) {
        int r = renameat2(ti->parentfd, stage_name, ti->parentfd, ti->base, RENAME_NOREPLACE);
        if (r != 0 && (errno == EINVAL || errno == ENOSYS)) {
            /* A filesystem without RENAME_NOREPLACE: check, then rename (a small race). */
            struct stat st;
            if (fstatat(ti->parentfd, ti->base, &st, AT_SYMLINK_NOFOLLOW) == 0)
                errno = EEXIST;
            else
                r = renameat(ti->parentfd, stage_name, ti->parentfd, ti->base);
        }
        if (r != 0) {
            if (errno == EEXIST || errno == ENOTEMPTY)
                return archive_job_fail(
                    j, ARCHIVE_JOB_TARGET_EXISTS, NULL, NULL,
                    "%s appeared while %s was being unpacked (pass merge = true to "
                    "merge into it)",
                    j->dst, j->src);
            return archive_job_fail_errno(j, errno, "cannot move the unpacked tree to", j->dst);
        }
        *moved = 1;
        /* The staging fd follows the directory to its new name. */
        fchmod(stagefd, fresh_mode);
        return ARCHIVE_JOB_OK;
    }
    int tfd = openat(ti->parentfd, ti->base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (tfd < 0) return archive_job_fail_errno(j, errno, "cannot open", j->dst);
    int rc = merge_walk(j, stagefd, tfd, "", 1, 1);
    if (rc == ARCHIVE_JOB_OK) rc = merge_walk(j, stagefd, tfd, "", 1, 0);
    close(tfd);
    return rc;
}
