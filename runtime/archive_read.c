/* archive_read.c - reading archives (see archive_read.h), and ARCHIVE_JOB_LIST.
 *
 * The bytes come through in_read, our own gunzip, because libarchive's would not notice a
 * damaged gzip trailer (see in_stream in archive_read.h). Worker thread only.
 */
#include "archive_read.h"

#include "archive_fs.h"

#include <archive_entry.h>

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Bytes allowed after the tar's end-of-archive blocks (padding to the block size, which tar -b
 * can make large); more is not an archive we wrote or GNU tar writes. */
#define TRAILING_MAX (16 * 1024 * 1024)

static ssize_t read_retry(int fd, void *buf, size_t len)
{
    ssize_t n;
    do
        n = read(fd, buf, len);
    while (n < 0 && errno == EINTR);
    return n;
}

static la_ssize_t in_error(struct archive *a, in_stream *s, int e, const char *msg)
{
    s->os_error = e;
    if (e)
        archive_set_error(a, e, "reading the archive failed: %s", strerror(e));
    else
        archive_set_error(a, EILSEQ, "damaged gzip stream: %s", msg ? msg : "unknown damage");
    return -1;
}

/* libarchive's read callback: the next block of tar bytes, 0 at the end, -1 on error. */
static la_ssize_t in_read(struct archive *a, void *ud, const void **buf)
{
    in_stream *s = (in_stream *)ud;
    *buf = s->out;
    if (!s->gzip) {
        if (s->raw_len > 0) {
            size_t n = s->raw_len;
            s->raw_len = 0;
            *buf = s->in;
            return (la_ssize_t)n;
        }
        ssize_t n = read_retry(s->fd, s->out, COPY_BLOCK);
        return n < 0 ? in_error(a, s, errno, NULL) : n;
    }
    s->zs.next_out = s->out;
    s->zs.avail_out = COPY_BLOCK;
    while (s->zs.avail_out > 0 && !s->eof) {
        if (s->zs.avail_in == 0) {
            ssize_t n = read_retry(s->fd, s->in, COPY_BLOCK);
            if (n < 0) return in_error(a, s, errno, NULL);
            if (n == 0) {
                if (!s->member_end) return in_error(a, s, 0, "it is truncated");
                s->eof = 1;
                break;
            }
            s->zs.next_in = s->in;
            s->zs.avail_in = (uInt)n;
        }
        if (s->member_end) {
            while (s->zs.avail_in > 0 && *s->zs.next_in == 0) {
                s->zs.next_in++;
                s->zs.avail_in--;
            }
            if (s->zs.avail_in == 0) continue;
            if (*s->zs.next_in != 0x1f)
                return in_error(a, s, 0, "it is followed by data that is not gzip");
            inflateReset(&s->zs);
            s->member_end = 0;
        }
        int z = inflate(&s->zs, Z_NO_FLUSH);
        if (z == Z_STREAM_END)
            s->member_end = 1;
        else if (z != Z_OK && !(z == Z_BUF_ERROR && s->zs.avail_in == 0))
            return in_error(a, s, 0, s->zs.msg ? s->zs.msg : "inflate failed");
    }
    return (la_ssize_t)(COPY_BLOCK - s->zs.avail_out);
}

void archive_reader_close(reader *r)
{
    if (r->a) archive_read_free(r->a);
    if (r->s.zlib_ready) inflateEnd(&r->s.zs);
    archive_fs_close_quietly(r->s.fd);
    free(r->s.in);
    free(r->s.out);
    memset(r, 0, sizeof *r);
    r->s.fd = -1;
}

/* Opens j->src as a gzip'd or plain tar (told apart by its first two bytes). */
int archive_reader_open(archive_job *j, reader *r)
{
    memset(r, 0, sizeof *r);
    r->s.fd = open(j->src, O_RDONLY | O_CLOEXEC);
    if (r->s.fd < 0) return archive_job_fail_errno(j, errno, "cannot open the archive", j->src);
    struct stat st;
    if (fstat(r->s.fd, &st) == 0 && S_ISDIR(st.st_mode))
        return archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL,
                                "%s is a directory, not an archive", j->src);
    r->s.in = (unsigned char *)malloc(COPY_BLOCK);
    r->s.out = (unsigned char *)malloc(COPY_BLOCK);
    if (!r->s.in || !r->s.out || !(r->a = archive_read_new())) return archive_job_fail_nomem(j);
    ssize_t n = read_retry(r->s.fd, r->s.in, COPY_BLOCK);
    if (n < 0) return archive_job_fail_errno(j, errno, "cannot read the archive", j->src);
    if (n >= 2 && r->s.in[0] == 0x1f && r->s.in[1] == 0x8b) {
        r->s.gzip = 1;
        if (inflateInit2(&r->s.zs, 16 + MAX_WBITS) != Z_OK)
            return archive_job_fail_nomem(j); /* gzip only */
        r->s.zlib_ready = 1;
        r->s.zs.next_in = r->s.in;
        r->s.zs.avail_in = (uInt)n;
    } else {
        r->s.raw_len = (size_t)n;
    }
    archive_read_support_format_tar(r->a);
    if (archive_read_open(r->a, &r->s, NULL, in_read, NULL) != ARCHIVE_OK)
        return archive_job_fail(j, r->s.os_error ? ARCHIVE_JOB_IO_ERROR : ARCHIVE_JOB_CORRUPT, NULL,
                                NULL, "%s is not a readable tar archive: %s", j->src,
                                archive_error_string(r->a));
    return ARCHIVE_JOB_OK;
}

