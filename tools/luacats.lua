--- tools/luacats.lua — LuaCATS annotations (lua-language-server's `---@meta` files) generated
-- from moonbox.schema, so that an editor completes a recipe's calls and options.
--
--   moonbox run tools/luacats.lua DIR     writes DIR/moonbox.render.lua, moonbox.task.lua,
--                                         moonbox.http.lua, moonbox.schedule.lua
--
-- The build runs it into build/meta/ (CMakeLists.txt, target moonbox_meta); `cmake --install`
-- and the .deb put the files in share/moonbox/meta/ (docs/reference/render.md, "Editors" says
-- how to point lua-language-server at them). spec/schema_spec.lua loads this file with dofile,
-- regenerates the files and compares them with the build's and with the schema.
local M = {}

-- Which annotation file each call prefix goes to, and the module table it names.
local FILE_OF = { render = "moonbox.render", sb = "moonbox.render", snap = "moonbox.render",
  group = "moonbox.render", fleet = "moonbox.render", proc = "moonbox.render", result = "moonbox.render",
  task = "moonbox.task", http = "moonbox.http", schedule = "moonbox.schedule" }
local CLASS_OF = { sb = "Sandbox", snap = "Snapshot", group = "Group", fleet = "Fleet", proc = "Process",
  result = "Result" }
local CLASSES = { Sandbox = true, Snapshot = true, Group = true, Fleet = true, Process = true, Result = true,
  Task = true }

--- luacats.lua_type(t) -> the LuaCATS type of a schema type (or list of alternatives).
function M.lua_type(t)
  if type(t) ~= "table" then t = { t } end
  local out = {}
  for _, one in ipairs(t) do
    if one == "seconds" then
      out[#out + 1] = "number|string"
    elseif one == "bytes" then
      out[#out + 1] = "integer"
    elseif CLASSES[one] then
      out[#out + 1] = "moonbox." .. one
    else
      out[#out + 1] = one
    end
  end
  return table.concat(out, "|")
end

--- luacats.field_type(o) -> the type of an option's field: its enum's literals, else lua_type.
function M.field_type(o)
  if o.enum then
    local lits = {}
    for i, e in ipairs(o.enum) do lits[i] = string.format("%q", e) end
    return table.concat(lits, "|")
  end
  return M.lua_type(o.type)
end

--- luacats.lua_name(call) -> how the annotation names the function: "render.sandboxes.create",
-- "Sandbox:exec" (a method of the class moonbox.Sandbox).
function M.lua_name(call)
  local prefix, method = call:match("^(%a+):([%w_]+)$")
  if prefix then return CLASS_OF[prefix] .. ":" .. method end
  return call
end

--- luacats.options_class(call) -> the class of its options table: "moonbox.opts.render.sandboxes.create".
function M.options_class(call)
  return "moonbox.opts." .. call:gsub(":", ".")
end

-- A declaration's `returns` as @return lines ("Snapshot, table" is two values).
local function return_lines(returns)
  local out = {}
  if not returns then return out end
  for part in returns:gmatch("[^,]+") do
    part = part:gsub("^%s+", ""):gsub("%s+$", "")
    part = part:gsub("%f[%w]([%u]%a+)%f[^%w]", function(w) return CLASSES[w] and ("moonbox." .. w) or w end)
    out[#out + 1] = "---@return " .. part
  end
  return out
end

local function sorted(t)
  local out = {}
  for k in pairs(t or {}) do out[#out + 1] = k end
  table.sort(out)
  return out
end

local function one_line(s) return (tostring(s or ""):gsub("%s+", " ")) end

--- luacats.generate(schema) -> { [file name] = text }: one `---@meta` file per module, from
-- every call declared in schema (require schema.MODULES first). Deterministic: calls and options
-- in sorted order. Does not yield.
function M.generate(schema)
  local by_file = {}
  for _, name in ipairs(schema.names()) do
    local file = FILE_OF[name:match("^(%a+)[.:]")]
    if file then
      by_file[file] = by_file[file] or {}
      table.insert(by_file[file], name)
    end
  end
  local out = {}
  for _, file in ipairs(sorted(by_file)) do
    local root = file:match("[^.]+$")
    local L = { "---@meta " .. file,
      "-- Generated from moonbox.schema by tools/luacats.lua: do not edit.", "" }
    L[#L + 1] = "---@class " .. file
    L[#L + 1] = "local " .. root .. " = {}"
    -- the tables on the way to each function (render.sandboxes, render.snapshots, ...)
    local tables = {}
    for _, name in ipairs(by_file[file]) do
      if not name:find(":", 1, true) then
        local path = name:match("^(.*)%.[%w_]+$")
        local acc
        for part in path:gmatch("[^.]+") do
          acc = acc and (acc .. "." .. part) or part
          if acc ~= root then tables[acc] = true end
        end
      end
    end
    for _, t in ipairs(sorted(tables)) do L[#L + 1] = t .. " = {}" end
    L[#L + 1] = ""
    if root == "render" then
      for _, c in ipairs(sorted(CLASS_OF)) do
        L[#L + 1] = "---@class moonbox." .. CLASS_OF[c]
        L[#L + 1] = "local " .. CLASS_OF[c] .. " = {}"
        L[#L + 1] = ""
      end
    end
    for _, name in ipairs(by_file[file]) do
      local d = schema.get(name)
      local opts_class = d.options and next(d.options) and M.options_class(name) or nil
      if opts_class then
        L[#L + 1] = "---@class " .. opts_class
        for _, k in ipairs(sorted(d.options)) do
          local o = d.options[k]
          local extra = {}
          if o.kind then extra[#extra + 1] = o.kind end
          if o.default ~= nil then extra[#extra + 1] = "default " .. tostring(o.default) end
          L[#L + 1] = "---@field " .. k .. "? " .. M.field_type(o) .. " " .. one_line(o.doc) ..
            (#extra > 0 and (" (" .. table.concat(extra, ", ") .. ")") or "")
        end
        L[#L + 1] = ""
      end
      L[#L + 1] = "---" .. one_line(d.summary) .. (d.yields and " [yields]" or "")
      local params = {}
      for _, a in ipairs(d.args or {}) do
        local ty = M.lua_type(a.type)
        if a.name == "opts" and opts_class then
          ty = opts_class
          local rest = type(a.type) == "table" and a.type or { a.type }
          for _, alt in ipairs(rest) do
            if alt ~= "table" then ty = ty .. "|" .. M.lua_type(alt) end
          end
        end
        L[#L + 1] = "---@param " .. a.name .. (a.optional and "?" or "") .. " " .. ty
        params[#params + 1] = a.name
      end
      for _, r in ipairs(return_lines(d.returns)) do L[#L + 1] = r end
      L[#L + 1] = "function " .. M.lua_name(name) .. "(" .. table.concat(params, ", ") .. ") end"
      L[#L + 1] = ""
    end
    L[#L + 1] = "return " .. root
    out[file .. ".lua"] = table.concat(L, "\n") .. "\n"
  end
  return out
end

--- luacats.write(schema, dir): generates into dir (created when missing); each file is written
-- beside and renamed into place. Raises on an I/O error. [yields] (sys.mkdir_p)
function M.write(schema, dir)
  require("moonbox.sys").mkdir_p(dir)
  for fname, text in pairs(M.generate(schema)) do
    local path = dir .. "/" .. fname
    local f = assert(io.open(path .. ".tmp", "wb"))
    assert(f:write(text))
    assert(f:close())
    assert(os.rename(path .. ".tmp", path))
  end
end

-- Run as a script (moonbox run tools/luacats.lua DIR): write the files.
local script = arg and arg[0] and tostring(arg[0]):match("luacats%.lua$")
if script and arg[1] then
  local schema = require "moonbox.schema"
  for _, m in ipairs(schema.MODULES) do require(m) end
  M.write(schema, arg[1])
end

return M
