/* archive_names.h - the security core of unpacking: which member names and link targets are safe.
 *
 * Pure functions of strings (no filesystem, no job, no libarchive), so they are unit tested
 * (tests/c/test_archive_names.c) and fuzzed (fuzz/fuzz_archive_names.c) on their own. They are
 * the first of unpack's two layers of defence; the second, the kernel refusing to follow a
 * symlink on the way to any member, is in archive_unpack.c, which says why both are needed.
 * Callers: archive_unpack.c and archive_records.c, before anything of a member is written.
 */
#ifndef MOONBOX_ARCHIVE_NAMES_H
#define MOONBOX_ARCHIVE_NAMES_H

/* Normalises a member name: drops empty and "." components ("./a//b/" is "a/b"; GNU tar writes
 * "./" prefixes). Returns NULL and sets *why for an absolute name or a ".." component, else a
 * malloc'd relative name ("" for the archive's root, "." itself) with no leading, trailing or
 * doubled '/', no "." and no ".." component. */
char *archive_normalize_name(const char *raw, const char **why);

/* Checks the target of a symlink whose normalised name is `name`: NULL when it is safe, else
 * the reason, a phrase ("points to an absolute path"). Safe targets have the form
 * "../../some/path" with no more ".." than the link is deep (see archive_names.c for why). */
const char *archive_symlink_problem(const char *name, const char *target);

#endif
