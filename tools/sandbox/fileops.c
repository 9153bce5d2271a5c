/*
 * fileops.c — `moonbox-sandbox files --op=OP`: the sandbox's files, read and written by our own
 * code running inside it (its namespaces, root, cgroup, ids and confinement: enter.c and
 * confine.c ran first). Nothing of the sandbox's is executed or loaded, and every path is
 * resolved by the kernel against the sandbox's root, so a symlink the sandbox planted means
 * the sandbox's file, never the host's. One operation per process:
 *
 *   stat   PATH [--follow]   one entry record                 (find -printf
 * '%f\0%y\0%s\0%T@\0%l\0%m\0') list   PATH --depth=N    entry records, names relative to PATH
 * (depth 0: PATH itself) read   PATH              "ok SIZE\n" on stderr, then the bytes on stdout
 * (follows symlinks) write  PATH --mode=OCT   stdin becomes the file: parents made, replaced
 * atomically pack   PATH [--exclude=NAME]...  the tree as records on stdout (see below) unpack PATH
 * records on stdin are created under PATH (made if missing)
 *
 * Records of pack/unpack: 'H', then NUL-terminated decimal/text fields type (f, d, l; h for a
 * hard link to a file earlier in the same stream; s, pack only, for a sparse file), mode
 * (octal), uid, gid, mtime, size, name (relative, '/'-separated), link target; then, for f,
 * exactly size bytes; an s record's size is its logical size and is followed by the number of
 * data segments and each segment's offset and length (decimal fields), then only the segments'
 * bytes. 'E' ends the stream. The backend turns tar archives into records and
 * back with libarchive, so one parser (libarchive's, with the backend's safety checks) reads
 * what clients send; this file only follows records, and checks each name again.
 *
 * Failures: one line "CODE message" on stderr and an exit status the engine maps: 2 not_found,
 * 13 permission_denied, 20 not_directory, 21 is_directory, 22 not_regular, 23 invalid,
 * 24 too_large, 27 too_many, 30 read_only_path, 1 io_error.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "linkmap.h"
#include "sandbox.h"

#define EX_NOT_FOUND   2
#define EX_NOT_DIR     20
#define EX_IS_DIR      21
#define EX_NOT_REGULAR 22
#define EX_INVALID     23
#define EX_TOO_MANY    27
#define EX_TOO_LARGE   24
#define EX_DENIED      13
#define EX_READ_ONLY   30
#define EX_IO          1

/* Bounds: entries and bytes one list answers with, directory levels a walk descends (one fd
 * each), data a pack carries by default (--max-bytes), and the segments of one sparse file
 * (more are merged, holes between them sent as zeros). */
#define LIST_MAX            100000
#define LIST_BYTES_MAX      (8u << 20)
#define DEPTH_MAX           256
#define PACK_MAX_BYTES      (8ULL << 30)
#define SPARSE_SEGMENTS_MAX 4096

