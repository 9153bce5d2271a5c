/* test_cron.c - unit tests for runtime/cron.c and the POSIX-TZ rules of runtime/tz.c.
 *
 * Each check pins one documented behaviour of docs/reference/cron.md: parse errors and their
 * messages, normal forms, next fire in UTC, offsets of zones made by tz_from_posix on both sides
 * of their transitions, and the DST rules of cron_next in such zones. Every expected instant was
 * computed by hand as written next to it (and cross-checked with `date -u -d ... +%s`), never by
 * the code under test. No file system: zones come from POSIX TZ strings.
 * Prints "N passed, M failed" last and exits non-zero on any failure; ctest runs it as c_cron.
 */
#include "cron.h"
#include "tz.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ---- helpers ---- */

/* The message cron_parse gives for text, or "(parsed)" when it parses. */
static const char *parse_error(const char *text)
{
    static char err[512];
    cron_expr c;
    if (cron_parse(text, &c, err, sizeof err) == 0) return "(parsed)";
    return err;
}

/* The normal form of text, or its parse error. */
static const char *normal_form(const char *text)
{
    static char buf[512];
    cron_expr c;
    if (cron_parse(text, &c, buf, sizeof buf) != 0) return buf;
    cron_format(&c, buf, sizeof buf);
    return buf;
}

/* The next fire of text after `after` in zone z, or -1 when there is none (or it does not
 * parse, which the test then reports). */
static long long next_in(const char *text, const tz_zone *z, long long after)
{
    char err[512];
    cron_expr c;
    int64_t at;
    if (cron_parse(text, &c, err, sizeof err) != 0) {
        fprintf(stderr, "unexpected parse error: %s\n", err);
        check_failures++;
        return -2;
    }
    return cron_next(&c, z, after, &at) ? (long long)at : -1;
}

static tz_zone *posix_zone(const char *spec)
{
    char err[256];
    tz_zone *z = NULL;
    if (tz_from_posix(spec, spec, &z, err, sizeof err) != 0) {
        fprintf(stderr, "tz_from_posix(\"%s\"): %s\n", spec, err);
        exit(2);
    }
    return z;
}

/* ---- parsing ---- */

static void parse_errors_name_field_text_and_expression(void)
{
    CHECK_STR("cron: field 2 (hour) \"25\": value out of range 0-23 in \"0 25 * * *\"",
              parse_error("0 25 * * *"));
    CHECK_STR("cron: field 4 (month) \"FOO\": \"FOO\" is not a month (1-12 or JAN-DEC) in "
              "\"0 0 * FOO *\"",
              parse_error("0 0 * FOO *"));
    CHECK_STR("cron: field 5 (day-of-week) \"FRI-SUN\": range 5-0 goes backwards (write Sunday "
              "as 7 at the end of a range) in \"0 0 * * FRI-SUN\"",
              parse_error("0 0 * * FRI-SUN"));
    CHECK_STR("cron: field 1 (minute) \"*/0\": step 0 out of range 1-59 in \"*/0 * * * *\"",
              parse_error("*/0 * * * *"));
    CHECK_STR("cron: field 1 (minute) \"1,,2\": empty list item in \"1,,2 * * * *\"",
              parse_error("1,,2 * * * *"));
    CHECK_STR("cron: expected 5 fields (minute hour day-of-month month day-of-week), got 4 in "
              "\"* * * *\"",
              parse_error("* * * *"));
    CHECK_STR("cron: unknown macro \"@reboot\" in \"@reboot\" (known: @yearly @annually @monthly "
              "@weekly @daily @midnight @hourly)",
              parse_error("@reboot"));
}

