/* archive_records.c - records: the stream between the backend and a sandbox's file helper.
 *
 * `moonbox local` never extracts or packs a sandbox's files itself: its file helper does,
 * inside the sandbox (tools/sandbox/fileops.c), following "records" — 'H', then NUL-terminated
 * fields type (f, d, l, or h: a hard link to an earlier f), octal mode, uid, gid, mtime, size,
 * name, link target, then size bytes for f; 'E' at the end. TO_RECORDS turns a client's archive
 * into records, with the member checks of unpack (archive_normalize_name, archive_symlink_problem,
 * hard links only to earlier files, no devices) so the helper only ever sees clean relative names;
 * FROM_RECORDS turns what a helper packed into a gzip'd tar. One parser reads what clients send
 * (libarchive, here); the helper only follows records. Both write dst through a 0600 temporary file
 * renamed into place. */
#include "archive_records.h"

#include "archive_fs.h"
#include "archive_names.h"
#include "archive_read.h"

#include <archive.h>
#include <archive_entry.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct rec_out {
    int fd;
    char buf[COPY_BLOCK];
    size_t len;
} rec_out;

static int rec_flush(rec_out *o)
{
    size_t off = 0;
    while (off < o->len) {
        ssize_t n = write(o->fd, o->buf + off, o->len - off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return errno;
        off += (size_t)n;
    }
    o->len = 0;
    return 0;
}

static int rec_put(rec_out *o, const void *p, size_t n)
{
    const char *s = (const char *)p;
    while (n > 0) {
        if (o->len == sizeof o->buf) {
            int e = rec_flush(o);
            if (e) return e;
        }
        size_t k = sizeof o->buf - o->len < n ? sizeof o->buf - o->len : n;
        memcpy(o->buf + o->len, s, k);
        o->len += k;
        s += k;
        n -= k;
    }
    return 0;
}

static int rec_field(rec_out *o, const char *s)
{
    return rec_put(o, s, strlen(s) + 1);
}

/* A temporary file beside dst, 0600; *tmp gets its malloc'd name. */
static int open_partial(archive_job *j, char **tmp)
{
    size_t tl = strlen(j->dst) + 32;
    if (!(*tmp = (char *)malloc(tl))) return -1;
    snprintf(*tmp, tl, "%s.partial-XXXXXX", j->dst);
    return mkostemp(*tmp, O_CLOEXEC);
}

/* Names of the regular files a records stream has carried so far: a hard link may only name
 * one of them. A list searched linearly (hard links are rare; each costs O(files)). */
typedef struct name_list {
    char **v;
    size_t n, cap;
} name_list;

static int names_add(name_list *l, const char *s)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        char **nv = (char **)realloc(l->v, cap * sizeof *nv);
        if (!nv) return -1;
        l->v = nv;
        l->cap = cap;
    }
    if (!(l->v[l->n] = strdup(s))) return -1;
    l->n++;
    return 0;
}

static int names_has(const name_list *l, const char *s)
{
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->v[i], s) == 0) return 1;
    return 0;
}

static void names_free(name_list *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->v[i]);
    free(l->v);
}

/* The to-records job, on the worker thread: reads the client's archive j->src member by member
 * and writes the records the file helper unpacks (format at the top of this file) to j->dst
 * through a 0600 partial file renamed into place when complete. Every member is checked as an
 * unpack checks it: names normalised (archive_normalize_name), hard links only to a file met
 * earlier, symlinks checked (archive_symlink_problem), no devices, fifos or sockets, at most
 * max_entries members and max_bytes of data; a member shorter than its size is zero-padded.
 * Returns ARCHIVE_JOB_OK, or UNSAFE / TOO_LARGE / CORRUPT / IO_ERROR / CANCELLED with the
 * sentence and the member on j (archive_job_fail*); on failure the partial file is removed.
 * Blocks (file I/O): never on the loop thread. */
