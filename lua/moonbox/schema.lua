--- moonbox.schema — one declared schema per public call, and the one check every call makes.
--
-- Each public module declares its calls next to the code that implements them, in its
-- `M.SCHEMA` table, keyed by the call's public name as a recipe writes it
-- ("render.sandboxes.create", "sb:exec", "task.map", ...), and registers them at load with
-- schema.declare(M.SCHEMA). A declaration:
--
--   { summary = "one line", args = { { name = "opts", type = "table", optional = true }, ... },
--     options = { lifetime = { type = "seconds", kind = "lifetime", default = ..., doc = "...",
--                              enum = { ... }, removed = { "old_name" } }, ... },
--     returns = "Sandbox", yields = true }
--
-- Types: "string", "integer", "number", "boolean", "table", "function", "seconds" (a
-- non-negative number or a duration string as moonbox.duration parses), "bytes" (a
-- non-negative integer), "any", or a class name ("Sandbox", "Snapshot", ...: a table whose
-- metatable's __name ends in ".<name>"); a list of them means any one. kind = "deadline" marks a
-- client-side deadline, kind = "lifetime" a server-side lifetime (docs/reference/render.md,
-- "Names"). `removed` lists old spellings, refused with a message naming the option;
-- `refusals` (on the option: { [old] = message }) replaces that message where the old name meant
-- something else.
--
-- schema.check(name, opts) validates an options table; schema.wrap(name, fn) returns fn with
-- its positional arguments and options checked first, before anything is sent. Every mistake
-- raises a structured error (core.Error) with code "invalid_option" (an option: unknown,
-- removed, of the wrong type or unit) or "invalid_argument" (a positional argument), op the
-- call's name, and `where` the recipe's line.
local core = require "moonbox.core"
local duration = require "moonbox.duration"
local options = require "moonbox.options"

local M = {}

local declared = {}

--- schema.MODULES: the public modules whose calls are declared; requiring them all declares
-- every call (spec/schema_spec.lua and tools/luacats.lua do; schema.all() returns what has
-- been declared so far and requires nothing itself).
M.MODULES = { "moonbox.render", "moonbox.render.files", "moonbox.task", "moonbox.http_schema",
  "moonbox.schedule" }

local SIMPLE = { string = true, integer = true, number = true, boolean = true, table = true,
  ["function"] = true, seconds = true, bytes = true, any = true }

local function types_of(t)
  if type(t) == "table" then return t end
  return { t }
end

--- schema.type_text(t) -> the type(s) as docs and messages write them: "string | Snapshot".
function M.type_text(t)
  return table.concat(types_of(t), " | ")
end

-- Checks a declaration's own shape (a programming error in moonbox, raised at load).
local function check_declaration(name, d)
  local function bad(msg) error("schema.declare: " .. name .. ": " .. msg, 3) end
  if type(d) ~= "table" then bad("a declaration must be a table") end
  if type(d.summary) ~= "string" then bad("summary (a string) is required") end
  for i, a in ipairs(d.args or {}) do
    if type(a.name) ~= "string" or a.type == nil then bad("args[" .. i .. "] needs a name and a type") end
  end
  for k, o in pairs(d.options or {}) do
    if type(o) ~= "table" or o.type == nil then bad("option " .. tostring(k) .. " needs a type") end
    if o.kind ~= nil and o.kind ~= "deadline" and o.kind ~= "lifetime" then
      bad("option " .. k .. ": kind must be \"deadline\" or \"lifetime\"")
    end
  end
end

--- schema.declare(tbl) -> tbl: registers every call of a module's M.SCHEMA. Declaring one name
-- twice with different declarations raises (two modules claim one call). Does not yield.
function M.declare(tbl)
  for name, d in pairs(tbl) do
    check_declaration(name, d)
    if declared[name] ~= nil and declared[name] ~= d then
      error("schema.declare: " .. name .. " is declared twice", 2)
    end
    declared[name] = d
  end
  return tbl
end

--- schema.get(name) -> the declaration of that call, or nil.
function M.get(name) return declared[name] end

--- schema.all() -> { [call name] = declaration } for every call declared so far (require
-- schema.MODULES first for every public call). A new table; the declarations are shared.
function M.all()
  local out = {}
  for k, v in pairs(declared) do out[k] = v end
  return out
end

--- schema.names() -> the declared call names, sorted.
function M.names()
  local out = {}
  for k in pairs(declared) do out[#out + 1] = k end
  table.sort(out)
  return out
end

--- schema.opts_index(d) -> the index in d.args of the options table (the argument named
-- "opts"), or nil when the call takes none.
function M.opts_index(d)
  for i, a in ipairs(d.args or {}) do
    if a.name == "opts" then return i end
  end
  return nil
end

-- Whether v is of the one type t (see the header).
local function is_type(v, t)
  if t == "any" then return true end
  if t == "integer" then return math.type(v) == "integer" end
  if t == "seconds" then return (type(v) == "number" or type(v) == "string") and duration.parse(v) ~= nil end
  if t == "bytes" then return math.type(v) == "integer" and v >= 0 end
  if SIMPLE[t] then return type(v) == t end
  local mt = getmetatable(v)
  local n = type(mt) == "table" and rawget(mt, "__name")
  return type(n) == "string" and (n == t or n:sub(-#t - 1) == "." .. t)
end

local enum_set -- (below)

local function matches(v, t)
  if type(t) ~= "table" then return is_type(v, t) end
  for _, one in ipairs(t) do
    if is_type(v, one) then return true end
  end
  return false
end
M.matches = matches

-- The enum of an option as a set (made once per declaration).
local enum_sets = setmetatable({}, { __mode = "k" })
enum_set = function(o)
  local set = enum_sets[o]
  if not set then
    set = {}
    for _, e in ipairs(o.enum) do set[e] = true end
    enum_sets[o] = set
  end
  return set
end

-- A value for a message: strings quoted, tables by their class.
local function shown(v)
  if type(v) == "string" then return string.format("%q", v) end
  local mt = getmetatable(v)
  if type(mt) == "table" and type(rawget(mt, "__name")) == "string" then
    return "a " .. mt.__name:match("[^.]+$")
  end
  if type(v) == "table" or type(v) == "function" then return "a " .. type(v) end
  return tostring(v)
end

--- schema.invalid(name, fields) -> raises a structured invalid_option error for call `name`
-- (fields: option, message, and anything else to carry, e.g. suggestion, expected, got); the
-- message is prefixed with the option. Used by the checks below and by calls whose own check
-- goes beyond a type (a range). Never returns.
function M.invalid(name, fields)
  fields.op, fields.code = name, fields.code or "invalid_option"
  error(core.Error.new(fields), 0)
end

local function known_names(opts_decl)
  local known = {}
  for k in pairs(opts_decl) do known[k] = true end
  return known
end

-- Raises for an option that is not declared: a removed spelling names its new name; a typo
-- the nearest one.
local function refuse_unknown(name, d, k)
  for new, o in pairs(d.options or {}) do
    for _, old in ipairs(o.removed or {}) do
      if old == k then
        M.invalid(name, { option = k, suggestion = new, message = o.refusals and o.refusals[k] or
          string.format("option `%s` was renamed: write `%s`", k, new) })
      end
    end
  end
  local near = type(k) == "string" and options.nearest(k, known_names(d.options or {})) or nil
  local list = {}
  for n in pairs(d.options or {}) do list[#list + 1] = n end
  table.sort(list)
  M.invalid(name, { option = k, suggestion = near,
    message = string.format("unknown option `%s`%s", tostring(k),
      near and string.format(" (did you mean `%s`?)", near) or
      (#list > 0 and " (known: " .. table.concat(list, ", ") .. ")" or " (this call takes none)")) })
end

-- Checks one option's value against its declaration.
local function check_value(name, k, o, v)
  if not matches(v, o.type) then
    M.invalid(name, { option = k, expected = M.type_text(o.type), got = type(v),
      message = string.format("option `%s` must be %s%s, got %s", k, M.type_text(o.type),
        M.type_text(o.type):find("seconds", 1, true) and " (seconds >= 0 or a duration like \"15m\")" or "",
        shown(v)) })
  end
  if o.enum and type(v) == "string" then
    local ok = false
    for _, e in ipairs(o.enum) do
      if e == v then ok = true end
    end
    if not ok then
      M.invalid(name, { option = k, expected = table.concat(o.enum, " | "), got = v,
        message = string.format("option `%s` must be one of \"%s\", got %s", k, table.concat(o.enum,
          "\", \""),
          shown(v)) })
    end
  end
end

--- schema.check(name, opts [, level]) -> opts: validates the options table of call `name`
-- (nil counts as {}). Raises invalid_option (see the header) for an option that is unknown
-- (with the nearest valid name as err.suggestion when one is near), removed (the new name in the
-- message), or of the wrong type, unit or value; keys are checked in sorted order, so the first
-- mistake reported is stable. `level` is accepted for callers that pass one; `where` is always
-- the nearest recipe frame (core.Error). Raises a plain error for an undeclared name (a bug in
-- moonbox). Does not yield.
function M.check(name, opts, level)
  local _ = level
  local d = declared[name]
  if not d then error("schema.check: no call " .. tostring(name) .. " is declared", 2) end
  if opts == nil then return opts end
  if type(opts) ~= "table" then
    M.invalid(name, { code = "invalid_argument", argument = "opts", expected = "table", got = type(opts),
      message = "the options must be a table, got " .. shown(opts) })
  end
  local decl = d.options or {}
  -- The common case first: every key declared, every value of its type (no allocation).
  local clean = true
  for k, v in pairs(opts) do
    local o = decl[k]
    if o == nil or not matches(v, o.type) or (o.enum and type(v) == "string" and not enum_set(o)[v]) then
      clean = false
      break
    end
  end
  if clean then return opts end
  local keys = {}
  for k in pairs(opts) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
  for _, k in ipairs(keys) do
    local o = decl[k]
    if o == nil then refuse_unknown(name, d, k) end
    check_value(name, k, o, opts[k])
  end
  return opts
end

--- schema.check_args(name, ...) -> nothing: checks the positional arguments of call `name`
-- against its args (a missing one that is not optional, or one of the wrong type, raises
-- invalid_argument naming it; the options table goes through schema.check). For a method
-- ("sb:exec") the first value is the object and is not checked. Does not yield.
local NO_ARGS = {}

function M.check_args(name, ...)
  local d = declared[name]
  if not d then error("schema.check_args: no call " .. tostring(name) .. " is declared", 2) end
  local first = name:find(":", 1, true) and 2 or 1
  for i, a in ipairs(d.args or NO_ARGS) do
    local v = select(first + i - 1, ...)
    if a.name == "opts" and (v == nil or type(v) == "table") then
      M.check(name, v)
    elseif v == nil then
      if not a.optional then
        M.invalid(name, { code = "invalid_argument", argument = a.name, expected = M.type_text(a.type),
          got = "nil", message = string.format("argument %d (%s) is required: %s", i, a.name,
            M.type_text(a.type)) })
      end
    elseif not matches(v, a.type) then
      M.invalid(name, { code = "invalid_argument", argument = a.name, expected = M.type_text(a.type),
        got = type(v), message = string.format("argument %d (%s) must be %s, got %s", i, a.name,
          M.type_text(a.type), shown(v)) })
    end
  end
end

--- schema.wrap(name, fn) -> a function that checks its arguments as schema.check_args(name,
-- ...) does, then tail-calls fn with them (so fn's own error levels still point at the
-- recipe). The check comes before anything fn does: a misspelt option sends nothing. A call
-- declared without arguments has nothing to check: fn itself is returned.
function M.wrap(name, fn)
  local d = declared[name]
  if not d then error("schema.wrap: no call " .. tostring(name) .. " is declared", 2) end
  if not d.args or #d.args == 0 then return fn end -- nothing to check
  -- A single typed argument (task.sleep, task.join, ...): checked inline, no vararg walk.
  local method = name:find(":", 1, true) ~= nil
  local a1 = d.args[1]
  if #d.args == 1 and not method and a1.name ~= "opts" and not a1.optional then
    local t = a1.type
    return function(...)
      local v = ...
      if v == nil or not matches(v, t) then M.check_args(name, ...) end
      return fn(...)
    end
  end
  return function(...)
    M.check_args(name, ...)
    return fn(...)
  end
end

--- schema.seconds(v) -> v as seconds (a number, or a duration string parsed), nil for nil.
-- The value must have passed a "seconds" check.
function M.seconds(v)
  if v == nil then return nil end
  return (duration.parse(v))
end

return M
