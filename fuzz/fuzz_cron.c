/* fuzz_cron.c - libFuzzer target for runtime/cron.c.
 *
 * Input layout: the whole input is the expression, cut at its first NUL byte (cron_parse takes a
 * C string). Seeds in corpus/cron/ are plain expressions without a trailing newline.
 *
 * Properties checked, each aborting on a violation:
 *  - a rejected expression gets a one-line message starting "cron: ";
 *  - a parsed expression keeps the invariants of cron.h (every mask non-empty and inside its
 *    field's range; "*" fields have a step);
 *  - round trip: the normal form parses again, to the same masks, '*' bits and steps, and its
 *    own normal form is byte for byte the same; cron_format truncates like snprintf;
 *  - cron_next in UTC after a fixed instant agrees with a deliberately naive oracle that walks
 *    the search window day by day and tries every hour and minute of a matching day; a result
 *    is strictly after the instant, on a whole minute, and asking again from one second before
 *    it gives it again.
 */
#include "cron.h"
#include "tz.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 2026-03-29T01:00:17Z: not on a whole minute, on the day Europe switches to summer time. */
#define AFTER 1774746017LL

static void fail(const char *what, const char *text)
{
    fprintf(stderr, "fuzz_cron: invariant violated: %s (expression \"%s\")\n", what, text);
    abort();
}

static int same_expr(const cron_expr *a, const cron_expr *b)
{
    if (a->minutes != b->minutes || a->hours != b->hours || a->mdays != b->mdays ||
        a->months != b->months || a->wdays != b->wdays || a->star != b->star)
        return 0;
    for (int f = 0; f < CRON_NFIELDS; f++)
        if (a->step[f] != b->step[f]) return 0;
    return 1;
}

static void check_invariants(const cron_expr *c, const char *text)
{
    if (c->minutes == 0 || (c->minutes >> 60) != 0) fail("minute mask", text);
    if (c->hours == 0 || (c->hours >> 24) != 0) fail("hour mask", text);
    if (c->mdays == 0 || (c->mdays & 1u) != 0) fail("mday mask", text);
    if (c->months == 0 || (c->months & 1u) != 0 || (c->months >> 13) != 0) fail("month mask", text);
    if (c->wdays == 0 || (c->wdays >> 7) != 0) fail("weekday mask", text);
    if (c->star >> CRON_NFIELDS) fail("star bits", text);
    for (int f = 0; f < CRON_NFIELDS; f++) {
        int starred = (c->star >> f) & 1;
        if (starred ? c->step[f] < 1 : c->step[f] != 0) fail("step of a field", text);
    }
}

/* The oracle: the first whole minute strictly after `after` and before the search limit that
 * matches c in UTC, found the slow, obvious way. Day rule as in docs/reference/cron.md: when
 * neither day field was written with '*', either may match; otherwise both must. */
static int naive_next_utc(const cron_expr *c, int64_t after, int64_t *out)
{
    int64_t first = (after >= 0 ? after / 60 : (after - 59) / 60) * 60 + 60;
    int64_t limit = after + (int64_t)CRON_SEARCH_DAYS * 86400;
    int64_t day0 = first >= 0 ? first / 86400 : (first - 86399) / 86400;
    for (int64_t day = day0; day * 86400 < limit; day++) {
        int64_t y;
        int m, d;
        tz_civil_from_days(day, &y, &m, &d);
        if (!((c->months >> m) & 1)) continue;
        int dom = (c->mdays >> d) & 1, dow = (c->wdays >> tz_weekday(day)) & 1;
        int either = !(c->star & ((1u << CRON_MDAY) | (1u << CRON_WDAY)));
        if (either ? !(dom || dow) : !(dom && dow)) continue;
        for (int h = 0; h < 24; h++) {
            if (!((c->hours >> h) & 1)) continue;
            for (int mi = 0; mi < 60; mi++) {
                if (!((c->minutes >> mi) & 1)) continue;
                int64_t at = day * 86400 + h * 3600 + mi * 60;
                if (at < first) continue;
                if (at >= limit) return 0;
                *out = at;
                return 1;
            }
        }
    }
    return 0;
}

static void check_next(const cron_expr *c, const char *text)
{
    int64_t got = 0, want = 0, again = 0;
    int rc = cron_next(c, tz_utc(), AFTER, &got);
    int want_rc = naive_next_utc(c, AFTER, &want);
    if (rc != want_rc) fail("cron_next found/not found differs from the naive search", text);
    if (!rc) return;
    if (got <= AFTER) fail("cron_next result is not strictly after the instant", text);
    if (got % 60 != 0) fail("cron_next result in UTC is not on a whole minute", text);
    if (got != want) fail("cron_next differs from the naive search", text);
    if (cron_next(c, tz_utc(), got - 1, &again) != 1 || again != got)
        fail("cron_next from one second earlier gives another instant", text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (text == NULL) abort();
    memcpy(text, data, size);
    text[size] = '\0';

    cron_expr c, c2;
    char err[512], norm[512], norm2[512], small[16];
    err[0] = '\0';
    if (cron_parse(text, &c, err, sizeof err) != 0) {
        if (strncmp(err, "cron: ", 6) != 0 || strchr(err, '\n') != NULL)
            fail("error message is not one line starting \"cron: \"", text);
        free(text);
        return 0;
    }
    check_invariants(&c, text);

    size_t need = cron_format(&c, norm, sizeof norm);
    if (need >= sizeof norm || strlen(norm) != need) fail("normal form length", text);
    size_t need_small = cron_format(&c, small, sizeof small);
    if (need_small != need || strlen(small) >= sizeof small ||
        strncmp(small, norm, strlen(small)) != 0 ||
        strlen(small) != (need < sizeof small ? need : sizeof small - 1))
        fail("cron_format into a short buffer is not snprintf-like", text);
    if (cron_parse(norm, &c2, err, sizeof err) != 0) fail("normal form does not parse", text);
    if (!same_expr(&c, &c2)) fail("normal form parses to a different expression", text);
    cron_format(&c2, norm2, sizeof norm2);
    if (strcmp(norm, norm2) != 0) fail("normal form of the normal form differs", text);
    if (cron_hour_restricted(&c) != cron_hour_restricted(&c2)) fail("hour restriction", text);

    check_next(&c, text);
    free(text);
    return 0;
}
