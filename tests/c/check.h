/*
 * check.h — the tiny harness of the C unit tests: CHECK/CHECK_INT/CHECK_STR record failures of
 * the check now running (with file:line) and go on; RUN(fn) runs one check and prints "ok" or
 * "FAIL" with its name; check_summary() prints "N passed, M failed" and returns the exit
 * status. Header-only: each test is one executable.
 */
#ifndef MOONBOX_TESTS_CHECK_H
#define MOONBOX_TESTS_CHECK_H

#include <stdio.h>
#include <string.h>

static int check_failures; /* assertion failures in the check now running */
static int checks_passed, checks_failed;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);               \
            check_failures++;                                                                      \
        }                                                                                          \
    } while (0)

#define CHECK_INT(expected, actual)                                                                \
    check_ll(__FILE__, __LINE__, #actual, (long long)(expected), (long long)(actual))

#define CHECK_STR(expected, actual) check_str(__FILE__, __LINE__, #actual, (expected), (actual))

static void check_ll(const char *file, int line, const char *what, long long expected,
                     long long actual)
{
    if (expected != actual) {
        fprintf(stderr, "%s:%d: %s: expected %lld, got %lld\n", file, line, what, expected, actual);
        check_failures++;
    }
}

/* Strings are shown between --- lines, so ones that hold newlines stay readable. */
static void check_str(const char *file, int line, const char *what, const char *expected,
                      const char *actual)
{
    if (strcmp(expected, actual) != 0) {
        fprintf(stderr, "%s:%d: %s:\n--- expected\n%s\n--- got\n%s\n---\n", file, line, what,
                expected, actual);
        check_failures++;
    }
}

static void run_check(const char *name, void (*check)(void))
{
    check_failures = 0;
    check();
    if (check_failures == 0) {
        checks_passed++;
        printf("ok   %s\n", name);
    } else {
        checks_failed++;
        printf("FAIL %s\n", name);
    }
}

#define RUN(check) run_check(#check, check)

/* Prints the totals; returns the process's exit status (0 when every check passed). */
static int check_summary(void)
{
    printf("%d passed, %d failed\n", checks_passed, checks_failed);
    return checks_failed == 0 ? 0 : 1;
}

#endif
