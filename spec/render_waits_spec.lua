-- Waits that wake on the event (moonbox.render.sandbox wait_running, moonbox.render.snapshots
-- wait_available) against a real `moonbox local`. Nothing here times anything: which requests
-- a wait made is read from the backend's journal, and a wait that only a far-away poll could end
-- is caught by a deadline far below that poll.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local render = require "moonbox.render"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"

local B

L.fixture(setup, teardown, function(b) B = b end)

-- The requests since journal mark `mark` whose method and path match.
local function requests(mark, method, path) return #runs.requests(B, mark, method, path) end

describe("sb:wait_running", function()
  it("returns on the lifecycle event while the first poll is a minute away", T.async(function()
    local sb <close> = render.sandboxes.create { wait = false }
    local mark = runs.last_seq(B)
    -- interval 60: the poll would first look at the deadline (60 s); the 20 s task.timeout
    -- fails this spec unless the log stream's lifecycle event ended the wait.
    task.timeout(20, sb.wait_running, sb, { interval = 60, timeout = 60 })
    assert.are.equal("running", sb.status)
    -- every wake re-reads the sandbox once: the replayed `creating` (maybe) and `running`
    local gets = requests(mark, "GET", "/v1/sandboxes/" .. sb.id)
    assert.is_true(gets >= 1 and gets <= 2, "GETs of the sandbox: " .. gets)
    assert.are.equal(1, requests(mark, "GET", "/v1/sandboxes/" .. sb.id .. "/logs"))
  end))

  for _, case in ipairs {
    { "cannot be had", "GET /v1/sandboxes/*/logs=503" },
    -- the stream's answer is held back far beyond the wait: only the poll can end it
    { "says nothing", "GET /v1/sandboxes/*/logs=latency:30000" },
  } do
    it("still ends by polling when the log stream " .. case[1], T.async(function()
      B:faults(case[2])
      local ok, sb = pcall(render.sandboxes.create, {})
      B:faults("")
      assert.is_true(ok, tostring(sb))
      assert.are.equal("running", sb.status)
      sb:terminate()
    end))
  end

  it("raises sandbox_not_running on the terminated event", T.async(function()
    local sb = render.sandboxes.create { wait = false }
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
    local ok, err = pcall(task.timeout, 20, sb.wait_running, sb, { interval = 60, timeout = 60 })
    assert.is_false(ok)
    assert.are.equal("sandbox_not_running", err.code, tostring(err))
  end))
end)

describe("snap:wait_available", function()
  it("first looks at the capture time it learned from the previous capture", T.async(function()
    local sb <close> = render.sandboxes.create {}
    -- 150 MB to copy: a capture of a few tenths of a second, which a poll from 0.1 s doubling
    -- (0.1, 0.3, 0.7 s) sees on its second or third GET.
    sb:exec("head -c 150000000 /dev/zero > /root/fill"):check()
    -- The first capture's answer is held back 2.5 s, so the time learned from it (request to
    -- available, as this process saw it) is at least that.
    B:faults("POST /v1/sandboxes/*/snapshots=latency:2500")
    local first = sb:snapshot {}
    B:faults("")
    local learned = require("moonbox.render.snapshots").learned_capture_seconds()
    assert.is_true(learned >= 2.5, "learned " .. tostring(learned))
    -- The second wait's first look comes at 90% of the learned time, after the capture has
    -- ended: one GET finds it available.
    local mark = runs.last_seq(B)
    local second = sb:snapshot {}
    assert.are.equal("available", second.status)
    local path = "/v1/sandbox-groups/" .. second.sandbox_group_id .. "/snapshots/" .. second.id
    assert.are.equal(1, requests(mark, "GET", path))
    first:delete()
    second:delete()
  end))
end)
