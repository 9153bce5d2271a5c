-- bench/cron.lua — c:next() calls per second against a naive Lua baseline that steps minute by
-- minute through os.date("!*t") until a hand-written predicate for the same expression matches
-- (what a first attempt in a recipe would do). Both run in this process, back to back, over the
-- same spread of start instants in 2026; the table gives the ratio. CPU time from os.clock.
-- Run: build/moonbox run bench/cron.lua [SECONDS_PER_ROW]
local cron = require "moonbox.cron"

local budget = tonumber(arg and arg[1]) or 0.3
local base = 1767225600 -- 2026-01-01T00:00:00Z

-- Calls fn(i) until `budget` CPU seconds pass; returns calls per second.
local function rate(fn)
  local n, t0 = 0, os.clock()
  repeat
    for _ = 1, 16 do
      n = n + 1
      fn(n)
    end
  until os.clock() - t0 >= budget
  return n / (os.clock() - t0)
end

local function start(i) return base + (i * 7919 * 61) % (365 * 86400) end

local function naive(pred)
  return function(i)
    local t = start(i) // 60 * 60 + 60
    while not pred(os.date("!*t", t)) do t = t + 60 end
    return t
  end
end

local cases = {
  { "*/15 9-17 * * 1-5", function(d) return d.min % 15 == 0 and d.hour >= 9 and d.hour <= 17 and d.wday >= 2 and d.wday <= 6 end },
  { "0 3 * * *", function(d) return d.min == 0 and d.hour == 3 end },
  { "0 12 1 * 1", function(d) return d.min == 0 and d.hour == 12 and (d.day == 1 or d.wday == 2) end },
  { "0 0 1 */3 *", function(d) return d.min == 0 and d.hour == 0 and d.day == 1 and (d.month - 1) % 3 == 0 end },
  { "30 2 * * *", nil, "Europe/Berlin" },
  { "0 0 30 2 *", nil }, -- never fires: the whole 8-year bound is searched
}

print(string.format("| expression | zone | moonbox next()/s | naive Lua /s | ratio |"))
print("|---|---|---:|---:|---:|")
for _, case in ipairs(cases) do
  local expr, pred, tz = case[1], case[2], case[3]
  local c = cron.parse(expr)
  local want = c:next(start(1), tz)
  local fast = rate(function(i) return c:next(start(i), tz) end)
  local slow, ratio = "—", "—"
  if pred then
    assert(naive(pred)(1) == want, "baseline disagrees on " .. expr)
    local r = rate(naive(pred))
    slow, ratio = string.format("%.0f", r), string.format("%.0f×", fast / r)
  end
  print(string.format("| `%s` | %s | %.0f | %s | %s |", expr, tz or "UTC", fast, slow, ratio))
end
