/* test_archive_names.c - unit tests for runtime/archive_names.c, the names an unpack accepts.
 *
 * Every expectation is written out by hand: the normalised name (or the refusal) for a member
 * name, and NULL or the reason for a symlink target at a given place in the tree. Chains of
 * links and hard links are pinned through the text rule they rely on (a ".." only before any
 * name, never more than the link is deep), with the tree that would escape named in a comment;
 * fuzz/fuzz_archive_names.c checks the same rules against a model of the extracted tree.
 * Prints "N passed, M failed" last and exits non-zero on any failure; ctest runs it as
 * c_archive_names.
 */
#include "archive_names.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* The normalised name, or "!" followed by the reason it was refused. */
static char *norm(const char *raw)
{
    static char out[64 * 1024];
    const char *why = "(unset)";
    char *n = archive_normalize_name(raw, &why);
    if (n) {
        CHECK(why == NULL);
        snprintf(out, sizeof out, "%s", n);
        free(n);
    } else {
        CHECK(why != NULL);
        snprintf(out, sizeof out, "!%s", why ? why : "");
    }
    return out;
}

/* The reason a symlink at `name` may not point to `target`, or "ok". */
static const char *link_check(const char *name, const char *target)
{
    const char *why = archive_symlink_problem(name, target);
    return why ? why : "ok";
}

#define ABSOLUTE "!has an absolute name"
#define DOTDOT   "!has a '..' component"

static void plain_names_are_kept(void)
{
    CHECK_STR("a", norm("a"));
    CHECK_STR("a/b/c", norm("a/b/c"));
    CHECK_STR("dir with space/f.txt", norm("dir with space/f.txt"));
}

static void dot_and_empty_components_are_dropped(void)
{
    CHECK_STR("a/b", norm("./a//b/"));
    CHECK_STR("a/b", norm("a/./b"));
    CHECK_STR("a/b", norm("././a/././b/./."));
    CHECK_STR("a", norm("a///"));
    CHECK_STR("a/b", norm("a////b"));
}

static void the_archive_root_is_the_empty_name(void)
{
    CHECK_STR("", norm(""));
    CHECK_STR("", norm("."));
    CHECK_STR("", norm("./"));
    CHECK_STR("", norm(".//./"));
}

static void absolute_names_are_refused(void)
{
    CHECK_STR(ABSOLUTE, norm("/"));
    CHECK_STR(ABSOLUTE, norm("/etc/passwd"));
    CHECK_STR(ABSOLUTE, norm("//etc"));
    CHECK_STR(ABSOLUTE, norm("/./a"));
    /* Not absolute: the leading "./" makes the slash an empty component. */
    CHECK_STR("etc", norm(".//etc"));
}

static void dotdot_components_are_refused_anywhere(void)
{
    CHECK_STR(DOTDOT, norm(".."));
    CHECK_STR(DOTDOT, norm("../a"));
    CHECK_STR(DOTDOT, norm("a/.."));
    CHECK_STR(DOTDOT, norm("a/../b"));      /* even when it stays inside */
    CHECK_STR(DOTDOT, norm("a/b/../../c")); /* and when it would end up at the root */
    CHECK_STR(DOTDOT, norm("./../a"));
    CHECK_STR(DOTDOT, norm("a//..//"));
}

static void names_that_only_look_like_dots_are_names(void)
{
    CHECK_STR("...", norm("..."));
    CHECK_STR("..a/a..", norm("..a/a.."));
    CHECK_STR(".a/.b", norm(".a/.b"));
    CHECK_STR("a/ ./. /b", norm("a/ ./. /b"));
    CHECK_STR("a\\..\\b", norm("a\\..\\b")); /* a backslash is an ordinary byte */
}

static void odd_bytes_pass_through_unchanged(void)
{
    CHECK_STR("\x01\x7f/\xff\xfe", norm("\x01\x7f/\xff\xfe"));
    CHECK_STR("\xc3\xa9t\xc3\xa9/\t\r", norm("./\xc3\xa9t\xc3\xa9//\t\r/"));
    CHECK_STR(" ", norm(" /"));
}

static void very_long_names_are_normalised_whole(void)
{
    /* 4096 components of "ab", each written as "./ab//": 24 KiB in, 12 KiB - 1 out. */
    size_t n = 4096;
    char *raw = malloc(n * 6 + 1), *want = malloc(n * 3);
    CHECK(raw && want);
    if (!raw || !want) return;
    for (size_t i = 0; i < n; i++) {
        memcpy(raw + i * 6, "./ab//", 6);
        memcpy(want + i * 3, "ab/", 3);
    }
    raw[n * 6] = '\0';
    want[n * 3 - 1] = '\0';
    CHECK_STR(want, norm(raw));
    CHECK_INT(n * 3 - 1, strlen(norm(raw)));
    /* The same with a ".." as its very last component. */
    memcpy(raw + (n - 1) * 6, "..////", 6);
    CHECK_STR(DOTDOT, norm(raw));
    free(raw);
    free(want);
}