/* Turns a failed libarchive read into CORRUPT, or IO_ERROR when the OS failed the read. */
int archive_reader_fail(archive_job *j, reader *r)
{
    const char *why = archive_error_string(r->a);
    return archive_job_fail(j, r->s.os_error ? ARCHIVE_JOB_IO_ERROR : ARCHIVE_JOB_CORRUPT, NULL,
                            NULL, "%s is not a readable tar archive: %s", j->src,
                            why ? why : "unknown error");
}

/* After the last member: reads the rest of a gzip stream so its trailer is checked. */
int archive_reader_finish(archive_job *j, reader *r)
{
    size_t trailing = 0;
    while (r->s.gzip && !r->s.eof) {
        const void *buf;
        la_ssize_t n = in_read(r->a, &r->s, &buf);
        if (n < 0) return archive_reader_fail(j, r);
        if (archive_job_cancelled(j)) return archive_job_fail_cancelled(j);
        trailing += (size_t)n;
        if (trailing > TRAILING_MAX)
            return archive_job_fail(j, ARCHIVE_JOB_CORRUPT, NULL, NULL,
                                    "%s has more than %d bytes after the end of its tar", j->src,
                                    TRAILING_MAX);
    }
    return ARCHIVE_JOB_OK;
}

/* ---- list (ARCHIVE_JOB_LIST) ---------------------------------------------------------------- */

static int list_add(archive_job *j, struct archive_entry *e)
{
    if (j->res.nitems == j->cap_items) {
        size_t ncap = j->cap_items ? j->cap_items * 2 : 64;
        archive_item *grown = (archive_item *)realloc(j->items, ncap * sizeof *grown);
        if (!grown) return archive_job_fail_nomem(j);
        j->items = grown;
        j->cap_items = ncap;
    }
    archive_item *it = &j->items[j->res.nitems];
    memset(it, 0, sizeof *it);
    const char *name = archive_entry_pathname(e);
    const char *hl = archive_entry_hardlink(e);
    const char *sl = archive_entry_symlink(e);
    mode_t type = archive_entry_filetype(e);
    it->type = hl                 ? ARCHIVE_ITEM_HARDLINK
               : type == AE_IFREG ? ARCHIVE_ITEM_FILE
               : type == AE_IFDIR ? ARCHIVE_ITEM_DIRECTORY
               : type == AE_IFLNK ? ARCHIVE_ITEM_SYMLINK
                                  : ARCHIVE_ITEM_OTHER;
    it->name = strdup(name ? name : "");
    if (it->name && it->type == ARCHIVE_ITEM_DIRECTORY) {
        size_t len = strlen(it->name);
        if (len > 1 && it->name[len - 1] == '/') it->name[len - 1] = '\0';
    }
    const char *target = hl ? hl : it->type == ARCHIVE_ITEM_SYMLINK ? sl : NULL;
    if (target) it->target = strdup(target);
    it->size = archive_entry_size(e);
    it->mode = (unsigned)(archive_entry_perm(e) & 07777);
    j->res.nitems++;
    if (!it->name || (target && !it->target)) return archive_job_fail_nomem(j);
    return ARCHIVE_JOB_OK;
}

int archive_reader_next(archive_job *j, reader *r, struct archive_entry **e)
{
    *e = NULL;
    struct archive_entry *m;
    int st = archive_read_next_header(r->a, &m);
    if (st == ARCHIVE_EOF) return archive_reader_finish(j, r);
    if (st < ARCHIVE_WARN) return archive_reader_fail(j, r);
    if (archive_job_cancelled(j)) return archive_job_fail_cancelled(j);
    if (++j->res.entries > j->max_entries)
        return archive_job_fail(j, ARCHIVE_JOB_TOO_LARGE, NULL, "max_entries",
                                "%s has more than max_entries (%llu) members", j->src,
                                (unsigned long long)j->max_entries);
    *e = m;
    return ARCHIVE_JOB_OK;
}

int archive_list_run(archive_job *j)
{
    reader rd;
    int rc = archive_reader_open(j, &rd);
    while (rc == ARCHIVE_JOB_OK) {
        struct archive_entry *e;
        if ((rc = archive_reader_next(j, &rd, &e)) != ARCHIVE_JOB_OK || !e) break;
        if ((rc = list_add(j, e)) != ARCHIVE_JOB_OK) break;
    }
    archive_reader_close(&rd);
    return rc;
}
