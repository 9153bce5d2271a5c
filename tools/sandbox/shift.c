/*
 * shift.c — `moonbox-sandbox capture --src=UPPER --dst=LAYER --uid-base=N`: copies a frozen
 * sandbox's upper layer into a new snapshot layer with ids made 0-based.
 *
 * A sandbox writes its upper layer with host ids of its own range (base + n); snapshot layers
 * are stored 0-based, like the base image, so that any later sandbox can stack them through an
 * idmapped mount of its own range. Ids are shifted: base + n -> n; 0 stays 0 (overlayfs makes
 * whiteouts and its work files as the mounter, host root); any other id -> 65534 (nobody).
 * File capabilities (security.capability, v3) have their root id shifted the same way; POSIX
 * ACLs name ids too and are not copied (said in docs/local-isolation.md).
 *
 * Runs on the host as root over a directory the sandbox filled, so it trusts nothing in it:
 * every step is relative to an open directory fd, never follows a symlink (O_NOFOLLOW,
 * AT_SYMLINK_NOFOLLOW), stays on the source filesystem, and bounds its depth. The copy goes to
 * LAYER.partial and is renamed to LAYER at the end, so a layer either does not exist or is
 * complete. Regular files are cloned when the filesystem can (FICLONE), else their data ranges
 * are copied with copy_file_range, holes kept. Hard links within the layer stay hard links. Prints
 * the bytes of file data copied. The alternative, cp -a followed by a chown walk, reads the tree
 * twice and clears setuid bits that must then be restored.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "linkmap.h"
#include "manifest.h"
#include "sandbox.h"

#define CAPTURE_DEPTH_MAX 512
/* Memory the hard-link table may take before it spills to files beside the layer (linkmap.h). */
#define CAPTURE_LINKS_MEM_MAX (32u << 20)

static unsigned long g_base;
static dev_t g_dev;
static unsigned long long g_bytes;

static linkmap links; /* paths relative to the destination root ("/a/b") */

/* The helper's peak memory on stderr ("maxrss=KIB"), for the specs that bound it. */
static void report_maxrss(void)
{
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0) fprintf(stderr, "maxrss=%ld\n", ru.ru_maxrss);
}

static unsigned shift_id(unsigned id)
{
    if (id >= g_base && id - g_base < SANDBOX_ID_RANGE) return id - (unsigned)g_base;
    if (id == 0) return 0;
    return 65534;
}

/* Copies extended attributes, shifting a v3 file capability's root id. */
static void copy_xattrs(int sfd, const char *sname, int dfd, const char *dname, const char *rel)
{
    /* An O_PATH-free way to read xattrs of a symlink: via its directory and name (a name may be
     * NAME_MAX bytes long: each path has room for it). */
    char names[65536], proc_s[64 + 4096];
    snprintf(proc_s, sizeof proc_s, "/proc/self/fd/%d/%s", sfd, sname);
    char dpath[64 + 4096];
    snprintf(dpath, sizeof dpath, "/proc/self/fd/%d/%s", dfd, dname);
    ssize_t len = llistxattr(proc_s, names, sizeof names);
    if (len < 0 && errno != EOPNOTSUPP) die("capture: listing the attributes of", rel, errno);
    if (len <= 0) return;
    for (char *n = names; n < names + len; n += strlen(n) + 1) {
        if (strncmp(n, "system.posix_acl", 16) == 0) continue;
        unsigned char val[65536];
        ssize_t vl = lgetxattr(proc_s, n, val, sizeof val);
        if (vl < 0) die("capture: reading an attribute of", rel, errno);
        if (strcmp(n, "security.capability") == 0 && vl == 24) {
            uint32_t rootid;
            memcpy(&rootid, val + 20, 4);
            rootid = shift_id(rootid);
            memcpy(val + 20, &rootid, 4);
        }
        if (lsetxattr(dpath, n, val, (size_t)vl, 0) < 0) {
            if (errno != EOPNOTSUPP) die("capture: keeping an attribute of", rel, errno);
            fprintf(stderr,
                    "moonbox-sandbox: capture: the layers' filesystem cannot keep attribute "
                    "%s of %s: %s\n",
                    n, rel, strerror(errno));
        }
    }
}

/* The copy's owner, mode, extended attributes and times, in that order: a chown clears the
 * setuid and setgid bits and the file capability (security.capability), so the mode and the
 * attributes go after it. */
