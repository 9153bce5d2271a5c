--- moonbox.duration — lengths of time as people write them: 90, "90s", "15m", "1h30m", "2d".
--
-- One parser for every option that takes a duration (schedules' catchup/jitter/timeout/every,
-- render.snapshots.rebuild's timeout), so they accept exactly the same spellings. It depends on
-- nothing else in moonbox: the render client and the schedule daemon both use it.
local M = {}

local UNIT = { s = 1, m = 60, h = 3600, d = 86400, w = 604800 }

--- duration.parse(v) -> seconds, or nil and a message. v: a number of seconds (>= 0, finite) or
-- a string of number+unit parts, units s, m, h, d, w ("90s", "15m", "1h30m", "2d", "1.5h";
-- spaces are ignored). Does not raise.
function M.parse(v)
  if type(v) == "number" then
    if v ~= v or v < 0 or v == math.huge then return nil, "expected seconds >= 0, got " .. tostring(v) end
    return v
  end
  if type(v) ~= "string" then return nil, "expected seconds or a string like \"15m\", got a " .. type(v) end
  local s = v:gsub("%s+", "")
  if s == "" then return nil, "expected a duration like \"15m\", got an empty string" end
  local total, pos = 0, 1
  while pos <= #s do
    local num, unit, nxt = s:match("^(%d+%.?%d*)(%a+)()", pos)
    if not num or not UNIT[unit] then
      return nil,
          "expected a duration like \"90s\", \"15m\", \"1h30m\" or \"2d\" (units s m h d w), got \"" ..
          v .. "\""
    end
    total = total + tonumber(num) * UNIT[unit]
    pos = nxt
  end
  return total
end

--- duration.format(seconds) -> "1h30m", "15m", "2d", "1.5s" (the inverse of parse, for messages).
function M.format(secs)
  if secs == 0 then return "0s" end
  local out = {}
  for _, u in ipairs { { "d", 86400 }, { "h", 3600 }, { "m", 60 } } do
    if secs >= u[2] then
      local n = secs // u[2]
      out[#out + 1] = string.format("%d%s", n, u[1])
      secs = secs - n * u[2]
    end
  end
  if secs > 0 then out[#out + 1] = string.format("%gs", secs) end
  return table.concat(out)
end

return M
