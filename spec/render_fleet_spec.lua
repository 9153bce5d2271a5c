-- render.restore and moonbox.guard (issue 5's first part) against a real `moonbox local`:
-- policies, every create settling before cleanup, and cleanup errors never masking the error.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local render = require "moonbox.render"
local guard = require "moonbox.guard"
local L = require "spec.support.local_backend"

local B, snap

L.fixture(setup, teardown, function(b)
  B = b
  local base <close> = render.sandboxes.create {}
  base:exec("echo from-snapshot > /root/marker"):check()
  snap = base:snapshot { name = "fleet-base" }
end)

local function live() return B:live() end

describe("render.restore", function()
  it("restores count sandboxes, at most concurrency at a time, and terminates them on close", T.async(function()
    do
      local fleet <close> = render.restore(snap, { count = 4, concurrency = 2, network = "deny-all" })
      assert.are.equal(4, #fleet)
      local out = task.map(fleet, function(sb) return sb:exec("cat /root/marker"):check().stdout end)
      assert.are.same({ "from-snapshot\n", "from-snapshot\n", "from-snapshot\n", "from-snapshot\n" }, out)
      assert.are.equal(4, live())
    end
    assert.are.equal(0, live())
  end))

  it("all_or_nothing: one failed create terminates every sibling and lists each outcome", T.async(function()
    B:faults("POST /v1/sandboxes=503#1")
    local ok, err = pcall(render.restore, snap, { count = 3, concurrency = 3 })
    B:faults("")
    assert.is_false(ok)
    assert.are.equal("restore_failed", err.code)
    assert.are.equal(3, #err.outcomes)
    local failed, made = 0, 0
    for _, o in ipairs(err.outcomes) do
      if o.error then failed = failed + 1 else made = made + 1 end
    end
    assert.are.same({ 1, 2 }, { failed, made })
    assert.matches("1 of 3 restores failed", err.message)
    assert.matches("%(terminated%)", err.message)
    assert.are.equal(0, live())
  end))

  it("best_effort: returns what runs and lists the failures", T.async(function()
    B:faults("POST /v1/sandboxes=503#1")
    local fleet <close> = render.restore(snap, { count = 3, policy = "best_effort" })
    B:faults("")
    assert.are.equal(2, #fleet)
    assert.are.equal(1, #fleet.failures)
    assert.are.equal("server_error", fleet.failures[1].error.code)
  end))

  it("quorum: enough is a fleet, too few is an error with nothing left running", T.async(function()
    B:faults("POST /v1/sandboxes=503#1")
    local fleet = render.restore(snap, { count = 3, policy = { quorum = 2 } })
    assert.are.equal(2, #fleet)
    fleet:terminate()
    B:faults("POST /v1/sandboxes=503#1")
    local ok, err = pcall(render.restore, snap, { count = 3, policy = { quorum = 3 } })
    B:faults("")
    assert.is_false(ok)
    assert.are.equal("restore_failed", err.code)
    assert.matches("needed at least 3", err.message)
    assert.are.equal(0, live())
  end))

  it("terminates what it created when its task is cancelled midway", T.async(function()
    B:faults("POST /v1/sandboxes=latency:150")
    local t = task.spawn(function() return render.restore(snap, { count = 6, concurrency = 2 }) end)
    for _ = 1, 200 do
      if live() >= 2 then break end
      task.sleep(0.02)
    end
    task.cancel(t)
    local ok, err = pcall(task.join, t)
    B:faults("")
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err))
    assert.are.equal(0, live())
  end))

  it("finds the sandbox of a create whose answer was lost by its label, without sending it again",
    T.async(function()
      local _, before = B:req("GET", "/_moonbox/journal")
      local mark = before[#before].seq
      B:faults("POST /v1/sandboxes=drop#1")
      do
        local fleet <close> = render.restore(snap, { count = 2 })
        B:faults("")
        assert.are.equal(2, #fleet)
        assert.are.equal(2, live())
      end
      local _, entries = B:req("GET", "/_moonbox/journal", { query = { since = mark } })
      local posts, dropped = 0, 0
      for _, e in ipairs(entries) do
        if e.method == "POST" and e.path == "/v1/sandboxes" then
          posts = posts + 1
          if e.fault == "drop" then dropped = dropped + 1 end
        end
      end
      assert.are.same({ 2, 1 }, { posts, dropped })
      assert.are.equal(0, live())
    end))

  it("says when a lost create answer may have left a sandbox it could not find", T.async(function()
    -- The answer is lost and the listing that would find the label fails as well.
    B:faults("POST /v1/sandboxes=drop#1;GET /v1/sandboxes=400#1")
    local ok, err = pcall(render.restore, snap, { count = 2 })
    B:faults("")
    assert.is_false(ok)
    assert.matches("may exist without an id", err.message)
    assert.matches("looking for its label mb%-x%x+ failed too", err.message)
    assert.are.equal(1, live()) -- the lost one: a recipe run's ledger keeps it for moonbox reap
    for sb in render.sandboxes.list {} do sb:terminate() end
  end))
end)

describe("cleanup failures while unwinding", function()
  it("join the error beside what an inner guard attached: a fleet's failed terminate keeps both",
    T.async(function()
      local ok, err = pcall(function()
        local fleet <close> = render.restore(snap, { count = 1 }) -- luacheck: ignore 211
        local g <close> = guard.new("inner scope")
        g:defer(function() error("inner cleanup broke", 0) end, "inner cleanup")
        B:faults("POST /v1/sandboxes/*/terminate=500")
        error({ code = "original" })
      end)
      B:faults("")
      assert.is_false(ok)
      assert.are.equal("original", err.code)
      local labels = {}
      for _, c in ipairs(err.cleanup_errors or {}) do labels[#labels + 1] = c.label end
      table.sort(labels)
      assert.are.equal(2, #labels, table.concat(labels, ", "))
      assert.are.equal("inner cleanup", labels[1])
      assert.matches("^terminate sbx%-", labels[2])
      for sb in render.sandboxes.list {} do sb:terminate() end
    end))
end)

describe("moonbox.guard", function()
  it("runs deferred cleanups last first, and they may wait", T.async(function()
    local order = {}
    do
      local g <close> = guard.new("test")
      g:defer(function() task.sleep(0.01); order[#order + 1] = "first deferred" end)
      g:defer(function() order[#order + 1] = "second deferred" end)
    end
    assert.are.same({ "second deferred", "first deferred" }, order)
  end))

  it("never lets a cleanup error mask the original error", T.async(function()
    local ok, err = pcall(function()
      local g <close> = guard.new("masking test")
      g:defer(function() error("cleanup broke") end, "terminate sbx-x")
      error({ code = "original" })
    end)
    assert.is_false(ok)
    assert.are.equal("original", err.code)
    assert.are.equal(1, #err.cleanup_errors)
    assert.are.equal("terminate sbx-x", err.cleanup_errors[1].label)
    assert.matches("cleanup broke", tostring(err.cleanup_errors[1].error))
  end))

  it("raises cleanup_failed naming the failures when nothing else went wrong", T.async(function()
    local ok, err = pcall(function()
      local g <close> = guard.new("quiet scope")
      g:defer(function() error("no terminate for you", 0) end, "terminate sbx-y")
    end)
    assert.is_false(ok)
    assert.are.equal("cleanup_failed", err.code)
    assert.matches("terminate sbx%-y: no terminate for you", err.message)
  end))

  it("unwinds a fleet when its task is cancelled, terminating every member", T.async(function()
    local t = task.spawn(function()
      local _fleet <close> = render.restore(snap, { count = 3 })
      task.sleep(60)
    end)
    for _ = 1, 200 do
      if live() == 3 then break end
      task.sleep(0.05)
    end
    task.cancel(t)
    pcall(task.join, t)
    assert.are.equal(0, live())
  end))
end)

describe("SIGINT during a recipe", function()
  it("exits 130 after the recipe's guards terminated every sandbox", function()
    local recipe = os.tmpname()
    local f = assert(io.open(recipe, "w"))
    f:write(string.format([[
local render = require "moonbox.render"
render.connect { backend = %q, api_key = %q, workspace = %q }
local fleet <close> = render.restore(%q, { count = 3 })
io.stdout:write("ready\n"); io.stdout:flush()
require("moonbox.task").sleep(60)
]], B.url, B.key, B.workspace, snap.id))
    f:close()
    local out = os.tmpname()
    local script = string.format("%s run %s > %s 2>&1 & pid=$!; " ..
      "for i in $(seq 200); do grep -q ready %s && break; sleep 0.05; done; kill -INT $pid; wait $pid; exit $?",
      L.BIN, recipe, out, out)
    local _, how, code = os.execute("sh -c '" .. script .. "'")
    local text = assert(io.open(out)):read("a")
    assert.are.equal("exit", how, text)
    assert.are.equal(130, code, text)
    T.run(function() assert.are.equal(0, live()) end)
    os.remove(recipe)
    os.remove(out)
  end)
end)
