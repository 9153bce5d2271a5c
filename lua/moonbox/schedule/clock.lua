--- moonbox.schedule.clock — the time schedules live in: the wall clock, or the test clock.
--
-- Every time `moonbox schedule` reasons about (slots, fires, history, catch-up windows,
-- timeouts) comes from one clock object. Normally that is the wall clock. For tests only,
-- MOONBOX_TEST_CLOCK="start=2026-03-01T00:00:00Z,scale=600" makes it a virtual clock that
-- reads `start` when the process starts and then runs `scale` times faster than real time, so
-- a spec covers hours of schedule in seconds. Code inside a run (task.sleep, HTTP timeouts)
-- keeps real time; only the schedule's own time is virtual.
--
-- Waiting goes through moonbox.timer.sleep_until (an ev_periodic on the wall clock): a virtual
-- time is mapped back to the real wall time at which the virtual clock will read it.
local timer = require "moonbox.timer"

local M = {}
local Clock = {}
Clock.__index = Clock

-- Days from 1970-01-01 to the civil date y-m-d (proleptic Gregorian; Howard Hinnant's
-- days_from_civil), so parsing a UTC time never depends on the local time zone.
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = (y >= 0 and y or y - 399) // 400
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = (153 * mp + 2) // 5 + d - 1
  local doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
  return era * 146097 + doe - 719468
end

--- clock.parse_time(s) -> seconds since the epoch, or nil, message. Accepts RFC 3339 in UTC
-- ("2026-03-01T00:00:00Z", fractions allowed) or with an offset ("...T01:00:00+01:00").
function M.parse_time(s)
  local y, mo, d, h, mi, sec, rest = tostring(s):match(
    "^(%d%d%d%d)%-(%d%d)%-(%d%d)[Tt ](%d%d):(%d%d):(%d%d%.?%d*)(.*)$")
  if not y then return nil,
      "expected an RFC 3339 time like 2026-03-01T00:00:00Z, got '" .. tostring(s) .. "'" end
  local t = days_from_civil(tonumber(y), tonumber(mo), tonumber(d)) * 86400 +
    tonumber(h) * 3600 + tonumber(mi) * 60 + tonumber(sec)
  if rest == "Z" or rest == "z" then return t end
  local sign, oh, om = rest:match("^([+-])(%d%d):(%d%d)$")
  if not sign then return nil, "expected Z or an offset like +01:00 at the end of '" .. s .. "'" end
  local off = tonumber(oh) * 3600 + tonumber(om) * 60
  return sign == "+" and t - off or t + off
end

--- clock.format(t) -> RFC 3339 UTC text, with milliseconds when t has a fraction.
function M.format(t)
  if t == nil then return "-" end
  local whole = math.floor(t)
  local s = os.date("!%Y-%m-%dT%H:%M:%S", whole)
  local ms = math.floor((t - whole) * 1000 + 0.5)
  if ms >= 1000 then return M.format(whole + 1) end
  if ms > 0 then s = s .. string.format(".%03d", ms) end
  return s .. "Z"
end

--- clock.from_env([value]) -> Clock: the test clock when MOONBOX_TEST_CLOCK (or value) is set,
-- else the wall clock. Raises a plain error naming the variable when its value is malformed.
function M.from_env(value)
  value = value or os.getenv("MOONBOX_TEST_CLOCK")
  if value == nil or value == "" then
    return setmetatable({ scale = 1, test = false }, Clock)
  end
  local opts = {}
  for k, v in value:gmatch("([%w_]+)=([^,]+)") do opts[k] = v end
  local start, scale = nil, tonumber(opts.scale or "1")
  if opts.start then
    local perr
    start, perr = M.parse_time(opts.start)
    if not start then error("MOONBOX_TEST_CLOCK: start: " .. perr, 0) end
  end
  if not scale or scale <= 0 then
    error("MOONBOX_TEST_CLOCK: scale must be a number > 0, got '" .. tostring(opts.scale) .. "'", 0)
  end
  local real0 = timer.wall()
  return setmetatable({ scale = scale, test = true, real0 = real0, virt0 = start or real0 }, Clock)
end

--- clock:now() -> the schedule's time now (seconds since the epoch, with a fraction).
function Clock:now()
  if not self.test then return timer.wall() end
  return self.virt0 + (timer.wall() - self.real0) * self.scale
end

--- clock:real_seconds(d) -> the real seconds that d seconds of this clock take.
function Clock:real_seconds(d)
  return d / self.scale
end

--- clock:sleep_until(t): waits until clock:now() >= t. [yields]
function Clock:sleep_until(t)
  while true do
    local now = self:now()
    if now >= t then return end
    if self.test then
      timer.sleep_until(self.real0 + (t - self.virt0) / self.scale)
    else
      timer.sleep_until(t)
    end
  end
end

--- clock:describe() -> "wall clock" or the test clock's settings, for logs.
function Clock:describe()
  if not self.test then return "wall clock" end
  return string.format("TEST CLOCK from %s at %gx", M.format(self.virt0), self.scale)
end

M.Clock = Clock
return M
