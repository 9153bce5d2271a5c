/*
 * tz.c — TZif reader, POSIX-TZ footer rules and the Gregorian calendar (see tz.h).
 *
 * A zone is its stored transitions (sorted instants, each naming a local-time type) plus an
 * optional footer rule for instants at or after the last one, as glibc and RFC 8536 do. Loading
 * checks everything once, so the lookups below never fail and never allocate. Zones are
 * immutable after loading; nothing here has global state except the built-in UTC zone, which is
 * a constant.
 */
#include "tz.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define TZ_FILE_MAX  (1024 * 1024)
#define TZ_TYPES_MAX 256
#define TZ_UTOFF_MAX (26 * 3600) /* RFC 8536 allows -25:59:59 to +25:59:59 */

/* ---- calendar ---------------------------------------------------------------------------- */

/* Counts in 400-year eras (146097 days each) from 0000-03-01, so that the leap day is the last
 * day of a year and month lengths repeat in a 5-month pattern (153 days). */
int64_t tz_days_from_civil(int64_t y, int m, int d)
{
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;                         /* 0-399 */
    int64_t mp = (m + 9) % 12;                           /* March = 0 */
    int64_t doy = (153 * mp + 2) / 5 + d - 1;            /* 0-365 */
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy; /* 0-146096 */
    return era * 146097 + doe - 719468; /* 719468: days from 0000-03-01 to 1970-01-01 */
}

void tz_civil_from_days(int64_t days, int64_t *y, int *m, int *d)
{
    days += 719468;
    int64_t era = (days >= 0 ? days : days - 146096) / 146097;
    int64_t doe = days - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    int64_t mp = (5 * doy + 2) / 153;
    *d = (int)(doy - (153 * mp + 2) / 5 + 1);
    *m = (int)(mp < 10 ? mp + 3 : mp - 9);
    *y = yoe + era * 400 + (*m <= 2);
}

int tz_weekday(int64_t days)
{
    int r = (int)((days + 4) % 7); /* 1970-01-01 was a Thursday */
    return r < 0 ? r + 7 : r;
}

int tz_is_leap(int64_t y)
{
    return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
}

int tz_days_in_month(int64_t y, int m)
{
    static const int len[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    return m == 2 && tz_is_leap(y) ? 29 : len[m - 1];
}

static int64_t floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q;
}

void tz_civil_from_seconds(int64_t wall, tz_civil *out)
{
    int64_t days = floor_div(wall, 86400);
    int64_t sod = wall - days * 86400;
    tz_civil_from_days(days, &out->year, &out->month, &out->day);
    out->hour = (int)(sod / 3600);
    out->min = (int)(sod / 60 % 60);
    out->sec = (int)(sod % 60);
    out->wday = tz_weekday(days);
    out->yday = (int)(days - tz_days_from_civil(out->year, 1, 1));
}

/* ---- zone data --------------------------------------------------------------------------- */

typedef struct tz_type {
    int32_t utoff;
    int isdst;
    char abbr[TZ_ABBR_MAX];
} tz_type;

/* A POSIX-TZ date rule: Jn (kind 'J', a = n), n (kind 'D', a = n) or Mm.w.d (kind 'M'). */
typedef struct tz_rule {
    char kind;
    int a, b, c;
    int32_t secs; /* local time of day of the change; may be negative or past 24h */
} tz_rule;

typedef struct tz_posix {
    tz_type std, dst;
    int has_dst;
    tz_rule start, end; /* start: std -> dst; end: dst -> std */
} tz_posix;

struct tz_zone {
    char name[TZ_NAME_MAX + 1];
    size_t ntrans;
    int64_t *trans;     /* strictly ascending */
    unsigned char *idx; /* type of each transition */
    size_t ntypes;      /* >= 1 */
    tz_type *types;
    int has_footer;
    tz_posix footer;
    int builtin;
};

static tz_type utc_type = {.utoff = 0, .isdst = 0, .abbr = "UTC"};
static const tz_zone utc_zone = {.name = "UTC", .ntypes = 1, .types = &utc_type, .builtin = 1};

const tz_zone *tz_utc(void)
{
    return &utc_zone;
}

const char *tz_name(const tz_zone *z)
{
    return z->name;
}