static void other_invalid_expressions_are_refused(void)
{
    static const char *const bad[] = {
        "",
        "   \t ",
        "60 * * * *",        /* minute out of range */
        "* * 0 * *",         /* day-of-month starts at 1 */
        "* * 32 * *",        /* ... and ends at 31 */
        "* * * 13 *",        /* month */
        "* * * * 8",         /* day-of-week 0-7 */
        "*,5 * * * *",       /* '*' must stand alone */
        "*5 * * * *",        /* ... or be followed by /step */
        "5-1 * * * *",       /* backwards range */
        "1- * * * *",        /* missing value */
        "1/ * * * *",        /* missing step */
        "*/60 * * * *",      /* step beyond the field */
        "* * * * */8",       /* day-of-week steps run 1-7 */
        "MON * * * *",       /* names only in month and day-of-week */
        "0 0 ? * MON#2",     /* Quartz syntax */
        "0 0 L * *",         /* Quartz syntax */
        "0 * * * * 2026",    /* six fields */
        "@daily 0",          /* macros take no fields */
        "1,2, * * * *",      /* trailing comma */
        "0 0 * JANUARY *",   /* names are three letters */
        "0 0 * * MON-FRI/0", /* step 0 */
        "0\n0 * * *",        /* a newline is not a blank */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (strcmp(parse_error(bad[i]), "(parsed)") == 0) {
            fprintf(stderr, "expected a parse error for \"%s\"\n", bad[i]);
            check_failures++;
        } else {
            CHECK(strncmp(parse_error(bad[i]), "cron: ", 6) == 0);
        }
    }
    char longer[CRON_TEXT_MAX + 2];
    memset(longer, ' ', sizeof longer - 1);
    longer[sizeof longer - 1] = '\0';
    memcpy(longer, "* * * * *", 9);
    CHECK_STR("cron: expression longer than 1000 bytes", parse_error(longer));
}

static void normal_forms(void)
{
    CHECK_STR("0 9 * 1,7 1-5", normal_form("0 9 * JAN,jul mon-FRI"));
    CHECK_STR("0 0 * * 0", normal_form("@weekly"));
    CHECK_STR("0 0 * * 0", normal_form("@WEEKLY"));
    CHECK_STR("0 * * * *", normal_form("@hourly"));
    CHECK_STR("0 0 * * *", normal_form("@midnight"));
    CHECK_STR("0 0 1 1 *", normal_form("@annually"));
    CHECK_STR("0 0 1 * *", normal_form("@monthly"));
    CHECK_STR("5-50/15 * * * *", normal_form("5/15 * * * *"));
    CHECK_STR("*/15 9-17 * * 1-5", normal_form("*/15   9-17\t* * 1-5"));
    CHECK_STR("1-3,5,7-9 * * * *", normal_form("9,8,7,5,3,2,1 * * * *"));
    CHECK_STR("0,30 * * * *", normal_form("30,0 * * * *"));
    CHECK_STR("0-40/20 * * * *", normal_form("0-59/20 * * * *"));
    CHECK_STR("0 0 * * 0,5,6", normal_form("0 0 * * 5-7"));
    CHECK_STR("0 0 * * 0-6", normal_form("0 0 * * 0-7"));
    CHECK_STR("0 0 * * 0", normal_form("0 0 * * SUN,7"));
    CHECK_STR("* * * * *", normal_form("*/1 * * * *"));
    CHECK_STR("*/7 * * * *", normal_form("*/7 * * * *"));
    CHECK_STR("0 0 * * *", normal_form(" 0 0 * * * "));
}

static void normal_form_reparses_and_format_is_snprintf_like(void)
{
    cron_expr c, c2;
    char err[256], buf[64], small[6];
    CHECK_INT(0, cron_parse("1,2,3,4,5,6,7,8 */2 1-31/3 FEB-apr sat,SUN", &c, err, sizeof err));
    size_t need = cron_format(&c, buf, sizeof buf);
    CHECK_STR("1-8 */2 1-31/3 2-4 0,6", buf);
    CHECK_INT(strlen(buf), need);
    CHECK_INT(0, cron_parse(buf, &c2, err, sizeof err));
    CHECK(memcmp(&c, &c2, sizeof c) == 0);
    CHECK_INT(need, cron_format(&c, small, sizeof small));
    CHECK_STR("1-8 *", small);
    CHECK_INT(need, cron_format(&c, NULL, 0));
}

static void hour_restriction_follows_the_hour_field(void)
{
    cron_expr c;
    char err[256];
    CHECK_INT(0, cron_parse("@hourly", &c, err, sizeof err));
    CHECK_INT(0, cron_hour_restricted(&c));
    CHECK_INT(0, cron_parse("0 */2 * * *", &c, err, sizeof err));
    CHECK_INT(0, cron_hour_restricted(&c));
    CHECK_INT(0, cron_parse("@daily", &c, err, sizeof err));
    CHECK_INT(1, cron_hour_restricted(&c));
    CHECK_INT(0, cron_parse("0 0-23 * * *", &c, err, sizeof err));
    CHECK_INT(1, cron_hour_restricted(&c));
}

/* ---- next fire in UTC ---- */

/* Anchors, from 2026-01-01T00:00:00Z = 1767225600 = 20454 days * 86400 (a Thursday):
 * a day is 86400 s, so 2026-01-0D is 1767225600 + (D - 1) * 86400. */