int archive_to_records_run(archive_job *j)
{
    reader rd;
    name_list files = {NULL, 0, 0};
    char *tmp = NULL, *name = NULL, *link = NULL;
    rec_out *o = (rec_out *)malloc(sizeof *o);
    if (!o) return archive_job_fail_nomem(j);
    o->len = 0;
    o->fd = -1;
    int rc = archive_reader_open(j, &rd);
    if (rc == ARCHIVE_JOB_OK && (o->fd = open_partial(j, &tmp)) < 0)
        rc = tmp ? archive_job_fail_errno(j, errno, "cannot create", tmp)
                 : archive_job_fail_nomem(j);
    char *buf = rc == ARCHIVE_JOB_OK ? (char *)malloc(COPY_BLOCK) : NULL;
    if (rc == ARCHIVE_JOB_OK && !buf) rc = archive_job_fail_nomem(j);
    while (rc == ARCHIVE_JOB_OK) {
        struct archive_entry *e;
        if ((rc = archive_reader_next(j, &rd, &e)) != ARCHIVE_JOB_OK || !e) break;
        const char *raw = archive_entry_pathname(e), *why = NULL;
        free(name);
        name = archive_normalize_name(raw ? raw : "", &why);
        if (!name) {
            rc = archive_job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL, "archive member %s %s",
                                  raw ? raw : "?", why);
            break;
        }
        mode_t type = archive_entry_filetype(e);
        const char *target = "";
        char t = 0;
        if (archive_entry_hardlink(e)) {
            const char *why2 = NULL;
            free(link);
            link = archive_normalize_name(archive_entry_hardlink(e), &why2);
            if (!link || !names_has(&files, link)) {
                rc = archive_job_fail(
                    j, ARCHIVE_JOB_UNSAFE, name, NULL,
                    "archive member %s is a hard link to %s, which is not a file earlier "
                    "in the archive",
                    name, archive_entry_hardlink(e));
                break;
            }
            t = 'h';
            target = link;
        } else if (type == AE_IFREG) {
            t = 'f';
        } else if (type == AE_IFDIR) {
            t = 'd';
        } else if (type == AE_IFLNK) {
            t = 'l';
            target = archive_entry_symlink(e) ? archive_entry_symlink(e) : "";
            const char *bad = archive_symlink_problem(name, target);
            if (bad) {
                rc = archive_job_fail(j, ARCHIVE_JOB_UNSAFE, name, NULL,
                                      "archive member %s is a symlink that %s", name, bad);
                break;
            }
        } else {
            rc = archive_job_fail(j, ARCHIVE_JOB_UNSAFE, name, NULL,
                                  "archive member %s is a device, fifo or socket", name);
            break;
        }
        if (!*name) continue; /* the archive's own root ("./"): the target directory itself */
        if (t == 'f' && !names_has(&files, name) && names_add(&files, name) < 0) {
            rc = archive_job_fail_nomem(j);
            break;
        }
        int64_t size = t == 'f' ? archive_entry_size(e) : 0;
        if (size < 0) size = 0;
        if (j->res.bytes + (uint64_t)size > j->max_bytes) {
            rc = archive_job_fail(j, ARCHIVE_JOB_TOO_LARGE, name, "max_bytes",
                                  "the archive holds more than %llu bytes",
                                  (unsigned long long)j->max_bytes);
            break;
        }
        char num[5][32];
        snprintf(num[0], sizeof num[0], "%o", (unsigned)(archive_entry_perm(e) & 07777));
        snprintf(num[1], sizeof num[1], "%lld", (long long)archive_entry_uid(e));
        snprintf(num[2], sizeof num[2], "%lld", (long long)archive_entry_gid(e));
        snprintf(num[3], sizeof num[3], "%lld", (long long)archive_entry_mtime(e));
        snprintf(num[4], sizeof num[4], "%lld", (long long)size);
        char ty[2] = {t, 0};
        int w = rec_put(o, "H", 1);
        if (!w) w = rec_field(o, ty);
        for (int i = 0; i < 5 && !w; i++)
            w = rec_field(o, num[i]);
        if (!w) w = rec_field(o, name);
        if (!w) w = rec_field(o, target);
        /* Exactly size bytes follow: what the archive holds, zero-padded if it is short. */
        int64_t left = size;
        while (!w && left > 0) {
            la_ssize_t n = archive_read_data(rd.a, buf, COPY_BLOCK);
            if (n < 0) {
                rc = archive_reader_fail(j, &rd);
                break;
            }
            if (n == 0) {
                memset(buf, 0, COPY_BLOCK);
                n = left < COPY_BLOCK ? (la_ssize_t)left : COPY_BLOCK;
            }
            if (n > left) n = (la_ssize_t)left;
            w = rec_put(o, buf, (size_t)n);
            left -= n;
            j->res.bytes += (uint64_t)n;
        }
        if (rc != ARCHIVE_JOB_OK) break;
        if (w) rc = archive_job_fail_errno(j, w, "cannot write", tmp);
    }
    if (rc == ARCHIVE_JOB_OK) {
        int w = rec_put(o, "E", 1);
        if (!w) w = rec_flush(o);
        if (w) rc = archive_job_fail_errno(j, w, "cannot write", tmp);
    }
    if (rc == ARCHIVE_JOB_OK && rename(tmp, j->dst) != 0)
        rc = archive_job_fail_errno(j, errno, "cannot move into place", j->dst);
    if (o->fd >= 0) {
        close(o->fd);
        if (rc != ARCHIVE_JOB_OK) unlink(tmp);
    }
    archive_reader_close(&rd);
    names_free(&files);
    free(buf);
    free(name);
    free(link);
    free(tmp);
    free(o);
    return rc;
}