void tz_free(tz_zone *z)
{
    if (!z || z->builtin) return;
    free(z->trans);
    free(z->idx);
    free(z->types);
    free(z);
}

static void copy_abbr(char *dst, const char *src, size_t n)
{
    if (n >= TZ_ABBR_MAX) n = TZ_ABBR_MAX - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

/* ---- POSIX TZ strings ---------------------------------------------------------------------- */

/* An abbreviation: 3+ letters, or <...> of letters, digits, '+' and '-'. */
static int posix_abbr(const char **sp, char *out)
{
    const char *s = *sp, *b, *e;
    if (*s == '<') {
        b = ++s;
        while ((*s >= 'A' && *s <= 'Z') || (*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') ||
               *s == '+' || *s == '-')
            s++;
        if (*s != '>') return -1;
        e = s++;
    } else {
        b = s;
        while ((*s >= 'A' && *s <= 'Z') || (*s >= 'a' && *s <= 'z'))
            s++;
        e = s;
    }
    if (e - b < 3) return -1;
    copy_abbr(out, b, (size_t)(e - b));
    *sp = s;
    return 0;
}

/* [+-]hh[:mm[:ss]] with hh <= max_hours; returns seconds (sign applied). */
static int posix_time(const char **sp, int max_hours, int32_t *out)
{
    const char *s = *sp;
    int sign = 1;
    if (*s == '+' || *s == '-') sign = *s++ == '-' ? -1 : 1;
    if (*s < '0' || *s > '9') return -1;
    int h = 0, m = 0, sec = 0, nd = 0;
    while (*s >= '0' && *s <= '9' && nd < 3) {
        h = h * 10 + (*s++ - '0');
        nd++;
    }
    if (h > max_hours) return -1;
    for (int part = 0; part < 2 && *s == ':'; part++) {
        s++;
        if (s[0] < '0' || s[0] > '5' || s[1] < '0' || s[1] > '9') return -1;
        int v = (s[0] - '0') * 10 + (s[1] - '0');
        s += 2;
        if (part == 0)
            m = v;
        else
            sec = v;
    }
    *out = sign * (h * 3600 + m * 60 + sec);
    *sp = s;
    return 0;
}

static int posix_number(const char **sp, int lo, int hi, int *out)
{
    const char *s = *sp;
    int v = 0, nd = 0;
    while (*s >= '0' && *s <= '9' && nd < 4) {
        v = v * 10 + (*s++ - '0');
        nd++;
    }
    if (nd == 0 || v < lo || v > hi) return -1;
    *out = v;
    *sp = s;
    return 0;
}

/* Jn | n | Mm.w.d, then an optional /time (RFC 8536 allows -167..167 hours). */
static int posix_rule(const char **sp, tz_rule *r)
{
    const char *s = *sp;
    memset(r, 0, sizeof *r);
    if (*s == 'J') {
        s++;
        r->kind = 'J';
        if (posix_number(&s, 1, 365, &r->a)) return -1;
    } else if (*s == 'M') {
        s++;
        r->kind = 'M';
        if (posix_number(&s, 1, 12, &r->a) || *s++ != '.') return -1;
        if (posix_number(&s, 1, 5, &r->b) || *s++ != '.') return -1;
        if (posix_number(&s, 0, 6, &r->c)) return -1;
    } else {
        r->kind = 'D';
        if (posix_number(&s, 0, 365, &r->a)) return -1;
    }
    r->secs = 2 * 3600;
    if (*s == '/') {
        s++;
        if (posix_time(&s, 167, &r->secs)) return -1;
    }
    *sp = s;
    return 0;
}

/* Parses "std offset [dst [offset] [,start[/time],end[/time]]]". POSIX offsets are hours west
 * of UTC; we store seconds east. A dst part without rules gets the US rules, as glibc does. */
static int posix_parse(const char *spec, tz_posix *p)
{
    const char *s = spec;
    int32_t off;
    memset(p, 0, sizeof *p);
    if (posix_abbr(&s, p->std.abbr) || posix_time(&s, 24, &off)) return -1;
    p->std.utoff = -off;
    if (!*s) return 0;
    if (posix_abbr(&s, p->dst.abbr)) return -1;
    p->has_dst = 1;
    p->dst.isdst = 1;
    p->dst.utoff = p->std.utoff + 3600;
    if (*s && *s != ',') {
        if (posix_time(&s, 24, &off)) return -1;
        p->dst.utoff = -off;
    }
    if (!*s) {
        const char *us = "M3.2.0,M11.1.0";
        if (posix_rule(&us, &p->start) || *us++ != ',' || posix_rule(&us, &p->end)) return -1;
        return 0;
    }
    if (*s++ != ',' || posix_rule(&s, &p->start) || *s++ != ',' || posix_rule(&s, &p->end))
        return -1;
    return *s ? -1 : 0;
}

/* Day (since 1970-01-01) on which rule r falls in year y. */
static int64_t rule_day(const tz_rule *r, int64_t y)
{
    int64_t jan1 = tz_days_from_civil(y, 1, 1);
    if (r->kind == 'J') return jan1 + r->a - 1 + (tz_is_leap(y) && r->a >= 60);
    if (r->kind == 'D') return jan1 + r->a;
    int64_t first = tz_days_from_civil(y, r->a, 1);
    int day = (r->c - tz_weekday(first) + 7) % 7 + (r->b - 1) * 7;
    int dim = tz_days_in_month(y, r->a);
    while (day >= dim)
        day -= 7;
    return first + day;
}

typedef struct posix_event {
    int64_t at;
    int dst; /* state after the event */
} posix_event;

/* The footer's period containing t. Computes both changes of the seven years around t, orders
 * them (a change back to standard time first when two coincide, so a zone whose rules say "DST
 * all year", like EST5EDT,0/0,J365/25, stays in DST) and keeps the ones that change the state.
 * Constant work; a closed form per hemisphere was rejected because it gets the all-year case and
 * the boundaries near New Year wrong.
 * The period is cut to [January 1st of y-1, January 1st of y+2) (UTC), where every change is
 * among those computed (a change can stray 167 hours out of its year): when no kept change
 * follows t, the state is unknown past the window, not constant to TZ_T_MAX. That happens when
 * the two changes coincide in some years (M1.4.2 and M1.5.2 are one day when January has four
 * Tuesdays), which all-but-cancels the rules. */
static void posix_period(const tz_posix *p, int64_t t, tz_period *out)
{
    if (!p->has_dst) {
        out->utoff = p->std.utoff;
        out->isdst = 0;
        out->abbr = p->std.abbr;
        out->start = TZ_T_MIN;
        out->end = TZ_T_MAX;
        return;
    }
    int64_t y, days = floor_div(t + p->std.utoff, 86400);
    int m, d;
    tz_civil_from_days(days, &y, &m, &d);
    posix_event ev[14], kept[14];
    int n = 0, nk = 0;
    for (int64_t yy = y - 3; yy <= y + 3; yy++) {
        ev[n].at = rule_day(&p->start, yy) * 86400 + p->start.secs - p->std.utoff;
        ev[n++].dst = 1;
        ev[n].at = rule_day(&p->end, yy) * 86400 + p->end.secs - p->dst.utoff;
        ev[n++].dst = 0;
    }
    for (int i = 1; i < n; i++) { /* insertion sort by (at, dst) */
        posix_event e = ev[i];
        int j = i - 1;
        while (j >= 0 && (ev[j].at > e.at || (ev[j].at == e.at && ev[j].dst > e.dst))) {
            ev[j + 1] = ev[j];
            j--;
        }
        ev[j + 1] = e;
    }
    for (int i = 0; i < n; i++) {
        while (nk > 0 && kept[nk - 1].at == ev[i].at)
            nk--;
        if (nk == 0 || kept[nk - 1].dst != ev[i].dst) kept[nk++] = ev[i];
    }
    int k = -1;
    while (k + 1 < nk && kept[k + 1].at <= t)
        k++;
    int dst = k >= 0 ? kept[k].dst : !kept[0].dst;
    const tz_type *ty = dst ? &p->dst : &p->std;
    out->utoff = ty->utoff;
    out->isdst = ty->isdst;
    out->abbr = ty->abbr;
    int64_t lo = tz_days_from_civil(y - 1, 1, 1) * 86400,
            hi = tz_days_from_civil(y + 2, 1, 1) * 86400;
    out->start = k >= 0 && kept[k].at > lo ? kept[k].at : lo;
    out->end = k + 1 < nk && kept[k + 1].at < hi ? kept[k + 1].at : hi;
}

/* ---- TZif -------------------------------------------------------------------------------- */

static uint32_t be32(const unsigned char *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static int64_t be64(const unsigned char *p)
{
    return (int64_t)((uint64_t)be32(p) << 32 | be32(p + 4));
}

typedef struct tzif_header {
    uint32_t isutcnt, isstdcnt, leapcnt, timecnt, typecnt, charcnt;
} tzif_header;

static void read_header(const unsigned char *p, tzif_header *h)
{
    h->isutcnt = be32(p + 20);
    h->isstdcnt = be32(p + 24);
    h->leapcnt = be32(p + 28);
    h->timecnt = be32(p + 32);
    h->typecnt = be32(p + 36);
    h->charcnt = be32(p + 40);
}

/* Bytes of a data block with `tsize`-byte times (4 in v1, 8 in v2+). */
static uint64_t block_size(const tzif_header *h, int tsize)
{
    return (uint64_t)h->timecnt * (uint64_t)tsize + h->timecnt + (uint64_t)h->typecnt * 6 +
           h->charcnt + (uint64_t)h->leapcnt * (uint64_t)(tsize + 4) + h->isstdcnt + h->isutcnt;
}

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        snprintf(err, errlen, __VA_ARGS__);                                                        \
        goto fail;                                                                                 \
    } while (0)

/* Parses TZif bytes data[0..len) of zone `name` into a new zone. Versions 2 and later skip the
 * v1 block and read the 64-bit one and the POSIX-TZ footer (the rule after the last
 * transition); version 1 has 32-bit times and no footer. Every count is checked against the
 * bytes left before anything is read, transitions must ascend, type indices and abbreviation
 * offsets must be in range, and offsets within +-TZ_UTOFF_MAX; leap-second files are refused.
 * Returns 0 with *out set (the caller frees it with tz_free); or -1 with one line in err (at
 * most errlen bytes) that names the zone and the defect, *out untouched and nothing leaked.
 * Never reads outside data; no I/O (tz_load reads the file), so it is the fuzz target. */
int tz_parse(const char *name, const unsigned char *data, size_t len, tz_zone **out, char *err,
             size_t errlen)
{
    tz_zone *z = calloc(1, sizeof *z);
    if (!z) {
        snprintf(err, errlen, "time zone \"%s\": out of memory", name);
        return -1;
    }
    snprintf(z->name, sizeof z->name, "%s", name);
    if (len < 4 || memcmp(data, "TZif", 4) != 0) FAIL("time zone \"%s\": not a TZif file", name);
    if (len < 44) FAIL("time zone \"%s\": truncated TZif header", name);
    tzif_header h;
    read_header(data, &h);
    int version = data[4];
    if (version != 0 && version < '2') FAIL("time zone \"%s\": unknown TZif version", name);
    const unsigned char *p = data + 44, *end = data + len;
    int tsize = 4;
    if (version >= '2') {
        uint64_t skip = block_size(&h, 4);
        if (skip + 44 > (uint64_t)(end - p)) FAIL("time zone \"%s\": truncated TZif data", name);
        p += skip;
        if (memcmp(p, "TZif", 4) != 0) FAIL("time zone \"%s\": bad second TZif header", name);
        read_header(p, &h);
        p += 44;
        tsize = 8;
    }
    if (h.leapcnt) FAIL("time zone \"%s\": leap-second (\"right/\") zones are not supported", name);
    if (h.typecnt == 0 || h.typecnt > TZ_TYPES_MAX || h.charcnt == 0 ||
        (h.isstdcnt && h.isstdcnt != h.typecnt) || (h.isutcnt && h.isutcnt != h.typecnt))
        FAIL("time zone \"%s\": inconsistent TZif counts", name);
    if (block_size(&h, tsize) > (uint64_t)(end - p))
        FAIL("time zone \"%s\": truncated TZif data", name);

    z->ntrans = h.timecnt;
    z->ntypes = h.typecnt;
    z->trans = malloc(sizeof *z->trans * (h.timecnt ? h.timecnt : 1));
    z->idx = malloc(h.timecnt ? h.timecnt : 1);
    z->types = calloc(h.typecnt, sizeof *z->types);
    if (!z->trans || !z->idx || !z->types) FAIL("time zone \"%s\": out of memory", name);
    for (uint32_t i = 0; i < h.timecnt; i++) {
        z->trans[i] = tsize == 8 ? be64(p) : (int32_t)be32(p);
        p += tsize;
        if (i > 0 && z->trans[i] <= z->trans[i - 1])
            FAIL("time zone \"%s\": transition times are not ascending", name);
    }
    for (uint32_t i = 0; i < h.timecnt; i++) {
        z->idx[i] = p[i];
        if (p[i] >= h.typecnt) FAIL("time zone \"%s\": transition type out of range", name);
    }
    p += h.timecnt;
    const unsigned char *chars = p + (size_t)h.typecnt * 6;
    for (uint32_t i = 0; i < h.typecnt; i++, p += 6) {
        int32_t utoff = (int32_t)be32(p);
        unsigned desig = p[5];
        if (utoff <= -TZ_UTOFF_MAX || utoff >= TZ_UTOFF_MAX || p[4] > 1 || desig >= h.charcnt)
            FAIL("time zone \"%s\": bad local time type", name);
        const unsigned char *nul = memchr(chars + desig, 0, h.charcnt - desig);
        if (!nul) FAIL("time zone \"%s\": unterminated abbreviation", name);
        z->types[i].utoff = utoff;
        z->types[i].isdst = p[4];
        copy_abbr(z->types[i].abbr, (const char *)chars + desig, (size_t)(nul - (chars + desig)));
    }
    p = chars + h.charcnt + h.isstdcnt + h.isutcnt; /* leapcnt is 0 */

    if (tsize == 8) {
        /* The footer: "\n" POSIX-TZ "\n"; an empty string means "no rule". */
        if (p >= end || *p != '\n') FAIL("time zone \"%s\": missing TZif footer", name);
        const unsigned char *nl = memchr(p + 1, '\n', (size_t)(end - p - 1));
        if (!nl) FAIL("time zone \"%s\": unterminated TZif footer", name);
        size_t flen = (size_t)(nl - p - 1);
        if (flen > 0) {
            char spec[128];
            if (flen >= sizeof spec || memchr(p + 1, 0, flen))
                FAIL("time zone \"%s\": bad TZif footer", name);
            memcpy(spec, p + 1, flen);
            spec[flen] = '\0';
            if (posix_parse(spec, &z->footer))
                FAIL("time zone \"%s\": bad TZif footer \"%s\"", name, spec);
            z->has_footer = 1;
        }
    }
    *out = z;
    return 0;
fail:
    tz_free(z);
    return -1;
}

int tz_from_posix(const char *name, const char *spec, tz_zone **out, char *err, size_t errlen)
{
    tz_zone *z = calloc(1, sizeof *z);
    if (!z) {
        snprintf(err, errlen, "time zone \"%s\": out of memory", name);
        return -1;
    }
    snprintf(z->name, sizeof z->name, "%s", name);
    z->ntypes = 1;
    z->types = calloc(1, sizeof *z->types);
    if (!z->types) FAIL("time zone \"%s\": out of memory", name);
    if (posix_parse(spec, &z->footer)) FAIL("time zone \"%s\": bad POSIX TZ string", name);
    z->types[0] = z->footer.std;
    z->has_footer = 1;
    *out = z;
    return 0;
fail:
    tz_free(z);
    return -1;
}

static int name_ok(const char *name, char *err, size_t errlen)
{
    size_t n = strlen(name);
    if (n == 0) {
        snprintf(err, errlen, "time zone name is empty");
        return 0;
    }
    if (n > TZ_NAME_MAX) {
        snprintf(err, errlen, "time zone name is longer than %d bytes", TZ_NAME_MAX);
        return 0;
    }
    if (name[0] == '/' || strstr(name, "..")) {
        snprintf(err, errlen, "time zone name \"%s\" must not start with '/' or contain \"..\"",
                 name);
        return 0;
    }
    for (const char *s = name; *s; s++) {
        char c = *s;
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
              c == '/' || c == '_' || c == '-' || c == '+' || c == '.')) {
            snprintf(err, errlen,
                     "time zone name \"%.64s\" has a character other than letters, digits and "
                     "/_-+.",
                     name);
            return 0;
        }
    }
    return 1;
}