static void finish(int sdir, int dfd, const char *name, const struct stat *st, const char *rel)
{
    if (fchownat(dfd, name, shift_id(st->st_uid), shift_id(st->st_gid), AT_SYMLINK_NOFOLLOW) < 0)
        die("capture: chown", rel, errno);
    if (!S_ISLNK(st->st_mode) && fchmodat(dfd, name, st->st_mode & 07777, 0) < 0)
        die("capture: chmod", rel, errno);
    copy_xattrs(sdir, name, dfd, name, rel);
    struct timespec ts[2] = {st->st_atim, st->st_mtim};
    utimensat(dfd, name, ts, AT_SYMLINK_NOFOLLOW);
}

/* Copies one byte range with pread and pwrite, through a buffer: where copy_file_range cannot
 * (the sandbox disk and the layers are different filesystems: EXDEV). */
static void copy_range_rw(int sfd, int dfd, off_t off, off_t len, const char *rel)
{
    static char buf[1 << 16];
    while (len > 0) {
        ssize_t n = pread(sfd, buf, len < (off_t)sizeof buf ? (size_t)len : sizeof buf, off);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) die("capture: reading", rel, errno);
        if (n == 0) break;
        for (ssize_t done = 0; done < n;) {
            ssize_t w = pwrite(dfd, buf + done, (size_t)(n - done), off + done);
            if (w < 0 && errno == EINTR) continue;
            if (w < 0) die("capture: writing", rel, errno);
            done += w;
        }
        off += n;
        len -= n;
        g_bytes += (unsigned long long)n;
    }
}

/* Copies one byte range with copy_file_range (in-kernel; reflinks where the filesystem can),
 * else (another filesystem) through a buffer. */
static void copy_range(int sfd, int dfd, off_t off, off_t len, const char *rel)
{
    static int no_cfr;
    loff_t in = off, out = off;
    while (len > 0) {
        if (no_cfr) {
            copy_range_rw(sfd, dfd, in, len, rel);
            return;
        }
        ssize_t n = copy_file_range(sfd, &in, dfd, &out, (size_t)len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 &&
            (errno == EXDEV || errno == EOPNOTSUPP || errno == ENOSYS || errno == EINVAL)) {
            no_cfr = 1;
            continue;
        }
        if (n < 0) die("capture: copying", rel, errno);
        if (n == 0) break; /* it shrank: the sandbox is frozen, so only by our own race */
        len -= n;
        g_bytes += (unsigned long long)n;
    }
}

/* Copies a file's data keeping its holes: only the ranges SEEK_DATA finds are copied and the
 * size is set with ftruncate, so a sparse file stays sparse (copying the zeros of a 4 GiB hole
 * would write 4 GiB to the host). A whole-file clone (FICLONE) keeps holes by itself. */
static void copy_data(int sfd, int dfd, const struct stat *st, const char *rel)
{
    if (ioctl(dfd, FICLONE, sfd) == 0) {
        g_bytes += (unsigned long long)st->st_blocks * 512;
        return;
    }
    off_t pos = 0;
    while (pos < st->st_size) {
        off_t d = lseek(sfd, pos, SEEK_DATA);
        if (d < 0) {
            if (errno == ENXIO) break; /* only a hole is left */
            d = pos;                   /* no SEEK_DATA here: copy the rest as it is */
        }
        off_t h = lseek(sfd, d, SEEK_HOLE);
        if (h < 0 || h > st->st_size) h = st->st_size;
        copy_range(sfd, dfd, d, h - d, rel);
        pos = h;
    }
    if (ftruncate(dfd, st->st_size) < 0) die("capture: setting the size of", rel, errno);
}

static int g_dst_root;

/* Copies the directory open on sdir into the one open on ddir (rel: its path, for messages),
 * for a snapshot capture: only entries on the captured filesystem (g_dev; whatever is mounted
 * below is skipped), nothing followed (O_NOFOLLOW, AT_SYMLINK_NOFOLLOW), directories recursively
 * up to CAPTURE_DEPTH_MAX, regular files by content with hard links kept as links, symlinks as
 * they are, overlay whiteouts and fifos recreated, sockets and devices dropped; xattrs copied and
 * owners shifted back out of the sandbox's id range (finish). Any failure die()s naming the
 * step and the path: a capture is all or nothing. */
