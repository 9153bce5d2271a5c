/* tarball.c - gzip'd tar archives of directory trees on worker threads (see tarball.h).
 *
 * libarchive parses and writes tar headers and gzips the packs we write; gunzipping input and
 * every filesystem step are done here (see "reading archives" and "unpack" for why). Extraction
 * goes to a fresh 0700 staging directory beside the target and only a complete, checked tree
 * is moved into place; a pack goes to a 0600 temporary file renamed over the output once
 * complete. Any failure or cancellation removes that partial output before the worker ends, so
 * nothing half-written is ever visible under the caller's names.
 */
#include "tarball.h"

#include <archive.h>
#include <archive_entry.h>
#include <zlib.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define COPY_BLOCK      (64 * 1024) /* bytes per read/write while packing; also the read block */
#define STAGE_BASE_MAX  100         /* bytes of the target's name kept in temporary names */
#define EXIT_WAIT_SECS  10          /* how long the process waits at exit for workers to clean up */
#define DIR_FIXUP_FIRST 64          /* first allocation of the directory fixup list */

struct archive_job {
    /* Fixed at start. */
    int kind;
    char *src, *dst;
    int gzip, merge, owner;
    mode_t umask;
    int file_mode;
    uint64_t max_bytes, max_entries;
    struct ev_loop *loop;
    ev_async done_watcher; /* loop thread starts and stops it; the worker only sends it */
    archive_job_notify_fn notify;
    void *notify_ud;

    atomic_int cancel; /* set by release (or at exit); polled by the worker */

    pthread_mutex_t mu; /* guards refs, abandoned, finished */
    int refs;           /* 2 while both the worker and the owner hold the job */
    int abandoned;      /* the owner released it; the watcher is stopped */
    int finished;       /* the worker published res */

    /* Written by the worker only, read by the owner after notify. */
    archive_job_result res;
    char *message, *member;
    archive_item *items;
    size_t cap_items;

    archive_job *live_next, *live_prev;
};

/* ---- jobs still running, for archive_job_live_count and the wait at exit ------------------ */

static pthread_mutex_t g_live_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_live_cv = PTHREAD_COND_INITIALIZER;
static archive_job *g_live_head;
static long g_live_count;
static pthread_once_t g_atexit_once = PTHREAD_ONCE_INIT;

static void live_link(archive_job *j)
{
    pthread_mutex_lock(&g_live_mu);
    j->live_prev = NULL;
    j->live_next = g_live_head;
    if (g_live_head) g_live_head->live_prev = j;
    g_live_head = j;
    g_live_count++;
    pthread_mutex_unlock(&g_live_mu);
}

static void live_unlink(archive_job *j)
{
    pthread_mutex_lock(&g_live_mu);
    if (j->live_prev)
        j->live_prev->live_next = j->live_next;
    else
        g_live_head = j->live_next;
    if (j->live_next) j->live_next->live_prev = j->live_prev;
    g_live_count--;
    pthread_cond_broadcast(&g_live_cv);
    pthread_mutex_unlock(&g_live_mu);
}

long archive_job_live_count(void)
{
    pthread_mutex_lock(&g_live_mu);
    long n = g_live_count;
    pthread_mutex_unlock(&g_live_mu);
    return n;
}

/* At exit, workers are detached threads that die with the process wherever they are, which
 * would leave a temporary file or a staging directory behind. So the process cancels them and
 * waits (boundedly) until each has removed its partial output. */
static void wait_workers_at_exit(void)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += EXIT_WAIT_SECS;
    pthread_mutex_lock(&g_live_mu);
    for (archive_job *j = g_live_head; j; j = j->live_next)
        atomic_store(&j->cancel, 1);
    while (g_live_count > 0)
        if (pthread_cond_timedwait(&g_live_cv, &g_live_mu, &until) == ETIMEDOUT) break;
    pthread_mutex_unlock(&g_live_mu);
}

static void register_exit_wait(void)
{
    atexit(wait_workers_at_exit);
}

/* ---- results -------------------------------------------------------------------------------- */

static int cancelled(archive_job *j)
{
    return atomic_load_explicit(&j->cancel, memory_order_relaxed);
}

/* Records the job's failure (the first one wins: later ones are consequences) and returns
 * status, so callers can `return job_fail(...)`. member may be NULL; limit is a literal. */
static int job_fail(archive_job *j, int status, const char *member, const char *limit,
                    const char *fmt, ...)
{
    if (j->res.status != ARCHIVE_JOB_OK) return j->res.status;
    j->res.status = status;
    j->res.limit = limit;
    if (member) j->member = strdup(member);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n >= 0 && (j->message = (char *)malloc((size_t)n + 1)) != NULL) {
        va_start(ap, fmt);
        vsnprintf(j->message, (size_t)n + 1, fmt, ap);
        va_end(ap);
    }
    return status;
}

static int fail_errno(archive_job *j, int e, const char *what, const char *path)
{
    return job_fail(j, e == ENOENT ? ARCHIVE_JOB_NOT_FOUND : ARCHIVE_JOB_IO_ERROR, NULL, NULL,
                    "%s %s: %s", what, path, strerror(e));
}

static int fail_cancelled(archive_job *j)
{
    return job_fail(j, ARCHIVE_JOB_CANCELLED, NULL, NULL, "the job was cancelled");
}

static int fail_nomem(archive_job *j)
{
    return job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "out of memory");
}

/* ---- small filesystem helpers ------------------------------------------------------------- */

static void close_quietly(int fd)
{
    if (fd >= 0) close(fd);
}

/* Splits path into a malloc'd directory ("." when there is none) and a pointer to its last
 * component inside *dir's allocation's twin *base (also malloc'd). Trailing slashes are
 * ignored; "/" gives ("/", ""). Returns 0, or -1 without memory. */
