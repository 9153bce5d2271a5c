/* task_internal.h - what the scheduler's files share: bindings/task.c (tasks, parking, the
 * drain, run, shutdown, the leak check) with task_deadline.c, task_cond.c, task_signal.c and
 * task_facts.c.
 *
 * Private to bindings/task*.c; everyone else uses mb.h, which states the scheduler's
 * invariants. Each mbt_open_* adds its functions to the moonbox.core table on top of the stack.
 */
#ifndef MOONBOX_TASK_INTERNAL_H
#define MOONBOX_TASK_INTERNAL_H

#include "mb.h"

/* The continuation of every park (mb_task_park): raises a pending cancellation or deadline,
 * else calls the parker's own continuation. */
int mbt_park_k(lua_State *L, int status, lua_KContext ctx);

/* Interrupts a parked task: runs its abort hook and queues it with reason (MB_WAKE_*). */
void mbt_interrupt(mb_task *t, int reason);

/* An abort hook that takes the task off the wait queue it parked on. */
void mbt_abort_waitq(mb_task *t, void *ud);

/* The task core.run drives, or NULL outside core.run. */
mb_task *mbt_root(void);

/* The per-task deadline timer's callback, and stopping it (task_deadline.c). */
void mbt_deadline_cb(struct ev_loop *loop, ev_timer *w, int revents);
void mbt_deadline_stop(mb_task *t);

void mbt_open_deadlines(lua_State *L);
void mbt_open_conds(lua_State *L);
void mbt_open_signals(lua_State *L);
void mbt_open_facts(lua_State *L);

#endif
