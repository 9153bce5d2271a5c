/* test_linkmap.c - unit tests for tools/sandbox/linkmap.c, the hard-link table of captures.
 *
 * In memory (a zeroed map, as fileops.c keeps one) and with a small memory cap that makes it
 * spill to its unnamed files half-way through: every value put comes back byte for byte, keys
 * never put are absent, and the spill leaves no name in its directory. ctest runs it as
 * c_linkmap.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "linkmap.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "check.h"

static void value_of(unsigned i, char *buf, size_t len)
{
    /* lengths vary from 1 to ~90 bytes, so the arena's offsets are not regular */
    int n = snprintf(buf, len, "/dir%u/", i % 97);
    for (unsigned k = 0; k < i % 13; k++)
        n += snprintf(buf + n, len - (size_t)n, "n%u", i);
}

static void fill_and_check(linkmap *m, unsigned count, dev_t dev)
{
    char v[256];
    for (unsigned i = 0; i < count; i++) {
        value_of(i, v, sizeof v);
        CHECK_INT(0, linkmap_put(m, dev, (ino_t)i * 7919 + 3, v, strlen(v)));
    }
    unsigned bad = 0;
    for (unsigned i = 0; i < count; i++) {
        const unsigned char *got;
        size_t len;
        value_of(i, v, sizeof v);
        if (linkmap_get(m, dev, (ino_t)i * 7919 + 3, &got, &len) != 1 || len != strlen(v) ||
            memcmp(got, v, len) != 0 || got[len] != 0)
            bad++;
    }
    CHECK_INT(0, bad);
    const unsigned char *got;
    size_t len;
    CHECK_INT(0, linkmap_get(m, dev, 5, &got, &len));                       /* never put */
    CHECK_INT(0, linkmap_get(m, makedev(9, 9), 3, &got, &len));             /* other device */
    CHECK_INT(0, linkmap_get(m, dev, (ino_t)count * 7919 + 3, &got, &len)); /* one past */
}

static void in_memory(void)
{
    linkmap m;
    memset(&m, 0, sizeof m);
    fill_and_check(&m, 20000, makedev(8, 1));
    CHECK(!linkmap_spilled(&m));
    struct stat st = {.st_dev = makedev(8, 1), .st_ino = 42};
    CHECK(linkmap_find(&m, &st) == NULL);
    CHECK_INT(0, linkmap_add(&m, &st, "/a/b"));
    CHECK_STR("/a/b", linkmap_find(&m, &st));
    linkmap_free(&m);
}

static int entries_in(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) n++;
    closedir(d);
    return n;
}

static void spilling(void)
{
    char dir[] = "/tmp/moonbox-linkmap-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    CHECK(dfd >= 0);
    linkmap m;
    linkmap_init(&m, 64 * 1024, dfd);
    fill_and_check(&m, 300, makedev(8, 1)); /* fits */
    CHECK(!linkmap_spilled(&m));
    fill_and_check(&m, 50000, makedev(8, 2)); /* spills and grows its table on disk */
    CHECK(linkmap_spilled(&m));
    /* what was put before the spill is still there */
    const unsigned char *got;
    size_t len;
    char v[256];
    value_of(299, v, sizeof v);
    CHECK_INT(1, linkmap_get(&m, makedev(8, 1), (ino_t)299 * 7919 + 3, &got, &len));
    CHECK_STR(v, (const char *)got);
    CHECK_INT(0, entries_in(dir)); /* the spill files have no names */
    linkmap_free(&m);
    close(dfd);
    rmdir(dir);
}

/* Values of the largest size and of none. */
static void sizes(void)
{
    linkmap m;
    memset(&m, 0, sizeof m);
    static char big[LINKMAP_VALUE_MAX + 1];
    memset(big, 'x', sizeof big);
    CHECK_INT(0, linkmap_put(&m, 1, 1, big, LINKMAP_VALUE_MAX));
    CHECK_INT(-1, linkmap_put(&m, 1, 2, big, LINKMAP_VALUE_MAX + 1));
    CHECK_INT(0, linkmap_put(&m, 1, 3, "", 0));
    const unsigned char *got;
    size_t len;
    CHECK_INT(1, linkmap_get(&m, 1, 1, &got, &len));
    CHECK_INT(LINKMAP_VALUE_MAX, len);
    CHECK_INT(1, linkmap_get(&m, 1, 3, &got, &len));
    CHECK_INT(0, len);
    CHECK_INT(0, linkmap_get(&m, 1, 2, &got, &len));
    linkmap_free(&m);
}

int main(void)
{
    RUN(in_memory);
    RUN(spilling);
    RUN(sizes);
    return check_summary();
}
