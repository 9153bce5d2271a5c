/* worker_job.h - the one worker-job primitive: a function run on its own thread whose completion
 * wakes the loop through an ev_async.
 *
 * Owns the thread, the two references (the worker's and the owner's) and the wake-up. Called
 * on the loop thread by runtime code that offloads blocking work (runtime/archive_job.c, the
 * filesystem jobs of runtime/fs_jobs.c); bindings never see it. The done callback runs on the
 * loop thread, never after the owner released the job, and must not call Lua (it wakes a task).
 */
#ifndef MOONBOX_WORKER_JOB_H
#define MOONBOX_WORKER_JOB_H

#include <ev.h>

typedef struct worker_job worker_job;

typedef void (*worker_job_fn)(void *arg); /* the work, on the worker thread */
typedef void (*worker_job_done_fn)(worker_job *w,
                                   void *ud); /* loop thread, once, if not released */

/* Runs run(arg) on a new detached thread; when it returns, done(w, ud) is called on loop's
 * thread unless the owner released w first. free_arg(arg) (may be NULL) runs once both the
 * worker has finished and the owner has released w, on whichever thread lets go last. Returns
 * 0 with *out set, or an errno (the thread could not start; nothing was run or freed). */
int worker_job_start(struct ev_loop *loop, worker_job_fn run, void (*free_arg)(void *arg),
                     void *arg, worker_job_done_fn done, void *ud, worker_job **out);

/* Whether the worker has finished (loop thread; its writes to arg are then visible). */
int worker_job_finished(worker_job *w);

/* The owner lets go: done is not called any more; the worker, if still running, finishes on
 * its own and the last side frees. Loop thread only. */
void worker_job_release(worker_job *w);

#endif