static int split_path(const char *path, char **dir, char **base)
{
    size_t len = strlen(path);
    while (len > 1 && path[len - 1] == '/')
        len--;
    size_t cut = len;
    while (cut > 0 && path[cut - 1] != '/')
        cut--;
    *base = strndup(path + cut, len - cut);
    if (cut == 0)
        *dir = strdup(".");
    else if (cut == 1)
        *dir = strdup("/");
    else
        *dir = strndup(path, cut - 1);
    if (!*dir || !*base) {
        free(*dir);
        free(*base);
        *dir = *base = NULL;
        return -1;
    }
    if (len == 1 && path[0] == '/') (*base)[0] = '\0';
    return 0;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void free_names(char **names, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

/* Reads the names in the directory open as dirfd (except . and ..) into a sorted array, so a
 * walk never holds a DIR stream across recursion and archives come out in a stable order.
 * Returns 0, or -1 with errno set. dirfd stays open and is not moved. */
static int read_names(int dirfd, char ***out, size_t *nout)
{
    int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -1;
    DIR *d = fdopendir(fd);
    if (!d) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    errno = 0;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        if (n == cap) {
            size_t ncap = cap ? cap * 2 : 32;
            char **grown = (char **)realloc(names, ncap * sizeof *names);
            if (!grown) goto nomem;
            names = grown;
            cap = ncap;
        }
        if (!(names[n] = strdup(de->d_name))) goto nomem;
        n++;
        errno = 0;
    }
    if (errno != 0) {
        int e = errno;
        closedir(d);
        free_names(names, n);
        errno = e;
        return -1;
    }
    closedir(d);
    if (n > 1) qsort(names, n, sizeof *names, cmp_names);
    *out = names;
    *nout = n;
    return 0;
nomem:
    closedir(d);
    free_names(names, n);
    errno = ENOMEM;
    return -1;
}

/* Joins prefix and name (prefix empty or ending in '/') into a new string. */
static char *join_rel(const char *prefix, const char *name, const char *suffix)
{
    size_t a = strlen(prefix), b = strlen(name), c = strlen(suffix);
    char *s = (char *)malloc(a + b + c + 1);
    if (!s) return NULL;
    memcpy(s, prefix, a);
    memcpy(s + a, name, b);
    memcpy(s + a + b, suffix, c + 1);
    return s;
}

/* Removes rootfd/path and everything below it, never following a symlink. path is relative to
 * rootfd, held in a PATH_MAX buffer that is extended in place while descending; only one
 * descriptor is open at a time, so depth is bounded by PATH_MAX, not by the fd limit. Used only
 * on our private staging directory, whose directories nobody else can swap for links.
 * Directories we may not enter or empty (modes from the archive) are made 0700 first.
 * Best effort: what cannot be removed is left. */
static void remove_tree(int rootfd, char *path, size_t len)
{
    struct stat st;
    if (fstatat(rootfd, path, &st, AT_SYMLINK_NOFOLLOW) != 0) return;
    if (!S_ISDIR(st.st_mode)) {
        unlinkat(rootfd, path, 0);
        return;
    }
    if ((st.st_mode & 0700) != 0700) fchmodat(rootfd, path, 0700, 0);
    int fd = openat(rootfd, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0) {
        char **names;
        size_t n;
        int ok = read_names(fd, &names, &n) == 0;
        close(fd);
        for (size_t i = 0; ok && i < n; i++) {
            size_t nl = strlen(names[i]);
            if (len + 1 + nl >= PATH_MAX) continue;
            path[len] = '/';
            memcpy(path + len + 1, names[i], nl + 1);
            remove_tree(rootfd, path, len + 1 + nl);
            path[len] = '\0';
        }
        if (ok) free_names(names, n);
    }
    unlinkat(rootfd, path, AT_REMOVEDIR);
}

/* Removes the entry `name` of the directory dirfd, whatever it is. */
static void remove_entry(int dirfd, const char *name)
{
    char path[PATH_MAX];
    size_t len = strlen(name);
    if (len >= PATH_MAX) return;
    memcpy(path, name, len + 1);
    remove_tree(dirfd, path, len);
}

/* Writes all of buf at offset off of fd. Returns 0 or -1 with errno. */
static int pwrite_all(int fd, const char *buf, size_t len, off_t off)
{
    while (len > 0) {
        ssize_t n = pwrite(fd, buf, len, off);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
        off += n;
    }
    return 0;
}

/* ---- pack ----------------------------------------------------------------------------------- */

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
        return job_fail(ps->j, ARCHIVE_JOB_IO_ERROR, rel, NULL, "writing the entry %s to %s: %s",
                        rel, ps->j->dst, archive_error_string(ps->a));
    ps->j->res.entries++;
    return ARCHIVE_JOB_OK;
}

/* Copies up to size bytes of the open file fd as the current entry's data. A file that shrank
 * meanwhile is padded with zeros by libarchive; bytes appended meanwhile are left out. */
static int pack_copy(pack_state *ps, int fd, int64_t size, const char *rel)
{
    archive_job *j = ps->j;
    while (size > 0) {
        if (cancelled(j)) return fail_cancelled(j);
        size_t want = size > COPY_BLOCK ? COPY_BLOCK : (size_t)size;
        ssize_t n = read(fd, ps->buf, want);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return fail_errno(j, errno, "reading", rel);
        if (n == 0) break;
        if (archive_write_data(ps->a, ps->buf, (size_t)n) < 0)
            return job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "writing %s: %s", j->dst,
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
        char *rel = join_rel(prefix, name, "");
        rc = fail_errno(j, errno, "cannot stat", rel ? rel : name);
        free(rel);
        return rc;
    }
    if (st.st_dev == ps->out_dev && st.st_ino == ps->out_ino) return ARCHIVE_JOB_OK;
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
        j->res.skipped++; /* devices, fifos, sockets: nothing a tar can carry usefully */
        return ARCHIVE_JOB_OK;
    }
    char *rel = join_rel(prefix, name, "");
    if (!rel) return fail_nomem(j);
    struct archive_entry *e = NULL;
    int fd = -1;

    if (S_ISLNK(st.st_mode)) {
        char target[PATH_MAX];
        ssize_t n = readlinkat(dirfd, name, target, sizeof target - 1);
        if (n < 0) {
            if (errno != ENOENT && errno != EINVAL)
                rc = fail_errno(j, errno, "cannot read the symlink", rel);
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
            rc = fail_errno(j, errno, "cannot open", rel);
        goto done;
    }
    if (fstat(fd, &st) != 0) {
        rc = fail_errno(j, errno, "cannot stat", rel);
        goto done;
    }
    if (S_ISDIR(st.st_mode)) {
        if (depth >= ARCHIVE_MAX_DEPTH) {
            rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, rel, NULL,
                          "%s/%s is nested more than %d directories deep", j->src, rel,
                          ARCHIVE_MAX_DEPTH);
            goto done;
        }
        if (!(e = pack_entry(rel, &st))) goto nomem;
        rc = pack_write_header(ps, e, rel);
        if (rc == ARCHIVE_JOB_OK) {
            char *sub = join_rel(rel, "/", "");
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
    rc = fail_nomem(j);
done:
    close_quietly(fd);
    archive_entry_free(e);
    free(rel);
    return rc;
}

static int pack_dir(pack_state *ps, int dirfd, const char *prefix, int depth)
{
    char **names;
    size_t n;
    if (read_names(dirfd, &names, &n) != 0)
        return fail_errno(ps->j, errno, "cannot read the directory", *prefix ? prefix : ps->j->src);
    int rc = ARCHIVE_JOB_OK;
    for (size_t i = 0; i < n && rc == ARCHIVE_JOB_OK; i++) {
        if (cancelled(ps->j))
            rc = fail_cancelled(ps->j);
        else
            rc = pack_one(ps, dirfd, names[i], prefix, depth);
    }
    free_names(names, n);
    return rc;
}

static int pack_run(archive_job *j)
{
    char *dir = NULL, *base = NULL, *tmp = NULL;
    int outdirfd = -1, rootfd = -1, fd = -1, rc;
    pack_state ps;
    memset(&ps, 0, sizeof ps);
    ps.j = j;

    if (split_path(j->dst, &dir, &base) != 0) return fail_nomem(j);
    if (!*base) {
        rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is not a file name", j->dst);
        goto out;
    }
    outdirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (outdirfd < 0) {
        rc = fail_errno(j, errno, "cannot open the directory of the archive", dir);
        goto out;
    }
    struct stat st;
    if (fstatat(outdirfd, base, &st, 0) == 0 && S_ISDIR(st.st_mode)) {
        rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is a directory", j->dst);
        goto out;
    }
    rootfd = open(j->src, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) {
        rc = errno == ENOTDIR
                 ? job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is not a directory", j->src)
                 : fail_errno(j, errno, "cannot open the directory", j->src);
        goto out;
    }
    size_t tl = strlen(dir) + strlen(base) + 32;
    if (!(tmp = (char *)malloc(tl))) {
        rc = fail_nomem(j);
        goto out;
    }
    snprintf(tmp, tl, "%s/.%.*s.partial-XXXXXX", dir, STAGE_BASE_MAX, base);
    fd = mkostemp(tmp, O_CLOEXEC); /* 0600 */
    if (fd < 0) {
        rc = fail_errno(j, errno, "cannot create", tmp);
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
        rc = fail_nomem(j);
        goto out;
    }
    archive_entry_linkresolver_set_strategy(ps.links, ARCHIVE_FORMAT_TAR_PAX_RESTRICTED);
    /* ustar headers, with pax extensions only where ustar cannot say it (long names, big
     * sizes or ids): the most widely readable choice. */
    if (archive_write_set_format_pax_restricted(ps.a) != ARCHIVE_OK ||
        (j->gzip && archive_write_add_filter_gzip(ps.a) != ARCHIVE_OK) ||
        archive_write_open_fd(ps.a, fd) != ARCHIVE_OK) {
        rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "cannot start writing %s: %s", j->dst,
                      archive_error_string(ps.a));
        goto out;
    }
    rc = pack_dir(&ps, rootfd, "", 1);
    if (rc == ARCHIVE_JOB_OK && archive_write_close(ps.a) != ARCHIVE_OK)
        rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "finishing %s: %s", j->dst,
                      archive_error_string(ps.a));
    if (rc == ARCHIVE_JOB_OK && fsync(fd) != 0) rc = fail_errno(j, errno, "cannot sync", tmp);
    if (rc == ARCHIVE_JOB_OK && cancelled(j)) rc = fail_cancelled(j);
    if (rc == ARCHIVE_JOB_OK && renameat(outdirfd, strrchr(tmp, '/') + 1, outdirfd, base) != 0)
        rc = fail_errno(j, errno, "cannot move the archive into place at", j->dst);

