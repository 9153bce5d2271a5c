/*
 * cron.c — cron expression parser, normal form and next-fire search (see cron.h).
 *
 * Invariants of a parsed cron_expr: every mask is non-empty and holds only bits of its field's
 * range; a field with its `star` bit set was written "*" or "*\/n" and its mask is exactly
 * {min, min+n, ...}. The search works on "wall seconds" (a local date and time counted as if it
 * were UTC) inside one offset period of the zone at a time, where wall time and real time move
 * together; DST gaps and overlaps are the joins between periods.
 */
#include "cron.h"

#include <stdio.h>
#include <string.h>

static const char *const field_names[CRON_NFIELDS] = {"minute", "hour", "day-of-month", "month",
                                                      "day-of-week"};
static const int field_min[CRON_NFIELDS] = {0, 0, 1, 1, 0};
static const int field_max[CRON_NFIELDS] = {59, 23, 31, 12, 7};

static const char *const month_names[12] = {"JAN", "FEB", "MAR", "APR", "MAY", "JUN",
                                            "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"};
static const char *const wday_names[7] = {"SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"};

static const struct {
    const char *name, *expansion;
} macros[] = {
    {"@yearly", "0 0 1 1 *"}, {"@annually", "0 0 1 1 *"}, {"@monthly", "0 0 1 * *"},
    {"@weekly", "0 0 * * 0"}, {"@daily", "0 0 * * *"},    {"@midnight", "0 0 * * *"},
    {"@hourly", "0 * * * *"},
};

/* ---- parsing ----------------------------------------------------------------------------- */

typedef struct parse_ctx {
    const char *text; /* the whole expression, for messages */
    char *err;
    size_t errlen;
} parse_ctx;

/* Copies s into out with anything but printable ASCII as '?', so messages stay one line. */
static void printable(char *out, size_t outlen, const char *s, size_t n)
{
    size_t i = 0;
    for (; i < n && i + 1 < outlen; i++)
        out[i] = (s[i] >= 0x20 && s[i] < 0x7f) ? s[i] : '?';
    out[i] = '\0';
}

static int field_error(parse_ctx *px, int f, const char *ftext, size_t flen, const char *why)
{
    char fq[64], eq[256];
    printable(fq, sizeof fq, ftext, flen);
    printable(eq, sizeof eq, px->text, strlen(px->text));
    snprintf(px->err, px->errlen, "cron: field %d (%s) \"%s\": %s in \"%s\"", f + 1, field_names[f],
             fq, why, eq);
    return -1;
}

static int upper(int c)
{
    return c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c;
}

/* field_error whose reason quotes s[0..n) (made printable): before "s" after. */
static int quoted_error(parse_ctx *px, int f, const char *ftext, size_t flen, const char *before,
                        const char *s, size_t n, const char *after)
{
    char q[32], why[128];
    printable(q, sizeof q, s, n);
    snprintf(why, sizeof why, "%s\"%s\"%s", before, q, after);
    return field_error(px, f, ftext, flen, why);
}

/* The decimal number s[0..n) into *out (values past 10000 stop growing, so any range check
 * still fails them); -1 when a byte is not a digit. */
static int parse_digits(const char *s, size_t n, int *out)
{
    int v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        if (v < 10000) v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 0;
}

/* One value of field f at s[0..n): a number, or a month/weekday name in those fields. */
static int parse_value(parse_ctx *px, int f, const char *ftext, size_t flen, const char *s,
                       size_t n, int *out)
{
    if (n == 0) return field_error(px, f, ftext, flen, "missing value");
    if (s[0] >= '0' && s[0] <= '9') {
        int v;
        if (parse_digits(s, n, &v) != 0)
            return quoted_error(px, f, ftext, flen, "", s, n, " is not a number");
        if (v < field_min[f] || v > field_max[f]) {
            char why[128];
            snprintf(why, sizeof why, "value out of range %d-%d", field_min[f], field_max[f]);
            return field_error(px, f, ftext, flen, why);
        }
        *out = v;
        return 0;
    }
    if (n == 3 && (f == CRON_MONTH || f == CRON_WDAY)) {
        const char *const *names = f == CRON_MONTH ? month_names : wday_names;
        int count = f == CRON_MONTH ? 12 : 7;
        for (int i = 0; i < count; i++) {
            if (upper(s[0]) == names[i][0] && upper(s[1]) == names[i][1] &&
                upper(s[2]) == names[i][2]) {
                *out = f == CRON_MONTH ? i + 1 : i;
                return 0;
            }
        }
    }
    return quoted_error(px, f, ftext, flen, "", s, n,
                        f == CRON_MONTH  ? " is not a month (1-12 or JAN-DEC)"
                        : f == CRON_WDAY ? " is not a weekday (0-7 or SUN-SAT)"
                                         : " is not a number");
}

