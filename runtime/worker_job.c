/* worker_job.c - a function on a worker thread, its completion sent to the loop by ev_async.
 *
 * Ownership: two references, the worker's and the owner's, counted under the job's mutex;
 * whoever drops the last frees the job (and its argument). The ev_async is started and stopped
 * on the loop thread only; the worker sends it under the mutex and only while the owner has not
 * released the job, so the watcher is never touched after the owner stopped it. (The earlier
 * alternative, the owner polling a done flag with sleeps between polls, cost a wake-up delay of
 * up to the sleep on every job and a timer per waiting task.)
 */
#include "worker_job.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

struct worker_job {
    struct ev_loop *loop;
    ev_async done_watcher; /* loop thread starts and stops it; the worker only sends it */
    worker_job_fn run;
    void (*free_arg)(void *arg);
    void *arg;
    worker_job_done_fn done;
    void *ud;
    pthread_mutex_t mu; /* guards refs, abandoned, finished */
    int refs;           /* 2 while both the worker and the owner hold the job */
    int abandoned;      /* the owner released it; the watcher is stopped */
    int finished;       /* run returned */
};

static void job_free(worker_job *w)
{
    if (w->free_arg) w->free_arg(w->arg);
    pthread_mutex_destroy(&w->mu);
    free(w);
}

static void job_unref_locked_and_unlock(worker_job *w)
{
    int last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (last) job_free(w);
}

/* The loop thread learns that the worker finished; the owner's done decides what it means. */
static void done_cb(struct ev_loop *loop, ev_async *a, int revents)
{
    worker_job *w = (worker_job *)a->data;
    (void)revents;
    pthread_mutex_lock(&w->mu); /* pairs with the worker's unlock: its writes are visible */
    int finished = w->finished;
    pthread_mutex_unlock(&w->mu);
    if (!finished) return;
    ev_async_stop(loop, a);
    w->done(w, w->ud);
}

static void *job_main(void *p)
{
    worker_job *w = (worker_job *)p;
    w->run(w->arg);
    pthread_mutex_lock(&w->mu);
    w->finished = 1;
    if (!w->abandoned) ev_async_send(w->loop, &w->done_watcher);
    job_unref_locked_and_unlock(w);
    return NULL;
}

int worker_job_start(struct ev_loop *loop, worker_job_fn run, void (*free_arg)(void *arg),
                     void *arg, worker_job_done_fn done, void *ud, worker_job **out)
{
    worker_job *w = (worker_job *)calloc(1, sizeof *w);
    if (!w) return ENOMEM;
    w->loop = loop;
    w->run = run;
    w->free_arg = free_arg;
    w->arg = arg;
    w->done = done;
    w->ud = ud;
    pthread_mutex_init(&w->mu, NULL);
    w->refs = 2;
    ev_async_init(&w->done_watcher, done_cb);
    w->done_watcher.data = w;
    ev_async_start(loop, &w->done_watcher);
    pthread_attr_t attr;
    pthread_t tid;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int r = pthread_create(&tid, &attr, job_main, w);
    pthread_attr_destroy(&attr);
    if (r != 0) {
        ev_async_stop(loop, &w->done_watcher);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return r;
    }
    *out = w;
    return 0;
}

int worker_job_finished(worker_job *w)
{
    pthread_mutex_lock(&w->mu);
    int f = w->finished;
    pthread_mutex_unlock(&w->mu);
    return f;
}

void worker_job_release(worker_job *w)
{
    pthread_mutex_lock(&w->mu);
    w->abandoned = 1;
    ev_async_stop(w->loop, &w->done_watcher);
    job_unref_locked_and_unlock(w);
}