out:
    if (ps.a) archive_write_free(ps.a); /* after a failure this may flush into tmp: removed next */
    if (fd >= 0) {
        close(fd);
        if (rc != ARCHIVE_JOB_OK) unlinkat(outdirfd, strrchr(tmp, '/') + 1, 0);
    }
    if (ps.links) archive_entry_linkresolver_free(ps.links);
    free(ps.buf);
    close_quietly(rootfd);
    close_quietly(outdirfd);
    free(tmp);
    free(dir);
    free(base);
    return rc;
}

/* ---- reading archives (unpack and list) ----------------------------------------------------- */

/* The input of unpack and list: the archive file, gunzipped here when it starts with the gzip
 * magic, and handed to libarchive as a plain tar. libarchive's own gzip reader does not check
 * the CRC-32 and length in the gzip trailer (a TODO in its source), and its tar reader stops at
 * the end-of-archive blocks without reading on to the trailer, so a damaged download would be
 * extracted with wrong bytes and no error. zlib in gzip mode checks both; after the last tar
 * member the rest of the stream is read too, so the trailer is always checked. Concatenated
 * gzip members and zero padding after the stream (tape blocking) are accepted, as gzip does. */
typedef struct in_stream {
    int fd;
    int gzip;       /* the file starts with the gzip magic */
    int member_end; /* a gzip member ended: what follows must be another one or zero bytes */
    int eof;
    int zlib_ready;
    z_stream zs;
    unsigned char *in, *out;
    size_t raw_len; /* plain input: bytes of `in` (the sniffed first block) not handed out */
    int os_error;   /* errno of a failed read(2), else 0 */
} in_stream;

typedef struct reader {
    struct archive *a;
    in_stream s;
} reader;

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
        archive_set_error(a, EILSEQ, "damaged gzip stream: %s", msg);
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

static void reader_close(reader *r)
{
    if (r->a) archive_read_free(r->a);
    if (r->s.zlib_ready) inflateEnd(&r->s.zs);
    close_quietly(r->s.fd);
    free(r->s.in);
    free(r->s.out);
    memset(r, 0, sizeof *r);
    r->s.fd = -1;
}

/* Opens j->src as a gzip'd or plain tar (told apart by its first two bytes). */
static int reader_open(archive_job *j, reader *r)
{
    memset(r, 0, sizeof *r);
    r->s.fd = open(j->src, O_RDONLY | O_CLOEXEC);
    if (r->s.fd < 0) return fail_errno(j, errno, "cannot open the archive", j->src);
    struct stat st;
    if (fstat(r->s.fd, &st) == 0 && S_ISDIR(st.st_mode))
        return job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is a directory, not an archive",
                        j->src);
    r->s.in = (unsigned char *)malloc(COPY_BLOCK);
    r->s.out = (unsigned char *)malloc(COPY_BLOCK);
    if (!r->s.in || !r->s.out || !(r->a = archive_read_new())) return fail_nomem(j);
    ssize_t n = read_retry(r->s.fd, r->s.in, COPY_BLOCK);
    if (n < 0) return fail_errno(j, errno, "cannot read the archive", j->src);
    if (n >= 2 && r->s.in[0] == 0x1f && r->s.in[1] == 0x8b) {
        r->s.gzip = 1;
        if (inflateInit2(&r->s.zs, 16 + MAX_WBITS) != Z_OK) return fail_nomem(j); /* gzip only */
        r->s.zlib_ready = 1;
        r->s.zs.next_in = r->s.in;
        r->s.zs.avail_in = (uInt)n;
    } else {
        r->s.raw_len = (size_t)n;
    }
    archive_read_support_format_tar(r->a);
    if (archive_read_open(r->a, &r->s, NULL, in_read, NULL) != ARCHIVE_OK)
        return job_fail(j, r->s.os_error ? ARCHIVE_JOB_IO_ERROR : ARCHIVE_JOB_CORRUPT, NULL, NULL,
                        "%s is not a readable tar archive: %s", j->src, archive_error_string(r->a));
    return ARCHIVE_JOB_OK;
}

/* Turns a failed libarchive read into CORRUPT, or IO_ERROR when the OS failed the read. */
static int fail_read(archive_job *j, reader *r)
{
    const char *why = archive_error_string(r->a);
    return job_fail(j, r->s.os_error ? ARCHIVE_JOB_IO_ERROR : ARCHIVE_JOB_CORRUPT, NULL, NULL,
                    "%s is not a readable tar archive: %s", j->src, why ? why : "unknown error");
}

/* After the last member: reads the rest of a gzip stream so its trailer is checked. */
static int reader_finish(archive_job *j, reader *r)
{
    size_t trailing = 0;
    while (r->s.gzip && !r->s.eof) {
        const void *buf;
        la_ssize_t n = in_read(r->a, &r->s, &buf);
        if (n < 0) return fail_read(j, r);
        if (cancelled(j)) return fail_cancelled(j);
        trailing += (size_t)n;
        if (trailing > TRAILING_MAX)
            return job_fail(j, ARCHIVE_JOB_CORRUPT, NULL, NULL,
                            "%s has more than %d bytes after the end of its tar", j->src,
                            TRAILING_MAX);
    }
    return ARCHIVE_JOB_OK;
}