static int fail_op(int code, const char *word, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail_op(int code, const char *word, const char *fmt, ...)
{
    char head[64];
    snprintf(head, sizeof head, "%s ", word);
    va_list ap;
    va_start(ap, fmt);
    say(head, fmt, ap);
    va_end(ap);
    return code;
}

static int errno_fail(const char *what, const char *path, int e)
{
    if (e == ENOENT) return fail_op(EX_NOT_FOUND, "not_found", "no file or directory at %s", path);
    if (e == ENOTDIR)
        return fail_op(EX_NOT_DIR, "not_directory", "a parent of %s is not a directory", path);
    if (e == EISDIR) return fail_op(EX_IS_DIR, "is_directory", "%s is a directory", path);
    if (e == ELOOP)
        return fail_op(EX_NOT_FOUND, "not_found", "too many symbolic links at %s", path);
    if (e == EACCES || e == EPERM)
        return fail_op(EX_DENIED, "permission_denied",
                       "%s %s: permission denied inside the sandbox", what, path);
    if (e == ENXIO || e == ENODEV)
        return fail_op(EX_NOT_REGULAR, "not_regular", "%s is a device that cannot be opened", path);
    if (e == ENAMETOOLONG)
        return fail_op(EX_INVALID, "path_too_long", "%s %.48s...: a name or the path is too long",
                       what, path);
    if (e == EROFS)
        return fail_op(EX_READ_ONLY, "read_only_path",
                       "%s %s: the file system there is read-only inside the sandbox", what, path);
    return fail_op(EX_IO, "io_error", "%s %s: %s", what, path, strerror(e));
}

/* ---- output ------------------------------------------------------------------------------------
 */

static char obuf[1 << 16];
static size_t olen;
static unsigned long long obytes; /* everything written so far */

static int oflush(void)
{
    int e = write_all(1, obuf, olen);
    olen = 0;
    return e;
}

static int oput(const void *p, size_t n)
{
    obytes += n;
    if (olen + n > sizeof obuf) {
        int e = oflush();
        if (e) return e;
        if (n > sizeof obuf) return write_all(1, p, n);
    }
    memcpy(obuf + olen, p, n);
    olen += n;
    return 0;
}

static int ofield(const char *s)
{
    return oput(s, strlen(s) + 1);
}

static int ofieldf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int ofieldf(const char *fmt, ...)
{
    char b[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    return ofield(b);
}

static char type_letter(mode_t m)
{
    if (S_ISREG(m)) return 'f';
    if (S_ISDIR(m)) return 'd';
    if (S_ISLNK(m)) return 'l';
    if (S_ISFIFO(m)) return 'p';
    if (S_ISSOCK(m)) return 's';
    if (S_ISCHR(m)) return 'c';
    return 'b';
}

/* Whether the entry name of dirfd (not followed) is on procfs, whose symlinks are magic links:
 * /proc/<pid>/exe of this very helper would name its host path, so their targets are not
 * reported. The entry itself is asked, not dirfd: with AT_FDCWD, name is a whole path. */
static int on_procfs(int dirfd, const char *name)
{
    struct statfs sf;
    int fd = openat(dirfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return 1; /* gone meanwhile: report no target */
    int proc = fstatfs(fd, &sf) != 0 || sf.f_type == PROC_SUPER_MAGIC;
    close(fd);
    return proc;
}

/* Whether fd is on procfs. */
static int fd_on_procfs(int fd)
{
    struct statfs sf;
    return fstatfs(fd, &sf) == 0 && sf.f_type == PROC_SUPER_MAGIC;
}

/* Opens path (flags: O_RDONLY, O_PATH, maybe O_DIRECTORY; O_CLOEXEC added) following
 * symlinks inside the sandbox but never a /proc magic link (RESOLVE_NO_MAGICLINKS): the
 * exe, cwd, root, fd/N and map_files/ entries of /proc/<pid> lead wherever that process's
 * file is, and for this helper's own process, /proc/self/exe, that is its binary on the host
 * (issue 23). Returns the fd, or -1 with *code set by fail_op (permission_denied for a magic
 * link, else errno_fail's). */
static int open_nomagic(const char *path, int flags, const char *what, int *code)
{
    struct open_how how = {.flags = (unsigned long long)(flags | O_CLOEXEC),
                           .resolve = RESOLVE_NO_MAGICLINKS};
    int fd = (int)syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how);
    if (fd >= 0) return fd;
    int e = errno;
    if (e == ELOOP) {
        /* too many symlinks, or a magic link: the latter resolves when allowed (O_PATH opens
         * nothing of it) */
        int probe = open(path, O_PATH | O_CLOEXEC);
        if (probe >= 0) {
            close(probe);
            *code = fail_op(EX_DENIED, "permission_denied",
                            "%s leads through a /proc magic link (a process's exe, cwd, root, fd "
                            "or map_files entry), which the file helper does not follow",
                            path);
            return -1;
        }
    }
    *code = errno_fail(what, path, e);
    return -1;
}

/* One entry record as find -printf '%f\0%y\0%s\0%T@\0%l\0%m\0' would print it. */
static int entry_record(int dirfd, const char *name, const char *shown, const struct stat *st)
{
    char ty[2] = {type_letter(st->st_mode), 0}, target[4096] = "";
    if (S_ISLNK(st->st_mode) && !on_procfs(dirfd, name)) {
        ssize_t n = readlinkat(dirfd, name, target, sizeof target - 1);
        target[n > 0 ? n : 0] = 0;
    }
    int e = ofield(shown);
    if (!e) e = ofield(ty);
    if (!e) e = ofieldf("%lld", (long long)st->st_size);
    if (!e) e = ofieldf("%lld.%09ld", (long long)st->st_mtim.tv_sec, st->st_mtim.tv_nsec);
    if (!e) e = ofield(target);
    if (!e) e = ofieldf("%o", (unsigned)(st->st_mode & 07777));
    return e;
}

/* ---- stat and list ----------------------------------------------------------------------------
 */

static const char *base_name(const char *p)
{
    const char *s = strrchr(p, '/');
    return s && s[1] ? s + 1 : (s && s == p ? "/" : (s ? p : p));
}

static int op_stat(const struct spec *s)
{
    struct stat st;
    if (s->follow) {
        int code, fd = open_nomagic(s->path, O_PATH, "stat", &code);
        if (fd < 0) return code;
        int rc = fstat(fd, &st);
        close(fd);
        if (rc < 0) return errno_fail("stat", s->path, errno);
    } else if (lstat(s->path, &st) < 0) {
        return errno_fail("stat", s->path, errno);
    }
    if (entry_record(AT_FDCWD, s->path, base_name(s->path), &st) || oflush())
        return fail_op(EX_IO, "io_error", "writing the answer failed");
    return 0;
}

static long listed;

static int list_dir(int dfd, const char *rel, long depth)
{
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return 0;
    }
    struct dirent *de;
    int rc = 0;
    while (!rc && (de = readdir(d))) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
            continue; /* gone meanwhile */
        if (++listed > LIST_MAX || obytes > LIST_BYTES_MAX) {
            rc = -1;
            break;
        }
        char shown[8192];
        if ((size_t)snprintf(shown, sizeof shown, "%s%s%s", rel, *rel ? "/" : "", de->d_name) >=
            sizeof shown)
            continue;
        if (entry_record(dirfd(d), de->d_name, shown, &st)) {
            rc = -2;
            break;
        }
        if (S_ISDIR(st.st_mode) && depth > 1) {
            int sub = openat(dirfd(d), de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (sub >= 0) rc = list_dir(sub, shown, depth - 1);
        }
    }
    closedir(d);
    return rc;
}

static int op_list(const struct spec *s)
{
    if (s->depth < 0 || s->depth > DEPTH_MAX)
        return fail_op(EX_INVALID, "invalid", "depth %ld is out of range", s->depth);
    if (s->depth == 0) {
        struct stat st;
        if (lstat(s->path, &st) < 0) return errno_fail("stat", s->path, errno);
        if (entry_record(AT_FDCWD, s->path, base_name(s->path), &st) || oflush())
            return fail_op(EX_IO, "io_error", "writing the answer failed");
        return 0;
    }
    int code, dfd = open_nomagic(s->path, O_RDONLY | O_DIRECTORY, "open", &code);
    if (dfd < 0) return code;
    int rc = list_dir(dfd, "", s->depth);
    if (rc == -1)
        return fail_op(
            EX_TOO_MANY, "too_many",
            "the listing of %s is larger than %d entries or %u MiB; list a deeper path or "
            "a smaller depth",
            s->path, LIST_MAX, LIST_BYTES_MAX >> 20);
    if (rc || oflush()) return fail_op(EX_IO, "io_error", "writing the answer failed");
    return 0;
}

/* ---- read --------------------------------------------------------------------------------------
 */

/* Opens path for reading without blocking on a FIFO and refuses what is not a regular file. */
static int open_regular(const char *path, struct stat *st, int *code)
{
    int fd = open_nomagic(path, O_RDONLY | O_NONBLOCK | O_NOCTTY, "open", code);
    if (fd < 0) return -1;
    if (fstat(fd, st) < 0) {
        *code = errno_fail("stat", path, errno);
        close(fd);
        return -1;
    }
    if (S_ISDIR(st->st_mode)) {
        *code = fail_op(EX_IS_DIR, "is_directory", "%s is a directory", path);
        close(fd);
        return -1;
    }
    if (!S_ISREG(st->st_mode)) {
        *code = fail_op(EX_NOT_REGULAR, "not_regular",
                        "%s is not a regular file (a device, fifo or socket)", path);
        close(fd);
        return -1;
    }
    fcntl(fd, F_SETFL, 0);
    return fd;
}

static int op_read(const struct spec *s)
{
    struct stat st;
    int code;
    int fd = open_regular(s->path, &st, &code);
    if (fd < 0) return code;
    fprintf(stderr, "ok %lld\n", (long long)st.st_size);
    fflush(stderr);
    static char buf[1 << 17];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return fail_op(EX_IO, "io_error", "reading %s: %s", s->path, strerror(errno));
        if (n == 0) break;
        if (write_all(1, buf, (size_t)n)) return EX_IO; /* the reader went away */
    }
    return 0;
}

