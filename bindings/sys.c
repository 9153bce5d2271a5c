/*
 * sys.c — module moonbox.sys: host chores of `moonbox local` done by system calls instead of by
 * starting mkdir, mount, umount, kill, ls and rm processes (on a paravirtualized VM a fork and
 * exec costs milliseconds of CPU; a syscall microseconds).
 *
 * Two kinds of calls. The inline ones (mkdir_p, mount_overlay, kill, listdir, try_lock) run on
 * the loop thread: each is a handful of metadata syscalls on local filesystems or procfs and
 * cannot wait for disk writeback or for another process; the comment above each says why. The
 * slow ones (unmounting a writable overlay syncs its upper filesystem; removing a sandbox's
 * upper directory is unbounded) run on a worker thread (runtime/worker_job.c, the primitive the
 * archive jobs use too) and park the calling task until its ev_async completion wakes it; the
 * work itself is runtime/host_fs.c's. This file only translates arguments and results.
 * Failures raise structured errors (op "sys.<fn>") naming the path or pid and the errno text;
 * err.errno holds the number. Misuse (wrong argument types) raises a plain error.
 */
#include "mb.h"

#include "host_fs.h"
#include "worker_job.h"

#include <errno.h>
#include <dirent.h>
#include <endian.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <linux/btrfs.h>

#define CALL_MT "moonbox.sys.Call"
#define LOCK_MT "moonbox.sys.Lock"

/* A stable code name for an errno, for err.code. */
static const char *errno_code(int e)
{
    switch (e) {
    case ENOENT:
        return "not_found";
    case EEXIST:
        return "exists";
    case ENOTDIR:
        return "not_directory";
    case EACCES:
    case EPERM:
        return "permission_denied";
    case EBUSY:
        return "busy";
    case EINVAL:
        return "invalid";
    case ESRCH:
        return "no_such_process";
    case ENOTEMPTY:
        return "not_empty";
    default:
        return "io_error";
    }
}

/* Raises a structured error for errno e: op, message "<what>: <strerror>", err.errno and,
 * when path is given, err.path. Never returns. */
