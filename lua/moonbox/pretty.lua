--- moonbox.pretty — values as a person wants to read them (the REPL prints results with it).
--
--   local pretty = require "moonbox.pretty"
--   print(pretty.format({ 1, "two", { x = 3 } }))   --> { 1, "two", { x = 3 } }
--
-- Strings are quoted and escaped; tables are nested up to a depth limit, on one line when they
-- fit and indented otherwise, with their array part first and then the other keys sorted;
-- cycles print as <cycle>. Sandbox, Snapshot, Group and Task objects print as a one-line
-- summary (id, status, plan, age) instead of their insides; so do structured errors. Other
-- values with a __tostring metamethod print through it. Nothing here yields or raises (a
-- failing __tostring prints as <type: error>).
local M = {}

local DEFAULTS = { depth = 4, width = 100, max_items = 200, indent = "  " }

local IDENT = "^[%a_][%w_]*$"
--- pretty.KEYWORDS: Lua's reserved words (a set); the REPL's completion offers them too.
local KEYWORDS = {}
for w in ([[and break do else elseif end false for function goto if in local nil not or
  repeat return then true until while]]):gmatch("%a+") do KEYWORDS[w] = true end

local ESCAPES = { ["\\"] = "\\\\", ['"'] = '\\"', ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
  ["\a"] = "\\a", ["\b"] = "\\b", ["\f"] = "\\f", ["\v"] = "\\v" }

--- pretty.quote(s) -> s as a Lua string literal that reads back to the same bytes: printable
-- text as is (UTF-8 included), control bytes escaped.
function M.quote(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return ESCAPES[c] or string.format("\\%03d", c:byte())
  end) .. '"'
end

-- ---- times ------------------------------------------------------------------------------------

--- pretty.parse_time("2026-04-01T18:30:00Z") -> seconds since the epoch, or nil.
M.parse_time = require("moonbox.rfc3339").parse

--- pretty.age(seconds) -> "12s", "5m", "3h", "2d".
function M.age(secs)
  if secs < 0 then secs = 0 end
  if secs < 120 then return string.format("%ds", math.floor(secs)) end
  if secs < 7200 then return string.format("%dm", math.floor(secs / 60)) end
  if secs < 172800 then return string.format("%dh", math.floor(secs / 3600)) end
  return string.format("%dd", math.floor(secs / 86400))
end

local function age_of(created)
  local t = M.parse_time(created)
  if not t then return nil end
  return M.age(os.time() - t)
end

-- ---- objects with a summary ------------------------------------------------------------------

local function field(obj, k)
  local ok, v = pcall(function() return obj[k] end)
  if ok then return v end
  return nil
end

-- The parts a summary can show, each a function(obj) -> text, or nil when obj has none; id and
-- status always show ("?" for a status not known).
local function optional(k)
  return function(obj)
    local v = field(obj, k)
    return v and tostring(v) or nil
  end
end
local PART = {
  id = function(obj) return tostring(field(obj, "id")) end,
  status = function(obj) return tostring(field(obj, "status") or "?") end,
  name = function(obj)
    local name = field(obj, "name")
    return name and M.quote(tostring(name)) or nil
  end,
  kind = optional("kind"),
  plan = optional("plan"),
  age = function(obj)
    local age = age_of(field(obj, "created_at"))
    return age and "age " .. age or nil
  end,
  kept = function(obj) return rawget(obj, "_kept") and "kept" or nil end,
}

-- What each object's summary shows after its class name, in order.
local SANDBOX = { "id", "status", "plan", "age", "kept" }
local SNAPSHOT = { "id", "name", "status", "kind", "plan", "age" }
local TASK = { "id", "name", "status" }