static void normalising_twice_changes_nothing(void)
{
    const char *raws[] = {"./a//b/", "a", "", ".", "...", "x/./y/", "\xff//\x01"};
    for (size_t i = 0; i < sizeof raws / sizeof *raws; i++) {
        const char *why;
        char *once = archive_normalize_name(raws[i], &why);
        CHECK(once != NULL);
        if (!once) continue;
        CHECK_STR(once, norm(once));
        free(once);
    }
}

static void symlink_targets_inside_the_tree_are_accepted(void)
{
    CHECK_STR("ok", link_check("l", "x"));
    CHECK_STR("ok", link_check("l", "a/b/c"));
    CHECK_STR("ok", link_check("l", "."));
    CHECK_STR("ok", link_check("l", "./"));
    CHECK_STR("ok", link_check("l", "a//b/"));
    CHECK_STR("ok", link_check("l", "a/."));
    CHECK_STR("ok", link_check("l", "..."));
    CHECK_STR("ok", link_check("d/l", ".."));        /* d/l -> the root */
    CHECK_STR("ok", link_check("d/l", "../x"));      /* -> x */
    CHECK_STR("ok", link_check("d/l", "./../x"));    /* "." steps are ignored */
    CHECK_STR("ok", link_check("d/l", "..//x"));     /* so are empty ones */
    CHECK_STR("ok", link_check("d/e/l", "../../x")); /* climbs exactly to the root */
}

static void empty_and_absolute_targets_are_refused(void)
{
    CHECK_STR("has an empty target", link_check("l", ""));
    CHECK_STR("points to an absolute path", link_check("l", "/etc/passwd"));
    CHECK_STR("points to an absolute path", link_check("d/l", "/"));
    CHECK_STR("points to an absolute path", link_check("d/l", "//x"));
}

static void targets_climbing_above_the_root_are_refused(void)
{
    const char *out = "points outside the target directory";
    CHECK_STR(out, link_check("l", ".."));
    CHECK_STR(out, link_check("l", "../x"));
    CHECK_STR(out, link_check("l", "./.."));
    CHECK_STR(out, link_check("d/l", "../.."));
    CHECK_STR(out, link_check("d/l", ".././.."));
    CHECK_STR(out, link_check("d/e/l", "../../../x"));
    CHECK_STR(out, link_check("d/e/l", "../../../d/e/x")); /* comes back in, but was outside */
}

/* Chains through earlier links. With a -> "." (accepted: it is the root), "a/../x" would be the
 * root's parent's x, though its text looks like it stays inside; so a ".." after any name is
 * refused, whatever the names are (no check of the text can know which are links, and members
 * may come in any order). Names alone are fine: each is a real directory or a link that passed
 * the same check. */
static void dotdot_after_a_name_is_refused_because_names_may_be_links(void)
{
    const char *after = "has '..' after a name in its target";
    CHECK_STR("ok", link_check("a", "."));
    CHECK_STR(after, link_check("b", "a/.."));
    CHECK_STR(after, link_check("b", "a/../x"));
    CHECK_STR(after, link_check("d/b", "../a/../.."));
    CHECK_STR(after, link_check("d/e/b", "../a/.."));
    CHECK_STR("ok", link_check("b", "a/a/a/x")); /* a/a/a is the root again: -> x */
    /* d/up -> ".." is the root; a link through it with more ".." is refused where it stands. */
    CHECK_STR("ok", link_check("d/up", ".."));
    CHECK_STR(after, link_check("c", "d/up/.."));
    CHECK_STR("ok", link_check("c", "d/up/d/up/x"));
}

/* A hard link to a symlink is the same link text in the hard link's directory, so unpack checks
 * the text again from there; and a hard link's own target is a member name, normalised as
 * one. */
static void hard_links_are_checked_from_their_own_place(void)
{
    /* d/l -> "../x" is the root's x; a hard link "h" to it at the root would point at ../x. */
    CHECK_STR("ok", link_check("d/l", "../x"));
    CHECK_STR("points outside the target directory", link_check("h", "../x"));
    /* The same text one level deeper is still inside. */
    CHECK_STR("ok", link_check("e/h", "../x"));
    /* Hard link targets: absolute or ".." names are refused like member names. */
    CHECK_STR(ABSOLUTE, norm("/etc/shadow"));
    CHECK_STR(DOTDOT, norm("../outside"));
    CHECK_STR("d/f", norm("./d//f"));
}

int main(void)
{
    RUN(plain_names_are_kept);
    RUN(dot_and_empty_components_are_dropped);
    RUN(the_archive_root_is_the_empty_name);
    RUN(absolute_names_are_refused);
    RUN(dotdot_components_are_refused_anywhere);
    RUN(names_that_only_look_like_dots_are_names);
    RUN(odd_bytes_pass_through_unchanged);
    RUN(very_long_names_are_normalised_whole);
    RUN(normalising_twice_changes_nothing);
    RUN(symlink_targets_inside_the_tree_are_accepted);
    RUN(empty_and_absolute_targets_are_refused);
    RUN(targets_climbing_above_the_root_are_refused);
    RUN(dotdot_after_a_name_is_refused_because_names_may_be_links);
    RUN(hard_links_are_checked_from_their_own_place);
    return check_summary();
}
