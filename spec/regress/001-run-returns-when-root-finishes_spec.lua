-- Regression: task.run blocked in the loop's poll after its task had finished whenever some
-- other watcher (here a child's pipe) stayed active with nothing to report, so a busted spec
-- that started a background process in one test hung in the next. Finishing the root task
-- must end the run at once.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local task = require "moonbox.task"

describe("task.run", function()
  it("returns as soon as its task finishes, even with idle watchers active", function()
    local p
    T.run(function()
      p = proc.spawn { "sh", "-c", "echo ready; exec sleep 100" }
      assert.are.equal("ready", p:lines("stdout")())
    end)
    local ran = false
    T.run(function()
      task.yield()
      ran = true
    end)
    assert.is_true(ran)
    T.run(function()
      p:kill("KILL")
      p:wait()
    end)
  end)
end)
