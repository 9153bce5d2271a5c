--- moonbox.repl.complete — tab completion for the REPL: globals and keywords, table fields
-- (`render.sandb` → `render.sandboxes`), and methods after `:` (`sb:ex` → `sb:exec`), including
-- a Sandbox's methods, whose metatable hides them behind an __index function.
--
-- Completion only reads values: it never calls a function the user wrote, except __index
-- metamethods met while walking a dotted path, which are called under pcall (they must not
-- wait; one that tries fails and completes nothing).
local M = {}

local KEYWORDS = require("moonbox.pretty").KEYWORDS

local function safe_index(v, k)
  local ok, r = pcall(function() return v[k] end)
  if ok then return r end
  return nil
end

--- Adds the identifier keys of table t (and, up to 4 levels, of its __index tables) to out.
local function add_keys(out, t, want_fn, depth)
  if type(t) ~= "table" or depth > 4 then return end
  for k, v in next, t do
    if type(k) == "string" and k:match("^[%a_][%w_]*$") and (not want_fn or type(v) == "function") then
      out[k] = true
    end
  end
  local mt = getmetatable(t)
  if type(mt) == "table" and type(rawget(mt, "__index")) == "table" then
    add_keys(out, rawget(mt, "__index"), want_fn, depth + 1)
  end
end

-- The fields an API object (Sandbox, Snapshot, Group: its _data) is read by: the API's keys in
-- snake_case, as moonbox.render.object reads them (a camelCase read raises).
local function field_names(data)
  local out = {}
  for k, val in pairs(data) do
    if type(k) == "string" then
      local snake = k:gsub("(%l)(%u)", function(a, b) return a .. "_" .. b:lower() end)
        :gsub("%u", string.lower)
      out[snake] = val
    end
  end
  return out
end

--- The names that can follow `v.` (method = false) or `v:` (method = true).
local function members(v, method)
  local out = {}
  local render = package.loaded["moonbox.render"]
  local mt = getmetatable(v)
  if render and mt ~= nil and mt == render.Sandbox then
    add_keys(out, render.Sandbox.methods, true, 0)
    if not method then
      add_keys(out, field_names(rawget(v, "_data")), false, 0)
    end
    return out
  end
  if type(v) == "string" then
    add_keys(out, string, method, 0)
    return out
  end
  if type(v) == "table" then
    add_keys(out, v, method, 0)
    -- Objects that keep their API fields in _data (Snapshot, Group) read them through __index.
    if not method and type(rawget(v, "_data")) == "table" then
      add_keys(out, field_names(rawget(v, "_data")), false, 0)
    end
  elseif type(mt) == "table" and type(rawget(mt, "__index")) == "table" then
    add_keys(out, rawget(mt, "__index"), method, 0)
  end
  for k in pairs(out) do
    if k:sub(1, 1) == "_" then out[k] = nil end
  end
  return out
end

--- complete(text, env) -> array of replacements for `text`, the word under the cursor (a
-- dotted path such as `render.sandboxes.cr` or `sb:ex`), sorted. env: the globals (default _G).
function M.complete(text, env)
  env = env or _G
  local path, sep, partial = text:match("^(.-)([%.:])([%a_]?[%w_]*)$")
  local names = {}
  if not path then
    partial = text:match("^[%a_]?[%w_]*$") and text
    if not partial then return {} end
    path = ""
    add_keys(names, env, false, 0)
    for w in pairs(KEYWORDS) do names[w] = true end
  else
    if not path:match("^[%a_][%w_]*$") and not path:match("^[%a_][%w_]*[%.%w_]*[%w_]$") then return {} end
    local v = env
    for name in path:gmatch("[^%.]+") do
      v = safe_index(v, name)
      if v == nil then return {} end
    end
    names = members(v, sep == ":")
  end
  local out = {}
  for name in pairs(names) do
    if name:sub(1, #partial) == partial then out[#out + 1] = path .. (sep or "") .. name end
  end
  table.sort(out)
  return out
end

return M