/* ---- write -------------------------------------------------------------------------------------
 */

/* mkdir -p of every parent of path (relative to dirfd), 0755, without following a final
 * symlink of any of them beyond what the kernel resolves inside the sandbox. */
static int make_parents(int dirfd, const char *path)
{
    char buf[8192];
    if (strlen(path) >= sizeof buf) return ENAMETOOLONG;
    strcpy(buf, path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdirat(dirfd, buf, 0755) < 0 && errno != EEXIST) return errno;
        *p = '/';
    }
    return 0;
}

/* Splits path into its directory (opened) and final name. */
static int open_parent(int at, const char *path, char *name, size_t namelen, int beneath)
{
    char dir[8192];
    const char *slash = strrchr(path, '/');
    if (!slash) {
        strcpy(dir, ".");
        snprintf(name, namelen, "%s", path);
    } else {
        size_t n = (size_t)(slash - path);
        if (n >= sizeof dir) {
            errno = ENAMETOOLONG;
            return -1;
        }
        memcpy(dir, path, n);
        dir[n] = 0;
        if (n == 0) strcpy(dir, "/");
        snprintf(name, namelen, "%s", slash + 1);
    }
    struct open_how how = {.flags = O_PATH | O_DIRECTORY | O_CLOEXEC,
                           .resolve = RESOLVE_NO_MAGICLINKS | (beneath ? RESOLVE_BENEATH : 0)};
    int fd = (int)syscall(SYS_openat2, at, dir, &how, sizeof how);
    return fd;
}