/* Finds zone `name` in dir (else $TZDIR, else TZ_DEFAULT_DIR) and parses it (tz_parse). The
 * name is checked first (name_ok: nothing that could leave the directory reaches open()); "UTC"
 * is the built-in zone and needs no file. The file must be regular and at most TZ_FILE_MAX
 * bytes; it is read whole with blocking read(2) (one small local file, on the loop thread).
 * Returns 0 with *out set (tz_free it), or -1 with one line in err naming the zone and the
 * directory or the file (and, for a bad file, the parser's reason then the path). */
int tz_load(const char *name, const char *dir, tz_zone **out, char *err, size_t errlen)
{
    if (!name_ok(name, err, errlen)) return -1;
    if (strcmp(name, "UTC") == 0) {
        *out = (tz_zone *)&utc_zone;
        return 0;
    }
    const char *from = "";
    if (!dir) {
        dir = getenv("TZDIR");
        from = " ($TZDIR)";
        if (!dir || !*dir) {
            dir = TZ_DEFAULT_DIR;
            from = "";
        }
    }
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path) {
        snprintf(err, errlen, "unknown time zone \"%s\": path too long under %s%s", name, dir,
                 from);
        return -1;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT || e == ENOTDIR)
            snprintf(err, errlen, "unknown time zone \"%s\": no such file in %s%s", name, dir,
                     from);
        else
            snprintf(err, errlen, "unknown time zone \"%s\": cannot open %s: %s", name, path,
                     strerror(e));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > TZ_FILE_MAX) {
        close(fd);
        snprintf(err, errlen, "unknown time zone \"%s\": %s is not a time zone file", name, path);
        return -1;
    }
    unsigned char *buf = malloc(st.st_size ? (size_t)st.st_size : 1);
    if (!buf) {
        close(fd);
        snprintf(err, errlen, "time zone \"%s\": out of memory", name);
        return -1;
    }
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    int rc = tz_parse(name, buf, got, out, err, errlen);
    free(buf);
    if (rc != 0) {
        /* Say which file, after the parser's reason. */
        size_t n = strlen(err);
        if (n + 1 < errlen) snprintf(err + n, errlen - n, " (%s)", path);
    }
    return rc;
}

