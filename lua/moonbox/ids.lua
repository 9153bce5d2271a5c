--- moonbox.ids — identifiers in Render's formats and fresh randomness, for every part of
-- moonbox that makes or checks them (the render client, the local backend), and Render's
-- timestamps (RFC 3339 UTC, whole seconds) through moonbox.rfc3339.
--
-- Ids are a prefix and lowercase base32hex characters (0-9a-v) from the kernel's random source:
-- sbx- + 25, and tea-/sbg-/snp-/exe-/usr- + 20. Tokens are 32 random bytes
-- in hex.
local rfc3339 = require "moonbox.rfc3339"

local M = {}

local ALPHABET = "0123456789abcdefghijklmnopqrstuv"
local urandom

--- ids.random_bytes(n) -> n bytes from /dev/urandom (the file stays open for the next call).
local function random_bytes(n)
  if not urandom then urandom = assert(io.open("/dev/urandom", "rb")) end
  return assert(urandom:read(n))
end
M.random_bytes = random_bytes

local BODY_LEN = { sbx = 25, tea = 20, sbg = 20, snp = 20, exe = 20, usr = 20 }

--- ids.new(prefix) -> "prefix-xxxx" with Render's body length for that prefix (20 for a prefix
-- Render does not define).
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

--- ids.iso(t) -> Render's timestamp text, RFC 3339 UTC in whole seconds
-- ("2026-04-01T18:30:00Z"), for unix time t (default now).
function M.iso(t)
  return rfc3339.format(math.floor(t or os.time()))
end

--- ids.parse_iso(s) -> unix seconds, or nil when s is not an RFC 3339 time (moonbox.rfc3339).
function M.parse_iso(s)
  if type(s) ~= "string" then return nil end
  return (rfc3339.parse(s))
end

return M
