/*
 * cron.c — module moonbox.cron: cron expressions (runtime/cron.c) and IANA time zones
 * (runtime/tz.c) for Lua. Every function here is a plain C call: none yields, none does I/O
 * except cron.zone's first load of a name (one small file read from the tz database).
 *
 * Zones are cached per name in a table shared by the module's functions (an upvalue, not a
 * registry ref), for the life of the Lua state; a zone's C data is freed by its userdata's __gc.
 */
#include "mb.h"

#include <math.h>
#include <string.h>

#include "cron.h"
#include "tz.h"

#define CRON_MT    "moonbox.cron.Cron"
#define ZONE_MT    "moonbox.cron.Zone"
#define NEXT_N_MAX 100000

typedef struct lzone {
    tz_zone *z;
} lzone;

/* Pushes the Zone named `name`, loading and caching it on first use; raises unknown_zone. The
 * cache is upvalue 1 of the calling C closure. */
static const tz_zone *push_zone(lua_State *L, const char *name)
{
    lua_getfield(L, lua_upvalueindex(1), name);
    if (!lua_isnil(L, -1)) return ((lzone *)lua_touserdata(L, -1))->z;
    lua_pop(L, 1);
    char err[512];
    tz_zone *z;
    if (tz_load(name, NULL, &z, err, sizeof err) != 0) {
        mb_error_new(L, "cron.zone", "unknown_zone", "%s", err);
        mb_setfield_str(L, -1, "zone", name);
        lua_error(L);
    }
    lzone *lz = (lzone *)lua_newuserdatauv(L, sizeof *lz, 0);
    lz->z = z;
    luaL_setmetatable(L, ZONE_MT);
    lua_pushvalue(L, -1);
    lua_setfield(L, lua_upvalueindex(1), name);
    return z;
}

/* The zone argument at idx: nil/none (UTC), an IANA name, or a Zone. */
static const tz_zone *check_zone(lua_State *L, int idx)
{
    if (lua_isnoneornil(L, idx)) return tz_utc();
    if (lua_type(L, idx) == LUA_TSTRING) {
        const tz_zone *z = push_zone(L, lua_tostring(L, idx));
        lua_pop(L, 1);
        return z;
    }
    lzone *lz = (lzone *)luaL_testudata(L, idx, ZONE_MT);
    if (!lz) luaL_typeerror(L, idx, "time zone name or Zone");
    return lz->z;
}

/* An instant argument: a finite number of Unix seconds in years 1-9999, floored. */
static int64_t check_instant(lua_State *L, int idx)
{
    if (lua_isinteger(L, idx)) {
        lua_Integer t = lua_tointeger(L, idx);
        luaL_argcheck(L, t >= CRON_T_MIN && t <= CRON_T_MAX, idx,
                      "instant out of range (years 1-9999)");
        return (int64_t)t;
    }
    lua_Number t = luaL_checknumber(L, idx);
    luaL_argcheck(L, t >= (lua_Number)CRON_T_MIN && t <= (lua_Number)CRON_T_MAX, idx,
                  "instant out of range (years 1-9999)");
    return (int64_t)floor(t);
}

static cron_expr *check_cron(lua_State *L, int idx)
{
    return (cron_expr *)luaL_checkudata(L, idx, CRON_MT);
}

/* cron.parse(expr) -> Cron. Raises a structured error (code invalid_cron, field expression)
 * whose message names the bad field: cron: field 2 (hour) "25": value out of range 0-23 in
 * "0 25 * * *". Does not yield. */
static int l_parse(lua_State *L)
{
    const char *text = luaL_checkstring(L, 1);
    cron_expr c;
    char err[512];
    if (cron_parse(text, &c, err, sizeof err) != 0) {
        mb_error_new(L, "cron.parse", "invalid_cron", "%s", err);
        mb_setfield_str(L, -1, "expression", text);
        return lua_error(L);
    }
    cron_expr *u = (cron_expr *)lua_newuserdatauv(L, sizeof *u, 0);
    *u = c;
    luaL_setmetatable(L, CRON_MT);
    return 1;
}