/* ---- lookups ----------------------------------------------------------------------------- */

static void type_period(const tz_type *ty, int64_t start, int64_t end, tz_period *p)
{
    p->utoff = ty->utoff;
    p->isdst = ty->isdst;
    p->abbr = ty->abbr;
    p->start = start;
    p->end = end;
}

void tz_period_at(const tz_zone *z, int64_t t, tz_period *p)
{
    if (t < TZ_T_MIN) t = TZ_T_MIN;
    if (t > TZ_T_MAX - 1) t = TZ_T_MAX - 1;
    size_t n = z->ntrans;
    if (n == 0) {
        if (z->has_footer)
            posix_period(&z->footer, t, p);
        else
            type_period(&z->types[0], TZ_T_MIN, TZ_T_MAX, p);
    } else if (t < z->trans[0]) {
        type_period(&z->types[0], TZ_T_MIN, z->trans[0], p);
    } else if (t >= z->trans[n - 1]) {
        if (z->has_footer) {
            posix_period(&z->footer, t, p);
            if (p->start < z->trans[n - 1]) p->start = z->trans[n - 1];
        } else {
            type_period(&z->types[z->idx[n - 1]], z->trans[n - 1], TZ_T_MAX, p);
        }
    } else {
        size_t lo = 0, hi = n - 1; /* trans[lo] <= t < trans[hi] */
        while (hi - lo > 1) {
            size_t mid = lo + (hi - lo) / 2;
            if (z->trans[mid] <= t)
                lo = mid;
            else
                hi = mid;
        }
        type_period(&z->types[z->idx[lo]], z->trans[lo], z->trans[hi], p);
    }
    if (p->start < TZ_T_MIN) p->start = TZ_T_MIN;
    if (p->end > TZ_T_MAX) p->end = TZ_T_MAX;
}

int32_t tz_offset_at(const tz_zone *z, int64_t t)
{
    tz_period p;
    tz_period_at(z, t, &p);
    return p.utoff;
}
