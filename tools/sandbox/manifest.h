/* manifest.h - what a snapshot layer holds, summed up so that a complete layer can be told from
 * a half-written or damaged one (shift.c writes it at capture, `moonbox-sandbox verify` checks a
 * layer against it).
 *
 * A manifest is the text file LAYER.manifest beside the layer:
 *
 *   moonbox-manifest 1
 *   files N        entries below the layer's root (of every kind)
 *   bytes B        sizes of its regular files, a file with several links counted once
 *   meta HEX       sha256 of the entries' records, in walk order
 *   tree HEX       sha256 of the same records, each regular file's followed by its contents' sha256
 *
 * The walk is depth first from the root, each directory's entries sorted by name (bytes, as
 * strcmp), a directory's record before its entries. An entry's record is a sequence of fields,
 * each a 4-byte big-endian length and that many bytes: its path ("/" for the root, "/a/b"
 * below), type (one of f d l c b p s), mode (octal, the 07777 bits), uid, gid, size (regular
 * files; else 0), link count (all but directories; else 0), device ("MAJOR:MINOR" for c and b;
 * else empty), symlink target (else empty), the number of extended attributes, then each
 * attribute's name and value, sorted by name. Numbers are decimal text. Timestamps are not in it
 * (reading a file may change its atime). Memory: the names of the directories on the current
 * path, and a linkmap entry per multiply-linked inode (bounded, spilling; linkmap.h).
 */
#ifndef MOONBOX_SANDBOX_MANIFEST_H
#define MOONBOX_SANDBOX_MANIFEST_H

#include "sha256.h"

#define MANIFEST_HEADER "moonbox-manifest 1"

struct manifest {
    unsigned long long files, bytes;
    unsigned char meta[SHA256_BYTES], tree[SHA256_BYTES];
    int has_tree; /* tree was computed (contents read) */
};

/* Why a walk failed: the step, the path inside the layer, errno (0: msg says it all). */
struct manifest_error {
    char step[64];
    char path[4096];
    int err;
};

/* Walks the layer open on dirfd and fills *out; contents: also read every regular file for
 * tree. Temporary files of the walk's link table go to the directory open on spill_dirfd.
 * Returns 0, or -1 with *e filled. */
int manifest_compute(int dirfd, int contents, int spill_dirfd, struct manifest *out,
                     struct manifest_error *e);

/* The manifest's text (at most 256 bytes with the NUL) into buf. */
void manifest_format(const struct manifest *m, char *buf, size_t len);

/* Parses a manifest's text; 0, or -1 with a reason in why. */
int manifest_parse(const char *text, struct manifest *m, const char **why);

/* Writes the manifest atomically as name in the directory open on dirfd: name.tmp, fsync,
 * rename, fsync of the directory. Returns 0 or an errno. */
int manifest_write(int dirfd, const char *name, const struct manifest *m);

#endif