static int raise_errno(lua_State *L, const char *op, int e, const char *path, const char *fmt, ...)
{
    char what[PATH_MAX + 256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    mb_error_new(L, op, errno_code(e), "%s: %s", what, strerror(e));
    mb_setfield_int(L, -1, "errno", e);
    mb_setfield_str(L, -1, "path", path);
    return lua_error(L);
}

/* ---- mkdir_p -------------------------------------------------------------------------------- */

/* sys.mkdir_p(path[, mode]) -> true. Creates the directory path (absolute) and its missing
 * parents, like `mkdir -p -m MODE`; mode (an integer, default 0755) applies to path itself
 * when it is created. Raises (op "sys.mkdir_p") not_directory when path or a parent is a file,
 * permission_denied, ... with err.path the prefix that failed. Inline: a few mkdir/stat calls
 * on a local filesystem or cgroupfs (metadata only, journalled asynchronously). Does not
 * yield. */
static int l_mkdir_p(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    lua_Integer mode = luaL_optinteger(L, 2, 0755);
    if (path[0] != '/') return luaL_error(L, "sys.mkdir_p: path must be absolute, got '%s'", path);
    char buf[PATH_MAX];
    if (strlen(path) >= sizeof buf)
        return raise_errno(L, "sys.mkdir_p", ENAMETOOLONG, path, "cannot create %s", path);
    strcpy(buf, path);
    int e = host_fs_mkdir_p(buf, (mode_t)(mode & 07777));
    if (e != 0) {
        if (strcmp(buf, path) == 0)
            return raise_errno(L, "sys.mkdir_p", e, path, "cannot create directory %s", path);
        return raise_errno(L, "sys.mkdir_p", e, buf, "cannot create directory %s (at %s)", path,
                           buf);
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* ---- mount_overlay -------------------------------------------------------------------------- */

/* sys.mount_overlay(lowers, upper, work, target[, opts]) -> true. Mounts an overlay filesystem
 * at target: lowers is a table of directories, topmost first (or one "a:b" string); upper and
 * work its upper and work directories. The options always include index=off, redirect_dir=off
 * and metacopy=off (an upper directory stays self-contained and reusable as a lower layer).
 * opts.readonly mounts it read-only; opts.source names the mount (default "moonbox"). Raises
 * (op "sys.mount_overlay") too_long when the options exceed a page (too many layers), and the
 * kernel's errno otherwise, naming target. Inline: an overlay mount looks up a few directories
 * that were just used (in the dentry cache) and creates work/work; no data is written back. */
static int l_mount_overlay(lua_State *L)
{
    const char *upper = luaL_checkstring(L, 2);
    const char *work = luaL_checkstring(L, 3);
    const char *target = luaL_checkstring(L, 4);
    int readonly = 0;
    const char *source = "moonbox";
    if (!lua_isnoneornil(L, 5)) {
        luaL_checktype(L, 5, LUA_TTABLE);
        lua_getfield(L, 5, "readonly");
        readonly = lua_toboolean(L, -1);
        lua_getfield(L, 5, "source");
        if (lua_isstring(L, -1)) source = lua_tostring(L, -1);
        lua_pop(L, 2); /* source stays referenced by opts */
    }
    if (lua_type(L, 1) != LUA_TTABLE) luaL_checkstring(L, 1);
    lua_settop(L, 5);
    const char *one[1];
    const char **lowers = one;
    size_t n = 1;
    if (lua_type(L, 1) == LUA_TTABLE) {
        lua_Integer len = luaL_len(L, 1);
        if (len < 1) return luaL_error(L, "sys.mount_overlay: lowers is empty");
        n = (size_t)len;
        lowers = (const char **)lua_newuserdatauv(L, n * sizeof *lowers, 0); /* slot 6 */
        for (lua_Integer i = 1; i <= len; i++) {
            lua_rawgeti(L, 1, i);
            const char *l = lua_tostring(L, -1);
            if (!l) return luaL_error(L, "sys.mount_overlay: lowers[%d] is not a string", (int)i);
            lua_pop(L, 1); /* the table keeps it alive */
            lowers[i - 1] = l;
        }
    } else {
        one[0] = lua_tostring(L, 1);
    }
    char data[HOST_FS_MOUNT_OPTIONS_MAX];
    size_t len = host_fs_overlay_options(data, sizeof data, lowers, n, upper, work);
    if (len >= sizeof data) {
        mb_error_new(L, "sys.mount_overlay", "too_long",
                     "cannot mount an overlay at %s: its options are %d bytes, more than the "
                     "kernel's page (too many or too long layer paths)",
                     target, (int)len);
        mb_setfield_str(L, -1, "path", target);
        return lua_error(L);
    }
    int e = host_fs_mount_overlay(source, target, readonly, data);
    if (e)
        return raise_errno(L, "sys.mount_overlay", e, target, "cannot mount an overlay at %s (%s)",
                           target, data);
    lua_pushboolean(L, 1);
    return 1;
}

/* ---- kill ----------------------------------------------------------------------------------- */

/* sys.kill(pid, sig) -> true. Sends signal number sig to pid (a negative pid: that process
 * group), for processes moonbox did not spawn itself (a sandbox's init, an exec's group inside
 * the sandbox). Raises (op "sys.kill") no_such_process when nothing has that pid,
 * permission_denied, naming the pid (err.pid). Inline: one kill(2). Does not yield. */
static int l_kill(lua_State *L)
{
    lua_Integer pid = luaL_checkinteger(L, 1);
    lua_Integer sig = luaL_checkinteger(L, 2);
    if (pid == 0 || pid == -1 || pid > INT_MAX || pid < -INT_MAX)
        return luaL_error(L, "sys.kill: refusing pid %d", (int)pid);
    if (sig < 0 || sig > 64) return luaL_error(L, "sys.kill: signal %d out of range", (int)sig);
    if (kill((pid_t)pid, (int)sig) != 0) {
        int e = errno;
        mb_error_new(L, "sys.kill", errno_code(e), "cannot send signal %d to %s %d: %s", (int)sig,
                     pid < 0 ? "process group" : "pid", (int)(pid < 0 ? -pid : pid), strerror(e));
        mb_setfield_int(L, -1, "errno", e);
        mb_setfield_int(L, -1, "pid", pid);
        return lua_error(L);
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* ---- file locks ---------------------------------------------------------------------------- */

/* A held flock(2) lock: the open descriptor is the lock, so closing it (unlock, `<close>`, __gc,
 * or the end of the process — also a SIGKILL) releases it. */
typedef struct sys_lock {
    int fd; /* -1 once unlocked */
} sys_lock;

/* sys.try_lock(path, "shared"|"exclusive") -> Lock, or nil when another open file holds a
 * conflicting lock. Opens (creating, 0600) the file at path and takes an advisory flock(2)
 * lock on it without waiting. Shared locks coexist; an exclusive one excludes every other,
 * also another of this process (each call opens its own descriptor). The descriptor is
 * close-on-exec, so children never inherit the lock. lock:unlock() (or `<close>`, or __gc)
 * releases it; the kernel releases it when the process ends, however it ends — which is what
 * makes such a lock a liveness signal between processes (see lua/moonbox/render/embedded.lua).
 * Raises (op "sys.try_lock") when the file cannot be opened, naming the path. Inline: one open
 * and one non-blocking flock. Does not yield. */
static int l_try_lock(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    static const char *const modes[] = {"shared", "exclusive", NULL};
    int exclusive = luaL_checkoption(L, 2, NULL, modes);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
        return raise_errno(L, "sys.try_lock", errno, path, "cannot open lock file %s", path);
    if (flock(fd, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
        int e = errno;
        close(fd);
        if (e == EWOULDBLOCK) {
            lua_pushnil(L);
            return 1;
        }
        return raise_errno(L, "sys.try_lock", e, path, "cannot lock %s", path);
    }
    sys_lock *lk = (sys_lock *)lua_newuserdatauv(L, sizeof *lk, 0);
    lk->fd = fd;
    luaL_setmetatable(L, LOCK_MT);
    return 1;
}

/* lock:unlock(): releases the lock (idempotent). Does not yield. */
static int l_lock_unlock(lua_State *L)
{
    sys_lock *lk = (sys_lock *)luaL_checkudata(L, 1, LOCK_MT);
    if (lk->fd >= 0) close(lk->fd);
    lk->fd = -1;
    return 0;
}

/* ---- getcwd --------------------------------------------------------------------------------- */

/* sys.getcwd() -> the process's working directory (absolute). Raises (op "sys.getcwd") when it
 * cannot be read (e.g. it was removed). Inline: one syscall. Does not yield. */
static int l_getcwd(lua_State *L)
{
    char buf[PATH_MAX];
    if (!getcwd(buf, sizeof buf))
        return raise_errno(L, "sys.getcwd", errno, NULL, "cannot read the working directory");
    lua_pushstring(L, buf);
    return 1;
}

/* ---- setenv --------------------------------------------------------------------------------- */

/* sys.setenv(name, value) sets an environment variable of this process (value nil: unsets it),
 * which libcurl reads per transfer (proxies, and moonbox's CA bundle variables) and children
 * inherit. Raises on a name with '=' or an empty one. Does not yield. */
static int l_setenv(lua_State *L)
{
    const char *name = luaL_checkstring(L, 1);
    if (!*name || strchr(name, '=')) return luaL_error(L, "sys.setenv: bad variable name");
    int rc = lua_isnoneornil(L, 2) ? unsetenv(name) : setenv(name, luaL_checkstring(L, 2), 1);
    if (rc != 0) return raise_errno(L, "sys.setenv", errno, NULL, "cannot set %s", name);
    return 0;
}

/* ---- listdir -------------------------------------------------------------------------------- */

/* sys.listdir(path) -> array of the entry names of directory path, without "." and "..", in
 * no particular order. Raises (op "sys.listdir") not_found, not_directory, ... naming path.
 * Inline: for the engine's own small directories (the layers directory); one getdents per
 * few hundred entries. Does not yield. */
static int l_listdir(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    DIR *d = opendir(path);
    if (!d) return raise_errno(L, "sys.listdir", errno, path, "cannot list directory %s", path);
    lua_newtable(L);
    lua_Integer n = 0;
    for (;;) {
        errno = 0;
        struct dirent *de = readdir(d);
        if (!de) break;
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        lua_pushstring(L, de->d_name);
        lua_rawseti(L, -2, ++n);
    }
    int e = errno;
    closedir(d);
    if (e != 0) return raise_errno(L, "sys.listdir", e, path, "cannot list directory %s", path);
    return 1;
}

/* ---- the sandbox disk: statvfs, btrfs subvolumes and quota groups ---------------------------- */

/* sys.statvfs(path) -> {size, free, avail, files, files_free}: the filesystem holding path, in
 * bytes (avail: what an unprivileged writer may still use) and inodes. Raises (op
 * "sys.statvfs") naming path. Inline: one statfs. Does not yield. */
static int l_statvfs(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    struct statvfs sv;
    if (statvfs(path, &sv) != 0)
        return raise_errno(L, "sys.statvfs", errno, path, "cannot stat the filesystem of %s", path);
    lua_createtable(L, 0, 5);
    mb_setfield_int(L, -1, "size", (lua_Integer)(sv.f_blocks * sv.f_frsize));
    mb_setfield_int(L, -1, "free", (lua_Integer)(sv.f_bfree * sv.f_frsize));
    mb_setfield_int(L, -1, "avail", (lua_Integer)(sv.f_bavail * sv.f_frsize));
    mb_setfield_int(L, -1, "files", (lua_Integer)sv.f_files);
    mb_setfield_int(L, -1, "files_free", (lua_Integer)sv.f_ffree);
    return 1;
}

/* sys.file_blocks(path) -> bytes allocated to file path (st_blocks * 512; a sparse file's
 * real cost). Raises (op "sys.file_blocks") naming path. Does not yield. */
static int l_file_blocks(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    struct stat st;
    if (stat(path, &st) != 0)
        return raise_errno(L, "sys.file_blocks", errno, path, "cannot stat %s", path);
    lua_pushinteger(L, (lua_Integer)st.st_blocks * 512);
    lua_pushinteger(L, (lua_Integer)st.st_size);
    return 2;
}

/* Opens path as a directory (O_RDONLY|O_DIRECTORY|O_CLOEXEC) or raises as op. */
static int open_dir(lua_State *L, const char *op, const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) raise_errno(L, op, errno, path, "cannot open directory %s", path);
    return fd;
}

/* sys.btrfs_subvol_create(path) -> true. Creates path (its parent must exist, on btrfs) as a new
 * btrfs subvolume: a directory with its own quota group. Raises (op "sys.btrfs_subvol_create")
 * exists, ... naming path. Inline: one metadata ioctl that joins the running transaction (no
 * commit, no writeback). Does not yield. */
static int l_btrfs_subvol_create(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    const char *slash = strrchr(path, '/');
    if (path[0] != '/' || !slash || !slash[1])
        return luaL_error(L, "sys.btrfs_subvol_create: path must be absolute, got '%s'", path);
    struct btrfs_ioctl_vol_args args;
    memset(&args, 0, sizeof args);
    if (strlen(slash + 1) >= sizeof args.name)
        return raise_errno(L, "sys.btrfs_subvol_create", ENAMETOOLONG, path, "cannot create %s",
                           path);
    strcpy(args.name, slash + 1);
    char parent[PATH_MAX];
    size_t plen = (size_t)(slash - path);
    if (plen == 0) plen = 1;
    if (plen >= sizeof parent)
        return raise_errno(L, "sys.btrfs_subvol_create", ENAMETOOLONG, path, "cannot create %s",
                           path);
    memcpy(parent, path, plen);
    parent[plen] = '\0';
    int fd = open_dir(L, "sys.btrfs_subvol_create", parent);
    int rc = ioctl(fd, BTRFS_IOC_SUBVOL_CREATE, &args);
    int e = errno;
    close(fd);
    if (rc != 0)
        return raise_errno(L, "sys.btrfs_subvol_create", e, path, "cannot create the subvolume %s",
                           path);
    lua_pushboolean(L, 1);
    return 1;
}

/* sys.btrfs_quota_enable(mountpoint) -> "simple" | "qgroups". Turns on quota accounting of the
 * btrfs filesystem at mountpoint: simple quotas (Linux 6.7+: each extent is charged to the
 * subvolume that wrote it, no backref walks) where the kernel has them, else full quota groups.
 * A no-op when it is on already. Raises (op "sys.btrfs_quota_enable") naming mountpoint. Inline
 * but slow (it commits a transaction): for a backend's start only. Does not yield. */
static int l_btrfs_quota_enable(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    int fd = open_dir(L, "sys.btrfs_quota_enable", path);
    struct btrfs_ioctl_quota_ctl_args q;
    memset(&q, 0, sizeof q);
    q.cmd = 4; /* BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA */
    const char *kind = "simple";
    int rc = ioctl(fd, BTRFS_IOC_QUOTA_CTL, &q);
    if (rc != 0 && errno == EINVAL) {
        q.cmd = BTRFS_QUOTA_CTL_ENABLE;
        kind = "qgroups";
        rc = ioctl(fd, BTRFS_IOC_QUOTA_CTL, &q);
    }
    int e = errno;
    close(fd);
    if (rc != 0)
        return raise_errno(L, "sys.btrfs_quota_enable", e, path, "cannot enable quotas on %s",
                           path);
    lua_pushstring(L, kind);
    return 1;
}

/* sys.btrfs_qgroup_limit(subvol, bytes) -> true. Limits what the subvolume at path may hold to
 * bytes (0: no limit); a write past it fails with EDQUOT ("Disk quota exceeded"). Raises (op
 * "sys.btrfs_qgroup_limit") naming path. Inline: one metadata ioctl joining the running
 * transaction. Does not yield. */
static int l_btrfs_qgroup_limit(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    lua_Integer bytes = luaL_checkinteger(L, 2);
    if (bytes < 0) return luaL_error(L, "sys.btrfs_qgroup_limit: bytes must be >= 0");
    int fd = open_dir(L, "sys.btrfs_qgroup_limit", path);
    struct btrfs_ioctl_qgroup_limit_args a;
    memset(&a, 0, sizeof a);
    a.qgroupid = 0; /* the subvolume of fd */
    a.lim.flags = BTRFS_QGROUP_LIMIT_MAX_RFER | BTRFS_QGROUP_LIMIT_MAX_EXCL;
    a.lim.max_rfer = a.lim.max_excl = bytes ? (uint64_t)bytes : UINT64_MAX;
    int rc = ioctl(fd, BTRFS_IOC_QGROUP_LIMIT, &a);
    int e = errno;
    close(fd);
    if (rc != 0)
        return raise_errno(L, "sys.btrfs_qgroup_limit", e, path, "cannot set the quota of %s",
                           path);
    lua_pushboolean(L, 1);
    return 1;
}

/* sys.btrfs_qgroup(subvol) -> used, limit: the bytes the btrfs subvolume at path holds (its
 * quota group's referenced bytes, as of the last commit) and may hold (nil: no limit). Raises (op
 * "sys.btrfs_qgroup") naming path. Inline: two metadata ioctls reading cached btree pages
 * (runtime/host_fs.c). Does not yield. */
static int l_btrfs_qgroup(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    uint64_t used, limit;
    int e = host_fs_qgroup(path, &used, &limit);
    if (e) return raise_errno(L, "sys.btrfs_qgroup", e, path, "cannot read the quota of %s", path);
    lua_pushinteger(L, (lua_Integer)used);
    if (limit == UINT64_MAX)
        lua_pushnil(L);
    else
        lua_pushinteger(L, (lua_Integer)limit);
    return 2;
}

/* sys.room(path) -> bytes a write under path can still take: the filesystem's available space,
 * and no more than its quota allows when path is a btrfs subvolume with a limit (the check the
 * HTTP server makes before an upload's body, runtime/host_fs.c). Raises (op "sys.room") naming
 * path. Inline: a statfs and two metadata ioctls. Does not yield. */
static int l_room(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    uint64_t room;
    int e = host_fs_room(path, &room);
    if (e) return raise_errno(L, "sys.room", e, path, "cannot stat the filesystem of %s", path);
    lua_pushinteger(L, (lua_Integer)room);
    return 1;
}

/* sys.btrfs_start_sync(path) -> true. Asks the btrfs filesystem holding path to commit its
 * running transaction, without waiting for it: space freed by a deletion is back (and counted
 * in statvfs and the quota groups) once the commit is done, not at the next 30 s commit.
 * Raises (op "sys.btrfs_start_sync") naming path. Inline: it only starts the commit. Does not
 * yield. */
static int l_btrfs_start_sync(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    int fd = open_dir(L, "sys.btrfs_start_sync", path);
    uint64_t transid = 0;
    int rc = ioctl(fd, BTRFS_IOC_START_SYNC, &transid);
    int e = errno;
    close(fd);
    if (rc != 0)
        return raise_errno(L, "sys.btrfs_start_sync", e, path, "cannot start a commit of %s", path);
    lua_pushboolean(L, 1);
    return 1;
}

/* ---- jobs on a worker thread: umount, remove_tree ------------------------------------------- */

enum { JOB_UMOUNT, JOB_REMOVE_TREE };

/* What the worker thread needs and writes. Freed by the worker-job primitive once both the
 * worker and the waiting call have let go (runtime/worker_job.c). */
typedef struct sys_job {
    int kind;
    int detach_fallback;
    char *path;
    int err;               /* 0 on success */
    int how;               /* umount: 1 unmounted, 2 detached (lazy) */
    char failed[PATH_MAX]; /* remove_tree: the entry that could not be removed */
} sys_job;

/* The waiting call, a userdata on the parked task's stack (slot 2; the path is slot 1). */
typedef struct sys_call {
    worker_job *work; /* NULL once released */
    sys_job *job;
    mb_task *task;
} sys_call;

static void job_run(void *arg)
{
    sys_job *j = (sys_job *)arg;
    if (j->kind == JOB_UMOUNT)
        j->err = host_fs_umount(j->path, j->detach_fallback, &j->how);
    else
        j->err = host_fs_remove_tree(AT_FDCWD, j->path, 0, j->failed, sizeof j->failed);
}

static void job_free(void *arg)
{
    sys_job *j = (sys_job *)arg;
    free(j->path);
    free(j);
}

static void call_release(sys_call *c)
{
    if (!c->work) return;
    worker_job_release(c->work);
    c->work = NULL;
    c->job = NULL;
}

static int call_gc(lua_State *L)
{
    call_release((sys_call *)lua_touserdata(L, 1));
    return 0;
}

/* On the loop thread when the worker finished: wakes the waiting task, nothing else. */
static void job_done(worker_job *w, void *ud)
{
    (void)w;
    mb_task_wake(((sys_call *)ud)->task);
}

/* The task was cancelled or its deadline expired: the syscall cannot be stopped, so the worker
 * finishes on its own and the last side frees the job. */
static void job_abort(mb_task *t, void *ud)
{
    (void)t;
    call_release((sys_call *)ud);
}

/* The continuation once the worker finished: the result, or the job's structured error. */
static int job_k(lua_State *L, int status, lua_KContext ctx)
{
    sys_call *c = (sys_call *)lua_touserdata(L, 2);
    sys_job *j = c->job;
    const char *path = lua_tostring(L, 1);
    (void)status;
    (void)ctx;
    int err = j->err, kind = j->kind, how = j->how;
    if (err && kind == JOB_REMOVE_TREE) {
        lua_pushstring(L, j->failed[0] ? j->failed : path);
        call_release(c);
        const char *at = lua_tostring(L, -1);
        return raise_errno(L, "sys.remove_tree", err, at, "cannot remove %s (removing %s)", at,
                           path);
    }
    call_release(c);
    if (err) return raise_errno(L, "sys.umount", err, path, "cannot unmount %s", path);
    if (kind == JOB_UMOUNT)
        lua_pushstring(L, how == 2 ? "detached" : "unmounted");
    else
        lua_pushboolean(L, 1);
    return 1;
}

/* Starts the job on a worker thread and parks the calling task until it finishes. */
static int job_start(lua_State *L, int kind, const char *op, int detach_fallback)
{
    const char *path = lua_tostring(L, 1);
    mb_task *t = mb_task_check_yieldable(L, op);
    lua_settop(L, 1);
    sys_call *c = (sys_call *)lua_newuserdatauv(L, sizeof *c, 0);
    memset(c, 0, sizeof *c);
    luaL_setmetatable(L, CALL_MT);
    c->task = t;
    sys_job *j = (sys_job *)calloc(1, sizeof *j);
    if (!j || !(j->path = strdup(path))) {
        free(j);
        return luaL_error(L, "sys: out of memory");
    }
    j->kind = kind;
    j->detach_fallback = detach_fallback;
    int r = worker_job_start(mb_runtime_get(L)->loop, job_run, job_free, j, job_done, c, &c->work);
    if (r != 0) {
        job_free(j);
        return raise_errno(L, op, r, path, "cannot start a worker thread for %s", path);
    }
    c->job = j;
    return mb_task_park(L, t, job_abort, c, 0, job_k);
}

/* sys.umount(target[, detach_fallback]) -> "unmounted" or "detached". Unmounts target on a
 * worker thread (unmounting a writable overlay syncs its whole upper filesystem, which may take
 * long) and parks the calling task until it is done. When the plain unmount fails (busy) and
 * detach_fallback is true, detaches it lazily instead (as `umount || umount -l`). Raises (op
 * "sys.umount") naming target. [yields] */
static int l_umount(lua_State *L)
{
    luaL_checkstring(L, 1);
    return job_start(L, JOB_UMOUNT, "sys.umount", lua_toboolean(L, 2));
}

/* sys.remove_tree(path) -> true. Removes path and everything below it on a worker thread (as
 * `rm -rf --one-file-system`: symlinks are removed, never followed; another filesystem mounted
 * below stops it with an error; runtime/host_fs.c) and parks the calling task until it is done.
 * A missing path is not an error. Raises (op "sys.remove_tree") naming the entry that could not
 * be removed. [yields] */
static int l_remove_tree(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    if (path[0] != '/' || strcmp(path, "/") == 0)
        return luaL_error(L, "sys.remove_tree: refusing path '%s'", path);
    return job_start(L, JOB_REMOVE_TREE, "sys.remove_tree", 0);
}

static const luaL_Reg lock_methods[] = {
    {"unlock", l_lock_unlock},
    {NULL, NULL},
};

static const luaL_Reg sys_functions[] = {
    {"mkdir_p", l_mkdir_p},
    {"mount_overlay", l_mount_overlay},
    {"kill", l_kill},
    {"listdir", l_listdir},
    {"getcwd", l_getcwd},
    {"setenv", l_setenv},
    {"umount", l_umount},
    {"remove_tree", l_remove_tree},
    {"try_lock", l_try_lock},
    {"statvfs", l_statvfs},
    {"file_blocks", l_file_blocks},
    {"btrfs_subvol_create", l_btrfs_subvol_create},
    {"btrfs_quota_enable", l_btrfs_quota_enable},
    {"btrfs_qgroup_limit", l_btrfs_qgroup_limit},
    {"btrfs_qgroup", l_btrfs_qgroup},
    {"room", l_room},
    {"btrfs_start_sync", l_btrfs_start_sync},
    {NULL, NULL},
};

int luaopen_moonbox_sys(lua_State *L)
{
    static const luaL_Reg call_meta[] = {{"__gc", call_gc}, {NULL, NULL}};
    static const luaL_Reg lock_meta[] = {
        {"__gc", l_lock_unlock}, {"__close", l_lock_unlock}, {NULL, NULL}};
    mb_newclass(L, CALL_MT, NULL, call_meta);
    mb_newclass(L, LOCK_MT, lock_methods, lock_meta);
    luaL_newlib(L, sys_functions);
    return 1;
}
