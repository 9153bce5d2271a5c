/* fuzz_tz.c - libFuzzer target for runtime/tz.c (and cron_next across zone changes).
 *
 * Input layout: when byte 0 is POSIX_MARKER ('='), the rest (cut at its first NUL) is a POSIX TZ
 * string for tz_from_posix, e.g. "=CET-1CEST,M3.5.0,M10.5.0/3"; otherwise the whole input is
 * TZif bytes for tz_parse. Seeds in corpus/tz/ are real TZif files from Debian's tzdata and a
 * few "=..." footer strings.
 *
 * For a zone that loads, at a fixed set of instants (the extremes of int64_t, the edges of the
 * tz and cron ranges, 1970, dates around DST changes, years past 2037 where the footer rules,
 * and one instant taken from the input), checks that tz_period_at gives a period containing the
 * (clamped) instant with a sane offset and abbreviation, that tz_offset_at agrees, that the
 * offset really holds at both ends of the period, and that the next period starts where this one
 * ends. Then runs cron_next with a fixed-hour and a wildcard-hour schedule from a few instants
 * and checks each fire against the DST rules of docs/reference/cron.md. A rejected input must
 * come with a message. Everything is freed, so ASan reports leaks.
 */
#include "cron.h"
#include "tz.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define POSIX_MARKER '='
#define UTOFF_LIMIT  (26 * 3600) /* RFC 8536 bound; POSIX offsets stay below it too */

static void fail(const char *what, int64_t t)
{
    fprintf(stderr, "fuzz_tz: invariant violated: %s (t = %lld)\n", what, (long long)t);
    abort();
}

static int64_t clamp(int64_t t)
{
    return t < TZ_T_MIN ? TZ_T_MIN : t > TZ_T_MAX - 1 ? TZ_T_MAX - 1 : t;
}

static void check_period(const tz_zone *z, int64_t t)
{
    tz_period p, q;
    int64_t tc = clamp(t);
    tz_period_at(z, t, &p);
    if (p.start > tc || tc >= p.end) fail("period does not contain the instant", t);
    if (p.start < TZ_T_MIN || p.end > TZ_T_MAX) fail("period outside the tz range", t);
    if (p.utoff <= -UTOFF_LIMIT || p.utoff >= UTOFF_LIMIT) fail("offset out of range", t);
    if (p.isdst != 0 && p.isdst != 1) fail("isdst is not 0 or 1", t);
    if (p.abbr == NULL || strlen(p.abbr) >= TZ_ABBR_MAX) fail("bad abbreviation", t);
    if (tz_offset_at(z, t) != p.utoff) fail("tz_offset_at disagrees with tz_period_at", t);
    /* The offset holds over all of [start, end): at both ends and in the middle too. */
    if (tz_offset_at(z, p.start) != p.utoff) fail("offset differs at the period's start", t);
    if (tz_offset_at(z, p.end - 1) != p.utoff) fail("offset differs at the period's end", t);
    if (tz_offset_at(z, p.start + (p.end - p.start) / 2) != p.utoff)
        fail("offset differs in the middle of the period", t);
    /* A period may end at a mere boundary of the computation (tz.h), after which a period
     * reaching back before it is fine; but where the offset really changes, both sides must put
     * the change at the same instant (cron_next's gap and overlap rules start there). */
    if (p.end < TZ_T_MAX) {
        tz_period_at(z, p.end, &q);
        if (q.utoff != p.utoff && q.start != p.end)
            fail("the offset changes at the period's end but the next period starts elsewhere", t);
    }
    if (p.start > TZ_T_MIN) {
        tz_period_at(z, p.start - 1, &q);
        if (q.utoff != p.utoff && q.end != p.start)
            fail("the offset changes at the period's start but the previous period ends elsewhere",
                 t);
    }
}

/* Local wall seconds of instant t in z. */
static int64_t wall_of(const tz_zone *z, int64_t t)
{
    return t + tz_offset_at(z, t);
}

/* A fire of "30 2 * * *" is at 02:30:00 local time, or it is the first instant after a gap
 * (a period start where the offset grew). */
static void check_fixed_hour_fire(const tz_zone *z, int64_t at)
{
    tz_civil lt;
    tz_period p;
    tz_civil_from_seconds(wall_of(z, at), &lt);
    if (lt.hour == 2 && lt.min == 30 && lt.sec == 0) return;
    tz_period_at(z, at, &p);
    if (p.start == at && at > TZ_T_MIN && tz_offset_at(z, at - 1) < p.utoff) return;
    fail("\"30 2 * * *\" fired at neither 02:30 nor the end of a gap", at);
}

