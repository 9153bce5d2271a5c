/*
 * sys.c — module moonbox.sys: host chores of `moonbox local` done by system calls instead of by
 * starting mkdir, mount, umount, kill, ls and rm processes (on a paravirtualized VM a fork and
 * exec costs milliseconds of CPU; a syscall microseconds).
 *
 * Two kinds of calls. The inline ones (mkdir_p, mount_overlay, kill, listdir, try_lock) run on
 * the loop thread: each is a handful of metadata syscalls on local filesystems or procfs and
 * cannot wait for disk writeback or for another process; the comment above each says why. The
 * slow ones (unmounting a writable overlay syncs its upper filesystem; removing a sandbox's
 * upper directory is unbounded) run on a detached worker thread as a job: sys.umount_start and
 * sys.remove_tree_start return a job whose :poll() the caller repeats (engine/host.lua sleeps
 * between polls). Polling, not a wake-up, because these jobs are rare and short compared with
 * a poll interval, and it keeps this file free of task parking.
 * Failures raise structured errors (op "sys.<fn>") naming the path or pid and the errno text;
 * err.errno holds the number. Misuse (wrong argument types) raises a plain error.
 */
#include "mb.h"

#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#define JOB_MT  "moonbox.sys.Job"
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

/* Creates dir and its missing parents; parents get 0755 (less the umask, as mkdir -p), dir
 * itself gets exactly mode when this call creates it (as mkdir -p -m; an existing directory is
 * left alone). Returns 0, or an errno with the failing prefix left in buf. */
static int mkdir_parents(char *buf, mode_t mode)
{
    size_t n = strlen(buf);
    while (n > 1 && buf[n - 1] == '/')
        buf[--n] = '\0';
    /* The usual cases first, without one failing mkdir per existing level: the directory exists,
     * or the parents do, or the nearest existing ancestor is a few levels up (found from the
     * leaf upwards). Anything unusual takes the walk from the root, which names the failing
     * prefix. */
    if (mkdir(buf, mode) == 0) return chmod(buf, mode) != 0 ? errno : 0;
    struct stat st0;
    if (errno == EEXIST && stat(buf, &st0) == 0 && S_ISDIR(st0.st_mode)) return 0;
    char *start = buf + 1; /* where the walk below begins: after the nearest existing ancestor */
    if (errno == ENOENT) {
        char *cut = strrchr(buf, '/');
        while (cut && cut > buf) {
            *cut = '\0';
            int rc = mkdir(buf, 0755), e = errno;
            *cut = '/';
            if (rc == 0 || e == EEXIST) {
                start = cut; /* buf up to cut exists now (or is not a directory: the walk says) */
                break;
            }
            if (e != ENOENT) break;
            char *prev = cut - 1;
            while (prev > buf && *prev != '/')
                prev--;
            cut = prev;
        }
    }
    for (char *p = start;; p++) {
        if (*p != '/' && *p != '\0') continue;
        char saved = *p;
        *p = '\0';
        int last = saved == '\0';
        struct stat st;
        if (mkdir(buf, last ? mode : 0755) == 0) {
            if (last && chmod(buf, mode) != 0) return errno;
        } else {
            int e = errno;
            if (e != EEXIST) return e;
            if (stat(buf, &st) != 0) return errno;
            if (!S_ISDIR(st.st_mode)) return ENOTDIR;
        }
        if (last) return 0;
        *p = saved;
        while (p[1] == '/')
            p++;
    }
}

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
    int e = mkdir_parents(buf, (mode_t)(mode & 07777));
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
    lua_settop(L, 5); /* the buffer below lives on the stack, above the arguments */
    luaL_Buffer b;
    luaL_buffinit(L, &b);
    luaL_addstring(&b, "lowerdir=");
    if (lua_type(L, 1) == LUA_TTABLE) {
        lua_Integer n = luaL_len(L, 1);
        if (n < 1) return luaL_error(L, "sys.mount_overlay: lowers is empty");
        for (lua_Integer i = 1; i <= n; i++) {
            lua_rawgeti(L, 1, i);
            const char *l = lua_tostring(L, -1);
            if (!l) return luaL_error(L, "sys.mount_overlay: lowers[%d] is not a string", (int)i);
            lua_pop(L, 1);
            if (i > 1) luaL_addchar(&b, ':');
            luaL_addstring(&b, l);
        }
    } else {
        luaL_addstring(&b, lua_tostring(L, 1));
    }
    luaL_addstring(&b, ",upperdir=");
    luaL_addstring(&b, upper);
    luaL_addstring(&b, ",workdir=");
    luaL_addstring(&b, work);
    luaL_addstring(&b, ",index=off,redirect_dir=off,metacopy=off");
    luaL_pushresult(&b);
    size_t len;
    const char *data = lua_tolstring(L, -1, &len);
    if (len >= 4096) {
        mb_error_new(L, "sys.mount_overlay", "too_long",
                     "cannot mount an overlay at %s: its options are %d bytes, more than the "
                     "kernel's page (too many or too long layer paths)",
                     target, (int)len);
        mb_setfield_str(L, -1, "path", target);
        return lua_error(L);
    }
    if (mount(source, target, "overlay", readonly ? MS_RDONLY : 0, data) != 0)
        return raise_errno(L, "sys.mount_overlay", errno, target,
                           "cannot mount an overlay at %s (%s)", target, data);
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

