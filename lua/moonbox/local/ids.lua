--- moonbox.local.ids — ids, tokens and timestamps in Render's formats: prefixed base32hex ids, random
--- tokens, RFC 3339 UTC timestamps.
--
-- Ids are a prefix and lowercase base32hex characters (0-9a-v) from the kernel's random source:
-- sbx- + 25, and tea-/sbg-/snp-/exe-/usr- + 20. Tokens and API keys are 32 random bytes in hex.
local M = {}

local ALPHABET = "0123456789abcdefghijklmnopqrstuv"
local urandom

local function random_bytes(n)
  if not urandom then urandom = assert(io.open("/dev/urandom", "rb")) end
  return assert(urandom:read(n))
end
M.random_bytes = random_bytes

local BODY_LEN = { sbx = 25, tea = 20, sbg = 20, snp = 20, exe = 20, usr = 20 }

--- ids.new(prefix) -> "prefix-xxxx" with Render's body length for that prefix.
function M.new(prefix)
  local n = BODY_LEN[prefix] or 20
  local bytes = random_bytes(n)
  local out = {}
  for i = 1, n do
    local b = bytes:byte(i) % 32
    out[i] = ALPHABET:sub(b + 1, b + 1)
  end
  return prefix .. "-" .. table.concat(out)
end

--- ids.valid(prefix, s) -> whether s is a well-formed id of that kind.
function M.valid(prefix, s)
  local n = BODY_LEN[prefix] or 20
  return type(s) == "string" and #s == #prefix + 1 + n and s:sub(1, #prefix + 1) == prefix .. "-"
    and s:sub(#prefix + 2):match("^[0-9a-v]+$") ~= nil
end

--- ids.token() -> 64 hex characters of fresh randomness (connect tokens, API keys).
function M.token()
  return (random_bytes(32):gsub(".", function(c) return string.format("%02x", c:byte()) end))
end

--- ids.iso(t) -> RFC 3339 UTC timestamp ("2026-04-01T18:30:00Z") for unix time t (default now).
function M.iso(t)
  t = t or os.time()
  return os.date("!%Y-%m-%dT%H:%M:%SZ", math.floor(t))
end

--- ids.parse_iso(s) -> unix seconds, or nil when s is not an RFC 3339 timestamp.
function M.parse_iso(s)
  if type(s) ~= "string" then return nil end
  local y, mo, d, h, mi, sec, frac, tz = s:match(
    "^(%d%d%d%d)-(%d%d)-(%d%d)[Tt](%d%d):(%d%d):(%d%d)(%.?%d*)([Zz+-]?.*)$")
  if not y then return nil end
  y, mo, d, h, mi, sec = tonumber(y), tonumber(mo), tonumber(d), tonumber(h), tonumber(mi), tonumber(sec)
  if mo < 1 or mo > 12 or d < 1 or d > 31 or h > 23 or mi > 59 or sec > 60 then return nil end
  -- days from civil (proleptic Gregorian), avoiding os.time's local-time interpretation
  local yy = mo <= 2 and y - 1 or y
  local era = (yy >= 0 and yy or yy - 399) // 400
  local yoe = yy - era * 400
  local mp = (mo + 9) % 12
  local doy = (153 * mp + 2) // 5 + d - 1
  local doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
  local days = era * 146097 + doe - 719468
  local t = days * 86400 + h * 3600 + mi * 60 + sec
  if frac ~= "" and frac ~= "." then t = t + (tonumber("0" .. frac) or 0) end
  if tz == "" then return nil end
  if tz ~= "Z" and tz ~= "z" then
    local sign, th, tm = tz:match("^([+-])(%d%d):?(%d%d)$")
    if not sign then return nil end
    local off = tonumber(th) * 3600 + tonumber(tm) * 60
    t = sign == "+" and t - off or t + off
  end
  return t
end

return M