-- "<Class part part ...>" for obj, with the parts of `shows` that obj has.
local function summary_of(class, obj, shows)
  local parts = { class }
  for _, p in ipairs(shows) do
    local text = PART[p](obj)
    if text then parts[#parts + 1] = text end
  end
  return "<" .. table.concat(parts, " ") .. ">"
end

--- The one-line summary of a known object, or nil. Detection never loads a module: a Sandbox
-- is recognised by moonbox.render's metatable (when that module is loaded), a Task by
-- moonbox.core's, Snapshot and Group by their metatables' __name, errors by core.Error.is.
local function summary(v, mt)
  local render = package.loaded["moonbox.render"]
  if render and mt == render.Sandbox then return summary_of("Sandbox", v, SANDBOX) end
  local core = package.loaded["moonbox.core"]
  if core and mt == core.Task then return summary_of("Task", v, TASK) end
  local name = rawget(mt, "__name")
  if name == "moonbox.render.Snapshot" then return summary_of("Snapshot", v, SNAPSHOT) end
  if name == "moonbox.Error" then
    local ok, s = pcall(tostring, v)
    return ok and ("<error: " .. s .. ">") or "<error>"
  end
  local ts = rawget(mt, "__tostring")
  if ts then
    local ok, s = pcall(tostring, v)
    if ok and type(s) == "string" then return s end
    return "<" .. type(v) .. ": __tostring failed>"
  end
  return nil
end

-- ---- tables -----------------------------------------------------------------------------------

local TYPE_ORDER = { number = 1, string = 2, boolean = 3 }

local function key_less(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then return (TYPE_ORDER[ta] or 9) < (TYPE_ORDER[tb] or 9) end
  if ta == "number" or ta == "string" then return a < b end
  return tostring(a) < tostring(b)
end

local format

local function format_key(k, opts, seen, depth)
  if type(k) == "string" and k:match(IDENT) and not KEYWORDS[k] then return k end
  return "[" .. format(k, opts, seen, depth) .. "]"
end

local function format_table(t, opts, seen, depth)
  if seen[t] then return "<cycle>" end
  if depth >= opts.depth then return "{...}" end
  seen[t] = true
  local n = rawlen(t)
  local items = {}
  local count = 0
  for i = 1, n do
    count = count + 1
    if count > opts.max_items then break end
    items[#items + 1] = format(rawget(t, i), opts, seen, depth + 1)
  end
  local keys = {}
  for k in next, t do
    if not (math.type(k) == "integer" and k >= 1 and k <= n) then keys[#keys + 1] = k end
  end
  table.sort(keys, key_less)
  for _, k in ipairs(keys) do
    count = count + 1
    if count > opts.max_items then break end
    items[#items + 1] = format_key(k, opts, seen, depth + 1) .. " = " ..
      format(rawget(t, k), opts, seen, depth + 1)
  end
  if count > opts.max_items then
    items[#items + 1] = string.format("... (%d more)", n + #keys - opts.max_items)
  end
  seen[t] = nil
  if #items == 0 then return "{}" end
  local one = "{ " .. table.concat(items, ", ") .. " }"
  if #one + #opts.indent * depth <= opts.width and not one:find("\n", 1, true) then return one end
  local pad = opts.indent:rep(depth + 1)
  for i, s in ipairs(items) do items[i] = pad .. s:gsub("\n", "\n" .. opts.indent) end
  return "{\n" .. table.concat(items, ",\n") .. "\n" .. opts.indent:rep(depth) .. "}"
end

format = function(v, opts, seen, depth)
  local tv = type(v)
  if tv == "string" then return M.quote(v) end
  if tv == "number" then
    if math.type(v) == "float" and v == math.floor(v) and v > -1e15 and v < 1e15 then
      return string.format("%.1f", v)
    end
    return tostring(v)
  end
  if tv == "nil" or tv == "boolean" then return tostring(v) end
  local mt = getmetatable(v)
  if type(mt) == "table" then
    local s = summary(v, mt)
    if s then return s end
  end
  if tv == "table" then return format_table(v, opts, seen, depth) end
  return tostring(v)
end

--- pretty.format(v, opts) -> string. opts: depth (tables nested deeper print as {...};
-- default 4), width (a table longer than this is indented over several lines; default 100),
-- max_items (per table; default 200), indent (default two spaces).
function M.format(v, opts)
  local o = {}
  for k, d in pairs(DEFAULTS) do o[k] = (opts and opts[k]) or d end
  return format(v, o, {}, 0)
end

--- pretty.summary(v) -> the one-line summary of a Sandbox/Snapshot/Task/error, or nil.
function M.summary(v)
  local mt = getmetatable(v)
  if type(mt) ~= "table" then return nil end
  return summary(v, mt)
end

M.KEYWORDS = KEYWORDS
return M
