-- Nothing left running, ever (issue 12): a create that is cancelled or fails at any point — in
-- flight, while waiting for `running`, or because that wait fails — terminates the sandbox it
-- made, and the ledger releases it. Each repro runs 20 times as `moonbox run` against a real
-- `moonbox local` with injected faults; after every run the backend lists 0 sandboxes without
-- any reap, and `moonbox ps` shows nothing held.
local T = require "moonbox.testing"
local runs = require "spec.support.runs"

local B, home

local TIMES = runs.TIMES

runs.fixture(setup, teardown, function(b, h) B, home = b, h end)

-- Runs recipe `TIMES` times under the fault spec; after each run checks that the run failed as
-- the recipe says (message matched by `failure`), that nothing is left on the backend and that
-- the ledger holds nothing. Returns how many creates the backend answered over all runs.
local function repeat_run(recipe_text, fault_spec, failure)
  local recipe = home:recipe(recipe_text)
  return runs.repeat_failing(B, home, { times = TIMES, faults = fault_spec, failure = failure,
    run = function() return home:moonbox("run", recipe) end })
end

local CREATE = "local sb <close> = render.sandboxes.create {}"

describe("a create in a task.map whose sibling fails", function()
  it("terminates its sandbox when cancelled while it waits for running (" .. TIMES .. " runs)", T.async(function()
    local answered = repeat_run(runs.sibling_fails(4, 0.15, CREATE), "GET /v1/sandboxes/*=latency:400", "recipe%-%d+%.lua:4: x")
    -- The repro made sandboxes (3 per run unless the machine is slow to send them): the
    -- terminations above were real.
    assert.is_true(answered >= TIMES, "creates answered: " .. answered)
  end))

  it("terminates its sandbox when cancelled while the create is in flight (" .. TIMES .. " runs)", T.async(function()
    -- The issue's repro: the sibling fails 10 ms in.
    repeat_run(runs.sibling_fails(4, 0.01, CREATE), "GET /v1/sandboxes/*=latency:400", "recipe%-%d+%.lua:4: x")
    -- And with the create held in the backend, so that every cancellation meets it in flight.
    local answered = repeat_run(runs.sibling_fails(4, 0.05, CREATE), "POST /v1/sandboxes=latency:300", "recipe%-%d+%.lua:4: x")
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