static unsigned long upload_seq;

/* Buffered reading of stdin for unpack's records (headers are read byte by byte). */
static char ibuf[1 << 16];
static size_t ipos, ilen;

static ssize_t in_read(void *dst, size_t n)
{
    if (ipos == ilen) {
        ssize_t r;
        while ((r = read(0, ibuf, sizeof ibuf)) < 0 && errno == EINTR) {
        }
        if (r <= 0) return r;
        ipos = 0;
        ilen = (size_t)r;
    }
    size_t k = ilen - ipos < n ? ilen - ipos : n;
    memcpy(dst, ibuf + ipos, k);
    ipos += k;
    return (ssize_t)k;
}

/* Creates name in dirfd from the bytes of in (len bytes, or until EOF when len < 0) with mode,
 * replacing what is there (not a directory) atomically: an unnamed O_TMPFILE linked in under a
 * temporary name and renamed over name, so a reader never sees half a file and a helper killed
 * midway leaves nothing behind. */
static int create_file(int dirfd, const char *name, int in, long long len, unsigned mode,
                       const char *shown)
{
    struct stat st;
    if (fstatat(dirfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (S_ISDIR(st.st_mode))
            return fail_op(EX_IS_DIR, "is_directory", "%s is a directory", shown);
        /* A device, fifo or socket is never replaced by an upload (a device node in /dev is
         * often a mount point, and replacing one is not what a client that names it means). */
        if (!S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode))
            return fail_op(EX_NOT_REGULAR, "not_regular",
                           "%s is a device, fifo or socket, not a regular file", shown);
    }
    int fd = openat(dirfd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
    char tmp[64];
    snprintf(tmp, sizeof tmp, ".moonbox-upload.%d.%lu", (int)getpid(), upload_seq++);
    int named = 0;
    if (fd < 0) {
        if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL)
            return errno_fail("create", shown, errno);
        fd = openat(dirfd, tmp, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0) return errno_fail("create", shown, errno);
        named = 1;
    }
    long long left = len;
    static char buf[1 << 17];
    int rc = 0;
    while (len < 0 || left > 0) {
        ssize_t n;
        if (len < 0) {
            n = sendfile(fd, in, NULL, 1 << 30);
            if (n < 0 && (errno == EINVAL || errno == ENOSYS)) {
                n = read(in, buf, sizeof buf);
                if (n > 0 && write_all(fd, buf, (size_t)n)) n = -1;
            }
        } else {
            n = in_read(buf, left < (long long)sizeof buf ? (size_t)left : sizeof buf);
            if (n == 0) {
                rc = fail_op(EX_INVALID, "invalid", "the data of %s ended early", shown);
                break;
            }
            if (n > 0 && write_all(fd, buf, (size_t)n)) n = -1;
            if (n > 0) left -= n;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            rc = errno_fail("write", shown, errno);
            break;
        }
        if (n == 0) break;
    }
    if (!rc && fchmod(fd, mode & 07777) < 0) rc = errno_fail("chmod", shown, errno);
    if (!rc && !named) {
        char self[64];
        snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
        if (linkat(AT_FDCWD, self, dirfd, tmp, AT_SYMLINK_FOLLOW) < 0)
            rc = errno_fail("link", shown, errno);
        else
            named = 1;
    }
    if (!rc && renameat(dirfd, tmp, dirfd, name) < 0) rc = errno_fail("rename", shown, errno);
    if (rc && named) unlinkat(dirfd, tmp, 0);
    close(fd);
    return rc;
}

