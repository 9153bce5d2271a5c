--- moonbox.rfc3339 — RFC 3339 times (Render's wire format) to and from Unix seconds, without
-- the process's local time zone ever being involved.
local M = {}

-- Days from 1970-01-01 to the civil date y-m-d (proleptic Gregorian; Howard Hinnant's
-- days_from_civil).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = (y >= 0 and y or y - 399) // 400
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = (153 * mp + 2) // 5 + d - 1
  local doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
  return era * 146097 + doe - 719468
end

--- rfc3339.parse(s) -> seconds since the epoch (with fraction), or nil, message. Accepts UTC
-- ("2026-03-01T00:00:00Z", fractions allowed) or an offset ("...T01:00:00+01:00"); refuses
-- fields out of range (month 13, hour 24, ...). The one RFC 3339 parser of moonbox.
function M.parse(s)
  local y, mo, d, h, mi, sec, rest = tostring(s):match(
    "^(%d%d%d%d)%-(%d%d)%-(%d%d)[Tt ](%d%d):(%d%d):(%d%d%.?%d*)(.*)$")
  if not y then
    return nil, "expected an RFC 3339 time like 2026-03-01T00:00:00Z, got '" .. tostring(s) .. "'"
  end
  y, mo, d, h, mi = tonumber(y), tonumber(mo), tonumber(d), tonumber(h), tonumber(mi)
  local secs = tonumber(sec)
  if not secs or mo < 1 or mo > 12 or d < 1 or d > 31 or h > 23 or mi > 59 or secs >= 61 then
    return nil, "'" .. tostring(s) .. "' is not a valid time (a field is out of range)"
  end
  local t = days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + secs
  if rest == "Z" or rest == "z" then return t end
  local sign, oh, om = rest:match("^([+-])(%d%d):?(%d%d)$")
  if not sign or tonumber(oh) > 23 or tonumber(om) > 59 then
    return nil, "expected Z or an offset like +01:00 at the end of '" .. tostring(s) .. "'"
  end
  local off = tonumber(oh) * 3600 + tonumber(om) * 60
  return sign == "+" and t - off or t + off
end

--- rfc3339.format(t) -> RFC 3339 UTC text, with milliseconds when t has a fraction; "-" for nil.
function M.format(t)
  if t == nil then return "-" end
  local whole = math.floor(t)
  local s = os.date("!%Y-%m-%dT%H:%M:%S", whole)
  local ms = math.floor((t - whole) * 1000 + 0.5)
  if ms >= 1000 then return M.format(whole + 1) end
  if ms > 0 then s = s .. string.format(".%03d", ms) end
  return s .. "Z"
end

return M