/* ---- jobs on a worker thread: umount, remove_tree ------------------------------------------- */

enum { JOB_UMOUNT, JOB_REMOVE_TREE };

/* Owned by two references, the worker's and the Lua userdata's, counted atomically; whoever
 * drops the last frees it. The worker writes err/how/failed_path, then sets done (release);
 * the owner reads them only after seeing done (acquire). */
typedef struct sys_job {
    int kind;
    int detach_fallback;
    char *path;
    atomic_int refs;
    atomic_int done;
    int err;               /* 0 on success */
    int how;               /* umount: 1 unmounted, 2 detached (lazy) */
    char failed[PATH_MAX]; /* remove_tree: the entry that could not be removed */
} sys_job;

typedef struct {
    sys_job *job;
} sys_job_ref;

static void job_unref(sys_job *j)
{
    if (atomic_fetch_sub(&j->refs, 1) == 1) {
        free(j->path);
        free(j);
    }
}

/* Directory levels whose open stream is kept while their children are removed; deeper ones
 * are closed on the way down and scanned again on the way up (only what is left, since every
 * entry seen was removed). A tree of any depth is removed with at most this many descriptors. */
#define REMOVE_KEEP_OPEN 64

typedef struct rm_level {
    char *name; /* the directory's name in its parent */
    DIR *dir;   /* the parent's open stream, or NULL once closed (deep levels) */
} rm_level;

/* Records the failure at name in the directory the stack leads to: its whole path when that
 * fits in j->failed, else the top, an ellipsis and the name. */
static void rm_fail(sys_job *j, int err, const rm_level *stack, size_t depth, const char *name)
{
    j->err = err;
    size_t len = (size_t)snprintf(j->failed, sizeof j->failed, "%s", j->path);
    for (size_t i = 0; i < depth && len < sizeof j->failed; i++)
        len += (size_t)snprintf(j->failed + len, sizeof j->failed - len, "/%s", stack[i].name);
    if (name && len < sizeof j->failed)
        len += (size_t)snprintf(j->failed + len, sizeof j->failed - len, "/%s", name);
    if (len >= sizeof j->failed)
        snprintf(j->failed, sizeof j->failed, "%s/.../%s", j->path, name ? name : "");
}

/* Removes the tree at j->path without ever building a path longer than one name: each directory
 * is entered with openat(O_NOFOLLOW | O_DIRECTORY) from its parent's descriptor, emptied, left
 * through "..", and removed with unlinkat relative to its parent, so depth and name lengths are
 * unbounded (nftw builds whole paths and fails past PATH_MAX, which a sandbox can nest beyond).
 * Never follows a symlink and never crosses onto another filesystem (EXDEV, as
 * rm --one-file-system). Meant for trees nobody writes to meanwhile (a terminated sandbox's).
 * O(entries), plus rescans of what is left in levels deeper than REMOVE_KEEP_OPEN. */
