-- moonbox.cron: cron expressions, IANA time zones, next-fire times and DST behaviour.
--
-- How the expected values were obtained, independently of moonbox's code:
--  * Every instant in the tables below was computed with GNU date, which uses glibc's own tz
--    code reading the same /usr/share/zoneinfo, e.g.
--      TZ=UTC date -d '2026-01-05 09:00' +%s              -> 1767603600
--      TZ=Europe/Berlin date -d '2026-03-29 03:00' +%s    -> 1774746000
--      TZ=Europe/Berlin date -d '2026-10-25 02:30 CEST' +%s -> 1792888200 (first of two 02:30s)
--    and the expected fire lists were worked out by hand from the calendar (weekdays printed by
--    date +%a) and the DST rules in docs/reference/cron.md.
--  * The "agrees with glibc" tests recompute offsets, abbreviations and local times at test time
--    by running date through io.popen, for hundreds of instants in many zones (including every
--    DST change of 2020-2060 found by bisection, +-1 s) and for TZif files written here whose
--    footer rules use the Jn, n and Mm.w.d forms.
local cron = require "moonbox.cron"
local core = require "moonbox.core"
local build = require "moonbox.build"

local BIN = os.getenv("MOONBOX_BIN") or build.exe

local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- Runs GNU date over `instants` with the environment prefix `env` (e.g. "TZ=Europe/Berlin");
-- returns {[t] = {off = seconds east, abbr = "CET", lt = "YYYY-MM-DDTHH:MM:SS"}}.
local function glibc(env, instants)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  for _, t in ipairs(instants) do f:write("@", t, "\n") end
  f:close()
  local p = assert(io.popen(env .. " date -f " .. path .. " '+%s %::z %Z %Y-%m-%dT%H:%M:%S'"))
  local out = {}
  for line in p:lines() do
    local t, sign, h, m, s, abbr, lt = line:match("^(%-?%d+) ([+-])(%d+):(%d+):(%d+) (%S+) (%S+)$")
    assert(t, "unexpected date output: " .. line)
    local off = tonumber(h) * 3600 + tonumber(m) * 60 + tonumber(s)
    out[tonumber(t)] = { off = sign == "-" and -off or off, abbr = abbr, lt = lt }
  end
  p:close()
  os.remove(path)
  return out
end

local function lt_text(z, t)
  local l = z:local_time(t)
  return string.format("%04d-%02d-%02dT%02d:%02d:%02d", l.year, l.month, l.day, l.hour, l.min, l.sec)
end

-- Deterministic spread of instants over [lo, hi).
local function spread(n, lo, hi, seed)
  local out, x = {}, seed
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    out[i] = lo + (x * 9973 + i) % (hi - lo)
  end
  return out
end

