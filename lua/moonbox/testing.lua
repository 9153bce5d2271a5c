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

--- T.refs() -> registry refs moonbox holds now (0 between tests means nothing leaked).
M.refs = core.refs

return M
