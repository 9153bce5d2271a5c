/* archive_job.c - an archive job's life: start, the worker thread, completion, release.
 *
 * libarchive parses and writes tar headers and gzips the packs we write; gunzipping input and
 * every filesystem step are done by the archive_*.c files (see archive_read.c and
 * archive_unpack.c for why). Extraction goes to a fresh 0700 staging directory beside the
 * target and only a complete, checked tree is moved into place; a pack goes to a 0600 temporary
 * file renamed over the output once complete. Any failure or cancellation removes that partial
 * output before the worker ends, so nothing half-written is ever visible under the caller's
 * names. This file owns the job's threads and references and runs the job kind's worker
 * function (archive_pack.c, archive_read.c, archive_unpack.c, archive_records.c); the public
 * contract is tarball.h. Start and release run on the loop thread.
 */
#include "archive_job.h"

#include "archive_pack.h"
#include "archive_read.h"
#include "archive_records.h"
#include "archive_unpack.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXIT_WAIT_SECS 10 /* how long the process waits at exit for workers to clean up */

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

/* ---- results (see archive_job.h) ----------------------------------------------------------- */

int archive_job_fail(archive_job *j, int status, const char *member, const char *limit,
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

int archive_job_fail_errno(archive_job *j, int e, const char *what, const char *path)
{
    return archive_job_fail(j, e == ENOENT ? ARCHIVE_JOB_NOT_FOUND : ARCHIVE_JOB_IO_ERROR, NULL,
                            NULL, "%s %s: %s", what, path, strerror(e));
}

int archive_job_fail_cancelled(archive_job *j)
{
    return archive_job_fail(j, ARCHIVE_JOB_CANCELLED, NULL, NULL, "the job was cancelled");
}

int archive_job_fail_nomem(archive_job *j)
{
    return archive_job_fail(j, ARCHIVE_JOB_IO_ERROR, NULL, NULL, "out of memory");
}
/* ---- job lifecycle -------------------------------------------------------------------------- */

/* Ownership of a job: the worker-job primitive (runtime/worker_job.c) holds the thread's and
 * the owner's references and frees the job with job_free once both let go. */

static void job_free(void *arg)
{
    archive_job *j = (archive_job *)arg;
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
static void job_done(worker_job *w, void *ud)
{
    archive_job *j = (archive_job *)ud;
    (void)w;
    j->notify(j, j->notify_ud);
}

static void job_run(void *arg)
{
    archive_job *j = (archive_job *)arg;
    switch (j->kind) {
    case ARCHIVE_JOB_PACK:
        archive_pack_run(j);
        break;
    case ARCHIVE_JOB_UNPACK:
        archive_unpack_run(j);
        break;
    case ARCHIVE_JOB_TO_RECORDS:
        archive_to_records_run(j);
        break;
    case ARCHIVE_JOB_FROM_RECORDS:
        archive_from_records_run(j);
        break;
    default:
        archive_list_run(j);
        break;
    }
    j->res.message = j->message ? j->message : (j->res.status ? "out of memory" : "");
    j->res.member = j->member;
    j->res.items = j->items;
    live_unlink(j); /* after the partial output is gone: the wait at exit relies on it */
}

/* tarball.h has the caller's contract. Here: the job holds two references, the caller's (until
 * archive_job_release) and the worker's (until job_main returns); src and dst are copied; the
 * ev_async done_watcher is started before the thread so that the worker's wake-up cannot be
 * lost, and it keeps the loop alive until the result is taken. The job joins the live list that
 * the exit handler waits on. On failure (ARCHIVE_JOB_IO_ERROR, a sentence in err, at most
 * errlen bytes) nothing is left: no thread, no watcher, no memory. Does not block. */
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
    j->notify = o->notify;
    j->notify_ud = o->notify_ud;
    atomic_init(&j->cancel, 0);
    pthread_once(&g_atexit_once, register_exit_wait);
    live_link(j);
    int r = worker_job_start(loop, job_run, job_free, j, job_done, j, &j->work);
    if (r != 0) {
        live_unlink(j);
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
    worker_job_release(j->work);
}