#define JAN1_2026 1767225600LL
#define DAY       86400LL

static void next_fire_in_utc(void)
{
    const tz_zone *utc = tz_utc();
    /* Strictly after: from midnight exactly, the next midnight. */
    CHECK_INT(JAN1_2026 + DAY, next_in("0 0 * * *", utc, JAN1_2026));
    CHECK_INT(JAN1_2026 + DAY, next_in("@daily", utc, JAN1_2026 + DAY - 1));
    /* From one second past the hour, the next hour. */
    CHECK_INT(JAN1_2026 + 3600, next_in("@hourly", utc, JAN1_2026 + 1));
    /* Friday 2026-01-02 17:50 -> Monday 2026-01-05 09:00 (17:45 was the last of Friday). */
    CHECK_INT(JAN1_2026 + 4 * DAY + 9 * 3600,
              next_in("*/15 9-17 * * 1-5", utc, JAN1_2026 + DAY + 17 * 3600 + 50 * 60));
    /* Sunday written 7: the first Sunday of 2026 is January 4th. */
    CHECK_INT(JAN1_2026 + 3 * DAY, next_in("0 0 * * 7", utc, JAN1_2026));
    /* OR rule: "the 1st or a Monday"; from Thursday 1st 12:00 the next is Monday 5th 12:00. */
    CHECK_INT(JAN1_2026 + 4 * DAY + 12 * 3600, next_in("0 12 1 * 1", utc, JAN1_2026 + 12 * 3600));
    /* AND rule: Mondays on odd days; after Monday 5th, Monday 12th is even, so Monday 19th. */
    CHECK_INT(JAN1_2026 + 18 * DAY, next_in("0 0 */2 * 1", utc, JAN1_2026 + 4 * DAY));
    /* February 29th: 2026 and 2027 have 365 days, then 31 + 28 days to 2028-02-29. */
    CHECK_INT(JAN1_2026 + (365 + 365 + 31 + 28) * DAY, next_in("0 0 29 2 *", utc, JAN1_2026));
    /* Never: February 30th, and the 31st of 30-day months, are beyond any search bound. */
    CHECK_INT(-1, next_in("0 0 30 2 *", utc, JAN1_2026));
    CHECK_INT(-1, next_in("0 0 31 4,6,9,11 *", utc, JAN1_2026));
    /* New Year: 2026-12-31T23:59 -> 2027-01-01T00:00 is 365 days after 2026-01-01. */
    CHECK_INT(JAN1_2026 + 365 * DAY, next_in("0 0 1 1 *", utc, JAN1_2026 + 365 * DAY - 60));
    /* Far ends: year 1 and year 9999. 0001-01-01T00:00Z is CRON_T_MIN; its next minute. */
    CHECK_INT(CRON_T_MIN + 60, next_in("* * * * *", utc, CRON_T_MIN));
    CHECK_INT(CRON_T_MAX + 1, next_in("* * * * *", utc, CRON_T_MAX));
}

/* ---- time zones from POSIX TZ strings ---- */

/* Offsets computed by hand from the rules, for 2026 (January 1st a Thursday):
 *
 * "CET-1CEST,M3.5.0,M10.5.0/3": standard CET = UTC+1 (POSIX writes hours west, so -1), summer
 * CEST = UTC+2. Start M3.5.0 = last Sunday of March at 02:00 local standard time: March 1st is
 * January 1st + 59 days = Thursday + 3 = Sunday, so the Sundays are 1, 8, 15, 22, 29; the change
 * is 2026-03-29T02:00+01:00 = 01:00Z = (20454 + 31 + 28 + 28) * 86400 + 3600 = 1774746000.
 * End M10.5.0/3 = last Sunday of October at 03:00 local summer time: October 1st is January 1st
 * + 273 days = Thursday + 0, so the Sundays are 4, 11, 18, 25; the change is
 * 2026-10-25T03:00+02:00 = 01:00Z = (20454 + 273 + 24) * 86400 + 3600 = 1792890000.
 *
 * "EST5EDT" (no rules: the US rules M3.2.0,M11.1.0 apply, both at 02:00): EST = UTC-5,
 * EDT = UTC-4. Second Sunday of March 2026 is the 8th: 02:00 EST = 07:00Z =
 * (20454 + 59 + 7) * 86400 + 25200 = 1772953200. First Sunday of November: November 1st is
 * January 1st + 304 days = Thursday + 3 = Sunday, so 02:00 EDT on the 1st = 06:00Z =
 * (20454 + 304) * 86400 + 21600 = 1793512800.
 *
 * "<+1030>-10:30<+11>-11,M10.1.0,M4.1.0" (Lord Howe, southern hemisphere, half-hour DST):
 * standard +10:30, summer +11. Summer time ends on the first Sunday of April at 02:00 summer
 * time: April 1st is January 1st + 90 days = Thursday + 6 = Wednesday, so Sunday the 5th;
 * 02:00+11:00 = 2026-04-04T15:00Z = (20454 + 90 + 4) * 86400 + 7200 - 39600 = 1775314800.
 * It starts on the first Sunday of October (the 4th) at 02:00+10:30 = 2026-10-03T15:30Z =
 * (20454 + 273 + 3) * 86400 + 7200 - 37800 = 1791041400. */