static void remove_tree(sys_job *j, dev_t dev)
{
    int top = open(j->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (top < 0) {
        if (errno == ENOTDIR || errno == ELOOP) {
            if (unlink(j->path) != 0) rm_fail(j, errno, NULL, 0, NULL);
        } else if (errno != ENOENT) {
            rm_fail(j, errno, NULL, 0, NULL);
        }
        return;
    }
    rm_level *stack = NULL;
    size_t depth = 0, cap = 0;
    DIR *cur = fdopendir(top);
    if (!cur) {
        rm_fail(j, errno, NULL, 0, NULL);
        close(top);
        return;
    }
    for (;;) {
        struct dirent *de;
        int descended = 0, read_err = 0;
        while (!descended) {
            errno = 0;
            if (!(de = readdir(cur))) {
                read_err = errno;
                break;
            }
            const char *n = de->d_name;
            if (strcmp(n, ".") == 0 || strcmp(n, "..") == 0) continue;
            struct stat st;
            int fd = dirfd(cur);
            if (fstatat(fd, n, &st, AT_SYMLINK_NOFOLLOW) != 0) {
                if (errno == ENOENT) continue;
                rm_fail(j, errno, stack, depth, n);
                goto out;
            }
            if (st.st_dev != dev) {
                rm_fail(j, EXDEV, stack, depth, n);
                goto out;
            }
            if (!S_ISDIR(st.st_mode)) {
                if (unlinkat(fd, n, 0) != 0 && errno != ENOENT) {
                    rm_fail(j, errno, stack, depth, n);
                    goto out;
                }
                continue;
            }
            int sub = openat(fd, n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            DIR *d = sub >= 0 ? fdopendir(sub) : NULL;
            if (!d) {
                if (sub >= 0) close(sub);
                rm_fail(j, errno, stack, depth, n);
                goto out;
            }
            if (depth == cap) {
                size_t nc = cap ? cap * 2 : 64;
                rm_level *ns = realloc(stack, nc * sizeof *ns);
                if (!ns) {
                    closedir(d);
                    rm_fail(j, ENOMEM, stack, depth, n);
                    goto out;
                }
                stack = ns;
                cap = nc;
            }
            stack[depth].name = strdup(n);
            stack[depth].dir = cur;
            if (!stack[depth].name) {
                closedir(d);
                rm_fail(j, ENOMEM, stack, depth, n);
                goto out;
            }
            if (depth >= REMOVE_KEEP_OPEN) { /* deep: let go of the parent's stream */
                closedir(cur);
                stack[depth].dir = NULL;
            }
            depth++;
            cur = d;
            descended = 1;
        }
        if (descended) continue;
        if (read_err) {
            rm_fail(j, read_err, stack, depth, NULL);
            goto out;
        }
        /* cur is empty: go up and remove it from its parent */
        if (depth == 0) break;
        rm_level lv = stack[--depth];
        DIR *parent = lv.dir;
        if (!parent) {
            int up = openat(dirfd(cur), "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            parent = up >= 0 ? fdopendir(up) : NULL;
            if (!parent) {
                if (up >= 0) close(up);
                rm_fail(j, errno, stack, depth, lv.name);
                free(lv.name);
                goto out;
            }
        }
        closedir(cur);
        cur = parent;
        if (unlinkat(dirfd(cur), lv.name, AT_REMOVEDIR) != 0 && errno != ENOENT) {
            rm_fail(j, errno, stack, depth, lv.name);
            free(lv.name);
            goto out;
        }
        free(lv.name);
        if (!lv.dir) rewinddir(cur); /* a reopened stream starts over: only what is left */
    }
    closedir(cur);
    cur = NULL;
    if (rmdir(j->path) != 0 && errno != ENOENT) rm_fail(j, errno, NULL, 0, NULL);
out:
    if (cur) closedir(cur);
    while (depth > 0) {
        depth--;
        if (stack[depth].dir) closedir(stack[depth].dir);
        free(stack[depth].name);
    }
    free(stack);
}

static void *job_main(void *arg)
{
    sys_job *j = (sys_job *)arg;
    if (j->kind == JOB_UMOUNT) {
        if (umount2(j->path, 0) == 0) {
            j->how = 1;
        } else {
            int first = errno; /* the one to report: why the plain unmount failed */
            if (j->detach_fallback && umount2(j->path, MNT_DETACH) == 0)
                j->how = 2;
            else
                j->err = first;
        }
    } else {
        struct stat st;
        if (lstat(j->path, &st) != 0) {
            if (errno != ENOENT) j->err = errno; /* already gone: done, as rm -rf */
        } else {
            remove_tree(j, st.st_dev);
        }
    }
    atomic_store_explicit(&j->done, 1, memory_order_release);
    job_unref(j);
    return NULL;
}

static int job_start(lua_State *L, int kind, const char *path, int detach_fallback)
{
    sys_job_ref *ref = (sys_job_ref *)lua_newuserdatauv(L, sizeof *ref, 1);
    ref->job = NULL;
    luaL_setmetatable(L, JOB_MT);
    sys_job *j = (sys_job *)calloc(1, sizeof *j);
    if (!j || !(j->path = strdup(path))) {
        free(j);
        return luaL_error(L, "sys: out of memory");
    }
    j->kind = kind;
    j->detach_fallback = detach_fallback;
    atomic_init(&j->refs, 2);
    atomic_init(&j->done, 0);
    pthread_attr_t attr;
    pthread_t tid;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int r = pthread_create(&tid, &attr, job_main, j);
    pthread_attr_destroy(&attr);
    if (r != 0) {
        free(j->path);
        free(j);
        return raise_errno(L, kind == JOB_UMOUNT ? "sys.umount" : "sys.remove_tree", r, path,
                           "cannot start a worker thread for %s", path);
    }
    ref->job = j;
    lua_pushvalue(L, 1); /* the path, for error messages */
    lua_setiuservalue(L, -2, 1);
    return 1;
}

/* sys.umount_start(target[, detach_fallback]) -> job. Unmounts target on a worker thread:
 * unmounting a writable overlay syncs its whole upper filesystem, which may take long. When
 * the plain unmount fails (busy) and detach_fallback is true, detaches it lazily instead (as
 * `umount || umount -l`). job:poll() -> nil while running, then "unmounted" or "detached", or
 * raises (op "sys.umount") naming target. Does not yield. */
static int l_umount_start(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    return job_start(L, JOB_UMOUNT, path, lua_toboolean(L, 2));
}

/* sys.remove_tree_start(path) -> job. Removes path and everything below it on a worker thread
 * (as `rm -rf --one-file-system`: symlinks are removed, never followed; another filesystem
 * mounted below stops it with an error). A missing path is not an error. job:poll() -> nil
 * while running, then true, or raises (op "sys.remove_tree") naming the entry that could not
 * be removed. Does not yield. */
static int l_remove_tree_start(lua_State *L)
{
    const char *path = luaL_checkstring(L, 1);
    if (path[0] != '/' || strcmp(path, "/") == 0)
        return luaL_error(L, "sys.remove_tree_start: refusing path '%s'", path);
    return job_start(L, JOB_REMOVE_TREE, path, 0);
}

/* job:poll() -> nil while the job runs; its result once done (see the starters). Raises the
 * job's structured error once done with a failure. Does not yield. */
static int l_job_poll(lua_State *L)
{
    sys_job_ref *ref = (sys_job_ref *)luaL_checkudata(L, 1, JOB_MT);
    sys_job *j = ref->job;
    if (!j) return luaL_error(L, "sys: job already collected");
    if (!atomic_load_explicit(&j->done, memory_order_acquire)) return 0;
    lua_getiuservalue(L, 1, 1);
    const char *path = lua_tostring(L, -1);
    if (j->kind == JOB_UMOUNT) {
        if (j->err) return raise_errno(L, "sys.umount", j->err, path, "cannot unmount %s", path);
        lua_pushstring(L, j->how == 2 ? "detached" : "unmounted");
        return 1;
    }
    if (j->err) {
        const char *at = j->failed[0] ? j->failed : path;
        return raise_errno(L, "sys.remove_tree", j->err, at, "cannot remove %s (removing %s)", at,
                           path);
    }
    lua_pushboolean(L, 1);
    return 1;
}

static int l_job_gc(lua_State *L)
{
    sys_job_ref *ref = (sys_job_ref *)luaL_checkudata(L, 1, JOB_MT);
    if (ref->job) job_unref(ref->job);
    ref->job = NULL;
    return 0;
}

static const luaL_Reg lock_methods[] = {
    {"unlock", l_lock_unlock},
    {NULL, NULL},
};

static const luaL_Reg job_methods[] = {
    {"poll", l_job_poll},
    {NULL, NULL},
};

static const luaL_Reg sys_functions[] = {
    {"mkdir_p", l_mkdir_p},
    {"mount_overlay", l_mount_overlay},
    {"kill", l_kill},
    {"listdir", l_listdir},
    {"getcwd", l_getcwd},
    {"setenv", l_setenv},
    {"umount_start", l_umount_start},
    {"remove_tree_start", l_remove_tree_start},
    {"try_lock", l_try_lock},
    {NULL, NULL},
};

int luaopen_moonbox_sys(lua_State *L)
{
    if (luaL_newmetatable(L, JOB_MT)) {
        luaL_newlib(L, job_methods);
        lua_setfield(L, -2, "__index");
        lua_pushcfunction(L, l_job_gc);
        lua_setfield(L, -2, "__gc");
    }
    lua_pop(L, 1);
    if (luaL_newmetatable(L, LOCK_MT)) {
        luaL_newlib(L, lock_methods);
        lua_setfield(L, -2, "__index");
        lua_pushcfunction(L, l_lock_unlock);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, l_lock_unlock);
        lua_setfield(L, -2, "__close");
    }
    lua_pop(L, 1);
    luaL_newlib(L, sys_functions);
    return 1;
}