static int op_write(const struct spec *s)
{
    unsigned mode = s->mode ? (unsigned)strtoul(s->mode, NULL, 8) : 0600;
    int e = make_parents(AT_FDCWD, s->path);
    if (e == EEXIST || e == ENOTDIR)
        return fail_op(EX_NOT_DIR, "not_directory", "a parent of %s is not a directory", s->path);
    if (e) return errno_fail("mkdir", s->path, e);
    char name[4096];
    int dfd = open_parent(AT_FDCWD, s->path, name, sizeof name, 0);
    if (dfd < 0) return errno_fail("open", s->path, errno);
    if (!*name) return fail_op(EX_IS_DIR, "is_directory", "%s is a directory", s->path);
    int rc = create_file(dfd, name, 0, -1, mode, s->path);
    close(dfd);
    if (!rc) fputs("ok\n", stderr);
    return rc;
}

/* ---- pack -------------------------------------------------------------------------------------
 */

static int excluded(const struct spec *s, const char *name)
{
    for (int i = 0; i < s->excludes.n; i++)
        if (strcmp(s->excludes.v[i], name) == 0) return 1;
    return 0;
}

/* Regular files with several links: the first path packed, so later ones go as hard links. */
static linkmap links;

/* The path packed first for st's file, or NULL (then rel is recorded as that path; without
 * memory it is not, and the file is packed as a copy). */
static const char *link_seen(const struct stat *st, const char *rel)
{
    const char *first = linkmap_find(&links, st);
    if (first) return first;
    linkmap_add(&links, st, rel);
    return NULL;
}

static unsigned long long pack_bytes, pack_max;

/* The data segments of fd (size bytes): SEEK_DATA/SEEK_HOLE, at most SPARSE_SEGMENTS_MAX (the
 * last one is extended over what follows). Returns the count, 0 for a file without holes (or a
 * filesystem that cannot say). */
static size_t segments(int fd, off_t size, off_t (*seg)[2])
{
    size_t n = 0;
    off_t pos = 0;
    while (pos < size) {
        off_t d = lseek(fd, pos, SEEK_DATA);
        if (d < 0) break; /* ENXIO: only a hole is left */
        off_t h = lseek(fd, d, SEEK_HOLE);
        if (h < 0 || h > size) h = size;
        if (n == SPARSE_SEGMENTS_MAX) {
            seg[n - 1][1] = h - seg[n - 1][0];
        } else {
            seg[n][0] = d;
            seg[n][1] = h - d;
            n++;
        }
        pos = h;
    }
    return n;
}

static int copy_range(int fd, off_t off, long long len)
{
    static char buf[1 << 16];
    int e = 0;
    while (len > 0) {
        ssize_t n =
            fd >= 0 ? pread(fd, buf, len < (long long)sizeof buf ? (size_t)len : sizeof buf, off)
                    : 0;
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) { /* it shrank meanwhile: zeros keep the record's promise */
            memset(buf, 0, sizeof buf);
            n = len < (long long)sizeof buf ? (ssize_t)len : (ssize_t)sizeof buf;
        }
        if ((e = oput(buf, (size_t)n))) break;
        len -= n;
        off += n;
    }
    return e;
}