static int parse_step(parse_ctx *px, int f, const char *ftext, size_t flen, const char *s, size_t n,
                      int *out)
{
    int v;
    if (n == 0) return field_error(px, f, ftext, flen, "missing step after '/'");
    if (parse_digits(s, n, &v) != 0)
        return quoted_error(px, f, ftext, flen, "step ", s, n, " is not a number");
    int hi = f == CRON_WDAY ? 7 : field_max[f];
    if (v < 1 || v > hi) {
        char why[128];
        snprintf(why, sizeof why, "step %d out of range 1-%d", v, hi);
        return field_error(px, f, ftext, flen, why);
    }
    *out = v;
    return 0;
}

/* Parses field f (s[0..n), no blanks) into *mask, and sets *star and *step for "*" forms. */
static int parse_field(parse_ctx *px, int f, const char *s, size_t n, uint64_t *mask, int *star,
                       int *stepv)
{
    *mask = 0;
    *star = 0;
    *stepv = 0;
    int lo = field_min[f], hi = f == CRON_WDAY ? 6 : field_max[f];
    if (s[0] == '*') {
        int step = 1;
        if (n > 1) {
            if (s[1] != '/')
                return field_error(px, f, s, n, "'*' must stand alone or be followed by /step");
            if (parse_step(px, f, s, n, s + 2, n - 2, &step)) return -1;
        }
        for (int v = lo; v <= hi; v += step)
            *mask |= 1ULL << v;
        *star = 1;
        *stepv = step;
        return 0;
    }
    size_t i = 0;
    while (i <= n) {
        size_t j = i;
        while (j < n && s[j] != ',')
            j++;
        /* item s[i..j): value, a-b, a-b/n or a/n */
        if (j == i) return field_error(px, f, s, n, "empty list item");
        const char *item = s + i;
        size_t ilen = j - i;
        const char *slash = memchr(item, '/', ilen);
        const char *dash = memchr(item, '-', slash ? (size_t)(slash - item) : ilen);
        size_t alen = dash ? (size_t)(dash - item) : slash ? (size_t)(slash - item) : ilen;
        int a, b, step = 1;
        if (item[0] == '*')
            return field_error(px, f, s, n, "'*' cannot be part of a list or range");
        if (parse_value(px, f, s, n, item, alen, &a)) return -1;
        if (dash) {
            const char *bs = dash + 1;
            size_t blen = (slash ? (size_t)(slash - bs) : (size_t)(item + ilen - bs));
            if (parse_value(px, f, s, n, bs, blen, &b)) return -1;
            if (b < a) {
                char why[128];
                snprintf(why, sizeof why, "range %d-%d goes backwards%s", a, b,
                         f == CRON_WDAY && b == 0 ? " (write Sunday as 7 at the end of a range)"
                                                  : "");
                return field_error(px, f, s, n, why);
            }
        } else {
            b = slash ? field_max[f] : a; /* "a/n" runs to the end of the field */
        }
        if (slash && parse_step(px, f, s, n, slash + 1, (size_t)(item + ilen - slash - 1), &step))
            return -1;
        for (int v = a; v <= b; v += step)
            *mask |= 1ULL << (f == CRON_WDAY && v == 7 ? 0 : v);
        i = j + 1;
    }
    return 0;
}