static void copy_tree(int sdir, int ddir, const char *rel, int depth)
{
    if (depth > CAPTURE_DEPTH_MAX)
        fail_msg("capture", "%s is nested deeper than %d levels", rel, CAPTURE_DEPTH_MAX);
    DIR *d = fdopendir(dup(sdir));
    if (!d) die("capture: reading", rel, errno);
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *n = de->d_name;
        if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0) continue;
        char sub[8192];
        snprintf(sub, sizeof sub, "%s/%s", rel, n);
        struct stat st;
        if (fstatat(sdir, n, &st, AT_SYMLINK_NOFOLLOW) < 0) die("capture: stat", sub, errno);
        if (st.st_dev != g_dev) continue; /* not ours: another filesystem mounted below */
        if (S_ISDIR(st.st_mode)) {
            if (mkdirat(ddir, n, 0700) < 0) die("capture: mkdir", sub, errno);
            int s2 = openat(sdir, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            int d2 = openat(ddir, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            if (s2 < 0 || d2 < 0) die("capture: open", sub, errno);
            copy_tree(s2, d2, sub, depth + 1);
            close(s2);
            close(d2);
            finish(sdir, ddir, n, &st, sub);
        } else if (S_ISREG(st.st_mode)) {
            if (st.st_nlink > 1) {
                const unsigned char *prev;
                size_t pl;
                int seen = linkmap_get(&links, st.st_dev, st.st_ino, &prev, &pl);
                if (seen < 0) die("capture: the link table, at", sub, errno);
                if (seen) {
                    if (linkat(g_dst_root, (const char *)prev + 1, ddir, n, 0) < 0)
                        die("capture: link", sub, errno);
                    continue;
                }
            }
            int sfd = openat(sdir, n, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
            if (sfd < 0) die("capture: open", sub, errno);
            int dfd = openat(ddir, n, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
            if (dfd < 0) die("capture: create", sub, errno);
            copy_data(sfd, dfd, &st, sub);
            close(sfd);
            close(dfd);
            finish(sdir, ddir, n, &st, sub);
            if (st.st_nlink > 1 && linkmap_put(&links, st.st_dev, st.st_ino, sub, strlen(sub)) < 0)
                die("capture: the link table, at", sub, errno);
        } else if (S_ISLNK(st.st_mode)) {
            char target[4096];
            ssize_t l = readlinkat(sdir, n, target, sizeof target - 1);
            if (l < 0) die("capture: readlink", sub, errno);
            target[l] = 0;
            if (symlinkat(target, ddir, n) < 0) die("capture: symlink", sub, errno);
            finish(sdir, ddir, n, &st, sub);
        } else if (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISBLK(st.st_mode)) {
            /* Whiteouts are character devices 0/0; fifos are kept; a sandbox cannot make other
             * device nodes, so any other one is dropped rather than created on the host. */
            int whiteout = S_ISCHR(st.st_mode) && major(st.st_rdev) == 0 && minor(st.st_rdev) == 0;
            if (!whiteout && !S_ISFIFO(st.st_mode)) continue;
            if (mknodat(ddir, n, st.st_mode & (S_IFMT | 07777), st.st_rdev) < 0)
                die("capture: mknod", sub, errno);
            finish(sdir, ddir, n, &st, sub);
        }
        /* sockets are not kept: nothing can connect to a socket file of a stopped process */
    }
    closedir(d);
}

/* The directory part of path (".", "/" or a copy of what precedes its last slash) and its last
 * name. */
static char *split_path(const char *path, const char **base)
{
    const char *slash = strrchr(path, '/');
    *base = slash ? slash + 1 : path;
    if (!slash) return strdup(".");
    if (slash == path) return strdup("/");
    return strndup(path, (size_t)(slash - path));
}

int cmd_capture(struct spec *s)
{
    /* The helper dies with the backend: a killed server never leaves a capture writing. */
    pid_t backend = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0)
        die("capture: setting the parent-death signal", NULL, errno);
    if (getppid() != backend) return EXIT_HELPER;
    if (!s->src || !s->dst || !s->uid_base)
        fail_msg("arguments", "capture needs --src --dst --uid-base");
    g_base = s->uid_base;
    const char *base;
    char *parent = split_path(s->dst, &base);
    if (!parent || !*base)
        fail_msg("arguments", "--dst wants a path to a new directory, got '%s'", s->dst);
    char partial[4096], manifest[4096];
    snprintf(partial, sizeof partial, "%s.partial", base);
    snprintf(manifest, sizeof manifest, "%s.manifest", base);
    int pfd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (pfd < 0) die("capture: open", parent, errno);
    if (faccessat(pfd, base, F_OK, AT_SYMLINK_NOFOLLOW) == 0)
        fail_msg("capture", "%s already exists", s->dst);
    /* A manifest left by an earlier capture of this name would vouch for a layer it never saw. */
    if (unlinkat(pfd, manifest, 0) < 0 && errno != ENOENT)
        die("capture: removing the old manifest of", s->dst, errno);
    int sfd = open(s->src, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sfd < 0) die("capture: open", s->src, errno);
    struct stat st;
    if (fstat(sfd, &st) < 0) die("capture: stat", s->src, errno);
    g_dev = st.st_dev;
    if (mkdirat(pfd, partial, 0700) < 0) die("capture: mkdir", partial, errno);
    int dfd = openat(pfd, partial, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) die("capture: open", partial, errno);
    g_dst_root = dfd;
    linkmap_init(&links, CAPTURE_LINKS_MEM_MAX, pfd);
    copy_tree(sfd, dfd, "", 0);
    linkmap_free(&links);
    if (fchown(dfd, shift_id(st.st_uid), shift_id(st.st_gid)) < 0 ||
        fchmod(dfd, st.st_mode & 07777) < 0)
        die("capture: the layer's root", partial, errno);
    copy_xattrs(sfd, ".", dfd, ".", "/");
    close(sfd);
    /* Durable before it is summed up: one syncfs of the layers' filesystem writes back every
     * file and directory of the copy (and whatever else is dirty there) in one pass, where an
     * fsync per file would commit the journal once per file. Since Linux 5.8 it reports
     * write-back errors of that filesystem, which is all a capture needs to know. */
    if (syncfs(dfd) < 0) die("capture: syncing the layer", s->dst, errno);
    /* The manifest is what was written, read back from the layer, not what was meant. */
    struct manifest m;
    struct manifest_error me;
    if (manifest_compute(dfd, 1, pfd, &m, &me) < 0)
        fail_msg("capture", "reading back the layer: %s %s: %s", me.step, me.path,
                 strerror(me.err));
    close(dfd);
    if (renameat(pfd, partial, pfd, base) < 0) die("capture: rename", s->dst, errno);
    int e = manifest_write(pfd, manifest, &m);
    if (e) die("capture: writing the manifest of", s->dst, e);
    close(pfd);
    char tree[2 * SHA256_BYTES + 1];
    sha256_hex(m.tree, tree);
    printf("files=%llu bytes=%llu tree=%s\n", m.files, m.bytes, tree);
    report_maxrss();
    free(parent);
    return 0;
}

/* verify's exits: 0 the layer matches, 1 it does not (or its manifest is missing or damaged),
 * 2 it could not be checked (usage, I/O). */
static void __attribute__((noreturn, format(printf, 2, 3)))
verify_exit(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    say("moonbox-sandbox: verify: ", fmt, ap);
    va_end(ap);
    exit(code);
}

int cmd_verify(struct spec *s)
{
    if (s->layers.n != 1 || !s->manifest)
        verify_exit(2, "usage: moonbox-sandbox verify --layer=LAYER --manifest=FILE [--quick]");
    const char *layer = s->layers.v[0];
    char text[1024];
    int mfd = open(s->manifest, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (mfd < 0 && errno == ENOENT) verify_exit(1, "the layer has no manifest");
    if (mfd < 0) verify_exit(2, "reading the manifest: %s", strerror(errno));
    size_t len = 0;
    for (;;) {
        ssize_t n = read(mfd, text + len, sizeof text - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) verify_exit(2, "reading the manifest: %s", strerror(errno));
        if (n == 0 || (len += (size_t)n) == sizeof text - 1) break;
    }
    close(mfd);
    text[len] = 0;
    struct manifest want, got;
    const char *why;
    if (strlen(text) != len || manifest_parse(text, &want, &why) < 0)
        verify_exit(1, "the manifest is damaged: %s", strlen(text) != len ? "it holds a NUL" : why);
    const char *base;
    char *parent = split_path(layer, &base);
    if (!parent || !*base) verify_exit(2, "--layer wants a directory, got '%s'", layer);
    int pfd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (pfd < 0) verify_exit(2, "opening the layer's directory: %s", strerror(errno));
    int dfd = openat(pfd, base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0 && errno == ENOENT) verify_exit(1, "the layer is missing");
    if (dfd < 0) verify_exit(2, "opening the layer: %s", strerror(errno));
    struct manifest_error me;
    if (manifest_compute(dfd, !s->quick, pfd, &got, &me) < 0)
        verify_exit(2, "%s %s: %s", me.step, me.path, strerror(me.err));
    if (got.files != want.files)
        verify_exit(1, "the layer has %llu entries, its manifest says %llu", got.files, want.files);
    if (got.bytes != want.bytes)
        verify_exit(1, "the layer's files hold %llu bytes, its manifest says %llu", got.bytes,
                    want.bytes);
    if (memcmp(got.meta, want.meta, SHA256_BYTES) != 0)
        verify_exit(1, "the layer's names, types, owners, modes or attributes differ from its "
                       "manifest (meta checksum)");
    if (!s->quick && memcmp(got.tree, want.tree, SHA256_BYTES) != 0)
        verify_exit(1,
                    "the contents of the layer's files differ from its manifest (tree checksum)");
    printf("ok files=%llu bytes=%llu\n", got.files, got.bytes);
    free(parent);
    return 0;
}