/* A fire of "*\/15 * * * *" is at a local :00, :15, :30 or :45 on a whole minute. */
static void check_wildcard_fire(const tz_zone *z, int64_t at)
{
    tz_civil lt;
    tz_civil_from_seconds(wall_of(z, at), &lt);
    if (lt.sec != 0 || lt.min % 15 != 0) fail("\"*/15 * * * *\" fired off its minutes", at);
}

static void check_cron(const tz_zone *z, const cron_expr *c, int fixed, int64_t after)
{
    int64_t at = 0, again = 0, limit = after + (int64_t)CRON_SEARCH_DAYS * 86400;
    for (int i = 0; i < 3; i++) {
        if (!cron_next(c, z, after, &at)) return;
        if (at <= after) fail("cron_next result is not strictly after the instant", after);
        if (at >= limit) fail("cron_next result beyond the search bound", after);
        if (fixed)
            check_fixed_hour_fire(z, at);
        else
            check_wildcard_fire(z, at);
        if (at > CRON_T_MAX) return; /* cron_next clamps later instants to CRON_T_MAX */
        if (cron_next(c, z, at - 1, &again) != 1 || again != at)
            fail("cron_next from one second earlier gives another instant", at);
        after = at;
    }
}

static void exercise(const tz_zone *z, int64_t from_input)
{
    /* The extremes, the edges of the tz and cron ranges, 1900, 1970, Europe's 2026 spring and
     * autumn changes (01:00Z both), 2038 (after Debian's last stored transition) and 2100. */
    static const int64_t instants[] = {INT64_MIN,  TZ_T_MIN - 1, TZ_T_MIN,   TZ_T_MIN + 1,
                                       CRON_T_MIN, -2208988800,  -1,         0,
                                       1774746000, 1792890000,   2145916800, 4107542400,
                                       CRON_T_MAX, TZ_T_MAX - 1, TZ_T_MAX,   INT64_MAX};
    for (size_t i = 0; i < sizeof instants / sizeof instants[0]; i++)
        check_period(z, instants[i]);
    check_period(z, from_input);

    cron_expr fixed, wild;
    char err[256];
    if (cron_parse("30 2 * * *", &fixed, err, sizeof err) != 0 ||
        cron_parse("*/15 * * * *", &wild, err, sizeof err) != 0)
        fail("cannot parse the test schedules", 0);
    /* Year 1, 2026-01-01, two hours before the spring change, an hour before the autumn one,
     * 2038 and year 9999. */
    static const int64_t afters[] = {CRON_T_MIN,        1767225600, 1774746000 - 7200,
                                     1792890000 - 3600, 2145916800, CRON_T_MAX};
    for (size_t i = 0; i < sizeof afters / sizeof afters[0]; i++) {
        check_cron(z, &fixed, 1, afters[i]);
        check_cron(z, &wild, 0, afters[i]);
    }
    int64_t a = from_input % (CRON_T_MAX - CRON_T_MIN);
    if (a < CRON_T_MIN) a += CRON_T_MAX - CRON_T_MIN;
    if (a > CRON_T_MAX) a -= CRON_T_MAX - CRON_T_MIN;
    check_cron(z, &fixed, 1, a);
    check_cron(z, &wild, 0, a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tz_zone *z = NULL;
    char err[512];
    int rc;
    err[0] = '\0';

    if (size > 0 && data[0] == POSIX_MARKER) {
        char *spec = malloc(size);
        if (spec == NULL) abort();
        memcpy(spec, data + 1, size - 1);
        spec[size - 1] = '\0';
        rc = tz_from_posix("Fuzz/Posix", spec, &z, err, sizeof err);
        free(spec);
    } else {
        rc = tz_parse("Fuzz/TZif", data, size, &z, err, sizeof err);
    }
    if (rc != 0) {
        if (err[0] == '\0' || z != NULL) fail("rejected without a message, or set *out", rc);
        return 0;
    }
    const char *name = size > 0 && data[0] == POSIX_MARKER ? "Fuzz/Posix" : "Fuzz/TZif";
    if (z == NULL || strcmp(tz_name(z), name) != 0) fail("zone without its name", 0);

    /* An instant from the input: its last 8 bytes, big-endian (the tail of a TZif file is the
     * footer, so mutations there move it around). */
    uint64_t u = 0;
    for (size_t i = size > 8 ? size - 8 : 0; i < size; i++)
        u = u << 8 | data[i];
    exercise(z, (int64_t)u);

    tz_free(z);
    return 0;
}
