/* archive_names.c - member names and symlink targets an unpack may accept (see archive_names.h).
 *
 * The rules are on the text alone, and strict enough that no check of the filesystem is needed
 * to know a link stays inside the tree, whatever order members come in. No allocation but the
 * normalised name; no state; safe on any thread.
 */
#include "archive_names.h"

#include <stdlib.h>
#include <string.h>

char *archive_normalize_name(const char *raw, const char **why)
{
    *why = NULL;
    if (raw[0] == '/') {
        *why = "has an absolute name";
        return NULL;
    }
    size_t len = strlen(raw);
    char *out = (char *)malloc(len + 1);
    if (!out) {
        *why = "could not be examined (out of memory)";
        return NULL;
    }
    size_t o = 0;
    const char *p = raw;
    while (*p) {
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') {
            free(out);
            *why = "has a '..' component";
            return NULL;
        }
        if (n > 0 && !(n == 1 && p[0] == '.')) {
            if (o > 0) out[o++] = '/';
            memcpy(out + o, p, n);
            o += n;
        }
        p += n;
        if (*p == '/') p++;
    }
    out[o] = '\0';
    return out;
}

/* Checks the target of a symlink whose normalised name is `name`. A relative target is
 * resolved from the link's directory; it must stay inside the tree. Targets are accepted only
 * in the form "../../some/path": leading ".." steps (no more than the link is deep) and then
 * names. A ".." after a name ("a/../b") is refused even when it looks harmless, because if
 * "a" is itself a link (extracted before or after this one) "a/.." is the parent of wherever
 * "a" points (with a -> ".", "a/../x" is above the tree), which no check of the text can know.
 * With that form, ".." only ever climbs real directories from the link's real location, and
 * each later name is either a real directory or another link that passed the same check, so no
 * chain of links leaves the tree.
 * Returns NULL when safe, else the reason. */
const char *archive_symlink_problem(const char *name, const char *target)
{
    if (!*target) return "has an empty target";
    if (target[0] == '/') return "points to an absolute path";
    int depth = 0;
    for (const char *s = name; *s; s++)
        if (*s == '/') depth++;
    int ups = 0, named = 0;
    const char *p = target;
    while (*p) {
        const char *end = strchr(p, '/');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') {
            if (named) return "has '..' after a name in its target";
            if (++ups > depth) return "points outside the target directory";
        } else if (n > 0 && !(n == 1 && p[0] == '.')) {
            named = 1;
        }
        p += n;
        if (*p == '/') p++;
    }
    return NULL;
}
