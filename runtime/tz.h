/*
 * tz.h — time zones from the system tz database, without the C library's process-global TZ.
 *
 * Owns reading TZif files (RFC 8536, versions 1 to 4; the 64-bit data of v2+ and the POSIX-TZ
 * footer that describes instants after the last stored transition), and answering "what is the
 * UTC offset at instant t" and "over which interval of instants does that offset hold". Also the
 * proleptic Gregorian calendar arithmetic that cron.c shares.
 *
 * Why not localtime_r: it reads $TZ through tzset(), which is process-global; changing it races
 * every other thread. A tz_zone here is immutable after loading and may be shared by threads.
 *
 * Instants are Unix seconds (int64_t, no leap seconds). Every function accepts any t in
 * [TZ_T_MIN, TZ_T_MAX] (about 12,000 years either side of 1970) and clamps outside it. No Lua.
 */
#ifndef MOONBOX_TZ_H
#define MOONBOX_TZ_H

#include <stddef.h>
#include <stdint.h>

#define TZ_T_MIN       (-400000000000LL)
#define TZ_T_MAX       400000000000LL
#define TZ_ABBR_MAX    16 /* longest abbreviation kept, with its NUL (longer ones are cut) */
#define TZ_NAME_MAX    255
#define TZ_DEFAULT_DIR "/usr/share/zoneinfo"

/* ---- calendar ---------------------------------------------------------------------------- */

/* Days since 1970-01-01 of the proleptic Gregorian date y-m-d (m 1-12, d 1-31). O(1). */
int64_t tz_days_from_civil(int64_t y, int m, int d);
/* The date of day `days` since 1970-01-01. */
void tz_civil_from_days(int64_t days, int64_t *y, int *m, int *d);
/* 0 = Sunday ... 6 = Saturday, of day `days` since 1970-01-01. */
int tz_weekday(int64_t days);
int tz_is_leap(int64_t y);
int tz_days_in_month(int64_t y, int m);

/* Broken-down wall-clock time. */
typedef struct tz_civil {
    int64_t year;
    int month, day, hour, min, sec; /* 1-12, 1-31, 0-23, 0-59, 0-59 */
    int wday;                       /* 0 = Sunday */
    int yday;                       /* 0-365 */
} tz_civil;

/* Splits "wall seconds" (days_from_civil * 86400 + seconds of the day) into fields. */
void tz_civil_from_seconds(int64_t wall, tz_civil *out);

/* ---- zones ------------------------------------------------------------------------------- */

typedef struct tz_zone tz_zone;

/* The offset in effect over [start, end): one "period" of a zone. Periods returned for
 * neighbouring instants may have the same offset (a change of abbreviation or of the DST flag
 * alone, or a boundary of the computation): callers must not assume consecutive periods differ. */
typedef struct tz_period {
    int32_t utoff;    /* seconds east of UTC */
    int isdst;        /* 1 when the zone calls this daylight saving time */
    const char *abbr; /* e.g. "CEST"; owned by the zone, valid while it lives */
    int64_t start;    /* first instant of the period; TZ_T_MIN when unbounded */
    int64_t end;      /* first instant after it; TZ_T_MAX when unbounded */
} tz_period;

/* The zone "UTC": built in, needs no file, never freed (tz_free ignores it). */
const tz_zone *tz_utc(void);

/* Loads zone `name` (an IANA name such as "Europe/Berlin") from directory `dir`, or from $TZDIR
 * or TZ_DEFAULT_DIR when dir is NULL. "UTC" is always the built-in zone. Names that are empty,
 * longer than TZ_NAME_MAX, start with '/', contain "..", or contain characters other than
 * letters, digits and "/_-+." are refused without touching the file system. Returns 0 and sets
 * *out (free with tz_free), or -1 with a message naming the zone and the directory in err.
 * Reads one file of at most 1 MiB. Leap-second ("right/") files are refused. */
int tz_load(const char *name, const char *dir, tz_zone **out, char *err, size_t errlen);

/* Parses TZif bytes (for tz_load, tests and fuzzing). Every count and index is checked against
 * the buffer; never reads outside data[0..len). Returns 0 or -1 with a message in err. */
int tz_parse(const char *name, const unsigned char *data, size_t len, tz_zone **out, char *err,
             size_t errlen);

/* Makes a zone from a POSIX TZ string alone (e.g. "CET-1CEST,M3.5.0,M10.5.0/3"): the footer
 * rules applied to every instant. Returns 0 or -1 with a message in err. */
int tz_from_posix(const char *name, const char *spec, tz_zone **out, char *err, size_t errlen);

void tz_free(tz_zone *z);

/* The zone's name as loaded. */
const char *tz_name(const tz_zone *z);

/* Fills *p with the period containing instant t. O(log transitions) for stored transitions;
 * for instants after the last one, computes the footer's transitions of the years around t
 * (a constant amount of work). */
void tz_period_at(const tz_zone *z, int64_t t, tz_period *p);

/* Seconds east of UTC at instant t (tz_period_at(...).utoff). */
int32_t tz_offset_at(const tz_zone *z, int64_t t);

#endif
