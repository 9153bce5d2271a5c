/* fuzz_archive_names.c - libFuzzer target for runtime/archive_names.c, unpack's name checks.
 *
 * Input layout: one archive member per line ('\n'); a line is a type byte ('d' directory, 'l'
 * symlink, 'h' hard link, anything else a regular file), the member name, and for links a NUL
 * and the target. Seeds in corpus/archive_names/ are such lines.
 *
 * Properties checked, each aborting on a violation:
 *  - a normalised name never starts with '/', has no empty, "." or ".." component, keeps every
 *    other component of the raw name in order, and normalising it again gives it back; a name
 *    is refused exactly when it is absolute or has a ".." component;
 *  - a link the checks accept never resolves outside the root. The members are applied to a
 *    model of the extracted tree with unpack's rules (archive_unpack.c): names and targets
 *    through archive_names.c, the kernel layer's refusal of a member below a symlink or a file,
 *    replacement of an earlier member of the same name unless it is a directory with entries,
 *    and hard links only to an earlier file or symlink, whose text is checked again from the
 *    hard link's place. Refused members are left out (the real unpack stops there; every
 *    sequence left is itself an input). After every member, every link in the model is
 *    resolved through every chain of links (missing names count as directories, so links that
 *    later members could complete are covered too) and must never climb above the root.
 */
#include "archive_names.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_MEMBERS 64
#define MAX_HOPS    40        /* links followed in one resolution, as the kernel's ELOOP */
#define PATH_CAP    (1 << 18) /* resolution buffer; a longer path stops the walk, unjudged */

enum kind { K_DIR = 1, K_FILE, K_LINK };

typedef struct entry {
    char *path; /* normalised, never "" */
    int kind;
    char *target; /* K_LINK: the link text */
} entry;

static entry model[MAX_MEMBERS * 64]; /* members and the directories they imply */
static size_t nmodel;
static const char *current_input;

static void fail(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_archive_names: invariant violated: %s (%s)\n", what,
            detail ? detail : "");
    abort();
}

/* ---- normalisation ------------------------------------------------------------------------- */

static int is_dotdot(const char *p, size_t n)
{
    return n == 2 && p[0] == '.' && p[1] == '.';
}

static int is_dot(const char *p, size_t n)
{
    return n == 1 && p[0] == '.';
}

/* Checks the contract of archive_normalize_name on raw; returns its result (caller frees). */
static char *checked_normalize(const char *raw)
{
    const char *why = NULL;
    char *n = archive_normalize_name(raw, &why);

    /* What the name should be, computed the plain way: every component but "" and ".". */
    size_t len = strlen(raw);
    char *want = malloc(len + 1);
    if (!want) abort();
    size_t o = 0;
    int refuse = raw[0] == '/';
    for (const char *p = raw; *p;) {
        size_t k = strcspn(p, "/");
        if (is_dotdot(p, k)) refuse = 1;
        if (k > 0 && !is_dot(p, k)) {
            if (o) want[o++] = '/';
            memcpy(want + o, p, k);
            o += k;
        }
        p += k;
        if (*p) p++;
    }
    want[o] = '\0';

    if (refuse) {
        if (n) fail("an absolute or '..' name was accepted", raw);
        if (!why || !*why) fail("a refused name has no reason", raw);
        free(want);
        return NULL;
    }
    if (!n) fail("a relative name without '..' was refused", raw);
    if (why) fail("an accepted name came with a reason", raw);
    if (n[0] == '/') fail("a normalised name starts with '/'", n);
    if (strcmp(n, want) != 0) fail("a normalised name lost or changed a component", raw);
    for (const char *p = n; *p;) {
        size_t k = strcspn(p, "/");
        if (k == 0 || is_dot(p, k) || is_dotdot(p, k))
            fail("a normalised name has an empty, '.' or '..' component", n);
        p += k;
        if (*p) p++;
    }
    const char *why2 = NULL;
    char *again = archive_normalize_name(n, &why2);
    if (!again || strcmp(again, n) != 0) fail("normalising twice is not a no-op", n);
    free(again);
    free(want);
    return n;
}

/* ---- the model of the extracted tree -------------------------------------------------------- */

static entry *find(const char *path, size_t len)
{
    for (size_t i = 0; i < nmodel; i++)
        if (strlen(model[i].path) == len && memcmp(model[i].path, path, len) == 0) return &model[i];
    return NULL;
}

static int has_children(const char *path)
{
    size_t len = strlen(path);
    for (size_t i = 0; i < nmodel; i++)
        if (strncmp(model[i].path, path, len) == 0 && model[i].path[len] == '/') return 1;
    return 0;
}

/* The kernel layer: every proper prefix of rel must be a directory or missing. */
static int parents_are_dirs(const char *rel)
{
    for (const char *s = strchr(rel, '/'); s; s = strchr(s + 1, '/')) {
        entry *e = find(rel, (size_t)(s - rel));
        if (e && e->kind != K_DIR) return 0;
    }
    return 1;
}

static void add_parents(const char *rel)
{
    for (const char *s = strchr(rel, '/'); s; s = strchr(s + 1, '/')) {
        if (find(rel, (size_t)(s - rel))) continue;
        entry *e = &model[nmodel++];
        e->path = strndup(rel, (size_t)(s - rel));
        if (!e->path) abort();
        e->kind = K_DIR;
        e->target = NULL;
    }
}

