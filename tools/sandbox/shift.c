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
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include "linkmap.h"
#include "sandbox.h"

#define CAPTURE_DEPTH_MAX 512

static unsigned long g_base;
static dev_t g_dev;
static unsigned long long g_bytes;

static linkmap links; /* paths relative to the destination root */

static unsigned shift_id(unsigned id)
{
    if (id >= g_base && id - g_base < SANDBOX_ID_RANGE) return id - (unsigned)g_base;
    if (id == 0) return 0;
    return 65534;
}

/* Copies extended attributes, shifting a v3 file capability's root id. */
static void copy_xattrs(int sfd, const char *sname, int dfd, const char *dname, const char *rel)
{
    char names[65536], proc_s[64];
    /* An O_PATH-free way to read xattrs of a symlink: via its directory and name. */
    snprintf(proc_s, sizeof proc_s, "/proc/self/fd/%d/%s", sfd, sname);
    char dpath[64 + 4096];
    snprintf(dpath, sizeof dpath, "/proc/self/fd/%d/%s", dfd, dname);
    ssize_t len = llistxattr(proc_s, names, sizeof names);
    if (len <= 0) return;
    for (char *n = names; n < names + len; n += strlen(n) + 1) {
        if (strncmp(n, "system.posix_acl", 16) == 0) continue;
        unsigned char val[65536];
        ssize_t vl = lgetxattr(proc_s, n, val, sizeof val);
        if (vl < 0) continue;
        if (strcmp(n, "security.capability") == 0 && vl == 24) {
            uint32_t rootid;
            memcpy(&rootid, val + 20, 4);
            rootid = shift_id(rootid);
            memcpy(val + 20, &rootid, 4);
        }
        if (lsetxattr(dpath, n, val, (size_t)vl, 0) < 0 && errno != EOPNOTSUPP)
            fprintf(stderr, "moonbox-sandbox: capture: keeping attribute %s of %s: %s\n", n, rel,
                    strerror(errno));
    }
}

static void finish(int dfd, const char *name, const struct stat *st, const char *rel)
{
    if (fchownat(dfd, name, shift_id(st->st_uid), shift_id(st->st_gid), AT_SYMLINK_NOFOLLOW) < 0)
        die("capture: chown", rel, errno);
    if (!S_ISLNK(st->st_mode) && fchmodat(dfd, name, st->st_mode & 07777, 0) < 0)
        die("capture: chmod", rel, errno);
    struct timespec ts[2] = {st->st_atim, st->st_mtim};
    utimensat(dfd, name, ts, AT_SYMLINK_NOFOLLOW);
}

/* Copies one byte range with copy_file_range (in-kernel; reflinks where the filesystem can). */
static void copy_range(int sfd, int dfd, off_t off, off_t len, const char *rel)
{
    loff_t in = off, out = off;
    while (len > 0) {
        ssize_t n = copy_file_range(sfd, &in, dfd, &out, (size_t)len, 0);
        if (n < 0 && errno == EINTR) continue;
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
            copy_xattrs(sdir, n, ddir, n, sub);
            finish(ddir, n, &st, sub);
        } else if (S_ISREG(st.st_mode)) {
            const char *prev = st.st_nlink > 1 ? linkmap_find(&links, &st) : NULL;
            if (prev) {
                if (linkat(g_dst_root, prev + 1, ddir, n, 0) < 0) die("capture: link", sub, errno);
                continue;
            }
            int sfd = openat(sdir, n, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
            if (sfd < 0) die("capture: open", sub, errno);
            int dfd = openat(ddir, n, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
            if (dfd < 0) die("capture: create", sub, errno);
            copy_data(sfd, dfd, &st, sub);
            close(sfd);
            close(dfd);
            copy_xattrs(sdir, n, ddir, n, sub);
            finish(ddir, n, &st, sub);
            if (st.st_nlink > 1 && linkmap_add(&links, &st, sub) != 0) die("capture", NULL, ENOMEM);
        } else if (S_ISLNK(st.st_mode)) {
            char target[4096];
            ssize_t l = readlinkat(sdir, n, target, sizeof target - 1);
            if (l < 0) die("capture: readlink", sub, errno);
            target[l] = 0;
            if (symlinkat(target, ddir, n) < 0) die("capture: symlink", sub, errno);
            copy_xattrs(sdir, n, ddir, n, sub);
            finish(ddir, n, &st, sub);
        } else if (S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISBLK(st.st_mode)) {
            /* Whiteouts are character devices 0/0; fifos are kept; a sandbox cannot make other
             * device nodes, so any other one is dropped rather than created on the host. */
            int whiteout = S_ISCHR(st.st_mode) && major(st.st_rdev) == 0 && minor(st.st_rdev) == 0;
            if (!whiteout && !S_ISFIFO(st.st_mode)) continue;
            if (mknodat(ddir, n, st.st_mode & (S_IFMT | 07777), st.st_rdev) < 0)
                die("capture: mknod", sub, errno);
            copy_xattrs(sdir, n, ddir, n, sub);
            finish(ddir, n, &st, sub);
        }
        /* sockets are not kept: nothing can connect to a socket file of a stopped process */
    }
    closedir(d);
}

int cmd_capture(struct spec *s)
{
    if (!s->src || !s->dst || !s->uid_base)
        fail_msg("arguments", "capture needs --src --dst --uid-base");
    g_base = s->uid_base;
    char partial[4096];
    snprintf(partial, sizeof partial, "%s.partial", s->dst);
    if (access(s->dst, F_OK) == 0) fail_msg("capture", "%s already exists", s->dst);
    int sfd = open(s->src, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sfd < 0) die("capture: open", s->src, errno);
    struct stat st;
    if (fstat(sfd, &st) < 0) die("capture: stat", s->src, errno);
    g_dev = st.st_dev;
    if (mkdir(partial, 0700) < 0) die("capture: mkdir", partial, errno);
    int dfd = open(partial, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) die("capture: open", partial, errno);
    g_dst_root = dfd;
    copy_tree(sfd, dfd, "", 0);
    if (fchown(dfd, shift_id(st.st_uid), shift_id(st.st_gid)) < 0 ||
        fchmod(dfd, st.st_mode & 07777) < 0)
        die("capture: the layer's root", partial, errno);
    copy_xattrs(sfd, ".", dfd, ".", "/");
    close(sfd);
    close(dfd);
    if (rename(partial, s->dst) < 0) die("capture: rename", s->dst, errno);
    printf("%llu\n", g_bytes);
    return 0;
}
