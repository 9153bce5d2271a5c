--- moonbox.render.object — how the client's objects (Sandbox, Snapshot, Group) show the API's
-- fields: in one spelling, snake_case (`snap.sandbox_group_id` for the wire's `sandboxGroupId`),
-- JSON null as nil, and every field the server sent kept, known or not.
--
-- An object is a table {_data = the decoded API object, ...} whose metatable's __index is
-- object.index(methods): methods first, then the field. Reading a field in camelCase
-- (`snap.sandboxGroupId`) raises, naming the snake_case spelling: a silent nil would hide the
-- typo. A field whose value is a JSON object or array (`sb.network_policy`) reads as a view
-- with the same rule (`sb.network_policy.allowed_domains`), except maps whose keys are the
-- recipe's own data (`env`), which are given as sent. object.fields(obj) is the API object as
-- it came over the wire, camelCase and all.
local json = require "moonbox.json"

local M = {}

--- object.camel(s) -> s in camelCase ("sandbox_group_id" → "sandboxGroupId"). Does not yield.
function M.camel(s)
  return (s:gsub("_(%l)", function(c) return c:upper() end))
end
local camel = M.camel

--- object.snake(s) -> s in snake_case ("sandboxGroupId" → "sandbox_group_id"). Does not yield.
function M.snake(s)
  return (s:gsub("(%l)(%u)", function(a, b) return a .. "_" .. b:lower() end)
    :gsub("(%u)", function(c) return c:lower() end))
end
local snake = M.snake

-- Fields whose value is a map keyed by the recipe's own names (environment variables, labels):
-- its keys are data, not API field names, so it is given as sent.
local AS_SENT = { env = true, envVars = true, labels = true, metadata = true }

local View = { __name = "moonbox.render.fields" }

-- The value a recipe reads for the API value v of field k: nil for JSON null, a view for a
-- nested object or array (a decoded table: no __index of its own; except AS_SENT maps), else v
-- itself.
local function shown(k, v)
  if v == json.null then return nil end
  local mt = type(v) == "table" and getmetatable(v)
  if type(v) == "table" and not AS_SENT[k] and (not mt or rawget(mt, "__index") == nil) then
    return setmetatable({ _data = v }, View)
  end
  return v
end

-- The API value behind the snake_case (or integer) key k of the API table data; raises (at the
-- recipe's line: level 3 from here is the code that indexed, as long as the __index function
-- calling this does not tail-call it) for a camelCase string key.
local function field(data, k, what)
  if type(k) ~= "string" then return shown(k, data[k]) end
  if k:find("%u") then
    error(string.format("%s: fields are read in snake_case: `%s`, not `%s` (object.fields(obj) " ..
      "holds the API's own spelling)", what, snake(k), k), 3)
  end
  local v = data[camel(k)]
  if v == nil then v = data[k] end
  return shown(k, v)
end

View.__index = function(view, k)
  local v = field(rawget(view, "_data"), k, "moonbox.render") -- not a tail call: field's level 3
  return v
end
View.__len = function(view) return #rawget(view, "_data") end
View.__newindex = function(_, k)
  error("moonbox.render: an API object's fields are read-only (set " .. tostring(k) .. " elsewhere)", 2)
end
--- pairs(view) walks the fields in snake_case, JSON null left out.
View.__pairs = function(view)
  local data = rawget(view, "_data")
  local k
  return function()
    local v
    repeat
      k, v = next(data, k)
    until k == nil or v ~= json.null
    if k == nil then return nil end
    local name = type(k) == "string" and snake(k) or k
    return name, shown(k, v)
  end
end

--- object.index(methods) -> an __index function: methods[k], else the API field k read in
-- snake_case (nil for JSON null, a view for a nested object or array). Reading a camelCase
-- key raises a plain error at the reading line naming the snake_case spelling. Does not yield.
function M.index(methods)
  return function(obj, k)
    local m = methods[k]
    if m then return m end
    local mt = getmetatable(obj)
    local v = field(rawget(obj, "_data"), k, type(mt) == "table" and rawget(mt, "__name") or "moonbox.render")
    return v -- not a tail call: field's error level 3 is the line that read the field
  end
end

--- object.fields(obj) -> the API object behind obj, or behind a nested view (the decoded JSON
-- table, in the API's camelCase; do not change it). Does not yield.
function M.fields(obj) return rawget(obj, "_data") end

return M