/* Parses a five-field cron expression (or an @macro, case-insensitive, expanded by a recursive
 * call) into *out: one bit mask per field, plus which fields were "*" or "*\/n" and their step
 * (cron_next needs both for the day-of-month/day-of-week OR rule). *out is zeroed first, so a
 * failed parse leaves nothing half-set that could be mistaken for a schedule. Returns 0, or -1
 * with one line in err (at most errlen bytes, NUL-terminated) naming the field, its text and
 * the whole expression (non-printable bytes escaped), as cron.h shows. Reads nothing but text
 * (at most CRON_TEXT_MAX bytes); allocates nothing; never blocks. */
int cron_parse(const char *text, cron_expr *out, char *err, size_t errlen)
{
    parse_ctx px = {text, err, errlen};
    char eq[256];
    memset(out, 0, sizeof *out);
    size_t tlen = strlen(text);
    if (tlen > CRON_TEXT_MAX) {
        snprintf(err, errlen, "cron: expression longer than %d bytes", CRON_TEXT_MAX);
        return -1;
    }
    const char *s = text;
    while (*s == ' ' || *s == '\t')
        s++;
    if (!*s) {
        snprintf(err, errlen, "cron: empty expression");
        return -1;
    }
    if (*s == '@') {
        size_t n = 0;
        while (s[n] && s[n] != ' ' && s[n] != '\t')
            n++;
        const char *rest = s + n;
        while (*rest == ' ' || *rest == '\t')
            rest++;
        for (size_t m = 0; m < sizeof macros / sizeof macros[0]; m++) {
            if (strlen(macros[m].name) != n) continue;
            size_t k = 0;
            while (k < n && upper(s[k]) == upper(macros[m].name[k]))
                k++;
            if (k < n) continue;
            if (*rest) {
                printable(eq, sizeof eq, text, tlen);
                snprintf(err, errlen, "cron: %s takes no fields in \"%s\"", macros[m].name, eq);
                return -1;
            }
            return cron_parse(macros[m].expansion, out, err, errlen);
        }
        char mq[64];
        printable(mq, sizeof mq, s, n);
        printable(eq, sizeof eq, text, tlen);
        snprintf(err, errlen,
                 "cron: unknown macro \"%s\" in \"%s\" (known: @yearly @annually @monthly @weekly "
                 "@daily @midnight @hourly)",
                 mq, eq);
        return -1;
    }
    const char *fs[CRON_NFIELDS + 1];
    size_t fl[CRON_NFIELDS + 1];
    int nf = 0;
    while (*s) {
        const char *b = s;
        while (*s && *s != ' ' && *s != '\t')
            s++;
        if (nf <= CRON_NFIELDS) {
            fs[nf] = b;
            fl[nf] = (size_t)(s - b);
        }
        nf++;
        while (*s == ' ' || *s == '\t')
            s++;
    }
    if (nf != CRON_NFIELDS) {
        printable(eq, sizeof eq, text, tlen);
        snprintf(err, errlen,
                 "cron: expected 5 fields (minute hour day-of-month month day-of-week), got %d "
                 "in \"%s\"%s",
                 nf, eq, nf > 5 ? " (seconds and year fields are not supported)" : "");
        return -1;
    }
    for (int f = 0; f < CRON_NFIELDS; f++) {
        uint64_t mask;
        int star, step;
        if (parse_field(&px, f, fs[f], fl[f], &mask, &star, &step)) return -1;
        if (star) out->star |= 1u << f;
        out->step[f] = step;
        switch (f) {
        case CRON_MINUTE:
            out->minutes = mask;
            break;
        case CRON_HOUR:
            out->hours = (uint32_t)mask;
            break;
        case CRON_MDAY:
            out->mdays = (uint32_t)mask;
            break;
        case CRON_MONTH:
            out->months = (uint32_t)mask;
            break;
        default:
            out->wdays = (uint32_t)mask;
            break;
        }
    }
    return 0;
}

int cron_hour_restricted(const cron_expr *c)
{
    return !(c->star & (1u << CRON_HOUR));
}

/* ---- normal form ------------------------------------------------------------------------- */