/* ---- list ----------------------------------------------------------------------------------- */

static int list_add(archive_job *j, struct archive_entry *e)
{
    if (j->res.nitems == j->cap_items) {
        size_t ncap = j->cap_items ? j->cap_items * 2 : 64;
        archive_item *grown = (archive_item *)realloc(j->items, ncap * sizeof *grown);
        if (!grown) return fail_nomem(j);
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
    if (!it->name || (target && !it->target)) return fail_nomem(j);
    return ARCHIVE_JOB_OK;
}

static int list_run(archive_job *j)
{
    reader rd;
    int rc = reader_open(j, &rd);
    for (; rc == ARCHIVE_JOB_OK;) {
        struct archive_entry *e;
        int r = archive_read_next_header(rd.a, &e);
        if (r == ARCHIVE_EOF) {
            rc = reader_finish(j, &rd);
            break;
        }
        if (r < ARCHIVE_WARN) {
            rc = fail_read(j, &rd);
            break;
        }
        if (cancelled(j)) {
            rc = fail_cancelled(j);
            break;
        }
        if (++j->res.entries > j->max_entries) {
            rc = job_fail(j, ARCHIVE_JOB_TOO_LARGE, NULL, "max_entries",
                          "%s has more than %llu members", j->src,
                          (unsigned long long)j->max_entries);
            break;
        }
        if ((rc = list_add(j, e)) != ARCHIVE_JOB_OK) break;
    }
    reader_close(&rd);
    return rc;
}

/* ---- unpack: checking members --------------------------------------------------------------- */

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

/* Normalises a member name: drops empty and "." components ("./a//b/" is "a/b"; GNU tar writes
 * "./" prefixes). Returns NULL and sets *why for an absolute name or a ".." component, else a
 * malloc'd relative name ("" for the archive's root, "." itself). */
static char *normalize_name(const char *raw, const char **why)
{
    *why = NULL;
    if (raw[0] == '/') {
        *why = "has an absolute name";
        return NULL;
    }
    size_t len = strlen(raw);
    char *out = (char *)malloc(len + 1);
    if (!out) {
        *why = "could not be examined (out of memory)";
        return NULL;
    }
    size_t o = 0;
    const char *p = raw;
    while (*p) {
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') {
            free(out);
            *why = "has a '..' component";
            return NULL;
        }
        if (n > 0 && !(n == 1 && p[0] == '.')) {
            if (o > 0) out[o++] = '/';
            memcpy(out + o, p, n);
            o += n;
        }
        p += n;
        if (*p == '/') p++;
    }
    out[o] = '\0';
    return out;
}

/* Checks the target of a symlink whose normalised name is `name`. A relative target is
 * resolved from the link's directory; it must stay inside the tree. Targets are accepted only
 * in the form "../../some/path": leading ".." steps (no more than the link is deep) and then
 * names. A ".." after a name ("a/../b") is refused even when it looks harmless, because if
 * "a" is itself a link (extracted before or after this one) "a/.." is the parent of wherever
 * "a" points (with a -> ".", "a/../x" is above the tree), which no check of the text can know.
 * With that form, ".." only ever climbs real directories from the link's real location, and
 * each later name is either a real directory or another link that passed the same check, so no
 * chain of links leaves the tree.
 * Returns NULL when safe, else the reason. */
static const char *symlink_problem(const char *name, const char *target)
{
    if (!*target) return "has an empty target";
    if (target[0] == '/') return "points to an absolute path";
    int depth = 0;
    for (const char *s = name; *s; s++)
        if (*s == '/') depth++;
    int ups = 0, named = 0;
    const char *p = target;
    while (*p) {
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') {
            if (named) return "has '..' after a name in its target";
            if (++ups > depth) return "points outside the target directory";
        } else if (n > 0 && !(n == 1 && p[0] == '.')) {
            named = 1;
        }
        p += n;
        if (*p == '/') p++;
    }
    return NULL;
}

/* ---- unpack: writing into staging ---------------------------------------------------------- */

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
    close_quietly(us->cache_fd);
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
        if (!grown) return fail_nomem(us->j);
        us->fix = grown;
        us->capfix = ncap;
    }
    dir_fixup *f = &us->fix[us->nfix];
    memset(f, 0, sizeof *f);
    if (!(f->rel = strdup(rel))) return fail_nomem(us->j);
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
        return job_fail(j, ARCHIVE_JOB_UNSAFE, member, NULL,
                        "refusing %s: member '%s' would be written through the symlink '%.*s' "
                        "extracted before it",
                        j->src, member, len, rel);
    case WALK_NOT_DIR:
    case WALK_MISSING:
        return job_fail(j, ARCHIVE_JOB_CORRUPT, member, NULL,
                        "member '%s' of %s needs '%.*s' to be a directory, but an earlier member "
                        "made it something else",
                        member, j->src, len, rel);
    default:
        return job_fail(j, ARCHIVE_JOB_IO_ERROR, member, NULL,
                        "cannot open '%.*s' while unpacking %s into %s: %s", len, rel, j->src,
                        j->dst, strerror(we->err));
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
        fail_nomem(us->j);
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
            return fail_errno(us->j, errno, "cannot replace", us->member);
        return ARCHIVE_JOB_OK;
    }
    us->cache_stale = 1;
    if (unlinkat(dirfd, base, AT_REMOVEDIR) != 0)
        return job_fail(us->j, ARCHIVE_JOB_CORRUPT, us->member, NULL,
                        "member '%s' of %s would replace a directory an earlier member filled",
                        us->member, us->j->src);
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

