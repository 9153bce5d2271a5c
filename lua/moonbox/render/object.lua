--- moonbox.render.object — how the client's objects (Sandbox, Snapshot, Group) show the API's
-- fields: in either spelling (snake_case as recipes write, camelCase as the API sends), JSON
-- null as nil, and every field the server sent kept, known or not.
--
-- An object is a table {_data = the decoded API object, ...} whose metatable's __index is
-- object.index(methods): methods first, then the field.
local json = require "moonbox.json"

local M = {}

--- object.camel(s) -> s in camelCase ("sandbox_group_id" → "sandboxGroupId").
function M.camel(s)
  return (s:gsub("_(%l)", function(c) return c:upper() end))
end
local camel = M.camel

--- object.index(methods) -> an __index function: methods[k], else the API field k in either
-- spelling (nil for JSON null).
function M.index(methods)
  return function(obj, k)
    local m = methods[k]
    if m then return m end
    local data = rawget(obj, "_data")
    local v = data[k]
    if v == nil and type(k) == "string" then v = data[camel(k)] end
    if v == json.null then return nil end
    return v
  end
end

--- object.fields(obj) -> the API object behind obj (the decoded JSON table; do not change it).
function M.fields(obj) return rawget(obj, "_data") end

return M