typedef struct out_buf {
    char *buf;
    size_t len, need;
} out_buf;

static void put(out_buf *o, const char *s)
{
    size_t n = strlen(s);
    if (o->need < o->len) {
        size_t room = o->len - o->need - 1;
        memcpy(o->buf + o->need, s, n < room ? n : room);
        o->buf[o->need + (n < room ? n : room)] = '\0';
    }
    o->need += n;
}

static void put_int(out_buf *o, int v)
{
    char tmp[16];
    snprintf(tmp, sizeof tmp, "%d", v);
    put(o, tmp);
}

/* A mask as "a-b/n" when it is an even progression of 3+ values, else as a list whose runs of
 * 3+ consecutive values are ranges. */
static void put_mask(out_buf *o, uint64_t mask, int lo, int hi)
{
    int vals[64], n = 0;
    for (int v = lo; v <= hi; v++)
        if (mask & (1ULL << v)) vals[n++] = v;
    if (n >= 3 && vals[1] - vals[0] > 1) {
        int d = vals[1] - vals[0], even = 1;
        for (int i = 2; i < n && even; i++)
            even = vals[i] - vals[i - 1] == d;
        if (even) {
            put_int(o, vals[0]);
            put(o, "-");
            put_int(o, vals[n - 1]);
            put(o, "/");
            put_int(o, d);
            return;
        }
    }
    for (int i = 0; i < n;) {
        int j = i;
        while (j + 1 < n && vals[j + 1] == vals[j] + 1)
            j++;
        if (i > 0) put(o, ",");
        put_int(o, vals[i]);
        if (j - i >= 2) {
            put(o, "-");
            put_int(o, vals[j]);
            i = j + 1;
        } else {
            i++;
        }
    }
}

size_t cron_format(const cron_expr *c, char *buf, size_t len)
{
    out_buf o = {buf, len, 0};
    if (len) buf[0] = '\0';
    const uint64_t masks[CRON_NFIELDS] = {c->minutes, c->hours, c->mdays, c->months, c->wdays};
    for (int f = 0; f < CRON_NFIELDS; f++) {
        if (f) put(&o, " ");
        if (c->star & (1u << f)) {
            put(&o, "*");
            if (c->step[f] > 1) {
                put(&o, "/");
                put_int(&o, c->step[f]);
            }
        } else {
            put_mask(&o, masks[f], field_min[f], f == CRON_WDAY ? 6 : field_max[f]);
        }
    }
    return o.need;
}

/* ---- search ------------------------------------------------------------------------------ */

/* Smallest set bit of mask at or above `from`, or -1. */
static int next_bit(uint64_t mask, int from)
{
    if (from > 63) return -1;
    uint64_t m = mask & (~0ULL << from);
    return m ? __builtin_ctzll(m) : -1;
}

static int64_t floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && (a < 0) != (b < 0)) ? q - 1 : q;
}

/* Vixie cron: when both day fields are restricted a day matches if either does; when either
 * was written with '*', both must (the starred one usually matches every day). */
static int day_matches(const cron_expr *c, int mday, int64_t days)
{
    int dom = (c->mdays >> mday) & 1;
    int dow = (c->wdays >> tz_weekday(days)) & 1;
    if (c->star & ((1u << CRON_MDAY) | (1u << CRON_WDAY))) return dom && dow;
    return dom || dow;
}

/* The cursor of the search: a date (kept both as fields and as a day number) and a time. */
typedef struct cursor {
    int64_t y, days;
    int mo, d, h, mi;
} cursor;

static void next_month(const cron_expr *c, cursor *k)
{
    int m = next_bit(c->months, k->mo + 1);
    if (m < 0) {
        k->y++;
        m = next_bit(c->months, 1);
    }
    k->mo = m;
    k->d = 1;
    k->days = tz_days_from_civil(k->y, k->mo, 1);
    k->h = k->mi = 0;
}

static void next_day(const cron_expr *c, cursor *k)
{
    k->h = k->mi = 0;
    if (k->d >= tz_days_in_month(k->y, k->mo)) {
        next_month(c, k);
        return;
    }
    k->d++;
    k->days++;
}

