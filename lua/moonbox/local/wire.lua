--- moonbox.local.wire — Render's wire conventions for the local backend: errors, record shapes, pages and
--- cursors, paths.
--
-- What every route shares: the JSON error body {message, code?}, the public shape of each
-- record (private fields start with "_" and never leave the process), list pages of
-- [{<kind>: {...}, cursor}] with opaque cursors, ownerId rules, and Go's path.Clean rule for
-- file paths.
local json = require "moonbox.json"
local fail = require("moonbox.local.service").fail

local M = {}

--- wire.public(rec) -> a copy of rec without private ("_") fields, nil values as JSON null
-- where Render sends null.
function M.public(rec, nulls)
  local out = {}
  for k, v in pairs(rec) do
    if type(k) == "string" and k:sub(1, 1) ~= "_" then out[k] = v end
  end
  for _, k in ipairs(nulls or {}) do
    if out[k] == nil then out[k] = json.null end
  end
  return out
end

local SANDBOX_NULLS = { "terminatedAt" }
local SNAPSHOT_NULLS = { "name", "capturedAt", "sizeBytes", "error", "expiresAt" }
local GROUP_NULLS = { "environmentId" }

function M.sandbox(rec) return M.public(rec, SANDBOX_NULLS) end
function M.snapshot(rec) return M.public(rec, SNAPSHOT_NULLS) end
function M.group(rec) return M.public(rec, GROUP_NULLS) end
function M.exec(rec) return M.public(rec) end

-- ---- cursors and pages -----------------------------------------------------------------------

local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"

-- base64url without padding: cursors must look opaque, and survive a query string unescaped.
local function b64(s)
  local out = {}
  for i = 1, #s, 3 do
    local a, b, c = s:byte(i, i + 2)
    local n = (a << 16) | ((b or 0) << 8) | (c or 0)
    local chars = 2 + (b and 1 or 0) + (c and 1 or 0)
    for j = 1, chars do
      local v = (n >> (6 * (4 - j))) & 63
      out[#out + 1] = B64:sub(v + 1, v + 1)
    end
  end
  return table.concat(out)
end

local function unb64(s)
  if not s:match("^[%w%-_]+$") or #s % 4 == 1 then return nil end
  local out = {}
  for i = 1, #s, 4 do
    local chunk = s:sub(i, i + 3)
    local n = 0
    for j = 1, 4 do
      local c = chunk:sub(j, j)
      local v = c ~= "" and (B64:find(c, 1, true) - 1) or 0
      n = (n << 6) | v
    end
    local bytes = #chunk - 1
    for j = 1, bytes do out[#out + 1] = string.char((n >> (8 * (3 - j))) & 255) end
  end
  return table.concat(out)
end

--- wire.cursor(kind, seq) -> an opaque cursor naming one record's place in its list.
function M.cursor(kind, seq) return b64(kind .. ":" .. seq) end

--- wire.parse_cursor(kind, s) -> seq (an integer), or nil when s is not a cursor of that kind.
-- A sequence no record can have (more than 2^53, where a number stops being exact) is no
-- cursor this backend handed out: refused, not turned into a float bound of the page query.
function M.parse_cursor(kind, s)
  local raw = unb64(s or "")
  if not raw then return nil end
  local k, digits = raw:match("^(%a+):(%d+)$")
  if k ~= kind or #digits > 16 then return nil end
  local seq = math.tointeger(tonumber(digits))
  if not seq or seq > (1 << 53) then return nil end
  return seq
end

--- wire.page(req, kind, wrapper, records, shape) -> JSON array page. records are newest
-- first, either all of them (an array) or a function(after_seq|nil, limit) -> that page's
-- records (a keyset query: newest first, sequence below after_seq, at most limit); the cursor
-- query parameter continues after the record it names; limit is 1..100 (default 20). Raises
-- invalid invalid_cursor / invalid_limit.
function M.page(req, kind, wrapper, records, shape)
  local limit = 20
  local lim = req:query_param("limit")
  if lim ~= nil then
    limit = lim:match("^%d+$") and math.tointeger(tonumber(lim))
    if not limit or limit < 1 or limit > 100 then
      fail("invalid", "limit must be an integer between 1 and 100", "invalid_limit")
    end
  end
  local start = 1
  local cur = req:query_param("cursor")
  local seq = cur ~= nil and M.parse_cursor(kind, cur)
  if cur ~= nil and not seq then fail("invalid", "invalid cursor", "invalid_cursor") end
  if type(records) == "function" then
    records = records(seq or nil, limit)
  elseif seq then
    start = #records + 1
    for i, rec in ipairs(records) do
      if rec._seq < seq then
        start = i
        break
      end
    end
  end
  local out = json.array()
  for i = start, math.min(#records, start + limit - 1) do
    local rec = records[i]
    out[#out + 1] = { [wrapper] = shape(rec), cursor = M.cursor(kind, rec._seq) }
  end
  return out
end

-- ---- paths ------------------------------------------------------------------------------------

--- wire.clean_path(p) -> p cleaned exactly as Go's path.Clean does.
M.clean_path = require("moonbox.path").clean

local PATH_MAX, NAME_MAX = 4095, 255

local function shown(p) return string.format("%q", p:sub(1, 48)) end

--- wire.sandbox_path(p) -> the absolute path inside the sandbox: relative paths are under the
-- home directory /root. Raises invalid for a missing or unclean path, or one holding a NUL
-- (every other byte, a newline too, is a byte a path may hold: the file helper takes it as an
-- argument).
function M.sandbox_path(p)
  if p == nil or p == "" then fail("invalid", "query parameter 'path' is required") end
  if p:find("%z") then fail("invalid", "path contains a NUL byte") end
  -- Linux's bounds (PATH_MAX with the home prefix, NAME_MAX), checked before a token is minted
  -- so the client learns at once; the answer names only the path's head, never all of it.
  if #p > PATH_MAX - #"/root/" then
    fail("invalid", string.format("path %s... is %d bytes; at most %d", shown(p), #p, PATH_MAX - #"/root/"),
      "path_too_long")
  end
  for name in p:gmatch("[^/]+") do
    if #name > NAME_MAX then
      fail("invalid", string.format("path: the name %s... is %d bytes; a name is at most %d", shown(name),
        #name, NAME_MAX), "path_too_long")
    end
  end
  local clean = M.clean_path(p)
  if clean ~= p then
    fail("invalid", string.format("path %q is not clean (it would be %q); send it cleaned", p, clean))
  end
  if p:sub(1, 1) == "/" then return p end
  if p == "." then return "/root" end
  return "/root/" .. p
end

return M
