/* archive_read.h - reading archives: the input side of unpack, list and to-records.
 *
 * A reader is one archive file opened for libarchive's tar parser, gunzipped here (see below);
 * archive_reader_finish must be called after the last member so a gzip trailer is checked.
 * Also ARCHIVE_JOB_LIST, which is nothing but reading. Worker thread only; a reader belongs to
 * one job.
 */
#ifndef MOONBOX_ARCHIVE_READ_H
#define MOONBOX_ARCHIVE_READ_H

#include "archive_job.h"

#include <archive.h>
#include <zlib.h>

/* The input of unpack and list: the archive file, gunzipped here when it starts with the gzip
 * magic, and handed to libarchive as a plain tar. libarchive's own gzip reader does not check
 * the CRC-32 and length in the gzip trailer (a TODO in its source), and its tar reader stops at
 * the end-of-archive blocks without reading on to the trailer, so a damaged download would be
 * extracted with wrong bytes and no error. zlib in gzip mode checks both; after the last tar
 * member the rest of the stream is read too, so the trailer is always checked. Concatenated
 * gzip members and zero padding after the stream (tape blocking) are accepted, as gzip does. */
typedef struct in_stream {
    int fd;
    int gzip;       /* the file starts with the gzip magic */
    int member_end; /* a gzip member ended: what follows must be another one or zero bytes */
    int eof;
    int zlib_ready;
    z_stream zs;
    unsigned char *in, *out;
    size_t raw_len; /* plain input: bytes of `in` (the sniffed first block) not handed out */
    int os_error;   /* errno of a failed read(2), else 0 */
} in_stream;

typedef struct reader {
    struct archive *a;
    in_stream s;
} reader;

/* Opens j->src as a gzip'd or plain tar (told apart by its first two bytes). After a failure
 * archive_reader_close is still needed. */
int archive_reader_open(archive_job *j, reader *r);
void archive_reader_close(reader *r);

/* Turns a failed libarchive read into CORRUPT, or IO_ERROR when the OS failed the read. */
int archive_reader_fail(archive_job *j, reader *r);

/* After the last member: reads the rest of a gzip stream so its trailer is checked. */
int archive_reader_finish(archive_job *j, reader *r);

/* The next member of the archive, the one loop every reading job shares: ARCHIVE_JOB_OK with
 * *e set; ARCHIVE_JOB_OK with *e NULL after the last member (the gzip trailer checked, as
 * archive_reader_finish); or the failure (corrupt input, cancellation, more than max_entries
 * members), recorded on the job. Counts members in j->res.entries. */
int archive_reader_next(archive_job *j, reader *r, struct archive_entry **e);

/* ARCHIVE_JOB_LIST: the members of j->src into j->items. */
int archive_list_run(archive_job *j);

#endif