/* Smallest wall time L with from <= L < limit whose minute matches c (ignoring zones). Skips
 * non-matching months whole and non-matching hours whole; days are visited one by one only when
 * a weekday is involved (at most 31 per month). Returns 1 and sets *out, or 0. */
static int next_wall(const cron_expr *c, int64_t from, int64_t limit, int64_t *out)
{
    if (from >= limit) return 0;
    int64_t w = floor_div(from, 60) * 60;
    if (w < from) w += 60;
    cursor k;
    k.days = floor_div(w, 86400);
    int64_t sod = w - k.days * 86400;
    tz_civil_from_days(k.days, &k.y, &k.mo, &k.d);
    k.h = (int)(sod / 3600);
    k.mi = (int)(sod / 60 % 60);
    int dom_only = (c->star & (1u << CRON_WDAY)) && !(c->star & (1u << CRON_MDAY));
    for (;;) {
        if (k.days * 86400 + k.h * 3600 + k.mi * 60 >= limit) return 0;
        if (!((c->months >> k.mo) & 1)) {
            next_month(c, &k);
            continue;
        }
        if (dom_only && c->wdays == 0x7f) { /* jump straight to the next listed day */
            int d = next_bit(c->mdays, k.d);
            if (d < 0 || d > tz_days_in_month(k.y, k.mo)) {
                next_month(c, &k);
                continue;
            }
            if (d != k.d) {
                k.days += d - k.d;
                k.d = d;
                k.h = k.mi = 0;
            }
        } else if (!day_matches(c, k.d, k.days)) {
            next_day(c, &k);
            continue;
        }
        int h = next_bit(c->hours, k.h);
        if (h < 0) {
            next_day(c, &k);
            continue;
        }
        if (h != k.h) {
            k.h = h;
            k.mi = 0;
        }
        int mi = next_bit(c->minutes, k.mi);
        if (mi < 0) {
            if (++k.h == 24)
                next_day(c, &k);
            else
                k.mi = 0;
            continue;
        }
        int64_t at = k.days * 86400 + k.h * 3600 + mi * 60;
        if (at >= limit) return 0;
        *out = at;
        return 1;
    }
}

/* Walks the zone's periods from `after`. Inside a period, real time t and wall time t + utoff
 * move together, so the first match is next_wall's answer moved back by the offset. At a join:
 *  - gap (offset grows): wall times [start + prev, start + off) never happen. A schedule with a
 *    restricted hour that matches one of them fires once, at `start`, the first instant after
 *    the gap; a schedule with a '*' hour just has no fires there.
 *  - overlap (offset shrinks): wall times [start + off, start + prev) happen a second time. A
 *    restricted-hour schedule had its chance in the previous period and skips them; a '*' hour
 *    schedule fires at every instant that matches, so at both.
 * Cost: one period lookup and one bounded next_wall per period crossed (about two a year). */
int cron_next(const cron_expr *c, const tz_zone *z, int64_t after, int64_t *out)
{
    if (after < CRON_T_MIN) after = CRON_T_MIN;
    if (after > CRON_T_MAX) after = CRON_T_MAX;
    int restricted = cron_hour_restricted(c);
    int64_t limit = after + (int64_t)CRON_SEARCH_DAYS * 86400;
    int64_t t = after + 1;
    while (t < limit) {
        tz_period p;
        tz_period_at(z, t, &p);
        int64_t off = p.utoff, from = t + off, wall_t;
        int64_t end = p.end < limit ? p.end : limit;
        if (restricted && p.start > TZ_T_MIN) {
            int64_t prev = tz_offset_at(z, p.start - 1);
            if (t == p.start && prev < off &&
                next_wall(c, p.start + prev, p.start + off, &wall_t)) {
                *out = p.start;
                return 1;
            }
            if (prev > off && from < p.start + prev) from = p.start + prev;
        }
        if (next_wall(c, from, end + off, &wall_t)) {
            *out = wall_t - off;
            return 1;
        }
        t = end;
    }
    return 0;
}