/* Writes one record for the entry `name` of dirfd (rel: its path in the packed tree; st: its
 * lstat) to the output: "H", type ('f' file, 'd', 'l' symlink with its target, 'h' a hard link
 * to the first path seen for that inode, 's' a sparse file as a segment map then only the data
 * of its segments), mode, uid, gid, mtime, size, name, target; a file's data follows, exactly
 * size bytes (a file that grew is cut, one that shrank is zero-padded). Counts data against
 * pack_max. Returns 0, an errno of the output (oput), or -EX_TOO_LARGE after fail_op reported
 * the limit. Runs inside the sandbox, confined; reads files with O_NOFOLLOW. */
static int pack_entry(int dirfd, const char *name, const char *rel, const struct stat *st)
{
    char ty[2] = {type_letter(st->st_mode), 0}, target[4096] = "";
    if (S_ISLNK(st->st_mode)) {
        ssize_t n = readlinkat(dirfd, name, target, sizeof target - 1);
        target[n > 0 ? n : 0] = 0;
    }
    int fd = -1;
    long long size = 0;
    static off_t seg[SPARSE_SEGMENTS_MAX][2];
    size_t nseg = 0;
    if (S_ISREG(st->st_mode)) {
        const char *first = st->st_nlink > 1 ? link_seen(st, rel) : NULL;
        if (first) {
            ty[0] = 'h';
            snprintf(target, sizeof target, "%s", first);
        } else {
            size = (long long)st->st_size;
            fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
            /* fewer blocks than bytes: it has holes, which cross as a map, not as zeros */
            if (fd >= 0 && (long long)st->st_blocks * 512 < size) {
                nseg = segments(fd, st->st_size, seg);
                if (nseg == 0 || nseg > 1 || seg[0][0] != 0 || seg[0][1] != st->st_size)
                    ty[0] = 's';
            }
        }
    }
    unsigned long long data = 0;
    if (ty[0] == 'f') data = (unsigned long long)size;
    for (size_t i = 0; ty[0] == 's' && i < nseg; i++)
        data += (unsigned long long)seg[i][1];
    if (pack_bytes + data > pack_max) {
        if (fd >= 0) close(fd);
        fail_op(EX_TOO_LARGE, "too_large", "the directory holds more than %llu bytes of file data",
                pack_max);
        return -EX_TOO_LARGE; /* negative: never an errno of oput */
    }
    pack_bytes += data;
    int e = oput("H", 1);
    if (!e) e = ofield(ty);
    if (!e) e = ofieldf("%o", (unsigned)(st->st_mode & 07777));
    if (!e) e = ofieldf("%u", (unsigned)st->st_uid);
    if (!e) e = ofieldf("%u", (unsigned)st->st_gid);
    if (!e) e = ofieldf("%lld", (long long)st->st_mtim.tv_sec);
    if (!e) e = ofieldf("%lld", ty[0] == 'h' ? 0LL : size);
    if (!e) e = ofield(rel);
    if (!e) e = ofield(target);
    if (!e && ty[0] == 's') {
        e = ofieldf("%zu", nseg);
        for (size_t i = 0; !e && i < nseg; i++) {
            e = ofieldf("%lld", (long long)seg[i][0]);
            if (!e) e = ofieldf("%lld", (long long)seg[i][1]);
        }
        for (size_t i = 0; !e && i < nseg; i++)
            e = copy_range(fd, seg[i][0], (long long)seg[i][1]);
    } else if (!e && ty[0] == 'f') {
        /* Exactly size bytes: a file that grew is cut, one that shrank is padded with zeros. */
        e = copy_range(fd, 0, size);
    }
    if (fd >= 0) close(fd);
    return e;
}

static int pack_dir(const struct spec *s, int dfd, const char *rel, int level)
{
    DIR *d = fdopendir(dfd);
    if (!d) {
        close(dfd);
        return 0;
    }
    struct dirent *de;
    int e = 0;
    while (!e && (de = readdir(d))) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        if (level == 0 && excluded(s, de->d_name)) continue;
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
        if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode) && !S_ISLNK(st.st_mode)) continue;
        /* a symlink of procfs may be a magic link, whose target names a file of the host */
        if (S_ISLNK(st.st_mode) && on_procfs(dirfd(d), de->d_name)) continue;
        char sub[8192];
        if ((size_t)snprintf(sub, sizeof sub, "%s%s%s", rel, *rel ? "/" : "", de->d_name) >=
            sizeof sub)
            continue;
        if ((e = pack_entry(dirfd(d), de->d_name, sub, &st))) break;
        if (S_ISDIR(st.st_mode) && level + 1 < DEPTH_MAX) {
            int fd = openat(dirfd(d), de->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (fd >= 0 && fd_on_procfs(fd)) { /* a /proc mounted below: not packed */
                close(fd);
                fd = -1;
            }
            if (fd >= 0) e = pack_dir(s, fd, sub, level + 1);
        }
    }
    closedir(d);
    return e;
}

