/*
 * archive.c — the module moonbox.archive: archive.pack, archive.unpack and archive.list, gzip'd
 * (or plain) tar archives of directory trees, done on a worker thread while the calling task
 * waits and every other task keeps running.
 *
 * runtime/ (tarball.h, archive_*.c) owns the job, its thread, its partial output and the
 * safety rules; this file parses arguments, parks the calling task, and turns the job's result
 * into Lua values or a structured error. The worker reports through an ev_async whose callback
 * only wakes the task (mb.h invariants); the continuation reads the result and releases the job.
 *
 * Ownership: each call keeps a small userdata on the waiting task's own stack that points at
 * its job. Exactly one of three places releases the job: the continuation (normal end), the
 * abort hook (cancellation or a deadline; the worker then stops and removes its partial
 * output), or __gc (only if the task is dropped without either, e.g. at a forced shutdown).
 * No registry refs are taken.
 */
#include "mb.h"
#include "tarball.h"

#include <string.h>
#include <unistd.h>

#define CALL_MT "moonbox.ArchiveCall"

/* Stack slots of a waiting call: the two arguments, the options table, the call userdata. */
#define ARG_SRC  1
#define ARG_DST  2
#define ARG_OPTS 3
#define ARG_CALL 4

typedef struct archive_call {
    archive_job *job; /* NULL once released */
    mb_task *task;
    int kind; /* enum archive_job_kind */
} archive_call;

static const char *op_name(int kind)
{
    return kind == ARCHIVE_JOB_PACK           ? "archive.pack"
           : kind == ARCHIVE_JOB_UNPACK       ? "archive.unpack"
           : kind == ARCHIVE_JOB_TO_RECORDS   ? "archive.to_records"
           : kind == ARCHIVE_JOB_FROM_RECORDS ? "archive.from_records"
                                              : "archive.list";
}

static const char *code_name(int status)
{
    switch (status) {
    case ARCHIVE_JOB_NOT_FOUND:
        return "not_found";
    case ARCHIVE_JOB_UNSAFE:
        return "unsafe_archive";
    case ARCHIVE_JOB_TOO_LARGE:
        return "archive_too_large";
    case ARCHIVE_JOB_CORRUPT:
        return "corrupt_archive";
    case ARCHIVE_JOB_TARGET_EXISTS:
        return "target_exists";
    case ARCHIVE_JOB_MERGE_CONFLICT:
        return "merge_conflict";
    default:
        return "io_error";
    }
}

static const char *item_type_name(int type)
{
    switch (type) {
    case ARCHIVE_ITEM_FILE:
        return "file";
    case ARCHIVE_ITEM_DIRECTORY:
        return "directory";
    case ARCHIVE_ITEM_SYMLINK:
        return "symlink";
    case ARCHIVE_ITEM_HARDLINK:
        return "hardlink";
    default:
        return "other";
    }
}

static void call_release(archive_call *c)
{
    if (!c->job) return;
    archive_job_release(c->job);
    c->job = NULL;
}

static int call_gc(lua_State *L)
{
    call_release((archive_call *)lua_touserdata(L, 1));
    return 0;
}

/* The job's notify function, on the loop thread: wakes the waiting task, nothing else. */
static void on_job_done(archive_job *job, void *ud)
{
    archive_call *c = (archive_call *)ud;
    (void)job;
    mb_task_wake(c->task);
}

/* Abort hook: the task was cancelled or its deadline expired. The worker is told to stop and
 * cleans up on its own; the job memory is freed by whichever side lets go last. */
static void abort_call(mb_task *t, void *ud)
{
    (void)t;
    call_release((archive_call *)ud);
}

/* Pushes the result of a successful job. */
static void push_result(lua_State *L, int kind, const archive_job_result *r)
{
    if (kind == ARCHIVE_JOB_LIST) {
        lua_createtable(L, (int)r->nitems, 0);
        for (size_t i = 0; i < r->nitems; i++) {
            const archive_item *it = &r->items[i];
            lua_createtable(L, 0, 5);
            mb_setfield_str(L, -1, "name", it->name);
            mb_setfield_str(L, -1, "type", item_type_name(it->type));
            mb_setfield_int(L, -1, "size", (lua_Integer)it->size);
            mb_setfield_int(L, -1, "mode", (lua_Integer)it->mode);
            mb_setfield_str(L, -1, "target", it->target);
            lua_rawseti(L, -2, (lua_Integer)i + 1);
        }
        return;
    }
    lua_createtable(L, 0, 3);
    mb_setfield_int(L, -1, "entries", (lua_Integer)r->entries);
    mb_setfield_int(L, -1, "bytes", (lua_Integer)r->bytes);
    if (kind == ARCHIVE_JOB_PACK) mb_setfield_int(L, -1, "skipped", (lua_Integer)r->skipped);
}

