-- schema_spec — every public call is declared once (moonbox.schema), checks what it is given
-- against that declaration before it does anything, and the manual and the editor annotations
-- say what the declaration says.
--
-- (a) For every declared call with options, one option misspelt (two adjacent letters swapped,
--     or one dropped) raises invalid_option naming it, with the declared name as the suggestion,
--     at this file's line — calling the real function, with no backend: the check comes before
--     any request, so no connection is made and no API request counted. Every removed spelling
--     raises invalid_option naming its new name; every option given a value of the wrong type
--     raises invalid_option naming it. A call without options gets a wrong-typed positional
--     argument instead and raises invalid_argument naming it.
-- (b) render.sandboxes.create{ netwrok = "deny-all" } explicitly.
-- (c) The reference tables against the schema, both ways. The convention (docs/reference/
--     render.md "Names" says it for readers): each call with options has a heading
--       ### Options: `CALL`
--     (any heading level) in the manual of its module — docs/reference/render.md for render.*,
--     sb:, snap:, group:, fleet:, proc:, result:; docs/reference/task.md for task.*;
--     docs/reference/http.md for http.*; docs/schedule.md for schedule.* — followed by one table
--     whose header is `| option | type | default | meaning |`. A row: the option in backticks;
--     the type as schema.type_text writes it, in backticks (alternatives separated by `\|`);
--     the default as a Lua literal in backticks, or — when there is none; the meaning, which
--     starts with **deadline** or **lifetime** exactly when the option's kind says so. Every
--     declared option has its row with the same type and default; every row and every such
--     heading names a declared option and call.
-- (d) The LuaCATS annotations generated from the schema (tools/luacats.lua): regenerated here,
--     they are the files the build wrote, and every call and option of the schema is in them
--     with its type.
local T = require "moonbox.testing"
local schema = require "moonbox.schema"
local options = require "moonbox.options"
for _, m in ipairs(schema.MODULES) do require(m) end
local render = require "moonbox.render"
local api = require "moonbox.render.api"
local task = require "moonbox.task"
local http = require "moonbox.http"
local schedule = require "moonbox.schedule"
local core = require "moonbox.core"
local markdown = require "spec.support.markdown"

local ROOT = (debug.getinfo(1, "S").source:match("^@(.*)/spec/[^/]*$")) or "."

-- ---- the objects a method is called on (no backend: nothing gets past the check) -------------

local function fake(class, data)
  return setmetatable({ _data = data or {}, _kept = true }, class)
end

local SAMPLE_CLASS = {
  Sandbox = function() return fake(render.Sandbox, { id = "srv-schemaspec0000000000", status = "running" }) end,
  Snapshot = function()
    return fake(render.Snapshot, { id = "snp-schemaspec0000000000", sandboxGroupId = "sbg-schemaspec000000000",
      status = "available" })
  end,
  Group = function() return fake(render.Group, { id = "sbg-schemaspec000000000" }) end,
  Fleet = function() return setmetatable({}, render.Fleet) end,
  Process = function() return setmetatable({ done = true, out = { stdout = {}, stderr = {} } }, render.Process) end,
  Result = function() return setmetatable({ code = 0, stdout = "", stderr = "" }, render.Result) end,
  Task = function() return task.spawn(function() end) end,
}

local RECEIVER = { sb = "Sandbox", snap = "Snapshot", group = "Group", fleet = "Fleet", proc = "Process",
  result = "Result" }

--- The function a call name names, and the object a method is called on (nil for a function).
local function resolve(name)
  local prefix, method = name:match("^(%a+):([%w_]+)$")
  if prefix then
    local obj = SAMPLE_CLASS[assert(RECEIVER[prefix], "no receiver for " .. name)]()
    return obj[method], obj
  end
  local root, rest = name:match("^(%a+)%.(.+)$")
  local t = ({ render = render, task = task, http = http, schedule = schedule })[root]
  assert(t, "no module for " .. name)
  for part in rest:gmatch("[^.]+") do t = t[part] end
  return t, nil
end

-- A value of type t (the first alternative of a list) that passes its check.
local function sample(t)
  if type(t) == "table" then t = t[1] end
  if SAMPLE_CLASS[t] then return SAMPLE_CLASS[t]() end
  return ({ string = "schema-spec", integer = 1, number = 1, boolean = true, table = {},
    ["function"] = function() end, seconds = 1, bytes = 1, any = "x" })[t]
end

-- A value that is none of the types t.
local function wrong(t)
  for _, v in ipairs { true, 0.5, "not-a-value", {}, function() end } do
    if not schema.matches(v, t) then return v end
  end
  error("no wrong value for " .. schema.type_text(t))