static int op_pack(const struct spec *s)
{
    pack_max = s->max_bytes ? s->max_bytes : PACK_MAX_BYTES;
    int code, dfd = open_nomagic(s->path, O_RDONLY | O_DIRECTORY, "open", &code);
    if (dfd < 0) return code;
    if (fd_on_procfs(dfd)) {
        close(dfd);
        return fail_op(EX_DENIED, "permission_denied",
                       "%s is on /proc, whose directories hold magic links to processes' files: "
                       "it is not packed (download its files one at a time)",
                       s->path);
    }
    fputs("ok\n", stderr);
    fflush(stderr);
    int e = pack_dir(s, dfd, "", 0);
    if (e == -EX_TOO_LARGE) return EX_TOO_LARGE;
    if (e || oput("E", 1) || oflush()) return EX_IO;
    return 0;
}

/* ---- unpack -----------------------------------------------------------------------------------
 */

static int in_field(char *buf, size_t len)
{
    size_t i = 0;
    for (;;) {
        char c;
        if (in_read(&c, 1) != 1) return -1;
        if (c == 0) break;
        if (i + 1 >= len) return -1;
        buf[i++] = c;
    }
    buf[i] = 0;
    return 0;
}

/* A member name is relative, '/'-separated, with no empty, "." or ".." segment. */
static int clean_name(const char *n)
{
    if (!*n || *n == '/') return 0;
    for (const char *p = n; *p;) {
        const char *e = strchr(p, '/');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        if (l == 0 || (l == 1 && p[0] == '.') || (l == 2 && p[0] == '.' && p[1] == '.')) return 0;
        p += l;
        if (*p) p++;
        if (e && !*p) return 0;
    }
    return 1;
}

/* `files unpack --path DIR`: reads records from stdin (archive_records.c writes them from a
 * client's checked archive) and makes them under s->path, creating it and its parents. Every
 * name must be clean (relative, no "..") and every parent is opened beneath the target without
 * following symlinks (open_parent); hard links resolve only to regular files already beneath
 * it (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS); links and symlinks are made under a
 * temporary name and renamed into place. Returns 0 after "ok" on stderr, or the fail_op /
 * errno_fail status (EX_INVALID, EX_NOT_DIR, ...) with its message reported. Runs inside the
 * sandbox, confined; blocks on stdin and the file system. */