/* cron.validate(expr) -> true | nil, message. Never raises (a non-string is invalid too). */
static int l_validate(lua_State *L)
{
    if (lua_type(L, 1) != LUA_TSTRING) {
        lua_pushnil(L);
        lua_pushfstring(L, "cron: expected an expression string, got %s", luaL_typename(L, 1));
        return 2;
    }
    cron_expr c;
    char err[512];
    if (cron_parse(lua_tostring(L, 1), &c, err, sizeof err) != 0) {
        lua_pushnil(L);
        lua_pushstring(L, err);
        return 2;
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* cron.zone(name) -> Zone, cached per name. Raises a structured error (code unknown_zone, field
 * zone) naming the zone and the directory searched. */
static int l_zone(lua_State *L)
{
    push_zone(L, luaL_checkstring(L, 1));
    return 1;
}

/* Formats t in zone z as RFC 3339. An offset with seconds (local mean time before ~1900) is
 * shown truncated to minutes and the wall time moved to match, so the text still names t. */
static void push_rfc3339(lua_State *L, const tz_zone *z, int64_t t)
{
    int32_t off = tz_offset_at(z, t);
    int32_t shown = off / 60 * 60;
    tz_civil lt;
    tz_civil_from_seconds(t + shown, &lt);
    int32_t a = shown < 0 ? -shown : shown;
    char buf[64];
    snprintf(buf, sizeof buf, "%04lld-%02d-%02dT%02d:%02d:%02d%c%02d:%02d", (long long)lt.year,
             lt.month, lt.day, lt.hour, lt.min, lt.sec, shown < 0 ? '-' : '+', (int)(a / 3600),
             (int)(a / 60 % 60));
    lua_pushstring(L, buf);
}

/* cron.format(t [, tz]) -> "2026-03-29T03:00:00+02:00": instant t (floored to the second) as
 * RFC 3339 local time in tz (default UTC, written "+00:00"). Raises unknown_zone. */
static int l_format(lua_State *L)
{
    int64_t t = check_instant(L, 1);
    const tz_zone *z = check_zone(L, 2);
    push_rfc3339(L, z, t);
    return 1;
}

/* c:next(after [, tz]) -> integer | nil: the first instant strictly after `after` at which c
 * fires in tz (default UTC), or nil when it never fires within CRON_SEARCH_DAYS. */
static int c_next(lua_State *L)
{
    cron_expr *c = check_cron(L, 1);
    int64_t after = check_instant(L, 2);
    const tz_zone *z = check_zone(L, 3);
    int64_t t;
    if (cron_next(c, z, after, &t))
        lua_pushinteger(L, (lua_Integer)t);
    else
        lua_pushnil(L);
    return 1;
}

/* c:next_n(after, n [, tz]) -> {t1, ..., tn}: the next n fires; shorter when the schedule stops
 * firing (the search bound applies after each fire). n is 1 to 100000. */
static int c_next_n(lua_State *L)
{
    cron_expr *c = check_cron(L, 1);
    int64_t after = check_instant(L, 2);
    lua_Integer n = luaL_checkinteger(L, 3);
    luaL_argcheck(L, n >= 1 && n <= NEXT_N_MAX, 3, "count must be 1 to 100000");
    const tz_zone *z = check_zone(L, 4);
    lua_createtable(L, (int)n, 0);
    for (lua_Integer i = 1; i <= n; i++) {
        int64_t t;
        if (after > CRON_T_MAX || !cron_next(c, z, after, &t)) break;
        lua_pushinteger(L, (lua_Integer)t);
        lua_rawseti(L, -2, i);
        after = t;
    }
    return 1;
}

/* tostring(c): the normal form, e.g. "0 9 * 1,7 1-5" for "0 9 * JAN,jul mon-FRI". */
static int c_tostring(lua_State *L)
{
    cron_expr *c = check_cron(L, 1);
    char buf[512];
    size_t n = cron_format(c, buf, sizeof buf);
    lua_pushlstring(L, buf, n < sizeof buf ? n : sizeof buf - 1);
    return 1;
}

static lzone *check_lzone(lua_State *L, int idx)
{
    return (lzone *)luaL_checkudata(L, idx, ZONE_MT);
}

/* z:offset(t) -> seconds east of UTC, abbreviation, is_dst. */
static int z_offset(lua_State *L)
{
    lzone *lz = check_lzone(L, 1);
    tz_period p;
    tz_period_at(lz->z, check_instant(L, 2), &p);
    lua_pushinteger(L, p.utoff);
    lua_pushstring(L, p.abbr);
    lua_pushboolean(L, p.isdst);
    return 3;
}

/* z:local_time(t) -> {year, month, day, hour, min, sec, wday, yday, isdst}, with os.date's
 * conventions (wday 1 = Sunday, yday 1 = January 1st). */
static int z_local_time(lua_State *L)
{
    lzone *lz = check_lzone(L, 1);
    int64_t t = check_instant(L, 2);
    tz_period p;
    tz_period_at(lz->z, t, &p);
    tz_civil lt;
    tz_civil_from_seconds(t + p.utoff, &lt);
    lua_createtable(L, 0, 9);
    mb_setfield_int(L, -1, "year", (lua_Integer)lt.year);
    mb_setfield_int(L, -1, "month", lt.month);
    mb_setfield_int(L, -1, "day", lt.day);
    mb_setfield_int(L, -1, "hour", lt.hour);
    mb_setfield_int(L, -1, "min", lt.min);
    mb_setfield_int(L, -1, "sec", lt.sec);
    mb_setfield_int(L, -1, "wday", lt.wday + 1);
    mb_setfield_int(L, -1, "yday", lt.yday + 1);
    mb_setfield_bool(L, -1, "isdst", p.isdst);
    return 1;
}

/* z:format(t) -> RFC 3339 text of t in this zone (same as cron.format(t, z)). */
static int z_format(lua_State *L)
{
    lzone *lz = check_lzone(L, 1);
    push_rfc3339(L, lz->z, check_instant(L, 2));
    return 1;
}

/* z.name, and the methods. */
static int z_index(lua_State *L)
{
    lzone *lz = check_lzone(L, 1);
    const char *k = lua_tostring(L, 2);
    if (k && strcmp(k, "name") == 0) {
        lua_pushstring(L, tz_name(lz->z));
        return 1;
    }
    lua_pushvalue(L, 2);
    lua_rawget(L, lua_upvalueindex(1));
    return 1;
}

static int z_tostring(lua_State *L)
{
    lua_pushstring(L, tz_name(check_lzone(L, 1)->z));
    return 1;
}

static int z_gc(lua_State *L)
{
    lzone *lz = check_lzone(L, 1);
    tz_free(lz->z);
    lz->z = NULL;
    return 0;
}

/* require "moonbox.cron": pushes the module table {parse, validate, zone, format,
 * search_days} and registers the Cron and Zone metatables (once per state). Every function
 * and Cron method shares one zone cache table as upvalue 1, so a zone name is parsed once per
 * state. Raises only on out of memory. Never yields. */
int luaopen_moonbox_cron(lua_State *L)
{
    static const luaL_Reg cron_methods[] = {{"next", c_next}, {"next_n", c_next_n}, {NULL, NULL}};
    static const luaL_Reg zone_methods[] = {
        {"offset", z_offset}, {"local_time", z_local_time}, {"format", z_format}, {NULL, NULL}};
    static const luaL_Reg funcs[] = {{"parse", l_parse},
                                     {"validate", l_validate},
                                     {"zone", l_zone},
                                     {"format", l_format},
                                     {NULL, NULL}};

    lua_newtable(L); /* the zone cache, upvalue 1 of every function that takes a zone */
    int cache = lua_gettop(L);

    if (luaL_newmetatable(L, CRON_MT)) {
        lua_newtable(L);
        lua_pushvalue(L, cache);
        luaL_setfuncs(L, cron_methods, 1);
        lua_setfield(L, -2, "__index");
        lua_pushcfunction(L, c_tostring);
        lua_setfield(L, -2, "__tostring");
    }
    lua_pop(L, 1);

    static const luaL_Reg zone_meta[] = {{"__tostring", z_tostring}, {"__gc", z_gc}, {NULL, NULL}};
    mb_newclass_index(L, ZONE_MT, zone_methods, z_index, zone_meta);

    lua_newtable(L);
    lua_pushvalue(L, cache);
    luaL_setfuncs(L, funcs, 1);
    mb_setfield_int(L, -1, "search_days", CRON_SEARCH_DAYS);
    return 1;
}
