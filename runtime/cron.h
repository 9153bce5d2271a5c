/*
 * cron.h — five-field cron expressions: parsing, normal form, and the next instant that matches
 * in a time zone.
 *
 * Syntax is Vixie cron's (crontab(5)) plus "a/n", names and macros; see docs/reference/cron.md.
 * A parsed expression is a set of bitmasks plus which fields were written starting with '*'
 * (that decides the day-of-month/day-of-week OR rule and the DST behaviour). Next-fire search
 * walks the zone's offset periods and, inside each, skips whole months, days and hours that
 * cannot match; the search stops CRON_SEARCH_DAYS after the start. No Lua, no global state.
 */
#ifndef MOONBOX_CRON_H
#define MOONBOX_CRON_H

#include <stddef.h>
#include <stdint.h>

#include "tz.h"

enum { CRON_MINUTE, CRON_HOUR, CRON_MDAY, CRON_MONTH, CRON_WDAY, CRON_NFIELDS };

/* 8 years of 366 days: the longest wait between two fires of any expression that can fire at
 * all is the 8 years between the February 29ths around 2100 (e.g. "0 0 29 2 *"). */
#define CRON_SEARCH_DAYS (8 * 366)
#define CRON_TEXT_MAX    1000 /* longest expression accepted, in bytes */

/* Instants next-fire accepts as "after": 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z. */
#define CRON_T_MIN (-62135596800LL)
#define CRON_T_MAX 253402300799LL

typedef struct cron_expr {
    uint64_t minutes;       /* bit m: minute m (0-59) */
    uint32_t hours;         /* bit h: hour h (0-23) */
    uint32_t mdays;         /* bit d: day of month d (1-31) */
    uint32_t months;        /* bit m: month m (1-12) */
    uint32_t wdays;         /* bit w: weekday w (0-6, Sunday = 0; 7 is stored as 0) */
    unsigned star;          /* bit i: field i was "*" or "*\/n" */
    int step[CRON_NFIELDS]; /* n of a "*\/n" field (1 for "*"); 0 for other fields */
} cron_expr;

/* Parses `text` (NUL-terminated) into *out. Returns 0, or -1 with a message in err that names
 * the field, its text and the whole expression, e.g.
 *   cron: field 2 (hour) "25": value out of range 0-23 in "0 25 * * *" */
int cron_parse(const char *text, cron_expr *out, char *err, size_t errlen);

/* Writes the normal form ("*\/15 9-17 * * 1-5"; macros expanded, names as numbers, Sunday 0,
 * lists sorted with runs and even steps folded) into buf; returns the length it needs, like
 * snprintf. Two expressions with the same normal form fire at the same instants. */
size_t cron_format(const cron_expr *c, char *buf, size_t len);

/* 1 when the hour field is restricted (not written with '*'): such schedules fire once at the
 * end of a DST gap that swallowed their time, and only at the first of two repeated times. */
int cron_hour_restricted(const cron_expr *c);

/* The first instant strictly after `after` (CRON_T_MIN..CRON_T_MAX) at which c fires in zone z,
 * with the DST rules of docs/reference/cron.md. Returns 1 and sets *out, or 0 when there is
 * none within CRON_SEARCH_DAYS. Work is bounded: O(months + days searched + DST periods
 * crossed), never minute by minute. */
int cron_next(const cron_expr *c, const tz_zone *z, int64_t after, int64_t *out);

#endif
