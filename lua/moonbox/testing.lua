--- moonbox.testing — helpers for busted specs run by `moonbox test`.
--
--   local T = require "moonbox.testing"
--   it("waits", T.async(function() task.sleep(0.01) end))
--
-- T.async(fn) runs the test body as a task on the real event loop (task.run) and re-raises
-- its failure with the task's traceback, so busted reports the failing spec line.
local core = require "moonbox.core"

local M = {}

--- T.async(fn) -> function: a busted test body that runs fn(...) as a task.
function M.async(fn)
  return function(...) return core.run(fn, ...) end
end

--- T.run(fn, ...) -> results of fn: runs fn as a task until it finishes.
M.run = core.run

--- T.raises(fn, ...) -> err: calls fn(...), asserts it raised, and returns what it raised.
function M.raises(fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, "expected an error, but the call succeeded")
  return err
end

--- T.errors_with(code, fn, ...) -> err: calls fn(...), asserts it raised a structured error
-- with that code, and returns the error for further checks.
function M.errors_with(code, fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, "expected an error with code " .. code .. ", but the call succeeded")
  assert(type(err) == "table", "expected a structured error with code " .. code .. ", got " .. tostring(err))
  assert(err.code == code,
    "expected error code " .. code .. ", got " .. tostring(err.code) .. ": " .. tostring(err))
  return err
end

--- T.refs() -> registry refs moonbox holds now (0 between tests means nothing leaked).
M.refs = core.refs

return M