static int op_unpack(const struct spec *s)
{
    struct stat st;
    if (stat(s->path, &st) == 0 && !S_ISDIR(st.st_mode))
        return fail_op(EX_NOT_DIR, "not_directory", "%s exists and is not a directory", s->path);
    int e = make_parents(AT_FDCWD, s->path);
    if (!e && mkdir(s->path, 0755) < 0 && errno != EEXIST) e = errno;
    if (e) return errno_fail("mkdir", s->path, e);
    int top = open(s->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (top < 0) return errno_fail("open", s->path, errno);
    for (;;) {
        char tag;
        if (in_read(&tag, 1) != 1)
            return fail_op(EX_INVALID, "invalid", "the records ended without an end mark");
        if (tag == 'E') break;
        if (tag != 'H') return fail_op(EX_INVALID, "invalid", "bad record tag");
        char type[4], mode[16], uid[16], gid[16], mtime[32], size[32], name[8192], target[4096];
        if (in_field(type, sizeof type) || in_field(mode, sizeof mode) ||
            in_field(uid, sizeof uid) || in_field(gid, sizeof gid) ||
            in_field(mtime, sizeof mtime) || in_field(size, sizeof size) ||
            in_field(name, sizeof name) || in_field(target, sizeof target))
            return fail_op(EX_INVALID, "invalid", "a malformed record");
        if (!clean_name(name))
            return fail_op(EX_INVALID, "invalid", "unsafe member name '%s'", name);
        unsigned m = (unsigned)strtoul(mode, NULL, 8) & 07777;
        long long sz = strtoll(size, NULL, 10);
        char leaf[4096];
        e = make_parents(top, name);
        if (e)
            return fail_op(EX_NOT_DIR, "not_directory", "cannot create the parents of %s: %s", name,
                           strerror(e));
        int dfd = open_parent(top, name, leaf, sizeof leaf, 1);
        if (dfd < 0)
            return fail_op(EX_INVALID, "invalid", "the parent of %s leaves the target: %s", name,
                           strerror(errno));
        int rc = 0;
        if (type[0] == 'f') {
            rc = create_file(dfd, leaf, 0, sz, m, name);
        } else if (type[0] == 'd') {
            if (mkdirat(dfd, leaf, m) < 0 && errno != EEXIST)
                rc = errno_fail("mkdir", name, errno);
            else if (fchmodat(dfd, leaf, m, 0) < 0)
                rc = errno_fail("chmod", name, errno);
        } else if (type[0] == 'h') {
            /* a hard link to a file an earlier record made, resolved beneath the target */
            if (!clean_name(target)) {
                rc = fail_op(EX_INVALID, "invalid", "unsafe hard link target '%s'", target);
            } else if (strcmp(target, name) != 0) {
                char tleaf[4096], tmp[64];
                struct open_how how = {.flags = O_PATH | O_CLOEXEC,
                                       .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
                                                  RESOLVE_NO_MAGICLINKS};
                int tdfd = open_parent(top, target, tleaf, sizeof tleaf, 1);
                int tfd = tdfd >= 0 ? (int)syscall(SYS_openat2, tdfd, tleaf, &how, sizeof how) : -1;
                struct stat tst;
                snprintf(tmp, sizeof tmp, ".moonbox-link.%d.%lu", (int)getpid(), upload_seq++);
                if (tfd < 0 || fstat(tfd, &tst) < 0 || !S_ISREG(tst.st_mode))
                    rc = fail_op(EX_INVALID, "invalid",
                                 "hard link %s names %s, which is not a file", name, target);
                else if (linkat(tdfd, tleaf, dfd, tmp, 0) < 0)
                    rc = errno_fail("link", name, errno);
                else if (renameat(dfd, tmp, dfd, leaf) < 0) {
                    rc = errno_fail("rename", name, errno);
                    unlinkat(dfd, tmp, 0);
                }
                if (tfd >= 0) close(tfd);
                if (tdfd >= 0) close(tdfd);
            }
        } else if (type[0] == 'l') {
            char tmp[64];
            snprintf(tmp, sizeof tmp, ".moonbox-link.%d.%lu", (int)getpid(), upload_seq++);
            if (symlinkat(target, dfd, tmp) < 0)
                rc = errno_fail("symlink", name, errno);
            else if (renameat(dfd, tmp, dfd, leaf) < 0) {
                rc = errno_fail("rename", name, errno);
                unlinkat(dfd, tmp, 0);
            }
        } else {
            rc = fail_op(EX_INVALID, "invalid", "unknown member type '%s'", type);
        }
        if (!rc) {
            struct timespec ts[2] = {{.tv_sec = strtoll(mtime, NULL, 10)},
                                     {.tv_sec = strtoll(mtime, NULL, 10)}};
            utimensat(dfd, leaf, ts, AT_SYMLINK_NOFOLLOW);
        }
        close(dfd);
        if (rc) return rc;
    }
    fputs("ok\n", stderr);
    return 0;
}

int fileops_run(const struct spec *s)
{
    if (!s->op || !s->path || !*s->path)
        return fail_op(EX_INVALID, "invalid", "files needs --op and --path");
    if (strcmp(s->op, "stat") == 0) return op_stat(s);
    if (strcmp(s->op, "list") == 0) return op_list(s);
    if (strcmp(s->op, "read") == 0) return op_read(s);
    if (strcmp(s->op, "write") == 0) return op_write(s);
    if (strcmp(s->op, "pack") == 0) return op_pack(s);
    if (strcmp(s->op, "unpack") == 0) return op_unpack(s);
    return fail_op(EX_INVALID, "invalid", "unknown operation '%s'", s->op);
}
