/* tarball.h - gzip'd tar archives of directory trees, packed, listed and extracted safely on
 * worker threads so the libev loop keeps running.
 *
 * Owns one archive job from start to release: a detached worker thread, an ev_async that tells
 * the loop the job finished, the result, and every partial output (the pack's temporary file,
 * the unpack's staging directory), which the worker removes unless the job succeeded.
 * Start and release on the loop's thread; notify runs there and must only record and wake.
 * No Lua here. (Named tarball, not archive, so that <archive.h> is always libarchive's.)
 * The implementation, one concern a file: archive_job.c (threads, references, completion),
 * archive_pack.c, archive_read.c (gunzip, tar reading, list), archive_names.c (which names and
 * link targets are safe), archive_unpack.c (staging), archive_commit.c (into place),
 * archive_records.c (a sandbox's file helper's stream), archive_fs.c (shared helpers). */
#ifndef MOONBOX_ARCHIVE_H
#define MOONBOX_ARCHIVE_H

#include <stddef.h>
#include <stdint.h>

#include <ev.h>

/* Defaults of the unpack limits: total uncompressed bytes of regular files, and members. */
#define ARCHIVE_DEFAULT_MAX_BYTES   (16ULL * 1024 * 1024 * 1024)
#define ARCHIVE_DEFAULT_MAX_ENTRIES 1000000ULL

/* Directory levels a pack walks and a merge descends; each level holds one open fd, so a bound
 * keeps a deep tree from exhausting the process's descriptors. */
#define ARCHIVE_MAX_DEPTH 256

enum archive_job_kind {
    ARCHIVE_JOB_PACK = 1,     /* src: a directory; dst: the archive file to write */
    ARCHIVE_JOB_UNPACK,       /* src: an archive file; dst: the directory to create or merge into */
    ARCHIVE_JOB_LIST,         /* src: an archive file; dst unused */
    ARCHIVE_JOB_TO_RECORDS,   /* src: an archive file; dst: records for a sandbox's file helper */
    ARCHIVE_JOB_FROM_RECORDS, /* src: records a file helper packed; dst: the archive to write */
};

/* Outcomes; the result's message says what happened in a sentence. */
enum archive_job_status {
    ARCHIVE_JOB_OK = 0,
    ARCHIVE_JOB_NOT_FOUND = -1, /* the source, or the directory the output goes in, is missing */
    ARCHIVE_JOB_IO_ERROR = -2,  /* reading or writing the filesystem failed */
    ARCHIVE_JOB_UNSAFE = -3,    /* a member was refused by the safety rules; member names it */
    ARCHIVE_JOB_TOO_LARGE = -4, /* a limit was exceeded; limit names which */
    ARCHIVE_JOB_CORRUPT = -5,   /* the input is not a readable (gzip'd) tar */
    ARCHIVE_JOB_TARGET_EXISTS = -6,  /* unpack without merge onto an existing path */
    ARCHIVE_JOB_MERGE_CONFLICT = -7, /* merge would replace a directory by a non-directory */
    ARCHIVE_JOB_CANCELLED = -8,      /* released before it finished (never seen by the owner) */
};

/* Member types reported by ARCHIVE_JOB_LIST. */
enum archive_item_type {
    ARCHIVE_ITEM_FILE = 1,
    ARCHIVE_ITEM_DIRECTORY,
    ARCHIVE_ITEM_SYMLINK,
    ARCHIVE_ITEM_HARDLINK,
    ARCHIVE_ITEM_OTHER,
};

typedef struct archive_item {
    char *name;    /* as stored, without a directory's trailing '/' */
    char *target;  /* symlink or hard link target, else NULL */
    int type;      /* enum archive_item_type */
    int64_t size;  /* bytes of data the member declares */
    unsigned mode; /* permission bits (07777) */
} archive_item;

typedef struct archive_job archive_job;

/* Called on the loop thread once the worker finished (never after archive_job_release). */
typedef void (*archive_job_notify_fn)(archive_job *job, void *ud);

typedef struct archive_job_opts {
    int kind;             /* enum archive_job_kind */
    const char *src;      /* copied by archive_job_start */
    const char *dst;      /* copied by archive_job_start; NULL for ARCHIVE_JOB_LIST */
    int gzip;             /* pack: 1 gzip the tar, 0 plain tar */
    int merge;            /* unpack: merge into an existing dst instead of refusing it */
    int owner;            /* unpack: restore numeric uid/gid from the archive (needs root) */
    unsigned umask;       /* unpack: bits cleared from every mode taken from the archive */
    int file_mode;        /* unpack: mode forced on regular files, or -1 to use the archive's */
    uint64_t max_bytes;   /* unpack: bound on regular-file bytes (see the defaults above) */
    uint64_t max_entries; /* unpack, list: bound on members */
    archive_job_notify_fn notify;
    void *notify_ud;
} archive_job_opts;

typedef struct archive_job_result {
    int status;          /* enum archive_job_status */
    const char *message; /* a sentence naming the paths and the reason; "" on success */
    const char *member;  /* UNSAFE, MERGE_CONFLICT, some CORRUPT: the member's name, else NULL */
    const char *limit;   /* TOO_LARGE: "max_bytes", "max_entries" or "path_length", else NULL */
    uint64_t entries;    /* members written (pack) or read (unpack, list) */
    uint64_t bytes;      /* regular-file data bytes written or extracted */
    uint64_t skipped;    /* pack: devices, fifos and sockets left out */
    const archive_item *items; /* list: the members in archive order */
    size_t nitems;
} archive_job_result;

/* Starts a job described by o on loop (the caller's thread must be the one running it): copies
 * the options, arms the completion watcher and starts a worker thread. Returns ARCHIVE_JOB_OK
 * and stores the job in *out; o->notify(job, o->notify_ud) runs on the loop thread once the
 * worker has finished and published the result. On failure (no memory, no thread) returns
 * ARCHIVE_JOB_IO_ERROR with a sentence in err and leaves nothing behind. The active watcher
 * keeps the loop alive while the job runs. */
int archive_job_start(struct ev_loop *loop, const archive_job_opts *o, archive_job **out, char *err,
                      size_t errlen);

/* The result of a finished job; valid from its notify call until archive_job_release. */
const archive_job_result *archive_job_result_of(const archive_job *job);

/* The owner gives the job up. After notify this frees it. Before notify it cancels the job:
 * notify will never run, the worker stops at its next check (between members, and every data
 * block), removes its partial output and frees the job itself. Either way the caller must not
 * use job again. Never blocks and never frees memory the worker still uses: the job is freed
 * by whichever of the worker and the owner lets go of it last. */
void archive_job_release(archive_job *job);

/* Jobs whose worker has not finished yet, including released ones still removing their
 * partial output. For tests and leak hunting. */
long archive_job_live_count(void);

#endif
