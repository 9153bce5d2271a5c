/* archive_records.h - ARCHIVE_JOB_TO_RECORDS and ARCHIVE_JOB_FROM_RECORDS.
 *
 * The conversions between tar archives and the "records" a sandbox's file helper
 * (tools/sandbox/fileops.c) reads and writes; the format is described in archive_records.c.
 * Worker thread only (archive_job.c calls them); each writes j->dst through a 0600 temporary
 * file renamed into place, removed on failure.
 */
#ifndef MOONBOX_ARCHIVE_RECORDS_H
#define MOONBOX_ARCHIVE_RECORDS_H

#include "archive_job.h"

/* A client's archive j->src into records j->dst, every member checked as unpack checks it. */
int archive_to_records_run(archive_job *j);

/* Records j->src (what a file helper packed) into a (gzip'd) tar j->dst. */
int archive_from_records_run(archive_job *j);

#endif