/* Reads one NUL-terminated field of at most cap - 1 bytes. */
static int rec_read_field(FILE *f, char *out, size_t cap)
{
    size_t n = 0;
    for (;;) {
        int c = getc(f);
        if (c == EOF) return -1;
        if (c == 0) break;
        if (n + 1 >= cap) return -1;
        out[n++] = (char)c;
    }
    out[n] = 0;
    return 0;
}

/* Bounds of a sparse file in records: its segments (the helper merges beyond this), and its
 * logical size (holes cost loop turns of ZERO_BLOCK bytes each, so a size the sandbox set with
 * truncate must not be unbounded). */
#define SPARSE_SEGMENTS_MAX 4096
#define SPARSE_LOGICAL_MAX  (1LL << 40)
#define ZERO_BLOCK          (1 << 20)
static const unsigned char zero_block[ZERO_BLOCK];

/* The from-records job, on the worker thread: reads the records a file helper packed inside a
 * sandbox (j->src; untrusted: every field is read with a fixed bound, sparse maps limited to
 * SPARSE_SEGMENTS_MAX segments and SPARSE_LOGICAL_MAX bytes) and writes them as a
 * pax-restricted tar, gzip'd when j->gzip, to j->dst through a 0600 partial file renamed into
 * place when complete. Returns ARCHIVE_JOB_OK, or CORRUPT (a malformed record, named) /
 * TOO_LARGE / IO_ERROR / CANCELLED with its sentence on j; on failure the partial file is
 * removed and dst is untouched. Blocks (file I/O): never on the loop thread. */