static int call_k(lua_State *L, int status, lua_KContext ctx)
{
    archive_call *c = (archive_call *)lua_touserdata(L, ARG_CALL);
    const archive_job_result *r = archive_job_result_of(c->job);
    (void)status;
    (void)ctx;
    if (r->status == ARCHIVE_JOB_OK) {
        push_result(L, c->kind, r);
        call_release(c);
        return 1;
    }
    /* Copy everything out of the job before releasing it: lua_error does not return. */
    mb_error_new(L, op_name(c->kind), code_name(r->status), "%s", r->message);
    int e = lua_gettop(L);
    lua_pushvalue(L, ARG_SRC);
    lua_setfield(L, e, "path");
    if (c->kind != ARCHIVE_JOB_LIST) {
        lua_pushvalue(L, ARG_DST);
        lua_setfield(L, e, "target");
    }
    mb_setfield_str(L, e, "member", r->member);
    mb_setfield_str(L, e, "limit", r->limit);
    call_release(c);
    return lua_error(L);
}

/* Starts the job o describes for task t and parks t until it finishes. The stack must hold
 * exactly the ARG_SRC..ARG_OPTS slots. */
static int start_and_park(lua_State *L, mb_task *t, archive_job_opts *o)
{
    mb_runtime *rt = mb_runtime_get(L);
    archive_call *c = (archive_call *)lua_newuserdatauv(L, sizeof *c, 0);
    memset(c, 0, sizeof *c);
    luaL_setmetatable(L, CALL_MT);
    c->task = t;
    c->kind = o->kind;
    o->notify = on_job_done;
    o->notify_ud = c;
    char err[256];
    if (archive_job_start(rt->loop, o, &c->job, err, sizeof err) != ARCHIVE_JOB_OK)
        return mb_error_raise(L, op_name(o->kind), "io_error", "%s", err);
    return mb_task_park(L, t, abort_call, c, 0, call_k);
}

/* ---- arguments ----------------------------------------------------------------------------- */

static const char *check_path(lua_State *L, int idx, const char *what)
{
    size_t len;
    const char *s = luaL_checklstring(L, idx, &len);
    if (len == 0) luaL_argerror(L, idx, lua_pushfstring(L, "%s must not be empty", what));
    if (strlen(s) != len) luaL_argerror(L, idx, lua_pushfstring(L, "%s contains a NUL byte", what));
    return s;
}

/* Checks that the options table at idx (nil allowed: replaced by an empty table) has only the
 * keys in `known`. */
static void check_opts(lua_State *L, int idx, const char *const *known)
{
    if (lua_isnoneornil(L, idx)) {
        lua_newtable(L);
        lua_replace(L, idx);
        return;
    }
    luaL_checktype(L, idx, LUA_TTABLE);
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        int ok = 0;
        if (lua_type(L, -1) == LUA_TSTRING)
            for (int i = 0; known[i]; i++)
                if (strcmp(lua_tostring(L, -1), known[i]) == 0) ok = 1;
        if (!ok)
            luaL_argerror(L, idx,
                          lua_pushfstring(L, "unknown option '%s'", luaL_tolstring(L, -1, NULL)));
    }
}

static int opt_bool(lua_State *L, int idx, const char *k, int def)
{
    int t = lua_getfield(L, idx, k);
    int v = def;
    if (t == LUA_TBOOLEAN)
        v = lua_toboolean(L, -1);
    else if (t != LUA_TNIL)
        luaL_argerror(L, idx, lua_pushfstring(L, "%s must be a boolean", k));
    lua_pop(L, 1);
    return v;
}

/* An integer option in [lo, hi], or def when absent. */
static lua_Integer opt_int(lua_State *L, int idx, const char *k, lua_Integer def, lua_Integer lo,
                           lua_Integer hi)
{
    int t = lua_getfield(L, idx, k);
    lua_Integer v = def;
    if (t != LUA_TNIL) {
        int isint;
        v = lua_tointegerx(L, -1, &isint);
        if (!isint || v < lo || v > hi)
            luaL_argerror(L, idx,
                          lua_pushfstring(L, "%s must be an integer from %I to %I", k, lo, hi));
    }
    lua_pop(L, 1);
    return v;
}

/* Begins a call of `kind` in o: src from ARG_SRC (src_what names it in errors), dst from
 * ARG_DST when dst_what is given, else that slot is made nil (every call has the slot layout
 * src, dst, opts); the options at ARG_OPTS (nil: none) may hold only the keys in `known`.
 * Raises usage errors. */