static int write_file(unpack_state *us, int dirfd, const char *base, const char *rel,
                      struct archive_entry *e)
{
    archive_job *j = us->j;
    int rc = make_room(us, dirfd, base);
    if (rc != ARCHIVE_JOB_OK) return rc;
    int fd = openat(dirfd, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return fail_errno(j, errno, "cannot create", rel);
    int64_t size = archive_entry_size_is_set(e) ? archive_entry_size(e) : 0;
    for (;;) {
        const void *buf;
        size_t len;
        la_int64_t off;
        int r = archive_read_data_block(us->rd.a, &buf, &len, &off);
        if (r == ARCHIVE_EOF) break;
        if (r < ARCHIVE_WARN) {
            rc = fail_read(j, &us->rd);
            goto out;
        }
        if (cancelled(j)) {
            rc = fail_cancelled(j);
            goto out;
        }
        if (off < 0 || (int64_t)len > size || off > size - (int64_t)len) {
            rc = job_fail(j, ARCHIVE_JOB_CORRUPT, us->member, NULL,
                          "member '%s' of %s has more data than its declared size", us->member,
                          j->src);
            goto out;
        }
        if (pwrite_all(fd, (const char *)buf, len, (off_t)off) != 0) {
            rc = fail_errno(j, errno, "cannot write", rel);
            goto out;
        }
    }
    /* Sparse members end in a hole that no data block covers. */
    if (ftruncate(fd, (off_t)size) != 0) {
        rc = fail_errno(j, errno, "cannot size", rel);
        goto out;
    }
    /* chown before chmod: chown clears setuid/setgid bits. */
    if (j->owner && fchown(fd, (uid_t)archive_entry_uid(e), (gid_t)archive_entry_gid(e)) != 0) {
        rc = fail_errno(j, errno, "cannot change the owner of", rel);
        goto out;
    }
    if (fchmod(fd, member_mode(j, e, 1)) != 0) {
        rc = fail_errno(j, errno, "cannot set the mode of", rel);
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
            return fail_errno(us->j, errno, "cannot create the directory", rel);
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
        return fail_errno(j, errno, "cannot create the symlink", rel);
    if (j->owner && fchownat(dirfd, base, (uid_t)archive_entry_uid(e), (gid_t)archive_entry_gid(e),
                             AT_SYMLINK_NOFOLLOW) != 0)
        return fail_errno(j, errno, "cannot change the owner of", rel);
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
    char *target = normalize_name(target_raw, &why);
    if (!target)
        return job_fail(j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
                        "refusing %s: member '%s' is a hard link to '%s', which %s", j->src,
                        us->member, target_raw, why);
    int rc = ARCHIVE_JOB_OK, tdir = -1;
    if (strcmp(target, rel) == 0) goto out; /* a link to itself: nothing to do */
    const char *slash = strrchr(target, '/');
    const char *tbase = slash ? slash + 1 : target;
    char *tparent = strndup(target, slash ? (size_t)(slash - target) : 0);
    if (!tparent) {
        rc = fail_nomem(j);
        goto out;
    }
    struct stat st;
    walk_error we;
    tdir = open_dir_rel(us, tparent, 0, &we);
    if (tdir < 0 && we.kind == WALK_SYMLINK) {
        rc = job_fail(j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
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
        rc = job_fail(j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
                      "refusing %s: member '%s' is a hard link to '%s', which is not a file "
                      "extracted before it",
                      j->src, us->member, target_raw);
        goto out;
    }
    if (S_ISLNK(st.st_mode)) {
        char text[PATH_MAX];
        ssize_t n = readlinkat(tdir, tbase, text, sizeof text - 1);
        if (n < 0) {
            rc = fail_errno(j, errno, "cannot read the symlink", target);
            goto out;
        }
        text[n] = '\0';
        const char *problem = symlink_problem(rel, text);
        if (problem) {
            rc = job_fail(j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
                          "refusing %s: member '%s' is a hard link to the symlink '%s', which "
                          "from the hard link's directory %s",
                          j->src, us->member, target_raw, problem);
            goto out;
        }
    } else if (!S_ISREG(st.st_mode)) {
        rc = job_fail(j, ARCHIVE_JOB_UNSAFE, us->member, NULL,
                      "refusing %s: member '%s' is a hard link to '%s', which is not a file",
                      j->src, us->member, target_raw);
        goto out;
    }
    if ((rc = make_room(us, dirfd, base)) != ARCHIVE_JOB_OK) goto out;
    us->cache_stale = 1;
    if (linkat(tdir, tbase, dirfd, base, 0) != 0) rc = fail_errno(j, errno, "cannot link", rel);
out:
    close_quietly(tdir);
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
        return job_fail(j, ARCHIVE_JOB_CORRUPT, NULL, NULL, "%s has a member without a name",
                        j->src);
    const char *why;
    char *rel = normalize_name(raw, &why);
    us->member = raw;
    if (!rel)
        return job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL, "refusing %s: member '%s' %s", j->src,
                        raw, why);
    int rc = ARCHIVE_JOB_OK;
    const char *hardlink = archive_entry_hardlink(e);
    mode_t type = archive_entry_filetype(e);
    if (strlen(rel) >= PATH_MAX) {
        rc = job_fail(j, ARCHIVE_JOB_TOO_LARGE, raw, "path_length",
                      "member '%.64s...' of %s has a name longer than %d bytes", raw, j->src,
                      PATH_MAX - 1);
        goto out;
    }
    if (!hardlink && type != AE_IFREG && type != AE_IFDIR && type != AE_IFLNK) {
        const char *what = type == AE_IFCHR    ? "a character device"
                           : type == AE_IFBLK  ? "a block device"
                           : type == AE_IFIFO  ? "a fifo"
                           : type == AE_IFSOCK ? "a socket"
                                               : "of an unknown type";
        rc = job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL, "refusing %s: member '%s' is %s", j->src,
                      raw, what);
        goto out;
    }
    if (!*rel) { /* ".": the target directory itself */
        if (hardlink || type != AE_IFDIR) {
            rc = job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL,
                          "refusing %s: member '%s' would replace the target directory itself",
                          j->src, raw);
        } else {
            us->root_set = 1;
            us->root_mode = member_mode(j, e, 0);
        }
        goto out;
    }
    const char *target = type == AE_IFLNK && !hardlink ? archive_entry_symlink(e) : NULL;
    if (type == AE_IFLNK && !hardlink) {
        const char *problem = symlink_problem(rel, target ? target : "");
        if (problem) {
            rc = job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL,
                          "refusing %s: member '%s' is a symlink that %s (-> %s)", j->src, raw,
                          problem, target ? target : "");
            goto out;
        }
    }
    if (type == AE_IFREG && !hardlink) {
        int64_t size = archive_entry_size(e);
        if (size < 0 || (uint64_t)size > j->max_bytes - j->res.bytes) {
            rc = job_fail(j, ARCHIVE_JOB_TOO_LARGE, raw, "max_bytes",
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
            return fail_errno(j, errno, "cannot change the owner of", f->rel);
        }
        if (fchmod(fd, f->mode) != 0) {
            close(fd);
            return fail_errno(j, errno, "cannot set the mode of", f->rel);
        }
        if (f->has_mtime) {
            struct timespec ts[2] = {{0, UTIME_OMIT}, f->mtime};
            futimens(fd, ts);
        }
        close(fd);
    }
    return ARCHIVE_JOB_OK;
}

/* ---- unpack: moving into place -------------------------------------------------------------- */

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
    return fail_errno(j, errno, "cannot move into place", rel);
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
    if (read_names(sfd, &names, &n) != 0)
        return fail_errno(j, errno, "cannot read the staging directory for", j->dst);
    int rc = ARCHIVE_JOB_OK;
    for (size_t i = 0; i < n && rc == ARCHIVE_JOB_OK; i++) {
        const char *name = names[i];
        struct stat s, t;
        char *rel = join_rel(prefix, name, "");
        if (!rel) {
            rc = fail_nomem(j);
            break;
        }
        int have_t = fstatat(tfd, name, &t, AT_SYMLINK_NOFOLLOW) == 0;
        if (fstatat(sfd, name, &s, AT_SYMLINK_NOFOLLOW) != 0) {
            rc = fail_errno(j, errno, "cannot stat the staged", rel);
        } else if (S_ISDIR(s.st_mode) && have_t && S_ISDIR(t.st_mode)) {
            if (depth >= ARCHIVE_MAX_DEPTH) {
                rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, rel, NULL,
                              "cannot merge %s: '%s' is nested more than %d directories deep",
                              j->dst, rel, ARCHIVE_MAX_DEPTH);
            } else {
                /* The staged directory is emptied and discarded: make sure we may. */
                fchmodat(sfd, name, 0700, 0);
                int sub_s = openat(sfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                int sub_t = openat(tfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                char *sub = join_rel(rel, "/", "");
                if (sub_s < 0 || sub_t < 0)
                    rc = fail_errno(j, errno, "cannot open", rel);
                else if (!sub)
                    rc = fail_nomem(j);
                else
                    rc = merge_walk(j, sub_s, sub_t, sub, depth + 1, check);
                free(sub);
                close_quietly(sub_s);
                close_quietly(sub_t);
            }
        } else if (have_t && S_ISDIR(t.st_mode)) {
            rc = job_fail(j, ARCHIVE_JOB_MERGE_CONFLICT, rel, NULL,
                          "cannot merge %s into %s: '%s' is a directory there and not in the "
                          "archive; nothing was changed",
                          j->src, j->dst, rel);
        } else if (!check) {
            if (have_t && S_ISDIR(s.st_mode) && unlinkat(tfd, name, 0) != 0)
                rc = fail_errno(j, errno, "cannot replace", rel);
            else
                rc = move_entry(j, sfd, tfd, name, &s, rel);
        }
        free(rel);
    }
    free_names(names, n);
    return rc;
}