int archive_from_records_run(archive_job *j)
{
    char *tmp = NULL, *buf = NULL;
    int fd = -1, rc = ARCHIVE_JOB_OK;
    struct archive *a = NULL;
    FILE *in = fopen(j->src, "rbe");
    if (!in) return archive_job_fail_errno(j, errno, "cannot open", j->src);
    if ((fd = open_partial(j, &tmp)) < 0) {
        rc = tmp ? archive_job_fail_errno(j, errno, "cannot create", tmp)
                 : archive_job_fail_nomem(j);
        goto out;
    }
    a = archive_write_new();
    buf = (char *)malloc(COPY_BLOCK);
    if (!a || !buf) {
        rc = archive_job_fail_nomem(j);
        goto out;
    }
    if (archive_write_set_format_pax_restricted(a) != ARCHIVE_OK ||
        (j->gzip &&
         (archive_write_add_filter_gzip(a) != ARCHIVE_OK ||
          archive_write_set_filter_option(a, "gzip", "compression-level", "1") != ARCHIVE_OK)) ||
        archive_write_open_fd(a, fd) != ARCHIVE_OK) {
        rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "cannot start writing %s: %s",
                              j->dst, archive_error_string(a));
        goto out;
    }
    for (;;) {
        int tag = getc(in);
        if (tag == 'E') break;
        if (tag != 'H') {
            rc = archive_job_fail(j, ARCHIVE_JOB_CORRUPT, NULL, NULL,
                                  "the sandbox's file helper sent malformed records");
            break;
        }
        if (archive_job_cancelled(j)) {
            rc = archive_job_fail_cancelled(j);
            break;
        }
        char ty[4], mode[16], uid[24], gid[24], mtime[32], size[32], name[8192], target[4096];
        if (rec_read_field(in, ty, sizeof ty) || rec_read_field(in, mode, sizeof mode) ||
            rec_read_field(in, uid, sizeof uid) || rec_read_field(in, gid, sizeof gid) ||
            rec_read_field(in, mtime, sizeof mtime) || rec_read_field(in, size, sizeof size) ||
            rec_read_field(in, name, sizeof name) || rec_read_field(in, target, sizeof target) ||
            !strchr("fdlhs", ty[0]) || !ty[0] || ty[1] || !*name) {
            rc = archive_job_fail(j, ARCHIVE_JOB_CORRUPT, NULL, NULL,
                                  "the sandbox's file helper sent a malformed record");
            break;
        }
        if (++j->res.entries > j->max_entries) {
            rc = archive_job_fail(j, ARCHIVE_JOB_TOO_LARGE, NULL, "max_entries",
                                  "the directory has more than %llu entries",
                                  (unsigned long long)j->max_entries);
            break;
        }
        long long sz = (ty[0] == 'f' || ty[0] == 's') ? strtoll(size, NULL, 10) : 0;
        if (sz < 0) sz = 0;
        /* A sparse file's map: segments of data (offset, length), ascending, inside its size. */
        long long(*seg)[2] = NULL;
        size_t nseg = 0;
        if (ty[0] == 's') {
            char num[32];
            if (sz > SPARSE_LOGICAL_MAX) {
                rc = archive_job_fail(
                    j, ARCHIVE_JOB_TOO_LARGE, name, "sparse_size",
                    "%s is a sparse file of %lld bytes; at most %lld can be packed", name, sz,
                    (long long)SPARSE_LOGICAL_MAX);
                break;
            }
            if (rec_read_field(in, num, sizeof num) ||
                (nseg = strtoul(num, NULL, 10)) > SPARSE_SEGMENTS_MAX ||
                !(seg = (long long(*)[2])calloc(nseg ? nseg : 1, sizeof *seg))) {
                rc = archive_job_fail(j, ARCHIVE_JOB_CORRUPT, name, NULL,
                                      "the sparse map of %s is malformed", name);
                break;
            }
            long long end = 0;
            for (size_t i = 0; i < nseg && rc == ARCHIVE_JOB_OK; i++) {
                char a[32], b[32];
                if (rec_read_field(in, a, sizeof a) || rec_read_field(in, b, sizeof b)) {
                    rc = archive_job_fail(j, ARCHIVE_JOB_CORRUPT, name, NULL,
                                          "the sparse map of %s is malformed", name);
                    break;
                }
                seg[i][0] = strtoll(a, NULL, 10);
                seg[i][1] = strtoll(b, NULL, 10);
                if (seg[i][0] < end || seg[i][1] < 0 || seg[i][0] + seg[i][1] > sz)
                    rc = archive_job_fail(j, ARCHIVE_JOB_CORRUPT, name, NULL,
                                          "the sparse map of %s is malformed", name);
                end = seg[i][0] + seg[i][1];
            }
            if (rc != ARCHIVE_JOB_OK) {
                free(seg);
                break;
            }
        }
        struct archive_entry *e = archive_entry_new();
        if (!e) {
            free(seg);
            rc = archive_job_fail_nomem(j);
            break;
        }
        archive_entry_copy_pathname(e, name);
        archive_entry_set_filetype(e, ty[0] == 'd' ? AE_IFDIR : ty[0] == 'l' ? AE_IFLNK : AE_IFREG);
        archive_entry_set_perm(e, (mode_t)(strtoul(mode, NULL, 8) & 07777));
        archive_entry_set_uid(e, strtoll(uid, NULL, 10));
        archive_entry_set_gid(e, strtoll(gid, NULL, 10));
        archive_entry_set_mtime(e, (time_t)strtoll(mtime, NULL, 10), 0);
        archive_entry_set_size(e, sz);
        if (ty[0] == 'l') archive_entry_copy_symlink(e, target);
        if (ty[0] == 'h') archive_entry_copy_hardlink(e, target);
        for (size_t i = 0; i < nseg; i++)
            archive_entry_sparse_add_entry(e, seg[i][0], seg[i][1]);
        int r = archive_write_header(a, e);
        archive_entry_free(e);
        if (r < ARCHIVE_WARN) {
            free(seg);
            rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, name, NULL, "writing the entry %s: %s",
                                  name, archive_error_string(a));
            break;
        }
        /* The data: a plain file's bytes; a sparse file's holes as zeros (the pax writer skips
         * them, so they cost loop turns, not output) and its segments' bytes from the records. */
        long long pos = 0;
        size_t next = 0;
        while (rc == ARCHIVE_JOB_OK && pos < sz) {
            long long run, hole;
            if (ty[0] == 's') {
                hole = next < nseg ? seg[next][0] - pos : sz - pos;
                run = next < nseg && hole == 0 ? seg[next][1] : 0;
            } else {
                hole = 0;
                run = sz;
            }
            if (hole > 0) {
                long long k = hole > ZERO_BLOCK ? ZERO_BLOCK : hole;
                if (archive_write_data(a, zero_block, (size_t)k) < 0) {
                    rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "writing %s: %s",
                                          j->dst, archive_error_string(a));
                    break;
                }
                pos += k;
                if (archive_job_cancelled(j)) rc = archive_job_fail_cancelled(j);
                continue;
            }
            while (run > 0) {
                size_t want = run > COPY_BLOCK ? COPY_BLOCK : (size_t)run;
                size_t n = fread(buf, 1, want, in);
                if (n == 0) {
                    rc = archive_job_fail(j, ARCHIVE_JOB_CORRUPT, name, NULL,
                                          "the records of %s end early", name);
                    break;
                }
                if (archive_write_data(a, buf, n) < 0) {
                    rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "writing %s: %s",
                                          j->dst, archive_error_string(a));
                    break;
                }
                run -= (long long)n;
                pos += (long long)n;
                j->res.bytes += n;
            }
            next++;
        }
        free(seg);
        if (rc != ARCHIVE_JOB_OK) break;
    }
    if (rc == ARCHIVE_JOB_OK && archive_write_close(a) != ARCHIVE_OK)
        rc = archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "finishing %s: %s", j->dst,
                              archive_error_string(a));
    if (rc == ARCHIVE_JOB_OK && rename(tmp, j->dst) != 0)
        rc = archive_job_fail_errno(j, errno, "cannot move into place", j->dst);
out:
    if (a) archive_write_free(a);
    if (fd >= 0) {
        close(fd);
        if (rc != ARCHIVE_JOB_OK) unlink(tmp);
    }
    fclose(in);
    free(buf);
    free(tmp);
    return rc;
}