static void begin_call(lua_State *L, archive_job_opts *o, int kind, const char *src_what,
                       const char *dst_what, const char *const *known)
{
    memset(o, 0, sizeof *o);
    o->kind = kind;
    o->src = check_path(L, ARG_SRC, src_what);
    if (dst_what) {
        o->dst = check_path(L, ARG_DST, dst_what);
        lua_settop(L, ARG_OPTS);
    } else {
        lua_settop(L, 2);
        lua_pushnil(L);
        lua_insert(L, ARG_DST);
    }
    check_opts(L, ARG_OPTS, known);
}

/* The max_bytes and max_entries options (bounds on file bytes and on members). */
static uint64_t opt_max_bytes(lua_State *L)
{
    return (uint64_t)opt_int(L, ARG_OPTS, "max_bytes", (lua_Integer)ARCHIVE_DEFAULT_MAX_BYTES, 0,
                             LUA_MAXINTEGER);
}

static uint64_t opt_max_entries(lua_State *L)
{
    return (uint64_t)opt_int(L, ARG_OPTS, "max_entries", (lua_Integer)ARCHIVE_DEFAULT_MAX_ENTRIES,
                             0, LUA_MAXINTEGER);
}

/* Starts the job o describes and parks the calling task until it ends (raises a usage error
 * outside a task). [yields] */
static int run_call(lua_State *L, archive_job_opts *o)
{
    mb_task *t = mb_task_check_yieldable(L, op_name(o->kind));
    return start_and_park(L, t, o);
}

/* ---- the module ------------------------------------------------------------------------------ */

/* archive.pack(src_dir, out_file [, opts]) -> {entries, bytes, skipped}
 * Writes a gzip-compressed POSIX tar (ustar, with pax extensions only where ustar cannot say
 * it) of the tree under src_dir to out_file. Member names are relative to src_dir, without
 * "./" or "/". Directories, regular files and symlinks are stored (symlinks as symlinks, never
 * followed); a file with several links inside the tree is stored once and its other paths as
 * hard links to it; devices, fifos and sockets are left out and counted in `skipped`. src_dir
 * itself may be a symlink to a directory; nothing below it is followed. The archive is written
 * to a temporary 0600 file beside out_file and renamed over out_file only once complete, so
 * out_file is either the whole archive (mode 0600) or untouched. Options:
 *   gzip = false   write a plain tar
 * Results: entries (members written), bytes (file data bytes), skipped.
 * Raises a usage error for bad arguments or outside a task, and a structured error (op
 * "archive.pack", code "not_found" when src_dir or out_file's directory is missing, else
 * "io_error"; fields path, target). Cancelling the task stops the worker, which removes its
 * temporary file. [yields] */
static int l_pack(lua_State *L)
{
    static const char *const known[] = {"gzip", NULL};
    archive_job_opts o;
    begin_call(L, &o, ARCHIVE_JOB_PACK, "src_dir", "out_file", known);
    o.gzip = opt_bool(L, ARG_OPTS, "gzip", 1);
    return run_call(L, &o);
}

/* archive.unpack(in_file, target_dir [, opts]) -> {entries, bytes}
 * Extracts a gzip'd or plain tar (detected from its first bytes) into a fresh 0700 staging
 * directory beside target_dir, then moves it into place: when target_dir does not exist the
 * staging directory is renamed to it in one step; when it exists and opts.merge is true, the
 * tree is merged into it (files and symlinks replace what is there, directories are merged,
 * existing directories keep their mode; a directory in the target where the archive has a
 * non-directory fails the whole merge before anything moves). Refuses, with nothing written
 * outside staging and staging removed, any member that: has an absolute name, has a ".."
 * component, is a symlink whose target is absolute, escapes target_dir or has ".." after a
 * name, is a hard link to anything but a file extracted before it, is a device, fifo or
 * socket, or would be written through a symlink. Options:
 *   merge = true        merge into an existing target_dir (default: refuse it)
 *   max_bytes = n       bound on file bytes (default 16 GiB)
 *   max_entries = n     bound on members (default 1,000,000)
 *   umask = bits        cleared from the archive's modes (default 0o022)
 *   file_mode = mode    forced on regular files (e.g. 0o600), instead of the archive's
 *   owner = true        restore numeric uid/gid (root only); otherwise files are ours and
 *                       setuid/setgid bits are dropped
 * Results: entries (members read), bytes (file bytes extracted).
 * Raises a usage error for bad arguments, outside a task, or owner = true when not root, and a
 * structured error with op "archive.unpack", fields path, target and, where it applies, member
 * and limit, and code "unsafe_archive", "archive_too_large" (limit "max_bytes", "max_entries"
 * or "path_length"), "corrupt_archive", "target_exists", "merge_conflict", "not_found" or
 * "io_error". Cancelling the task stops the worker, which removes the staging directory; once
 * the move into place has begun it completes. [yields] */