/* Puts (rel, kind, target) into the model as make_room and the writers do; 0 when refused. */
static int place(const char *rel, int kind, const char *target)
{
    entry *e = find(rel, strlen(rel));
    if (e && e->kind == K_DIR) {
        if (kind == K_DIR) return 1;
        if (has_children(rel)) return 0; /* would replace a directory an earlier member filled */
    }
    size_t depth = 0;
    for (const char *c = rel; *c; c++)
        depth += *c == '/';
    if (nmodel + depth + 1 > sizeof model / sizeof *model) return 0; /* too big to model */
    add_parents(rel);
    e = find(rel, strlen(rel));
    if (!e) {
        e = &model[nmodel++];
        if (!(e->path = strdup(rel))) abort();
    } else {
        free(e->target);
    }
    e->kind = kind;
    e->target = NULL;
    if (target && !(e->target = strdup(target))) abort();
    return 1;
}

static void model_free(void)
{
    for (size_t i = 0; i < nmodel; i++) {
        free(model[i].path);
        free(model[i].target);
    }
    nmodel = 0;
}

/* ---- resolution ------------------------------------------------------------------------------ */

static char rpath[PATH_CAP]; /* the real directory walked so far, "" for the root */
static size_t rlen;

/* Follows text from the directory in rpath; returns 0 when it stops (missing, a file, too long,
 * too many hops) and aborts if a ".." climbs above the root. */
static int follow(const char *text, int *hops, const char *link)
{
    for (const char *p = text; *p;) {
        size_t k = strcspn(p, "/");
        if (is_dotdot(p, k)) {
            if (rlen == 0) {
                fprintf(stderr, "link %s -> %s\ninput:\n%s\n", link, text, current_input);
                fail("an accepted link resolves outside the root", link);
            }
            while (rlen > 0 && rpath[rlen - 1] != '/')
                rlen--;
            if (rlen > 0) rlen--; /* the '/' */
        } else if (k > 0 && !is_dot(p, k)) {
            size_t before = rlen;
            if (rlen + 1 + k >= PATH_CAP) return 0;
            if (rlen) rpath[rlen++] = '/';
            memcpy(rpath + rlen, p, k);
            rlen += k;
            entry *e = find(rpath, rlen);
            if (e && e->kind == K_FILE && p[k]) return 0; /* ENOTDIR */
            if (e && e->kind == K_LINK) {
                if (++*hops > MAX_HOPS) return 0;
                rlen = before; /* the link's own directory */
                if (!follow(e->target, hops, link)) return 0;
            }
        }
        p += k;
        if (*p) p++;
    }
    return 1;
}

static void check_every_link(void)
{
    for (size_t i = 0; i < nmodel; i++) {
        if (model[i].kind != K_LINK) continue;
        const char *slash = strrchr(model[i].path, '/');
        rlen = slash ? (size_t)(slash - model[i].path) : 0;
        memcpy(rpath, model[i].path, rlen);
        int hops = 0;
        follow(model[i].target, &hops, model[i].path);
    }
}

/* ---- members --------------------------------------------------------------------------------- */

static void member(char type, const char *name, const char *target)
{
    char *rel = checked_normalize(name);
    if (!rel) return;
    if (!*rel || !parents_are_dirs(rel)) goto out;
    if (type == 'l') {
        const char *why = archive_symlink_problem(rel, target);
        if (why && !*why) fail("a refused symlink has an empty reason", target);
        if (!why && (target[0] == '/' || !target[0]))
            fail("an empty or absolute symlink target was accepted", target);
        if (!why) place(rel, K_LINK, target);
    } else if (type == 'h') {
        char *t = checked_normalize(target);
        entry *e = t && *t && parents_are_dirs(t) ? find(t, strlen(t)) : NULL;
        if (e && strcmp(t, rel) != 0) {
            if (e->kind == K_FILE) {
                place(rel, K_FILE, NULL);
            } else if (e->kind == K_LINK && !archive_symlink_problem(rel, e->target)) {
                char *text = strdup(e->target); /* e may move when place() grows the model */
                if (!text) abort();
                place(rel, K_LINK, text);
                free(text);
            }
        }
        free(t);
    } else {
        place(rel, type == 'd' ? K_DIR : K_FILE, NULL);
    }
    check_every_link();
out:
    free(rel);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text) abort();
    memcpy(text, data, size);
    text[size] = '\0';
    current_input = text;
    size_t members = 0;
    for (size_t at = 0; at < size && members < MAX_MEMBERS; members++) {
        const uint8_t *nl = memchr(data + at, '\n', size - at);
        size_t end = nl ? (size_t)(nl - data) : size;
        text[end] = '\0';
        if (end > at) {
            /* Type byte, name up to a NUL, then the target (up to the line's end or a NUL). */
            const char *name = text + at + 1;
            const char *nul = memchr(name, '\0', end - at - 1 + 1);
            const char *target = nul && nul < text + end ? nul + 1 : "";
            member(text[at], name, target);
        }
        at = end + 1;
    }
    model_free();
    free(text);
    return 0;
}
