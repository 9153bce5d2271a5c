--- moonbox.json — JSON for the Render wire format.
--
-- Decoding is lua-cjson's (C, fast). Encoding is here because the wire needs what Debian's
-- lua-cjson 2.1.0 cannot say: an empty array (`[]`, e.g. an empty list page) versus an empty
-- object (`{}`), and keys in a stable order (so request bodies can be compared byte for byte in
-- tests and journals). Arrays are tables marked with json.array or non-empty sequences; an
-- unmarked empty table is an object. json.null stands for JSON null in both directions.
local cjson = require "cjson"

local M = {}

M.null = cjson.null

local ARRAY = { __name = "json.array" }
local OBJECT = { __name = "json.object" }

--- json.array(t) -> t marked to encode as a JSON array (even when empty).
function M.array(t) return setmetatable(t or {}, ARRAY) end

--- json.object(t) -> t marked to encode as a JSON object (even when empty).
function M.object(t) return setmetatable(t or {}, OBJECT) end

--- json.is_array(t) -> whether t encodes as an array.
local function is_array(t)
  local mt = getmetatable(t)
  if mt == ARRAY then return true end
  if mt == OBJECT then return false end
  local n = #t
  if n == 0 then return false end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end
M.is_array = is_array

-- Strings are escaped (and invalid UTF-8 replaced) in one C pass, moonbox.strings.json_quote:
-- exec output passes through here, and a Lua gsub was 10x slower.
local json_quote = require("moonbox.strings").json_quote

--- json.utf8_clean(s) -> s with every byte that is not part of valid UTF-8 replaced by U+FFFD.
function M.utf8_clean(s)
  if utf8.len(s) then return s end
  local out, i, n = {}, 1, #s
  while i <= n do
    local len, bad = utf8.len(s, i)
    if len then
      out[#out + 1] = s:sub(i)
      break
    end
    out[#out + 1] = s:sub(i, bad - 1)
    out[#out + 1] = "\239\191\189"
    i = bad + 1
  end
  return table.concat(out)
end

local function encode_string(s)
  return json_quote(s)
end

local encode

local function encode_table(t, out, depth)
  if depth > 100 then error("json.encode: nesting deeper than 100 (a cycle?)", 0) end
  if is_array(t) then
    out[#out + 1] = "["
    for i = 1, #t do
      if i > 1 then out[#out + 1] = "," end
      encode(t[i], out, depth + 1)
    end
    out[#out + 1] = "]"
    return
  end
  local keys = {}
  for k in pairs(t) do
    if type(k) ~= "string" then
      error("json.encode: object key " .. tostring(k) .. " is not a string", 0)
    end
    keys[#keys + 1] = k
  end
  table.sort(keys)
  out[#out + 1] = "{"
  for i, k in ipairs(keys) do
    if i > 1 then out[#out + 1] = "," end
    out[#out + 1] = encode_string(k)
    out[#out + 1] = ":"
    encode(t[k], out, depth + 1)
  end
  out[#out + 1] = "}"
end

encode = function(v, out, depth)
  local ty = type(v)
  if v == nil or v == M.null then
    out[#out + 1] = "null"
  elseif ty == "boolean" then
    out[#out + 1] = v and "true" or "false"
  elseif ty == "number" then
    if v ~= v or v == math.huge or v == -math.huge then
      error("json.encode: cannot encode " .. tostring(v), 0)
    end
    if math.type(v) == "integer" then
      out[#out + 1] = string.format("%d", v)
    elseif v == math.floor(v) and math.abs(v) < 2 ^ 53 then
      out[#out + 1] = string.format("%d", math.floor(v))
    else
      -- the shortest of 15 or 17 significant digits that reads back as the same double
      local short = string.format("%.15g", v)
      out[#out + 1] = tonumber(short) == v and short or string.format("%.17g", v)
    end
  elseif ty == "string" then
    out[#out + 1] = encode_string(v)
  elseif ty == "table" then
    encode_table(v, out, depth)
  else
    error("json.encode: cannot encode a " .. ty, 0)
  end
end

--- json.encode(v) -> string. Objects have their keys sorted. Raises on values JSON cannot
-- hold (functions, NaN, non-string keys, cycles).
function M.encode(v)
  local out = {}
  encode(v, out, 0)
  return table.concat(out)
end

-- lua-cjson decodes every number as a float; a whole number within ±2^53 (where a double is
-- exact) becomes a Lua integer, so a size or a limit prints as 6, not 6.0, and compares with
-- math.type "integer". Tables are changed in place (only existing keys are assigned).
local MAX_EXACT = 2 ^ 53
local function integers(v)
  if math.type(v) == "float" then
    return (v > -MAX_EXACT and v < MAX_EXACT and math.tointeger(v)) or v
  end
  if type(v) == "table" then
    for k, x in pairs(v) do
      if type(x) == "table" then
        integers(x)
      elseif math.type(x) == "float" then
        v[k] = integers(x)
      end
    end
  end
  return v
end

--- json.decode(s) -> value, or nil and a message when s is not JSON. JSON null becomes
-- json.null; arrays come back as plain sequences (an empty one re-encodes as {} unless marked);
-- whole numbers within ±2^53 are integers, others floats.
function M.decode(s)
  if type(s) ~= "string" then return nil, "expected a JSON string, got " .. type(s) end
  local ok, v = pcall(cjson.decode, s)
  if not ok then return nil, (tostring(v):gsub("^.-: ", "")) end
  return integers(v)
end

return M
