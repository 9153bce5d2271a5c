/* archive_pack.h - ARCHIVE_JOB_PACK: a directory tree into a (gzip'd) tar.
 *
 * Runs on the job's worker thread only (archive_job.c calls it). Writes a 0600 temporary file
 * beside the output and renames it into place once complete; on failure removes it.
 */
#ifndef MOONBOX_ARCHIVE_PACK_H
#define MOONBOX_ARCHIVE_PACK_H

#include "archive_job.h"

/* Packs j->src into j->dst; returns the job's status (also recorded in j->res). */
int archive_pack_run(archive_job *j);

#endif