/* Where the target is and whether it exists, resolved once: the staging directory is made in
 * the same directory (same filesystem, so moving it is a rename). */
typedef struct target_info {
    char *parent; /* canonical directory holding the target */
    char *base;   /* the target's name in it */
    int parentfd;
    int exists;
} target_info;

static int resolve_target(archive_job *j, target_info *ti)
{
    struct stat st;
    char *canon = NULL, *dir = NULL;
    if (lstat(j->dst, &st) == 0) {
        if (!j->merge)
            return job_fail(j, ARCHIVE_JOB_TARGET_EXISTS, NULL, NULL,
                            "%s already exists (pass merge = true to merge into it)", j->dst);
        if (!(canon = realpath(j->dst, NULL)))
            return fail_errno(j, errno, "cannot resolve", j->dst);
        if (stat(canon, &st) != 0 || !S_ISDIR(st.st_mode)) {
            free(canon);
            return job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is not a directory", j->dst);
        }
        ti->exists = 1;
        int r = split_path(canon, &ti->parent, &ti->base);
        free(canon);
        if (r != 0) return fail_nomem(j);
    } else if (errno == ENOENT) {
        char *base;
        if (split_path(j->dst, &dir, &base) != 0) return fail_nomem(j);
        ti->base = base;
        ti->parent = realpath(dir, NULL);
        int e = errno;
        if (!ti->parent) {
            int rc = job_fail(j, e == ENOENT ? ARCHIVE_JOB_NOT_FOUND : ARCHIVE_JOB_IO_ERROR, NULL,
                              NULL, "cannot unpack into %s: its directory %s %s", j->dst, dir,
                              e == ENOENT ? "does not exist" : strerror(e));
            free(dir);
            return rc;
        }
        free(dir);
        if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
            return job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "%s is not a directory name",
                            j->dst);
    } else {
        return fail_errno(j, errno, "cannot examine", j->dst);
    }
    if (!*ti->base)
        return job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "refusing to unpack onto /");
    ti->parentfd = open(ti->parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (ti->parentfd < 0) return fail_errno(j, errno, "cannot open", ti->parent);
    return ARCHIVE_JOB_OK;
}

/* Moves a complete staging directory into place: one rename onto a missing target (refusing
 * to replace anything that appeared meanwhile), or a merge into an existing one. */
static int commit(archive_job *j, unpack_state *us, target_info *ti, const char *stage_name,
                  int *moved)
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
                return job_fail(j, ARCHIVE_JOB_TARGET_EXISTS, NULL, NULL,
                                "%s appeared while %s was being unpacked (pass merge = true to "
                                "merge into it)",
                                j->dst, j->src);
            return fail_errno(j, errno, "cannot move the unpacked tree to", j->dst);
        }
        *moved = 1;
        /* The staging fd follows the directory to its new name. */
        fchmod(us->stagefd, us->root_set ? us->root_mode : 0777 & ~j->umask);
        return ARCHIVE_JOB_OK;
    }
    int tfd = openat(ti->parentfd, ti->base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (tfd < 0) return fail_errno(j, errno, "cannot open", j->dst);
    int rc = merge_walk(j, us->stagefd, tfd, "", 1, 1);
    if (rc == ARCHIVE_JOB_OK) rc = merge_walk(j, us->stagefd, tfd, "", 1, 0);
    close(tfd);
    return rc;
}