static int l_unpack(lua_State *L)
{
    static const char *const known[] = {"merge",     "max_bytes", "max_entries", "umask",
                                        "file_mode", "owner",     NULL};
    archive_job_opts o;
    begin_call(L, &o, ARCHIVE_JOB_UNPACK, "in_file", "target_dir", known);
    o.merge = opt_bool(L, ARG_OPTS, "merge", 0);
    o.owner = opt_bool(L, ARG_OPTS, "owner", 0);
    o.max_bytes = opt_max_bytes(L);
    o.max_entries = opt_max_entries(L);
    o.umask = (unsigned)opt_int(L, ARG_OPTS, "umask", 022, 0, 0777);
    o.file_mode = (int)opt_int(L, ARG_OPTS, "file_mode", -1, 0, 07777);
    if (o.owner && geteuid() != 0)
        luaL_argerror(L, ARG_OPTS, "owner = true needs root (only root may give files away)");
    return run_call(L, &o);
}

/* archive.list(in_file [, opts]) -> {{name, type, size, mode, target}, ...}
 * Reads the members of a gzip'd or plain tar without extracting anything. name is as stored
 * (a directory's trailing "/" removed; nothing is normalised or checked); type is "file",
 * "directory", "symlink", "hardlink" or "other" (devices, fifos); size is the declared data
 * size; mode the permission bits; target the symlink or hard link target. Options:
 *   max_entries = n   bound on members (default 1,000,000)
 * Raises a usage error for bad arguments or outside a task, and a structured error (op
 * "archive.list", code "corrupt_archive", "archive_too_large", "not_found" or "io_error";
 * field path). [yields] */
static int l_list(lua_State *L)
{
    static const char *const known[] = {"max_entries", NULL};
    archive_job_opts o;
    begin_call(L, &o, ARCHIVE_JOB_LIST, "in_file", NULL, known);
    o.max_entries = opt_max_entries(L);
    return run_call(L, &o);
}

/* archive.to_records(in_file, out_file [, opts]) -> {entries, bytes}
 * Turns a gzip'd or plain tar into the records a `moonbox local` sandbox's file helper
 * extracts (see runtime/archive_records.c), checking every member as unpack does before
 * anything is written: an absolute name, a ".." component, a symlink whose target is absolute
 * or leaves the tree or has ".." after a name, a hard link, a device, fifo or socket refuse the
 * whole archive. out_file is written through a 0600 temporary file renamed into place.
 * Options: max_bytes, max_entries as for unpack. Raises a usage error for bad arguments or
 * outside a task, and a structured error (op "archive.to_records", code "unsafe_archive" with
 * member, "archive_too_large" with limit, "corrupt_archive", "not_found" or "io_error").
 * [yields] */
static int l_to_records(lua_State *L)
{
    static const char *const known[] = {"max_bytes", "max_entries", NULL};
    archive_job_opts o;
    begin_call(L, &o, ARCHIVE_JOB_TO_RECORDS, "in_file", "out_file", known);
    o.max_bytes = opt_max_bytes(L);
    o.max_entries = opt_max_entries(L);
    return run_call(L, &o);
}

/* archive.from_records(in_file, out_file [, opts]) -> {entries, bytes}
 * Writes the records a sandbox's file helper packed as a POSIX tar, gzip'd (level 1) unless
 * opts.gzip is false, through a 0600 temporary file renamed into place. Malformed records
 * raise "corrupt_archive". Options: gzip = false, max_entries. Raises as to_records (op
 * "archive.from_records"). [yields] */
static int l_from_records(lua_State *L)
{
    static const char *const known[] = {"gzip", "max_entries", NULL};
    archive_job_opts o;
    begin_call(L, &o, ARCHIVE_JOB_FROM_RECORDS, "in_file", "out_file", known);
    o.gzip = opt_bool(L, ARG_OPTS, "gzip", 1);
    o.max_entries = opt_max_entries(L);
    return run_call(L, &o);
}

/* archive.live_count() -> n: archive jobs whose worker thread has not finished, including
 * cancelled ones still removing their partial output. For tests and leak hunting. */
static int l_live_count(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)archive_job_live_count());
    return 1;
}

static const luaL_Reg archive_funcs[] = {
    {"pack", l_pack},
    {"unpack", l_unpack},
    {"list", l_list},
    {"to_records", l_to_records},
    {"from_records", l_from_records},
    {"live_count", l_live_count},
    {NULL, NULL},
};

int luaopen_moonbox_archive(lua_State *L)
{
    mb_runtime_get(L);
    mb_errors_open(L);
    static const luaL_Reg call_meta[] = {{"__gc", call_gc}, {NULL, NULL}};
    mb_newclass(L, CALL_MT, NULL, call_meta);
    luaL_newlib(L, archive_funcs);
    return 1;
}