#define CET_SPRING  1774746000LL
#define CET_AUTUMN  1792890000LL
#define US_SPRING   1772953200LL
#define US_AUTUMN   1793512800LL
#define LHI_APRIL   1775314800LL
#define LHI_OCTOBER 1791041400LL

static void posix_cet_offsets_around_both_changes(void)
{
    tz_zone *z = posix_zone("CET-1CEST,M3.5.0,M10.5.0/3");
    tz_period p;
    CHECK_INT(3600, tz_offset_at(z, JAN1_2026));
    CHECK_INT(3600, tz_offset_at(z, CET_SPRING - 1));
    CHECK_INT(7200, tz_offset_at(z, CET_SPRING));
    CHECK_INT(7200, tz_offset_at(z, CET_AUTUMN - 1));
    CHECK_INT(3600, tz_offset_at(z, CET_AUTUMN));
    tz_period_at(z, CET_SPRING + 12345, &p);
    CHECK_INT(7200, p.utoff);
    CHECK_INT(1, p.isdst);
    CHECK_STR("CEST", p.abbr);
    CHECK_INT(CET_SPRING, p.start);
    CHECK_INT(CET_AUTUMN, p.end);
    tz_period_at(z, CET_SPRING - 1, &p);
    CHECK_INT(0, p.isdst);
    CHECK_STR("CET", p.abbr);
    CHECK_INT(CET_SPRING, p.end);
    CHECK_STR("CET-1CEST,M3.5.0,M10.5.0/3", tz_name(z));
    tz_free(z);
}

static void posix_us_default_rules_and_southern_half_hour(void)
{
    tz_zone *us = posix_zone("EST5EDT");
    CHECK_INT(-18000, tz_offset_at(us, US_SPRING - 1));
    CHECK_INT(-14400, tz_offset_at(us, US_SPRING));
    CHECK_INT(-14400, tz_offset_at(us, US_AUTUMN - 1));
    CHECK_INT(-18000, tz_offset_at(us, US_AUTUMN));
    tz_free(us);

    tz_zone *lhi = posix_zone("<+1030>-10:30<+11>-11,M10.1.0,M4.1.0");
    tz_period p;
    CHECK_INT(39600, tz_offset_at(lhi, JAN1_2026)); /* January is summer down there */
    CHECK_INT(39600, tz_offset_at(lhi, LHI_APRIL - 1));
    CHECK_INT(37800, tz_offset_at(lhi, LHI_APRIL));
    CHECK_INT(37800, tz_offset_at(lhi, LHI_OCTOBER - 1));
    CHECK_INT(39600, tz_offset_at(lhi, LHI_OCTOBER));
    tz_period_at(lhi, LHI_APRIL, &p);
    CHECK_STR("+1030", p.abbr);
    CHECK_INT(LHI_APRIL, p.start);
    CHECK_INT(LHI_OCTOBER, p.end);
    tz_free(lhi);

    tz_zone *fixed = posix_zone("IST-5:30");
    CHECK_INT(19800, tz_offset_at(fixed, JAN1_2026));
    CHECK_INT(19800, tz_offset_at(fixed, CET_SPRING));
    tz_period_at(fixed, 0, &p);
    CHECK_INT(TZ_T_MIN, p.start);
    CHECK_INT(TZ_T_MAX, p.end);
    tz_free(fixed);
}

