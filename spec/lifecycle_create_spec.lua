-- Nothing left running, ever (issue 12): a create that is cancelled or fails at any point — in
-- flight, while waiting for `running`, or because that wait fails — terminates the sandbox it
-- made, and the ledger releases it. Each repro runs 20 times as `moonbox run` against a real
-- `moonbox local` with injected faults; after every run the backend lists 0 sandboxes without
-- any reap, and `moonbox ps` shows nothing held.
local T = require "moonbox.testing"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"

local B, home

local TIMES = runs.TIMES

setup(T.async(function()
  B = L.start()
  home = runs.home(B)
end))

teardown(T.async(function()
  if home then home:destroy() end
  if B then B:destroy() end
end))

local function faults(spec)
  local status = B:req("PUT", "/_moonbox/faults", { body = spec })
  assert.are.equal(200, status)
end

-- Runs recipe `TIMES` times under the fault spec; after each run checks that the run failed as
-- the recipe says (message matched by `failure`), that nothing is left on the backend and that
-- the ledger holds nothing. Returns how many creates the backend answered over all runs.
local function repeat_run(recipe_text, fault_spec, failure)
  local recipe = home:recipe(recipe_text)
  local answered = 0
  for i = 1, TIMES do
    local mark = runs.last_seq(B)
    faults(fault_spec)
    local r = home:moonbox("run", recipe)
    faults("")
    local what = string.format("run %d of %d: %s", i, TIMES, r.stderr)
    assert.are.equal(1, r.code, what)
    assert.matches(failure, r.stderr)
    -- A client gone is no reason for the backend to stop: wait for what it still works on.
    runs.settled(B, mark)
    assert.are.same({}, runs.live(B), what)
    for _, e in ipairs(runs.journal(B, mark)) do
      if e.method == "POST" and e.path == "/v1/sandboxes" and e.status == 201 then answered = answered + 1 end
    end
    local ps = home:moonbox("ps")
    assert.are.equal(0, ps.code, ps.stderr)
    assert.is_nil(ps.stdout:find("holds", 1, true), ps.stdout)
  end
  return answered
end

describe("a create in a task.map whose sibling fails", function()
  it("terminates its sandbox when cancelled while it waits for running (" .. TIMES .. " runs)", T.async(function()
    local answered = repeat_run([[
local render = require "moonbox.render"
local task = require "moonbox.task"
task.map({ 1, 2, 3, 4 }, function(i)
  if i == 1 then task.sleep(0.15) error("x") end
  local sb <close> = render.sandboxes.create {}
end)
]], "GET /v1/sandboxes/*=latency:400", "recipe%-%d+%.lua:4: x")
    -- The repro made sandboxes (3 per run unless the machine is slow to send them): the
    -- terminations above were real.
    assert.is_true(answered >= TIMES, "creates answered: " .. answered)
  end))

  it("terminates its sandbox when cancelled while the create is in flight (" .. TIMES .. " runs)", T.async(function()
    -- The issue's repro: the sibling fails 10 ms in.
    repeat_run([[
local render = require "moonbox.render"
local task = require "moonbox.task"
task.map({ 1, 2, 3, 4 }, function(i)
  if i == 1 then task.sleep(0.01) error("x") end
  local sb <close> = render.sandboxes.create {}
end)
]], "GET /v1/sandboxes/*=latency:400", "recipe%-%d+%.lua:4: x")
    -- And with the create held in the backend, so that every cancellation meets it in flight.
    local answered = repeat_run([[
local render = require "moonbox.render"
local task = require "moonbox.task"
task.map({ 1, 2, 3, 4 }, function(i)
  if i == 1 then task.sleep(0.05) error("x") end
  local sb <close> = render.sandboxes.create {}
end)
]], "POST /v1/sandboxes=latency:300", "recipe%-%d+%.lua:4: x")
    assert.is_true(answered >= TIMES, "creates answered: " .. answered)
  end))

  it("terminates its sandbox when the wait for running fails (" .. TIMES .. " runs)", T.async(function()
    local answered = repeat_run([[
local render = require "moonbox.render"
local task = require "moonbox.task"
task.map({ 1, 2, 3, 4 }, function()
  local sb <close> = render.sandboxes.create {}
end)
]], "GET /v1/sandboxes/*=400", "recipe%-%d+%.lua:4: sandboxes.get: injected fault")
    assert.is_true(answered >= TIMES, "creates answered: " .. answered)
  end))
end)
