-- Pins the task scheduler's contract (docs/architecture.md, "Rules of the runtime core" 1-5).
local T = require "moonbox.testing"
local task = require "moonbox.task"
local core = require "moonbox.core"

local function closer(fn) return setmetatable({}, { __close = fn }) end

describe("task.spawn and join", function()
  it("returns every result of the joined task", T.async(function()
    local t = task.spawn(function(a, b) task.sleep(0.001) return a + b, "x", nil, 4 end, 1, 2)
    local a, b, c, d = task.join(t)
    assert.are.same({ 3, "x", nil, 4 }, { a, b, c, d })
  end))

  it("re-raises the joined task's error value unchanged", T.async(function()
    local e = { code = "mine" }
    local t = task.spawn(function() error(e) end)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.are.equal(e, err)
  end))

  it("does not start a task cancelled before it ran", T.async(function()
    local ran = false
    local t = task.spawn(function() ran = true end)
    task.cancel(t)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err))
    assert.is_false(ran)
  end))

  it("treats a bare coroutine.yield in a task as task.yield", T.async(function()
    local order = {}
    local t = task.spawn(function() order[#order + 1] = "other" end)
    coroutine.yield()
    order[#order + 1] = "me"
    task.join(t)
    assert.are.same({ "other", "me" }, order)
  end))

  it("reports a deadlock instead of hanging", function()
    local ok, err = pcall(task.run, function() core.cond():wait() end)
    assert.is_false(ok)
    assert.matches("deadlock", tostring(err))
    core.shutdown()
  end)
end)

describe("cancellation", function()
  it("unwinds <close> variables in reverse order and lets closers wait", T.async(function()
    local log = {}
    local t = task.spawn(function()
      local _a <close> = closer(function()
        task.sleep(0.005) -- a closer can itself yield
        log[#log + 1] = "a"
      end)
      local _b <close> = closer(function()
        task.sleep(0.001)
        log[#log + 1] = "b"
      end)
      task.sleep(10)
      log[#log + 1] = "not reached"
    end)
    task.sleep(0.01)
    task.cancel(t)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err))
    assert.are.same({ "b", "a" }, log)
  end))

  it("is delivered to pcall handlers as a structured error", T.async(function()
    local seen
    local t = task.spawn(function()
      local ok, err = pcall(task.sleep, 10)
      seen = { ok = ok, code = err.code, str = tostring(err) }
      task.sleep(0.001) -- after handling it, the task may wait again
      return "recovered"
    end)
    task.sleep(0.005)
    task.cancel(t)
    assert.are.equal("recovered", task.join(t))
    assert.is_false(seen.ok)
    assert.are.equal("cancelled", seen.code)
    assert.matches("task_spec.lua:%d+: task: task %d+ was cancelled", seen.str)
  end))

  it("of a task that is running reaches it at its next wait", T.async(function()
    local reached
    local t
    t = task.spawn(function()
      task.cancel(t) -- cancel ourselves while running: nothing happens yet
      reached = "before wait"
      task.sleep(1)
      reached = "after wait"
    end)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err))
    assert.are.equal("before wait", reached)
  end))

  it("of a joiner removes it from the joined task's waiters", T.async(function()
    local gate, joining = task.semaphore(0), false
    local slow = task.spawn(function() gate:acquire() return 1 end) -- finishes only when let go
    local j = task.spawn(function()
      joining = true
      return task.join(slow)
    end)
    while not joining do task.yield() end -- j now waits in join: slow cannot have finished
    task.cancel(j)
    assert.is_false((pcall(task.join, j)))
    gate:release()
    assert.are.equal(1, task.join(slow))
  end))
end)

describe("task.timeout", function()
  it("raises a timeout error when the budget runs out", T.async(function()
    local ok, err = pcall(task.timeout, 0.02, function() task.sleep(5) end)
    assert.is_false(ok)
    assert.is_true(task.is_timeout(err)) -- the body, had it run out its sleep, would return
  end))

  it("inside another timeout gets the smaller budget", T.async(function()
    local inner_budget
    local ok, err = pcall(task.timeout, 0.05, function()
      return task.timeout(10, function()
        inner_budget = task.remaining()
        task.sleep(5)
      end)
    end)
    assert.is_false(ok)
    assert.is_true(task.is_timeout(err))
    assert.is_true(inner_budget <= 0.05)
    assert.are.equal(0.05, err.seconds) -- the outer timeout is the one that expired
  end))

  it("inner expiry is raised by the inner timeout and can be handled inside the outer",
    T.async(function()
      local r = task.timeout(5, function()
        local ok, err = pcall(task.timeout, 0.01, function() task.sleep(5) end)
        assert.is_false(ok)
        assert.are.equal(0.01, err.seconds)
        task.sleep(0.001) -- the outer budget still allows waiting
        return "outer fine"
      end)
      assert.are.equal("outer fine", r)
      assert.is_nil(task.remaining())
    end))

  it("lets closers wait while unwinding from an expired deadline", T.async(function()
    local closed = false
    local ok = pcall(task.timeout, 0.01, function()
      local _g <close> = closer(function()
        task.sleep(0.01)
        closed = true
      end)
      task.sleep(5)
    end)
    assert.is_false(ok)
    assert.is_true(closed)
  end))

  it("returns the function's results when it finishes in time", T.async(function()
    assert.are.same({ 1, 2 }, { task.timeout(1, function() return 1, 2 end) })
  end))
end)

describe("task.scope", function()
  it("cancels the siblings on the first failure and re-raises that error", T.async(function()
    local cancelled = {}
    local ok, err = pcall(task.scope, function(s)
      for i = 1, 3 do
        s:spawn(function()
          local _g <close> = closer(function() cancelled[#cancelled + 1] = i end)
          task.sleep(10)
        end)
      end
      s:spawn(function()
        task.sleep(0.005)
        error("the original failure")
      end)
      task.sleep(10) -- the body is cancelled too
    end)
    assert.is_false(ok)
    assert.matches("the original failure", err)
    table.sort(cancelled)
    assert.are.same({ 1, 2, 3 }, cancelled)
  end))

  it("waits for every child before returning", T.async(function()
    local done = 0
    local r = task.scope(function(s)
      for i = 1, 5 do
        s:spawn(function() task.sleep(0.001 * i) done = done + 1 end)
      end
      return "body"
    end)
    assert.are.equal("body", r)
    assert.are.equal(5, done)
  end))

  it("re-raises a failure of the body after cancelling the children", T.async(function()
    local child_unwound = false
    local ok, err = pcall(task.scope, function(s)
      s:spawn(function()
        local _g <close> = closer(function() child_unwound = true end)
        task.sleep(10)
      end)
      task.sleep(0.001)
      error({ code = "body failed" })
    end)
    assert.is_false(ok)
    assert.are.equal("body failed", err.code)
    assert.is_true(child_unwound)
  end))
end)

describe("combinators", function()
  it("all_settled never loses a result", T.async(function()
    local items = {}
    for i = 1, 20 do
      items[i] = function()
        task.sleep(0.0005 * (20 - i))
        if i % 3 == 0 then error("fail " .. i, 0) end
        return i
      end
    end
    local out = task.all_settled(items)
    assert.are.equal(20, #out)
    for i = 1, 20 do
      if i % 3 == 0 then
        assert.is_false(out[i].ok)
        assert.are.equal("fail " .. i, out[i].error)
      else
        assert.is_true(out[i].ok)
        assert.are.equal(i, out[i].value)
      end
    end
  end))

  it("map never exceeds its concurrency and keeps order", T.async(function()
    local live, peak = 0, 0
    local items = {}
    for i = 1, 40 do items[i] = i end
    local out = task.map(items, function(v)
      live = live + 1
      if live > peak then peak = live end
      task.sleep(0.001 * (v % 4))
      live = live - 1
      return v * 10
    end, { concurrency = 5 })
    assert.are.equal(5, peak)
    for i = 1, 40 do assert.are.equal(i * 10, out[i]) end
  end))

  it("map raises the first failure and cancels the rest", T.async(function()
    local started = 0
    local items = {}
    for i = 1, 100 do items[i] = i end
    local ok, err = pcall(task.map, items, function(v)
      started = started + 1
      if v == 3 then error("item 3 broke", 0) end
      task.sleep(1)
    end, 4)
    assert.is_false(ok)
    assert.are.equal("item 3 broke", err)
    assert.is_true(started < 100)
  end))

  it("all returns first results in order and fails fast", T.async(function()
    local r = task.all({ function() return "a" end, function() task.sleep(0.001) return "b" end })
    assert.are.same({ "a", "b" }, r)
    local ok, err = pcall(task.all, { function() task.sleep(1) end, function() error("x", 0) end })
    assert.is_false(ok)
    assert.are.equal("x", err)
  end))

  it("race returns the first to finish and cancels the others", T.async(function()
    local slow_unwound = false
    local v, i = task.race({
      function()
        local _g <close> = closer(function() slow_unwound = true end)
        task.sleep(5)
      end,
      function() task.sleep(0.002) return "fast" end,
    })
    assert.are.equal("fast", v)
    assert.are.equal(2, i)
    assert.is_true(slow_unwound)
  end))

  it("semaphore serves waiters first come first served and bounds holders", T.async(function()
    local sem = task.semaphore(2)
    local holders, peak, order = 0, 0, {}
    local ts = {}
    for i = 1, 6 do
      ts[i] = task.spawn(function()
        sem:with(function()
          order[#order + 1] = i
          holders = holders + 1
          if holders > peak then peak = holders end
          task.sleep(0.002)
          holders = holders - 1
        end)
      end)
    end
    for _, t in ipairs(ts) do task.join(t) end
    assert.are.equal(2, peak)
    assert.are.same({ 1, 2, 3, 4, 5, 6 }, order)
  end))

  it("semaphore does not lose a permit when a waiter is cancelled", T.async(function()
    local sem = task.semaphore(1)
    sem:acquire()
    local w = task.spawn(function() sem:acquire() end)
    task.sleep(0.001)
    task.cancel(w)
    pcall(task.join, w)
    sem:release()
    sem:acquire() -- must not block
    sem:release()
    assert.are.equal(1, sem.permits)
  end))
end)

describe("yielding from places that cannot yield", function()
  it("names the unsupported places instead of Lua's generic message", T.async(function()
    local ok, err = pcall(table.sort, { 3, 1, 2 }, function(a, b)
      task.sleep(0)
      return a < b
    end)
    assert.is_false(ok)
    assert.matches("task.sleep cannot wait here", err)
    assert.matches("table.sort comparators", err)
    assert.not_matches("attempt to yield across a C%-call boundary", err)
  end))

  it("says so when called outside any task", function()
    local ok, err = pcall(task.sleep, 0)
    assert.is_false(ok)
    assert.matches("not inside a task", err)
  end)

  it("says so inside a raw coroutine", T.async(function()
    local co = coroutine.wrap(function() return pcall(task.sleep, 0) end)
    local ok, err = co()
    assert.is_false(ok)
    assert.matches("coroutine.create/wrap", err)
  end))
end)

describe("tracebacks", function()
  it("name the failing line and the parent task", T.async(function()
    local child
    local parent = task.spawn(function()
      child = task.spawn(function()
        task.sleep(0.001)
        error("deep failure") -- the failing line
      end)
      return task.join(child)
    end)
    local ok = pcall(task.join, parent)
    assert.is_false(ok)
    local tb = core.traceback(child)
    assert.matches("task_spec.lua:%d+: deep failure", tb)
    local chain = core.data(child).chain
    assert.matches("task %d+ spawned at .*task_spec.lua:%d+ by", chain)
    assert.matches("task " .. parent.id .. " spawned at", chain)
  end))

  it("survive a re-raise through join to the parent", T.async(function()
    local t = task.spawn(function()
      local inner = task.spawn(function() error("from inner", 0) end)
      task.join(inner)
    end)
    pcall(task.join, t)
    local tb = core.traceback(t)
    assert.matches("from inner", tb)
    assert.matches("in task %d+ spawned at", tb)
  end))
end)

describe("registry references", function()
  it("are all released when tasks finish", T.async(function()
    local before = T.refs()
    local ts = {}
    for i = 1, 50 do ts[i] = task.spawn(function() task.sleep(0.001) end) end
    for _, t in ipairs(ts) do task.join(t) end
    assert.are.equal(before, T.refs())
  end))
end)

describe("task context", function()
  it("is inherited at spawn, copied on write, and outlives the parent", T.async(function()
    assert.is_nil(task.context("k"))
    local grandchild_saw
    local parent = task.spawn(function()
      task.set_context("k", "run-1")
      local child = task.spawn(function()
        task.sleep(0.01)
        -- spawned after its parent set the key; the parent's later change does not reach it
        assert.are.equal("run-1", task.context("k"))
        task.set_context("k2", "child-only")
        return task.spawn(function()
          task.sleep(0.02) -- runs after its parent (and grandparent) finished
          grandchild_saw = { task.context("k"), task.context("k2") }
        end)
      end)
      task.set_context("k", "run-2")
      assert.is_nil(task.context("k2"))
      return child
    end)
    local child = task.join(parent)
    local grandchild = task.join(child)
    task.join(grandchild)
    assert.are.same({ "run-1", "child-only" }, grandchild_saw)
    assert.are.equal("run-2", task.context("k", parent))
    assert.is_nil(task.context("k")) -- the test's own task never had it
  end))
end)