-- The instants where z's offset changes in [lo, hi), found by daily steps and bisection.
local function changes(z, lo, hi)
  local out = {}
  local prev = z:offset(lo)
  for t = lo + 86400, hi, 86400 do
    local off = z:offset(t)
    if off ~= prev then
      local a, b = t - 86400, t
      while b - a > 1 do
        local mid = (a + b) // 2
        if z:offset(mid) == prev then a = mid else b = mid end
      end
      out[#out + 1] = b
      prev = off
    end
  end
  return out
end

local function fires(expr, after, n, tz)
  return cron.parse(expr):next_n(after, n, tz)
end

describe("cron.parse", function()
  it("accepts the syntax and prints the normal form", function()
    local cases = {
      { "*/15 9-17 * * 1-5", "*/15 9-17 * * 1-5" },
      { "0 9 * JAN,jul mon-FRI", "0 9 * 1,7 1-5" },
      { "  0   0\t* * 7 ", "0 0 * * 0" },
      { "0 0 * * SUN,7", "0 0 * * 0" },
      { "0 0 * * 5-7", "0 0 * * 0,5,6" },
      { "0-59/20 * * * *", "0-40/20 * * * *" },
      { "5/15 * * * *", "5-50/15 * * * *" },
      { "0 0 1,15,2,3 * *", "0 0 1-3,15 * *" },
      { "*/1 * * * *", "* * * * *" },
      { "0 */6 * * *", "0 */6 * * *" },
      { "0 0 */2 * *", "0 0 */2 * *" },
      { "0 12 1 * 1", "0 12 1 * 1" },
      { "@hourly", "0 * * * *" },
      { "@daily", "0 0 * * *" },
      { "@midnight", "0 0 * * *" },
      { "@weekly", "0 0 * * 0" },
      { "@monthly", "0 0 1 * *" },
      { "@yearly", "0 0 1 1 *" },
      { "@ANNUALLY", "0 0 1 1 *" },
    }
    for _, c in ipairs(cases) do
      assert.are.equal(c[2], tostring(cron.parse(c[1])), c[1])
      assert.is_true(cron.validate(c[1]))
    end
  end)

  it("rejects bad expressions with messages that point at the field", function()
    local cases = {
      { "0 25 * * *", 'cron: field 2 (hour) "25": value out of range 0-23 in "0 25 * * *"' },
      { "60 * * * *", 'cron: field 1 (minute) "60": value out of range 0-59 in "60 * * * *"' },
      { "0 0 0 * *", 'cron: field 3 (day-of-month) "0": value out of range 1-31 in "0 0 0 * *"' },
      { "0 0 * 13 *", 'cron: field 4 (month) "13": value out of range 1-12 in "0 0 * 13 *"' },
      { "0 0 * * 8", 'cron: field 5 (day-of-week) "8": value out of range 0-7 in "0 0 * * 8"' },
      { "0 0 * FOO *", 'cron: field 4 (month) "FOO": "FOO" is not a month (1-12 or JAN-DEC) in "0 0 * FOO *"' },
      { "0 0 * * MO", 'cron: field 5 (day-of-week) "MO": "MO" is not a weekday (0-7 or SUN-SAT) in "0 0 * * MO"' },
      { "0 JAN * * *", 'cron: field 2 (hour) "JAN": "JAN" is not a number in "0 JAN * * *"' },
      { "5x * * * *", 'cron: field 1 (minute) "5x": "5x" is not a number in "5x * * * *"' },
      { "0 0 * * 5-1", 'cron: field 5 (day-of-week) "5-1": range 5-1 goes backwards in "0 0 * * 5-1"' },
      { "0 0 * * FRI-SUN", 'cron: field 5 (day-of-week) "FRI-SUN": range 5-0 goes backwards'
        .. ' (write Sunday as 7 at the end of a range) in "0 0 * * FRI-SUN"' },
      { "*/0 * * * *", 'cron: field 1 (minute) "*/0": step 0 out of range 1-59 in "*/0 * * * *"' },
      { "0 1-5/ * * *", 'cron: field 2 (hour) "1-5/": missing step after \'/\' in "0 1-5/ * * *"' },
      { "1,,2 * * * *", 'cron: field 1 (minute) "1,,2": empty list item in "1,,2 * * * *"' },
      { "*,5 * * * *", 'cron: field 1 (minute) "*,5": \'*\' must stand alone or be followed by /step in "*,5 * * * *"' },
      { "5,* * * * *", 'cron: field 1 (minute) "5,*": \'*\' cannot be part of a list or range in "5,* * * * *"' },
      { "* * * *", 'cron: expected 5 fields (minute hour day-of-month month day-of-week), got 4 in "* * * *"' },
      { "0 0 0 * * * *", 'cron: expected 5 fields (minute hour day-of-month month day-of-week), got 7 in'
        .. ' "0 0 0 * * * *" (seconds and year fields are not supported)' },
      { "@reboot", 'cron: unknown macro "@reboot" in "@reboot" (known: @yearly @annually @monthly @weekly'
        .. ' @daily @midnight @hourly)' },
      { "@daily 5", 'cron: @daily takes no fields in "@daily 5"' },
      { "  ", "cron: empty expression" },
    }
    for _, c in ipairs(cases) do
      local ok, msg = cron.validate(c[1])
      assert.is_nil(ok, c[1])
      assert.are.equal(c[2], msg)
      local ok2, err = pcall(cron.parse, c[1])
      assert.is_false(ok2)
      assert.is_true(core.Error.is(err))
      assert.are.equal("invalid_cron", err.code)
      assert.are.equal("cron.parse", err.op)
      assert.are.equal(c[2], err.message)
      assert.are.equal(c[1], err.expression)
    end
  end)

  it("validates without raising, whatever it is given", function()
    local ok, msg = cron.validate(42)
    assert.is_nil(ok)
    assert.are.equal("cron: expected an expression string, got number", msg)
    assert.is_nil((cron.validate(nil)))
    assert.has_error(function() cron.parse({}) end)
  end)
end)

describe("c:next in UTC", function()
  it("steps through working hours and skips the weekend", function()
    -- after Fri 2026-01-02 16:50: 17:00 .. 17:45, then Mon 2026-01-05 09:00
    assert.are.same({ 1767373200, 1767374100, 1767375000, 1767375900, 1767603600 },
      fires("*/15 9-17 * * 1-5", 1767372600, 5))
  end)

  it("skips months without a 31st", function()
    -- after 2026-01-01: Jan 31, Mar 31, May 31, Jul 31, Aug 31
    assert.are.same({ 1769817600, 1774915200, 1780185600, 1785456000, 1788134400 },
      fires("0 0 31 * *", 1767225600, 5))
  end)

  it("finds leap days, across the 8 years without one around 2100", function()
    assert.are.same({ 1835395200, 1961625600 }, fires("0 0 29 2 *", 1767225600, 2)) -- 2028, 2032
    assert.are.equal(4233686400, cron.parse("0 0 29 2 *"):next(4007836800)) -- 2097-01-01 -> 2104-02-29
  end)

  it("fires when either day field matches if both are restricted", function()
    -- after 2026-01-01 00:00 (Thu): the 1st, then Mondays, then Sun Feb 1 (the 1st), Mon Feb 2
    assert.are.same({ 1767268800, 1767614400, 1768219200, 1768824000, 1769428800, 1769947200, 1770033600 },
      fires("0 12 1 * 1", 1767225600, 7))
  end)

  it("requires both when one day field is a star", function()
    -- "*/2" for day-of-month is still a star field: odd days that are Mondays
    -- after 2026-01-01: Mon Jan 5, Mon Jan 19, Mon Feb 9 (odd, Monday)
    assert.are.same({ 1767571200, 1768780800, 1770595200 }, fires("0 0 */2 * 1", 1767225600, 3))
  end)

  it("understands month and weekday names in any case", function()
    -- after Thu 2026-01-29 12:00: Fri Jan 30, then Wed Jul 1, Thu Jul 2, Fri Jul 3, Mon Jul 6
    assert.are.same({ 1769763600, 1782896400, 1782982800, 1783069200, 1783328400 },
      fires("0 9 * JAN,jul mon-FRI", 1769688000, 5))
  end)

  it("expands @weekly and @yearly", function()
    assert.are.same({ 1767484800, 1768089600, 1768694400 }, fires("@weekly", 1767225600, 3))
    -- strictly after: from 2026-01-01T00:00:00Z itself the next @yearly is 2027
    assert.are.same({ 1798761600, 1830297600 }, fires("@yearly", 1767225600, 2))
  end)

  it("is strictly after, also for fractional instants", function()
    local c = cron.parse("*/15 9-17 * * 1-5")
    assert.are.equal(1767374100, c:next(1767373200))
    assert.are.equal(1767373200, c:next(1767373199.5))
    assert.are.equal(1767374100, c:next(1767373200.25))
  end)

  it("returns nil for expressions that can never fire", function()
    assert.is_nil(cron.parse("0 0 30 2 *"):next(1767225600))
    assert.is_nil(cron.parse("0 0 31 4,6,9,11 *"):next(0, "Europe/Berlin"))
    assert.are.same({}, fires("0 0 30 2 *", 1767225600, 3))
    assert.are.equal(8 * 366, cron.search_days)
  end)

  it("raises plain errors for misuse", function()
    local c = cron.parse("* * * * *")
    assert.has_error(function() c:next("soon") end)
    assert.has_error(function() c:next(0 / 0) end)
    assert.has_error(function() c:next(1e300) end)
    assert.has_error(function() c:next_n(0, 0) end)
    assert.has_error(function() c:next(0, 42) end)
  end)
end)

describe("DST", function()
  local berlin, ny = "Europe/Berlin", "America/New_York"

  it("fires a fixed-hour schedule once at the end of the spring-forward gap", function()
    -- Berlin 2026-03-29: 02:00 CET -> 03:00 CEST; 02:30 does not exist, so 03:00 CEST
    assert.are.same({ 1774746000, 1774830600 }, fires("30 2 * * *", 1774695600, 2, berlin))
    -- New York 2026-03-08: 02:00 EST -> 03:00 EDT
    assert.are.same({ 1772953200, 1773037800 }, fires("30 2 * * *", 1772902800, 2, ny))
    assert.are.equal("2026-03-29T03:00:00+02:00", cron.format(1774746000, berlin))
    assert.are.equal("2026-03-08T03:00:00-04:00", cron.format(1772953200, ny))
  end)

  it("has no wildcard-hour fires inside the gap", function()
    -- Berlin: 01:45 CET, then 03:00, 03:15 CEST
    assert.are.same({ 1774745100, 1774746000, 1774746900 }, fires("*/15 * * * *", 1774744800, 3, berlin))
    -- New York hourly: 01:00 EST, 03:00 EDT, 04:00 EDT
    assert.are.same({ 1772949600, 1772953200, 1772956800 }, fires("0 * * * *", 1772947800, 3, ny))
  end)

  it("fires a fixed-hour schedule at the first of two repeated times only", function()
    -- Berlin 2026-10-25: 03:00 CEST -> 02:00 CET; 02:30 CEST fires, 02:30 CET does not
    assert.are.same({ 1792888200, 1792978200 }, fires("30 2 * * *", 1792836000, 2, berlin))
    -- New York 2026-11-01: 02:00 EDT -> 01:00 EST
    assert.are.same({ 1793511000, 1793601000 }, fires("30 1 * * *", 1793462400, 2, ny))
    -- asked from inside the second pass, the next fire is the next day's
    assert.are.equal(1793601000, cron.parse("30 1 * * *"):next(1793513700, ny))
  end)

  it("fires a wildcard-hour schedule at both of two repeated times", function()
    -- Berlin from 01:50 CEST: 02:00 CEST, 02:30 CEST, 02:00 CET, 02:30 CET, 03:00 CET
    assert.are.same({ 1792886400, 1792888200, 1792890000, 1792891800, 1792893600 },
      fires("*/30 * * * *", 1792885800, 5, berlin))
    -- New York from 00:50 EDT: 01:15, 01:45 EDT, 01:15, 01:45 EST, 02:15 EST
    assert.are.same({ 1793510100, 1793511900, 1793513700, 1793515500, 1793517300 },
      fires("15,45 * * * *", 1793508600, 5, ny))
  end)

  it("follows the footer rules after the last stored transition (2045)", function()
    -- the TZif files store transitions up to 2037; 2045 comes from "CET-1CEST,M3.5.0,M10.5.0/3"
    -- and "EST5EDT,M3.2.0,M11.1.0"
    assert.are.same({ 2374102800, 2374187400 }, fires("30 2 * * *", 2374052400, 2, berlin))
    assert.are.same({ 2392849800, 2392939800 }, fires("30 2 * * *", 2392797600, 2, berlin))
    assert.are.equal(2372914800, cron.parse("30 2 * * *"):next(2372864400, ny))
    assert.are.same({ 2393472600, 2393562600 }, fires("30 1 * * *", 2393424000, 2, ny))
  end)
end)

describe("c:next against minute-by-minute stepping", function()
  -- The naive rule, straight from the documentation: step through real instants minute by minute;
  -- fire where the local time matches, except that a restricted-hour schedule skips a local time
  -- it already had, and fires at a gap's first instant if it matches a local time the gap skipped.
  local function matcher(expr)
    local sets = {}
    local f = {}
    for w in expr:gmatch("%S+") do f[#f + 1] = w end
    local ranges = { { 0, 59 }, { 0, 23 }, { 1, 31 }, { 1, 12 }, { 0, 7 } }
    for i = 1, 5 do
      local set = {}
      for item in f[i]:gmatch("[^,]+") do
        local a, b, step = item:match("^(%d+)-(%d+)/(%d+)$")
        if not a then a, b = item:match("^(%d+)-(%d+)$") end
        if not a then a = item:match("^(%d+)$") b = a end
        if not a then step = item:match("^%*/(%d+)$") or (item == "*" and 1) a, b = ranges[i][1], ranges[i][2] end
        for v = tonumber(a), tonumber(b), tonumber(step or 1) do set[v] = true end
      end
      if i == 5 and set[7] then set[0] = true end
      sets[i] = set
    end
    local dom_star, dow_star = f[3]:sub(1, 1) == "*", f[5]:sub(1, 1) == "*"
    return function(l)
      if not (sets[1][l.min] and sets[2][l.hour] and sets[4][l.month]) then return false end
      local dom, dow = sets[3][l.day], sets[5][l.wday - 1]
      if dom_star or dow_star then return dom and dow end
      return dom or dow
    end, f[2]:sub(1, 1) ~= "*"
  end

  local function naive_fires(expr, z, from, to)
    local match, restricted = matcher(expr)
    local out = {}
    for t = from, to, 60 do
      local off = z:offset(t)
      local wall = t + off
      local fire = match(z:local_time(t))
      if restricted and fire then -- a local time this schedule already had does not fire again
        for s = t - 6 * 3600, t - 60, 60 do
          if s + z:offset(s) == wall then fire = false end
        end
      end
      local before = z:offset(t - 1)
      if restricted and before < off then -- t ends a gap: fire if the gap skipped a match
        for w = t + before, wall - 60, 60 do
          if match(os.date("!*t", w)) then fire = true end
        end
      end
      if fire then out[#out + 1] = t end
    end
    return out
  end

  it("agrees across the 2026 DST changes in Berlin and New York", function()
    local exprs = { "30 2 * * *", "*/15 * * * *", "0 * * * *", "15,45 1-3 * * *", "*/20 */2 * * *",
      "0,30 2 * * 0", "5 1,2 25 10 *", "59 1 * * *", "0 3 * * *", "* 2 * * *" }
    local windows = {
      { "Europe/Berlin", 1774735200, 1774764000 }, { "Europe/Berlin", 1792875600, 1792908000 },
      { "America/New_York", 1772942400, 1772971200 }, { "America/New_York", 1793502000, 1793534400 },
    }
    for _, w in ipairs(windows) do
      local z = cron.zone(w[1])
      for _, expr in ipairs(exprs) do
        local want = naive_fires(expr, z, w[2] + 60, w[3])
        local got, t = {}, w[2]
        while true do
          t = cron.parse(expr):next(t, z)
          if not t or t > w[3] then break end
          got[#got + 1] = t
        end
        assert.are.same({ w[1], expr, want }, { w[1], expr, got })
      end
    end
  end)

  it("agrees over 60 days in UTC for the day-of-month/day-of-week rules", function()
    local z = cron.zone("UTC")
    for _, expr in ipairs({ "0 12 1,15 * 1", "0 0 */2 * 1", "30 6 13 * 5", "0 0 * * 6,7", "10 */5 29-31 * *" }) do
      local from, to = 1769904000, 1769904000 + 60 * 86400 -- 2026-02-01 onwards, across February's end
      local want = naive_fires(expr, z, from + 60, to)
      local got, t = {}, from
      while true do
        t = cron.parse(expr):next(t, z)
        if not t or t > to then break end
        got[#got + 1] = t
      end
      assert.is_true(#want > 3, expr)
      assert.are.same({ expr, want }, { expr, got })
    end
  end)
end)

describe("zones", function()
  it("reports offsets, abbreviations and local time", function()
    local z = cron.zone("Europe/Berlin")
    assert.are.equal("Europe/Berlin", z.name)
    assert.are.equal("Europe/Berlin", tostring(z))
    assert.are.same({ 3600, "CET", false }, { z:offset(1774745999) })
    assert.are.same({ 7200, "CEST", true }, { z:offset(1774746000) })
    assert.are.same({ year = 2026, month = 3, day = 29, hour = 3, min = 0, sec = 0, wday = 1, yday = 88, isdst = true },
      z:local_time(1774746000))
    assert.are.same({ 0, "UTC", false }, { cron.zone("UTC"):offset(1774746000) })
  end)

  it("caches zones per name and accepts a Zone wherever a name goes", function()
    assert.are.equal(cron.zone("America/New_York"), cron.zone("America/New_York"))
    local c = cron.parse("30 2 * * *")
    assert.are.equal(c:next(1772902800, "America/New_York"), c:next(1772902800, cron.zone("America/New_York")))
    assert.are.equal(cron.format(1772953200, "America/New_York"), cron.zone("America/New_York"):format(1772953200))
  end)

  it("formats RFC 3339 in the zone", function()
    assert.are.equal("2026-03-29T01:00:00+00:00", cron.format(1774746000))
    assert.are.equal("2026-03-29T06:30:00+05:30", cron.format(1774746000, "Asia/Kolkata"))
    assert.are.equal("2026-03-28T21:00:00-04:00", cron.format(1774746000.9, "America/New_York"))
    assert.are.equal("1969-12-31T23:59:59+00:00", cron.format(-1))
  end)

  it("names the zone and the directory when a zone is unknown", function()
    local ok, err = pcall(cron.zone, "Mars/Olympus_Mons")
    assert.is_false(ok)
    assert.is_true(core.Error.is(err))
    assert.are.equal("unknown_zone", err.code)
    assert.are.equal("Mars/Olympus_Mons", err.zone)
    local dir = os.getenv("TZDIR")
    if not dir or dir == "" then dir = "/usr/share/zoneinfo" end
    assert.truthy(err.message:find('"Mars/Olympus_Mons"', 1, true))
    assert.truthy(err.message:find(dir, 1, true))
    ok, err = pcall(cron.parse("* * * * *").next, cron.parse("* * * * *"), 0, "Nowhere")
    assert.is_false(ok)
    assert.are.equal("unknown_zone", err.code)
  end)

  it("refuses names that would leave the database", function()
    for _, name in ipairs({ "../../etc/passwd", "/etc/localtime", "Europe/../../x", "", "Europe/Ber lin" }) do
      local ok, err = pcall(cron.zone, name)
      assert.is_false(ok, name)
      assert.are.equal("unknown_zone", err.code)
    end
    local _, err = pcall(cron.zone, "../x")
    assert.are.equal([[time zone name "../x" must not start with '/' or contain ".."]], err.message)
    _, err = pcall(cron.zone, "America")
    assert.truthy(err.message:find("is not a time zone file", 1, true))
  end)

  it("refuses leap-second zones", function()
    local dir = os.getenv("TZDIR")
    if not dir or dir == "" then dir = "/usr/share/zoneinfo" end
    local f = io.open(dir .. "/right/UTC")
    assert.truthy(f, "no " .. dir .. "/right/UTC: this spec needs tzdata's leap-second zones " ..
      "(tzdata on Debian 12, tzdata-legacy from Debian 13; ./dev setup installs them)")
    f:close()
    local ok, err = pcall(cron.zone, "right/UTC")
    assert.is_false(ok)
    assert.truthy(err.message:find("leap-second", 1, true), err.message)
  end)

  it("agrees with glibc on offsets, abbreviations and local times", function()
    local zones = { "Europe/Berlin", "America/New_York", "Australia/Sydney", "Australia/Lord_Howe",
      "Asia/Jerusalem", "America/Santiago", "America/Nuuk", "Asia/Kolkata", "Pacific/Apia",
      "Africa/Casablanca", "America/St_Johns", "Europe/Dublin", "Europe/London", "America/Sao_Paulo",
      "Etc/GMT+5", "UTC" }
    local checked = 0
    for zi, name in ipairs(zones) do
      local z = cron.zone(name)
      -- 1901..2100, plus both sides of every change in 2020..2060 (2038+ is footer-only)
      local instants = spread(150, -2145916800, 4102444800, zi)
      for _, t in ipairs(changes(z, 1577836800, 2871763200)) do
        instants[#instants + 1] = t - 1
        instants[#instants + 1] = t
      end
      local want = glibc("TZ=" .. q(name), instants)
      for _, t in ipairs(instants) do
        local w = assert(want[t], name .. " " .. t)
        local off, abbr = z:offset(t)
        assert.are.same({ name, t, w.off, w.abbr, w.lt }, { name, t, off, abbr, lt_text(z, t) })
        checked = checked + 1
      end
    end
    assert.is_true(checked > 2000)
  end)
end)

describe("TZif files and footer rules", function()
  -- A version-2 TZif file: one transition (1906-08-16) to its only local time type, then the
  -- footer. (glibc ignores the footer of a file without transitions; RFC 8536 does not.)
  local function tzif(footer, utoff, abbr)
    local chars = abbr .. "\0"
    local function block(tfmt)
      return "TZif2" .. string.rep("\0", 15) .. string.pack(">I4I4I4I4I4I4", 0, 0, 0, 1, 1, #chars)
        .. string.pack(tfmt, -2000000000) .. "\0" .. string.pack(">i4BB", utoff, 0, 0) .. chars
    end
    return block(">i4") .. block(">i8") .. "\n" .. footer .. "\n"
  end

  local dir
  setup(function()
    dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. q(dir .. "/Test")))
    local files = {
      J = tzif("XST-3XDT,J60/1:30,J300/-1", 10800, "XST"),           -- Jn, Feb 29 never counted
      D = tzif("YST5YDT4,59/26,300", -18000, "YST"),                  -- zero-based n, time past 24h
      M = tzif("<-03>3<-02>,M3.5.0/-2,M10.5.0/-1", -10800, "-03"),  -- negative times
      S = tzif("ZST-10ZDT,M10.1.0,M4.1.0/3", 36000, "ZST"),          -- southern hemisphere
      Y = tzif("EST5EDT,0/0,J365/25", -18000, "EST"),                 -- DST all year
      Bad = "TZif2" .. string.rep("\0", 15) .. string.pack(">I4I4I4I4I4I4", 0, 0, 0, 1000, 1, 4), -- no data
    }
    for name, data in pairs(files) do
      local f = assert(io.open(dir .. "/Test/" .. name, "wb"))
      f:write(data)
      f:close()
    end
  end)

  teardown(function()
    os.execute("rm -rf " .. q(dir))
  end)

  -- Runs moonbox with TZDIR=dir: prints "t offset abbr localtime" for each instant in zone.
  local function moonbox_offsets(zone, instants)
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write([[
local cron = require "moonbox.cron"
local z = cron.zone(arg[1])
for t in io.lines(arg[2]) do
  t = math.tointeger(tonumber(t))
  local off, abbr = z:offset(t)
  local l = z:local_time(t)
  print(t, off, abbr, string.format("%04d-%02d-%02dT%02d:%02d:%02d", l.year, l.month, l.day, l.hour, l.min, l.sec))
end
]])
    f:close()
    local list = os.tmpname()
    f = assert(io.open(list, "w"))
    for _, t in ipairs(instants) do f:write(t, "\n") end
    f:close()
    local p = assert(io.popen("TZDIR=" .. q(dir) .. " " .. q(BIN) .. " run " .. script .. " " .. q(zone) .. " " .. list .. " 2>&1"))
    local out = {}
    for line in p:lines() do
      local t, off, abbr, lt = line:match("^(%-?%d+)\t(%-?%d+)\t(%S+)\t(%S+)$")
      assert(t, "unexpected output: " .. line)
      out[tonumber(t)] = { off = tonumber(off), abbr = abbr, lt = lt }
    end
    p:close()
    os.remove(script)
    os.remove(list)
    return out
  end

  it("reads zones from $TZDIR and agrees with glibc on Jn, n and Mm.w.d rules", function()
    for _, name in ipairs({ "Test/J", "Test/D", "Test/M", "Test/S" }) do
      local instants = spread(300, 946684800, 4102444800, #name) -- 2000..2100
      -- every 30 minutes for two days either side of the rule dates of 2031 and 2032 (a leap year)
      for _, base in ipairs({ 1930089600, 1950825600, 1961625600, 1982448000, 1932595200, 1948924800, 1933200000,
        1950739200 }) do
        for k = -96, 96 do instants[#instants + 1] = base + k * 1800 end
      end
      local want = glibc("TZDIR=" .. q(dir) .. " TZ=" .. q(name), instants)
      local got = moonbox_offsets(name, instants)
      for _, t in ipairs(instants) do
        assert.are.same({ name, t, want[t].off, want[t].abbr, want[t].lt }, { name, t, got[t].off, got[t].abbr, got[t].lt })
      end
    end
  end)

  it("keeps DST all year for a footer that says so (where glibc does not)", function()
    -- EST5EDT,0/0,J365/25: RFC 8536 §3.3.1 says DST all year. glibc switches to EST for the
    -- first five hours of each UTC year, so these are pinned by hand instead.
    local instants = { 1893456000, 1893459600, 1893470400, 1909000000 } -- 2030-01-01 00, 01, 04 UTC; July
    local got = moonbox_offsets("Test/Y", instants)
    for _, t in ipairs(instants) do
      assert.are.same({ -14400, "EDT" }, { got[t].off, got[t].abbr })
    end
  end)

  it("reports a broken file with the zone, the reason and the path", function()
    local p = assert(io.popen("TZDIR=" .. q(dir) .. " " .. q(BIN) .. " run /dev/stdin 2>&1 <<'EOF'\n"
      .. "local ok, e = pcall(require('moonbox.cron').zone, 'Test/Bad') print(e.message)\nEOF"))
    local out = p:read("a")
    p:close()
    assert.are.equal('time zone "Test/Bad": truncated TZif data (' .. dir .. "/Test/Bad)\n", out)
  end)
end)
