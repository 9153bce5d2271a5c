/* archive_unpack.h - ARCHIVE_JOB_UNPACK: a (gzip'd) tar extracted safely into a directory.
 *
 * Runs on the job's worker thread only (archive_job.c calls it). Writes into a fresh 0700
 * staging directory beside the target and moves only a complete, checked tree into place
 * (archive_commit.c); on failure or cancellation the staging directory is removed.
 */
#ifndef MOONBOX_ARCHIVE_UNPACK_H
#define MOONBOX_ARCHIVE_UNPACK_H

#include "archive_job.h"

/* Unpacks j->src into j->dst; returns the job's status (also recorded in j->res). */
int archive_unpack_run(archive_job *j);

#endif