static void posix_bad_strings_are_refused(void)
{
    static const char *const bad[] = {
        "",
        "CET",
        "CE-1",
        "CET-1CEST,M13.5.0,M10.5.0",
        "CET-1CEST,M3.5.0",
        "X1",
        "<AB>3",
        "CET25",
        "CET-1CEST,M3.6.0,M10.5.0",
        "CET-1CEST,J0,J365",
        "C3",
        "CET-1CEST,",
        "CET-1CEST,M3.5.0,M10.5.0/168",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err[256] = "";
        tz_zone *z = NULL;
        if (tz_from_posix("bad", bad[i], &z, err, sizeof err) == 0) {
            fprintf(stderr, "expected tz_from_posix to refuse \"%s\"\n", bad[i]);
            check_failures++;
            tz_free(z);
        } else {
            CHECK(strstr(err, "bad POSIX TZ string") != NULL);
        }
    }
}

/* ---- cron_next across DST changes (docs/reference/cron.md, "The special problem of DST") ---- */

static void gap_fires_fixed_hour_once_at_its_end(void)
{
    tz_zone *z = posix_zone("CET-1CEST,M3.5.0,M10.5.0/3");
    /* 02:30 does not exist on 2026-03-29: fires at the end of the gap, 03:00 CEST. */
    CHECK_INT(CET_SPRING, next_in("30 2 * * *", z, CET_SPRING - 3600));
    /* Matching the gap and its end is still one fire; the next is 02:00 CEST on the 30th,
     * one day after 00:00Z of the 29th, which is CET_SPRING - 3600. */
    CHECK_INT(CET_SPRING, next_in("0 2,3 * * *", z, CET_SPRING - 3600));
    CHECK_INT(CET_SPRING - 3600 + DAY, next_in("0 2,3 * * *", z, CET_SPRING));
    /* The days before, 02:30 CET = 01:30Z: from the 27th's fire, the 28th's. */
    CHECK_INT(CET_SPRING - DAY + 1800, next_in("30 2 * * *", z, CET_SPRING - 2 * DAY + 1800));
    /* Wildcard hour: no fires in the gap; 01:45 CET -> 03:00 CEST -> 03:15 CEST. */
    CHECK_INT(CET_SPRING - 900, next_in("*/15 * * * *", z, CET_SPRING - 901));
    CHECK_INT(CET_SPRING, next_in("*/15 * * * *", z, CET_SPRING - 900));
    CHECK_INT(CET_SPRING + 900, next_in("*/15 * * * *", z, CET_SPRING));
    tz_free(z);
}

static void overlap_fires_fixed_hour_once_and_wildcard_twice(void)
{
    tz_zone *z = posix_zone("EST5EDT");
    /* On 2026-11-01 01:00-02:00 happens twice: 01:30 EDT = 05:30Z, then 01:30 EST = 06:30Z. */
    long long edt_0130 = US_AUTUMN - 1800, est_0130 = US_AUTUMN + 1800;
    CHECK_INT(edt_0130, next_in("30 1 * * *", z, US_AUTUMN - 4 * 3600));
    /* Fixed hour: not again at 01:30 EST; the next is 01:30 EST on November 2nd. */
    CHECK_INT(est_0130 + DAY, next_in("30 1 * * *", z, edt_0130));
    /* Asked from inside the second pass, also the next day's. */
    CHECK_INT(est_0130 + DAY, next_in("30 1 * * *", z, US_AUTUMN + 60));
    /* Wildcard hour: 01:15 and 01:45 EDT, then 01:15 and 01:45 EST. */
    CHECK_INT(US_AUTUMN - 2700, next_in("15,45 * * * *", z, US_AUTUMN - 3600));
    CHECK_INT(US_AUTUMN - 900, next_in("15,45 * * * *", z, US_AUTUMN - 2700));
    CHECK_INT(US_AUTUMN + 900, next_in("15,45 * * * *", z, US_AUTUMN - 900));
    CHECK_INT(US_AUTUMN + 2700, next_in("15,45 * * * *", z, US_AUTUMN + 900));
    tz_free(z);
}

int main(void)
{
    RUN(parse_errors_name_field_text_and_expression);
    RUN(other_invalid_expressions_are_refused);
    RUN(normal_forms);
    RUN(normal_form_reparses_and_format_is_snprintf_like);
    RUN(hour_restriction_follows_the_hour_field);
    RUN(next_fire_in_utc);
    RUN(posix_cet_offsets_around_both_changes);
    RUN(posix_us_default_rules_and_southern_half_hour);
    RUN(posix_bad_strings_are_refused);
    RUN(gap_fires_fixed_hour_once_at_its_end);
    RUN(overlap_fires_fixed_hour_once_and_wildcard_twice);
    return check_summary();
}
