--- moonbox.schedule.clock — the time schedules live in: the wall clock, or the test clock.
--
-- Every time `moonbox schedule` reasons about (slots, fires, history, catch-up windows,
-- timeouts) comes from one clock object. Normally that is the wall clock. For tests only,
-- MOONBOX_TEST_CLOCK="start=2026-03-01T00:00:00Z,scale=600" makes it a virtual clock that
-- reads `start` when the process starts and then runs `scale` times faster than real time, so
-- a spec covers hours of schedule in seconds. Code inside a run (task.sleep, HTTP timeouts)
-- keeps real time; only the schedule's own time is virtual. `at=UNIX_SECONDS` anchors `start`
-- at that real time instead of the process's start, so several daemons (one database, several
-- processes) share one virtual timeline.
--
-- Waiting goes through moonbox.timer.sleep_until (an ev_periodic on the wall clock): a virtual
-- time is mapped back to the real wall time at which the virtual clock will read it.
local timer = require "moonbox.timer"
local core = require "moonbox.core"
local rfc3339 = require "moonbox.rfc3339"

local M = {}
local Clock = {}
Clock.__index = Clock

--- clock.parse_time(s) -> seconds since the epoch, or nil, message (moonbox.rfc3339.parse).
M.parse_time = rfc3339.parse

--- clock.format(t) -> RFC 3339 UTC text, with milliseconds when t has a fraction.
M.format = rfc3339.format

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
  local real0 = core.time()
  if opts.at then
    real0 = tonumber(opts.at)
    if not real0 then
      error("MOONBOX_TEST_CLOCK: at must be seconds since the epoch, got '" .. opts.at .. "'", 0)
    end
  end
  return setmetatable({ scale = scale, test = true, real0 = real0, virt0 = start or real0 }, Clock)
end

--- clock:now() -> the schedule's time now (seconds since the epoch, with a fraction).
function Clock:now()
  if not self.test then return core.time() end
  return self.virt0 + (core.time() - self.real0) * self.scale
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