static int unpack_run(archive_job *j)
{
    target_info ti = {NULL, NULL, -1, 0};
    unpack_state us;
    memset(&us, 0, sizeof us);
    us.j = j;
    us.stagefd = us.cache_fd = us.rd.s.fd = -1;
    char *stage = NULL;
    int moved = 0, rc;

    if ((rc = resolve_target(j, &ti)) != ARCHIVE_JOB_OK) goto out;
    if ((rc = reader_open(j, &us.rd)) != ARCHIVE_JOB_OK) goto out;
    size_t sl = strlen(ti.parent) + strlen(ti.base) + 40;
    if (!(stage = (char *)malloc(sl))) {
        rc = fail_nomem(j);
        goto out;
    }
    snprintf(stage, sl, "%s/.%.*s.moonbox-staging-XXXXXX", strcmp(ti.parent, "/") ? ti.parent : "",
             STAGE_BASE_MAX, ti.base);
    if (!mkdtemp(stage)) { /* 0700 */
        free(stage);
        stage = NULL;
        rc = fail_errno(j, errno, "cannot create a staging directory beside", j->dst);
        goto out;
    }
    const char *stage_name = strrchr(stage, '/') + 1;
    us.stagefd = openat(ti.parentfd, stage_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (us.stagefd < 0) {
        rc = fail_errno(j, errno, "cannot open", stage);
        goto out;
    }
    for (;;) {
        struct archive_entry *e;
        int r = archive_read_next_header(us.rd.a, &e);
        if (r == ARCHIVE_EOF) break;
        if (r < ARCHIVE_WARN) {
            rc = fail_read(j, &us.rd);
            goto out;
        }
        if (cancelled(j)) {
            rc = fail_cancelled(j);
            goto out;
        }
        if (++j->res.entries > j->max_entries) {
            rc = job_fail(j, ARCHIVE_JOB_TOO_LARGE, NULL, "max_entries",
                          "%s has more than max_entries (%llu) members", j->src,
                          (unsigned long long)j->max_entries);
            goto out;
        }
        if ((rc = unpack_member(&us, e)) != ARCHIVE_JOB_OK) goto out;
    }
    if ((rc = reader_finish(j, &us.rd)) != ARCHIVE_JOB_OK) goto out;
    if ((rc = apply_fixups(&us)) != ARCHIVE_JOB_OK) goto out;
    if (cancelled(j)) {
        rc = fail_cancelled(j);
        goto out;
    }
    /* From here on the job runs to its end even if cancelled: a half-merged target is worse
     * than a complete one. */
    rc = commit(j, &us, &ti, stage_name, &moved);

out:
    cache_drop(&us);
    reader_close(&us.rd);
    close_quietly(us.stagefd);
    if (stage && !moved) remove_entry(ti.parentfd, strrchr(stage, '/') + 1);
    for (size_t i = 0; i < us.nfix; i++)
        free(us.fix[i].rel);
    free(us.fix);
    free(stage);
    close_quietly(ti.parentfd);
    free(ti.parent);
    free(ti.base);
    return rc;
}

/* ---- records: the stream between the backend and a sandbox's file helper ------------------------
 *
 * `moonbox local` never extracts or packs a sandbox's files itself: its file helper does,
 * inside the sandbox (tools/sandbox/fileops.c), following "records" — 'H', then NUL-terminated
 * fields type (f, d, l, or h: a hard link to an earlier f), octal mode, uid, gid, mtime, size,
 * name, link target, then size bytes for f; 'E' at the end. TO_RECORDS turns a client's archive
 * into records, with the member checks of unpack (normalize_name, symlink_problem, hard links
 * only to earlier files, no devices) so the helper only ever sees clean relative names;
 * FROM_RECORDS turns what a helper packed into a gzip'd tar. One parser reads what clients send
 * (libarchive, here); the helper only follows records. Both write dst through a 0600 temporary file
 * renamed into place. */

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

static int to_records_run(archive_job *j)
{
    reader rd;
    name_list files = {NULL, 0, 0};
    char *tmp = NULL, *name = NULL, *link = NULL;
    rec_out *o = (rec_out *)malloc(sizeof *o);
    if (!o) return fail_nomem(j);
    o->len = 0;
    o->fd = -1;
    int rc = reader_open(j, &rd);
    if (rc == ARCHIVE_JOB_OK && (o->fd = open_partial(j, &tmp)) < 0)
        rc = tmp ? fail_errno(j, errno, "cannot create", tmp) : fail_nomem(j);
    char *buf = rc == ARCHIVE_JOB_OK ? (char *)malloc(COPY_BLOCK) : NULL;
    if (rc == ARCHIVE_JOB_OK && !buf) rc = fail_nomem(j);
    while (rc == ARCHIVE_JOB_OK) {
        struct archive_entry *e;
        int r = archive_read_next_header(rd.a, &e);
        if (r == ARCHIVE_EOF) {
            rc = reader_finish(j, &rd);
            break;
        }
        if (r < ARCHIVE_WARN) {
            rc = fail_read(j, &rd);
            break;
        }
        if (cancelled(j)) {
            rc = fail_cancelled(j);
            break;
        }
        if (++j->res.entries > j->max_entries) {
            rc = job_fail(j, ARCHIVE_JOB_TOO_LARGE, NULL, "max_entries",
                          "the archive has more than %llu members",
                          (unsigned long long)j->max_entries);
            break;
        }
        const char *raw = archive_entry_pathname(e), *why = NULL;
        free(name);
        name = normalize_name(raw ? raw : "", &why);
        if (!name) {
            rc = job_fail(j, ARCHIVE_JOB_UNSAFE, raw, NULL, "archive member %s %s", raw ? raw : "?",
                          why);
            break;
        }
        mode_t type = archive_entry_filetype(e);
        const char *target = "";
        char t = 0;
        if (archive_entry_hardlink(e)) {
            const char *why2 = NULL;
            free(link);
            link = normalize_name(archive_entry_hardlink(e), &why2);
            if (!link || !names_has(&files, link)) {
                rc = job_fail(j, ARCHIVE_JOB_UNSAFE, name, NULL,
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
            const char *bad = symlink_problem(name, target);
            if (bad) {
                rc = job_fail(j, ARCHIVE_JOB_UNSAFE, name, NULL,
                              "archive member %s is a symlink that %s", name, bad);
                break;
            }
        } else {
            rc = job_fail(j, ARCHIVE_JOB_UNSAFE, name, NULL,
                          "archive member %s is a device, fifo or socket", name);
            break;
        }
        if (!*name) continue; /* the archive's own root ("./"): the target directory itself */
        if (t == 'f' && !names_has(&files, name) && names_add(&files, name) < 0) {
            rc = fail_nomem(j);
            break;
        }
        int64_t size = t == 'f' ? archive_entry_size(e) : 0;
        if (size < 0) size = 0;
        if (j->res.bytes + (uint64_t)size > j->max_bytes) {
            rc = job_fail(j, ARCHIVE_JOB_TOO_LARGE, name, "max_bytes",
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
                rc = fail_read(j, &rd);
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
        if (w) rc = fail_errno(j, w, "cannot write", tmp);
    }
    if (rc == ARCHIVE_JOB_OK) {
        int w = rec_put(o, "E", 1);
        if (!w) w = rec_flush(o);
        if (w) rc = fail_errno(j, w, "cannot write", tmp);
    }
    if (rc == ARCHIVE_JOB_OK && rename(tmp, j->dst) != 0)
        rc = fail_errno(j, errno, "cannot move into place", j->dst);
    if (o->fd >= 0) {
        close(o->fd);
        if (rc != ARCHIVE_JOB_OK) unlink(tmp);
    }
    reader_close(&rd);
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

static int from_records_run(archive_job *j)
{
    char *tmp = NULL, *buf = NULL;
    int fd = -1, rc = ARCHIVE_JOB_OK;
    struct archive *a = NULL;
    FILE *in = fopen(j->src, "rbe");
    if (!in) return fail_errno(j, errno, "cannot open", j->src);
    if ((fd = open_partial(j, &tmp)) < 0) {
        rc = tmp ? fail_errno(j, errno, "cannot create", tmp) : fail_nomem(j);
        goto out;
    }
    a = archive_write_new();
    buf = (char *)malloc(COPY_BLOCK);
    if (!a || !buf) {
        rc = fail_nomem(j);
        goto out;
    }
    if (archive_write_set_format_pax_restricted(a) != ARCHIVE_OK ||
        (j->gzip &&
         (archive_write_add_filter_gzip(a) != ARCHIVE_OK ||
          archive_write_set_filter_option(a, "gzip", "compression-level", "1") != ARCHIVE_OK)) ||
        archive_write_open_fd(a, fd) != ARCHIVE_OK) {
        rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "cannot start writing %s: %s", j->dst,
                      archive_error_string(a));
        goto out;
    }
    for (;;) {
        int tag = getc(in);
        if (tag == 'E') break;
        if (tag != 'H') {
            rc = job_fail(j, ARCHIVE_JOB_CORRUPT, NULL, NULL,
                          "the sandbox's file helper sent malformed records");
            break;
        }
        if (cancelled(j)) {
            rc = fail_cancelled(j);
            break;
        }
        char ty[4], mode[16], uid[24], gid[24], mtime[32], size[32], name[8192], target[4096];
        if (rec_read_field(in, ty, sizeof ty) || rec_read_field(in, mode, sizeof mode) ||
            rec_read_field(in, uid, sizeof uid) || rec_read_field(in, gid, sizeof gid) ||
            rec_read_field(in, mtime, sizeof mtime) || rec_read_field(in, size, sizeof size) ||
            rec_read_field(in, name, sizeof name) || rec_read_field(in, target, sizeof target) ||
            !strchr("fdlhs", ty[0]) || !ty[0] || ty[1] || !*name) {
            rc = job_fail(j, ARCHIVE_JOB_CORRUPT, NULL, NULL,
                          "the sandbox's file helper sent a malformed record");
            break;
        }
        if (++j->res.entries > j->max_entries) {
            rc = job_fail(j, ARCHIVE_JOB_TOO_LARGE, NULL, "max_entries",
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
                rc = job_fail(j, ARCHIVE_JOB_TOO_LARGE, name, "sparse_size",
                              "%s is a sparse file of %lld bytes; at most %lld can be packed", name,
                              sz, (long long)SPARSE_LOGICAL_MAX);
                break;
            }
            if (rec_read_field(in, num, sizeof num) ||
                (nseg = strtoul(num, NULL, 10)) > SPARSE_SEGMENTS_MAX ||
                !(seg = (long long(*)[2])calloc(nseg ? nseg : 1, sizeof *seg))) {
                rc = job_fail(j, ARCHIVE_JOB_CORRUPT, name, NULL,
                              "the sparse map of %s is malformed", name);
                break;
            }
            long long end = 0;
            for (size_t i = 0; i < nseg && rc == ARCHIVE_JOB_OK; i++) {
                char a[32], b[32];
                if (rec_read_field(in, a, sizeof a) || rec_read_field(in, b, sizeof b)) {
                    rc = job_fail(j, ARCHIVE_JOB_CORRUPT, name, NULL,
                                  "the sparse map of %s is malformed", name);
                    break;
                }
                seg[i][0] = strtoll(a, NULL, 10);
                seg[i][1] = strtoll(b, NULL, 10);
                if (seg[i][0] < end || seg[i][1] < 0 || seg[i][0] + seg[i][1] > sz)
                    rc = job_fail(j, ARCHIVE_JOB_CORRUPT, name, NULL,
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
            rc = fail_nomem(j);
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
            rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, name, NULL, "writing the entry %s: %s", name,
                          archive_error_string(a));
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
                    rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "writing %s: %s", j->dst,
                                  archive_error_string(a));
                    break;
                }
                pos += k;
                if (cancelled(j)) rc = fail_cancelled(j);
                continue;
            }
            while (run > 0) {
                size_t want = run > COPY_BLOCK ? COPY_BLOCK : (size_t)run;
                size_t n = fread(buf, 1, want, in);
                if (n == 0) {
                    rc = job_fail(j, ARCHIVE_JOB_CORRUPT, name, NULL, "the records of %s end early",
                                  name);
                    break;
                }
                if (archive_write_data(a, buf, n) < 0) {
                    rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "writing %s: %s", j->dst,
                                  archive_error_string(a));
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
        rc = job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "finishing %s: %s", j->dst,
                      archive_error_string(a));
    if (rc == ARCHIVE_JOB_OK && rename(tmp, j->dst) != 0)
        rc = fail_errno(j, errno, "cannot move into place", j->dst);
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

/* ---- job lifecycle -------------------------------------------------------------------------- */

/* Ownership of a job: two references, the worker's and the owner's, counted under the job's
 * mutex; whoever drops the last frees it. The ev_async is started and stopped on the loop thread
 * only; the worker sends it under the mutex and only while the owner has not released the job,
 * so the watcher is never touched after the owner stopped it. */

static void job_free(archive_job *j)
{
    pthread_mutex_destroy(&j->mu);
    for (size_t i = 0; i < j->res.nitems; i++) {
        free(j->items[i].name);
        free(j->items[i].target);
    }
    free(j->items);
    free(j->message);
    free(j->member);
    free(j->src);
    free(j->dst);
    free(j);
}

/* The loop thread learns that the worker finished. Records nothing itself: the result is in
 * the job; the owner's notify decides what it means (and must not call Lua). */
static void job_done_cb(struct ev_loop *loop, ev_async *w, int revents)
{
    archive_job *j = (archive_job *)w->data;
    (void)revents;
    pthread_mutex_lock(&j->mu); /* pairs with the worker's unlock: its writes are visible */
    int finished = j->finished;
    pthread_mutex_unlock(&j->mu);
    if (!finished) return;
    ev_async_stop(loop, w);
    j->notify(j, j->notify_ud);
}

static void *job_main(void *arg)
{
    archive_job *j = (archive_job *)arg;
    switch (j->kind) {
    case ARCHIVE_JOB_PACK:
        pack_run(j);
        break;
    case ARCHIVE_JOB_UNPACK:
        unpack_run(j);
        break;
    case ARCHIVE_JOB_TO_RECORDS:
        to_records_run(j);
        break;
    case ARCHIVE_JOB_FROM_RECORDS:
        from_records_run(j);
        break;
    default:
        list_run(j);
        break;
    }
    j->res.message = j->message ? j->message : (j->res.status ? "out of memory" : "");
    j->res.member = j->member;
    j->res.items = j->items;
    live_unlink(j); /* after the partial output is gone: the wait at exit relies on it */
    pthread_mutex_lock(&j->mu);
    j->finished = 1;
    if (!j->abandoned) ev_async_send(j->loop, &j->done_watcher);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) job_free(j);
    return NULL;
}

int archive_job_start(struct ev_loop *loop, const archive_job_opts *o, archive_job **out, char *err,
                      size_t errlen)
{
    archive_job *j = (archive_job *)calloc(1, sizeof *j);
    if (!j || !(j->src = strdup(o->src)) || (o->dst && !(j->dst = strdup(o->dst)))) {
        if (j) free(j->src);
        free(j);
        snprintf(err, errlen, "out of memory starting an archive job");
        return ARCHIVE_JOB_IO_ERROR;
    }
    j->kind = o->kind;
    j->gzip = o->gzip;
    j->merge = o->merge;
    j->owner = o->owner;
    j->umask = (mode_t)(o->umask & 0777);
    j->file_mode = o->file_mode;
    j->max_bytes = o->max_bytes;
    j->max_entries = o->max_entries;
    j->loop = loop;
    j->notify = o->notify;
    j->notify_ud = o->notify_ud;
    atomic_init(&j->cancel, 0);
    pthread_mutex_init(&j->mu, NULL);
    j->refs = 2;
    ev_async_init(&j->done_watcher, job_done_cb);
    j->done_watcher.data = j;
    ev_async_start(loop, &j->done_watcher);
    pthread_once(&g_atexit_once, register_exit_wait);
    live_link(j);

    pthread_attr_t attr;
    pthread_t tid;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int r = pthread_create(&tid, &attr, job_main, j);
    pthread_attr_destroy(&attr);
    if (r != 0) {
        live_unlink(j);
        ev_async_stop(loop, &j->done_watcher);
        job_free(j);
        snprintf(err, errlen, "cannot start an archive worker thread: %s", strerror(r));
        return ARCHIVE_JOB_IO_ERROR;
    }
    *out = j;
    return ARCHIVE_JOB_OK;
}

const archive_job_result *archive_job_result_of(const archive_job *job)
{
    return &job->res;
}

void archive_job_release(archive_job *j)
{
    atomic_store(&j->cancel, 1);
    pthread_mutex_lock(&j->mu);
    j->abandoned = 1;
    ev_async_stop(j->loop, &j->done_watcher);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) job_free(j);
}
