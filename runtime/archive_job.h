/* archive_job.h - what the archive workers share: the job itself and how they record its outcome.
 *
 * Internal to runtime/archive_*.c (the loop side, and bindings, use tarball.h). A job is
 * written by its worker thread only, from start until it publishes the result (archive_job.c);
 * the archive_job_fail family records the first failure, later ones being its consequences,
 * and returns the status so callers can `return archive_job_fail(...)`. Workers poll
 * archive_job_cancelled between members and every data block. Nothing here touches the loop.
 */
#ifndef MOONBOX_ARCHIVE_JOB_H
#define MOONBOX_ARCHIVE_JOB_H

#include "tarball.h"
#include "worker_job.h"

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#define COPY_BLOCK     (64 * 1024) /* bytes per read/write while packing; also the read block */
#define STAGE_BASE_MAX 100         /* bytes of the target's name kept in temporary names */

struct archive_job {
    /* Fixed at start. */
    int kind;
    char *src, *dst;
    int gzip, merge, owner;
    mode_t umask;
    int file_mode;
    uint64_t max_bytes, max_entries;
    worker_job *work; /* the thread and the wake-up (runtime/worker_job.c) */
    archive_job_notify_fn notify;
    void *notify_ud;

    atomic_int cancel; /* set by release (or at exit); polled by the worker */

    /* Written by the worker only, read by the owner after notify. */
    archive_job_result res;
    char *message, *member;
    archive_item *items;
    size_t cap_items;

    archive_job *live_next, *live_prev;
};

static inline int archive_job_cancelled(archive_job *j)
{
    return atomic_load_explicit(&j->cancel, memory_order_relaxed);
}

/* Records the job's failure (the first one wins: later ones are consequences) and returns
 * status, so callers can `return archive_job_fail(...)`. member may be NULL; limit is a literal. */
int archive_job_fail(archive_job *j, int status, const char *member, const char *limit,
                     const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* "<what> <path>: <strerror(e)>", as NOT_FOUND for ENOENT, else IO_ERROR. */
int archive_job_fail_errno(archive_job *j, int e, const char *what, const char *path);
int archive_job_fail_cancelled(archive_job *j);
int archive_job_fail_nomem(archive_job *j);

#endif
