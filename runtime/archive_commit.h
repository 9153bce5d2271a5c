/* archive_commit.h - the last step of an unpack: the staged tree into place.
 *
 * archive_resolve_target finds where the target goes before anything is staged (the staging
 * directory is made beside it, so the move is a rename); archive_commit then renames the
 * staging directory onto a missing target, or merges it into an existing one after a pass
 * that finds every conflict first. Worker thread only; called by archive_unpack.c.
 */
#ifndef MOONBOX_ARCHIVE_COMMIT_H
#define MOONBOX_ARCHIVE_COMMIT_H

#include "archive_job.h"

/* Where the target is and whether it exists, resolved once: the staging directory is made in
 * the same directory (same filesystem, so moving it is a rename). */
typedef struct target_info {
    char *parent; /* canonical directory holding the target */
    char *base;   /* the target's name in it */
    int parentfd;
    int exists;
} target_info;

/* Fills ti for j->dst (ti->parentfd -1 and the strings NULL beforehand; the caller frees them
 * and closes parentfd): refuses an existing target without merge, a missing parent, and "/". */
int archive_resolve_target(archive_job *j, target_info *ti);

/* Moves the complete staging directory stage_name (open as stagefd, in ti->parent) into place.
 * A fresh target gets fresh_mode; *moved is set once the staging directory is the target, and
 * from then on the caller must not remove it. */
int archive_commit(archive_job *j, const target_info *ti, int stagefd, const char *stage_name,
                   mode_t fresh_mode, int *moved);

#endif
