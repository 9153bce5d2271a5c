--- moonbox.guard — cleanups that run whatever happens, in reverse order, and never hide the
-- error that made them run.
--
--   local guard = require "moonbox.guard"
--   local g <close> = guard.new("build")
--   local sb = render.sandboxes.create { ... }:keep()
--   g:defer(function() sb:terminate() end, "terminate " .. sb.id)
--
-- When the scope ends, the deferred functions run last-in first-out, each under its own
-- protected call, and may wait (they run in the task that owns the guard). If the scope is
-- unwinding an error (or a cancellation), cleanup failures are attached to that error as
-- `err.cleanup_errors` (a table error) and reported on stderr; they never replace it. If the
-- scope ended normally, a cleanup failure raises an error with code "cleanup_failed" listing
-- every failure with its label.
local core = require "moonbox.core"

local M = {}
local Guard = {}
Guard.__index = Guard
Guard.__name = "moonbox.Guard"

--- guard.new(name) -> Guard, a `<close>` value. name appears in reports.
function M.new(name)
  return setmetatable({ name = name or "guard", list = {} }, Guard)
end

--- g:defer(fn, label) -> g: adds fn(err) to run when the guard closes (err is the error being
-- unwound, or nil). label names it in reports (e.g. "terminate sbx-...").
function Guard:defer(fn, label)
  if type(fn) ~= "function" then error("guard:defer: expected a function", 2) end
  self.list[#self.list + 1] = { fn = fn, label = label or ("cleanup " .. (#self.list + 1)) }
  return self
end

--- g:cancel_all(): forgets every deferred cleanup (e.g. once ownership moved elsewhere).
function Guard:cancel_all()
  self.list = {}
end

--- g:run(err) -> failures: runs the deferred cleanups now (last first) and empties the list;
-- returns {{label=, error=}, ...} for the ones that failed. Does not raise. [yields]
function Guard:run(err)
  local failures = {}
  local list = self.list
  self.list = {}
  for i = #list, 1, -1 do
    local item = list[i]
    local ok, e = xpcall(item.fn, core.msgh, err)
    if not ok then failures[#failures + 1] = { label = item.label, error = e } end
  end
  return failures
end

--- guard.describe(failures [, key]) -> "A: error; B: error" for a list of {[key] = name,
-- error = e} (key defaults to "label", as cleanup failures have it). Does not yield.
local function describe(failures, key)
  key = key or "label"
  local parts = {}
  for _, f in ipairs(failures) do parts[#parts + 1] = tostring(f[key]) .. ": " .. tostring(f.error) end
  return table.concat(parts, "; ")
end
M.describe = describe

--- guard.attach(err, failures): appends failures ({label, error, ...} each) to
-- err.cleanup_errors when err is a table error, keeping what is already there; the one way a
-- cleanup failure joins the error being unwound (it never replaces it). Does nothing for a
-- string error or an empty list. Does not yield.
function M.attach(err, failures)
  if type(err) ~= "table" or #failures == 0 then return end
  local list = rawget(err, "cleanup_errors") or {}
  for _, f in ipairs(failures) do list[#list + 1] = f end
  rawset(err, "cleanup_errors", list)
end

Guard.__close = function(self, err)
  local failures = self:run(err)
  if #failures == 0 then return end
  if err ~= nil then
    -- Never replace the error being unwound: attach and report.
    M.attach(err, failures)
    io.stderr:write("moonbox: while unwinding ", tostring(err), ", cleanup of ", self.name,
      " failed: ", describe(failures), "\n")
    return
  end
  error(core.Error.new { op = "guard", code = "cleanup_failed", failures = failures,
    message = "cleanup of " .. self.name .. " failed: " .. describe(failures) }, 0)
end

M.Guard = Guard
return M