end

--- Calls the call `name` with valid positional arguments (a sample of each type) and the given
-- options table in its opts position (or `override` = {index, value} for one argument).
local function call(name, opts, override)
  local d = schema.get(name)
  local fn, self = resolve(name)
  assert.is_function(fn, name .. " resolves to a function")
  local args, n = {}, 0
  if self then
    n = 1
    args[1] = self
  end
  for i, a in ipairs(d.args or {}) do
    local v
    if a.name == "opts" then v = opts else v = sample(a.type) end
    if override and override[1] == i then v = override[2] end
    args[n + i] = v
  end
  local count = n + #(d.args or {})
  return pcall(fn, table.unpack(args, 1, count))
end

--- A misspelling of option k (adjacent letters swapped, else one dropped) whose nearest declared
-- name is k, and that is neither declared nor a removed spelling; nil when there is none.
local function misspell(k, decl)
  local known, taken = {}, {}
  for n, o in pairs(decl) do
    known[n], taken[n] = true, true
    for _, old in ipairs(o.removed or {}) do taken[old] = true end
  end
  local variants = {}
  for i = 1, #k - 1 do
    if k:sub(i, i) ~= k:sub(i + 1, i + 1) then
      variants[#variants + 1] = k:sub(1, i - 1) .. k:sub(i + 1, i + 1) .. k:sub(i, i) .. k:sub(i + 2)
    end
  end
  for i = 1, #k do variants[#variants + 1] = k:sub(1, i - 1) .. k:sub(i + 1) end
  for _, v in ipairs(variants) do
    if v ~= "" and not taken[v] and options.nearest(v, known) == k then return v end
  end
  return nil
end

local function sorted_keys(t)
  local out = {}
  for k in pairs(t or {}) do out[#out + 1] = k end
  table.sort(out)
  return out
end

-- Nothing reached a backend: no connection was made, no API request counted.
local function nothing_sent(calls_before)
  assert.is_nil(render.current_connection(), "a connection was made")
  assert.are.equal(calls_before, api.calls_made, "an API request was counted")
end

local function assert_here(err)
  assert.matches("spec/schema_spec.lua:%d+$", tostring(err.where))
end

describe("moonbox.schema", function()
  before_each(function() schedule._reset() end)

  it("declares the public calls of render, task, http and schedule", function()
    local names = schema.names()
    local by_module = {}
    for _, n in ipairs(names) do
      local m = n:match("^(%a+)[.:]")
      by_module[m] = (by_module[m] or 0) + 1
      local d = schema.get(n)
      assert.is_string(d.summary, n)
      assert.is_function((resolve(n)), n .. " is declared but does not resolve to a function")
    end
    for _, m in ipairs { "render", "sb", "snap", "group", "fleet", "proc", "result", "task", "http", "schedule" } do
      assert.is_true((by_module[m] or 0) > 0, "no call of " .. m .. " is declared")
    end
  end)

  it("refuses a misspelt option on every call with options, naming the nearest one, before anything is sent",
    T.async(function()
      local before = api.calls_made
      local checked = 0
      for _, name in ipairs(schema.names()) do
        local d = schema.get(name)
        if d.options and next(d.options) and schema.opts_index(d) then
          local typo, meant
          for _, k in ipairs(sorted_keys(d.options)) do
            typo = misspell(k, d.options)
            if typo then
              meant = k
              break
            end
          end
          assert.is_string(typo, name .. ": no option of it can be misspelt into a near miss")
          local ok, err = call(name, { [typo] = sample(d.options[meant].type) })
          assert.is_false(ok, name .. "{" .. typo .. "} did not raise")
          assert.is_true(core.Error.is(err), name .. ": not a structured error: " .. tostring(err))
          assert.are.same({ "invalid_option", typo, meant, name }, { err.code, err.option, err.suggestion, err.op })
          assert.matches("did you mean `" .. meant .. "`?", tostring(err.message), 1, true)
          assert_here(err)
          checked = checked + 1
        end
      end
      assert.is_true(checked >= 20, "only " .. checked .. " calls with options")
      nothing_sent(before)
    end))

  it("refuses every removed spelling with its new name, and a value of the wrong type naming the option",
    T.async(function()
      local before = api.calls_made
      for _, name in ipairs(schema.names()) do
        local d = schema.get(name)
        if d.options and schema.opts_index(d) then
          for _, k in ipairs(sorted_keys(d.options)) do
            local o = d.options[k]
            for _, old in ipairs(o.removed or {}) do
              local ok, err = call(name, { [old] = sample(o.type) })
              assert.is_false(ok, name .. "{" .. old .. "} did not raise")
              assert.are.same({ "invalid_option", old, k }, { err.code, err.option, err.suggestion })
              assert.matches("`" .. k .. "`", err.message, 1, true)
            end
            local ok, err = call(name, { [k] = wrong(o.type) })
            assert.is_false(ok, name .. "{" .. k .. " = <wrong type>} did not raise")
            assert.are.same({ "invalid_option", k, name }, { err.code, err.option, err.op })
            assert.matches("option `" .. k .. "` must be", err.message, 1, true)
            assert_here(err)
          end
        end
      end
      nothing_sent(before)
    end))

  it("refuses a wrong-typed positional argument on every call without options", T.async(function()
    local before = api.calls_made
    local checked, unchecked = 0, {}
    for _, name in ipairs(schema.names()) do
      local d = schema.get(name)
      if not (d.options and next(d.options)) then
        local index
        for i, a in ipairs(d.args or {}) do
          if a.type ~= "any" and a.name ~= "opts" then
            index = i
            break
          end
        end
        if index then
          local a = d.args[index]
          local ok, err = call(name, nil, { index, wrong(a.type) })
          assert.is_false(ok, name .. ": a wrong " .. a.name .. " did not raise")
          assert.is_true(core.Error.is(err), name .. ": not a structured error: " .. tostring(err))
          assert.are.same({ "invalid_argument", a.name, name }, { err.code, err.argument, err.op })
          assert_here(err)
          checked = checked + 1
        else
          unchecked[#unchecked + 1] = name
        end
      end
    end
    -- What is left takes no argument that can be of a wrong type (none, or any value).
    for _, name in ipairs(unchecked) do
      for _, a in ipairs(schema.get(name).args or {}) do
        assert.are.equal("any", a.type, name .. " has a typed argument the spec did not try")
      end
    end
    assert.is_true(checked >= 20, "only " .. checked .. " calls checked")
    nothing_sent(before)
  end))

  it("refuses render.sandboxes.create{ netwrok = \"deny-all\" } before anything is sent", T.async(function()
    local before = api.calls_made
    local line = debug.getinfo(1, "l").currentline + 1
    local ok, err = pcall(render.sandboxes.create, { netwrok = "deny-all" })
    assert.is_false(ok)
    assert.are.same({ "invalid_option", "render.sandboxes.create", "netwrok", "network" },
      { err.code, err.op, err.option, err.suggestion })
    assert.are.equal("spec/schema_spec.lua:" .. line,
      tostring(err.where):match("spec/schema_spec.lua:%d+$"))
    assert.matches("render.sandboxes.create: unknown option `netwrok` (did you mean `network`?)", tostring(err),
      1, true)
    -- the old lifetime spellings say the new name
    local _, e2 = pcall(render.sandboxes.create, { timeout = 600 })
    assert.matches("`timeout` was the sandbox's lifetime: write `lifetime`; the wait's deadline is `wait_timeout`",
      e2.message, 1, true)
    local _, e3 = pcall(render.restore, "base", { timeout_seconds = 600 })
    assert.matches("option `timeout_seconds` was renamed: write `lifetime`", e3.message, 1, true)
    local _, e4 = pcall(render.sandboxes.create, { network = "deny-al" })
    assert.matches("option `network` must be one of \"allow-all\", \"deny-all\", got \"deny-al\"", e4.message, 1,
      true)
    nothing_sent(before)
  end))
end)

-- ---- (c) the reference tables ---------------------------------------------------------------------

local DOC_OF = { render = "docs/reference/render.md", sb = "docs/reference/render.md",
  snap = "docs/reference/render.md", group = "docs/reference/render.md", fleet = "docs/reference/render.md",
  proc = "docs/reference/render.md", result = "docs/reference/render.md", task = "docs/reference/task.md",
  http = "docs/reference/http.md", schedule = "docs/schedule.md" }

local function read(path)
  local f = assert(io.open(ROOT .. "/" .. path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local cells = markdown.cells

--- Every "Options: `CALL`" table of a manual: { [call] = { [option] = {type, default, meaning, line} } }.
local function doc_tables(path)
  local out = {}
  local lines = {}
  for l in (read(path) .. "\n"):gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
  local i = 1
  while i <= #lines do
    local cname = lines[i]:match("^#+%s+Options: `([^`]+)`%s*$")
    if cname then
      assert.is_nil(out[cname], path .. ":" .. i .. ": a second table for " .. cname)
      local j = i + 1
      while lines[j] and lines[j]:match("^%s*$") do j = j + 1 end
      assert.are.equal("| option | type | default | meaning |", lines[j],
        path .. ":" .. j .. ": the table of " .. cname .. " must start with the agreed header")
      assert.matches("^|%-%-%-|", lines[j + 1] or "")
      local rows = {}
      j = j + 2
      while lines[j] and lines[j]:match("^|") do
        local c = cells(lines[j])
        assert.are.equal(4, #c, path .. ":" .. j .. ": a row has four cells")
        local opt = c[1]:match("^`([%w_]+)`$")
        assert.is_string(opt, path .. ":" .. j .. ": the option cell is a name in backticks")
        rows[opt] = { type = c[2]:match("^`(.+)`$"), default = c[3], meaning = c[4], line = j }
        j = j + 1
      end
      out[cname] = rows
      i = j
    else
      i = i + 1
    end
  end
  return out
end

local function default_text(v)
  if v == nil then return "—" end
  if type(v) == "string" then return "`\"" .. v .. "\"`" end
  return "`" .. tostring(v) .. "`"
end

describe("the reference tables", function()
  it("say what the schema says, both ways", function()
    local docs = {}
    for _, path in pairs(DOC_OF) do docs[path] = docs[path] or doc_tables(path) end
    -- schema -> docs
    for _, name in ipairs(schema.names()) do
      local d = schema.get(name)
      if d.options and next(d.options) then
        local path = DOC_OF[name:match("^(%a+)[.:]")]
        local rows = docs[path][name]
        assert.is_table(rows, path .. " has no \"Options: `" .. name .. "`\" table")
        for _, k in ipairs(sorted_keys(d.options)) do
          local o, r = d.options[k], rows[k]
          local where = path .. ": " .. name .. " option " .. k
          assert.is_table(r, where .. " is not documented")
          assert.are.equal(schema.type_text(o.type), r.type, where .. ": type")
          assert.are.equal(default_text(o.default), r.default, where .. ": default")
          local kind = r.meaning:match("^%*%*(%a+)%*%*")
          assert.are.equal(o.kind, kind, where .. ": the meaning starts with **" .. tostring(o.kind) .. "**")
        end
      end
    end
    -- docs -> schema
    for path, tables in pairs(docs) do
      for cname, rows in pairs(tables) do
        local d = schema.get(cname)
        assert.is_table(d, path .. " documents options of " .. cname .. ", which is not declared")
        for opt, r in pairs(rows) do
          assert.is_table((d.options or {})[opt],
            path .. ":" .. r.line .. ": " .. cname .. " option " .. opt .. " is documented but not declared")
        end
      end
    end
  end)
end)

-- ---- (d) the annotations ---------------------------------------------------------------------------

describe("the LuaCATS annotations", function()
  local luacats = dofile(ROOT .. "/tools/luacats.lua")

  it("are what the build installs, and carry every call and option with its type", function()
    local files = luacats.generate(schema)
    assert.is_true(next(files) ~= nil)
    local built = os.getenv("MOONBOX_BUILD_DIR")
    if built then
      for fname, text in pairs(files) do
        local f = io.open(built .. "/meta/" .. fname, "rb")
        assert.is_not_nil(f, "the build did not write meta/" .. fname .. " (rebuild: ./dev build)")
        local got = f:read("a")
        f:close()
        assert.are.equal(text, got, "meta/" .. fname .. " is stale (rebuild: ./dev build)")
      end
    end
    local all = {}
    for _, text in pairs(files) do all[#all + 1] = text end
    local text = table.concat(all, "\n")
    for _, f in pairs(files) do assert.matches("^%-%-%-@meta", f) end
    for _, name in ipairs(schema.names()) do
      local d = schema.get(name)
      local func = luacats.lua_name(name)
      assert.matches("\nfunction " .. func:gsub("[%.%:%-]", "%%%0") .. "%(", text, nil, false)
      for _, k in ipairs(sorted_keys(d.options)) do
        local class = luacats.options_class(name)
        local field = "---@field " .. k .. "? " .. luacats.field_type(d.options[k])
        local block = text:match("%-%-%-@class " .. class:gsub("%.", "%%.") .. "\n(.-)\n\n")
        assert.is_string(block, "no options class " .. class .. " for " .. name)
        assert.matches(field, block, 1, true)
      end
      for _, a in ipairs(d.args or {}) do
        local want = "---@param " .. a.name .. (a.optional and "?" or "") .. " " ..
          (a.name == "opts" and d.options and next(d.options) and luacats.options_class(name)
            or luacats.lua_type(a.type))
        assert.matches(want, text, 1, true)
      end
    end
  end)
end)
