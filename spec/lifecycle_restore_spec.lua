-- Nothing left running, ever (issue 12), for the creates that moonbox makes on a recipe's
-- behalf: render.restore's fleet, render.snapshots.rebuild's builder, and a REPL session's
-- sandboxes — each cancelled while its creates are in flight or waiting for `running`, 20 times,
-- against a real `moonbox local` with injected latency. After every run the backend lists 0
-- sandboxes without any reap and `moonbox ps` shows nothing held.
local T = require "moonbox.testing"
local runs = require "spec.support.runs"
local proc = require "moonbox.proc"

local B, home

local TIMES = runs.TIMES

runs.fixture(setup, teardown, function(b, h) B, home = b, h end)

describe("render.restore cancelled midway", function()
  it("terminates every sandbox it made, in flight or booting (" .. TIMES .. " runs)", T.async(function()
    local recipe = home:recipe(runs.sibling_fails(2, 0.15,
      "local fleet <close> = render.restore(nil, { count = 6, concurrency = 3 })"))
    local answered = runs.repeat_failing(B, home, { times = TIMES, failure = "recipe%-%d+%.lua:4: x",
      faults = "GET /v1/sandboxes/*=latency:400;POST /v1/sandboxes=latency:50",
      run = function() return home:moonbox("run", recipe) end })
    assert.is_true(answered >= TIMES, "creates answered: " .. answered)
  end))
end)

describe("render.snapshots.rebuild cancelled while its builder boots", function()
  it("terminates the builder (" .. TIMES .. " runs)", T.async(function()
    local recipe = home:recipe(runs.sibling_fails(2, 0.15,
      'render.snapshots.rebuild("lifecycle", function(sb) sb:exec("true"):check() end)'))
    local answered = runs.repeat_failing(B, home, { times = TIMES, failure = "recipe%-%d+%.lua:4: x",
      faults = "GET /v1/sandboxes/*=latency:400", run = function() return home:moonbox("run", recipe) end })
    assert.is_true(answered >= TIMES // 2, "builders made: " .. answered)
  end))
end)

describe("a REPL chunk whose creates are cancelled", function()
  it("leaves nothing running once the chunk has failed (" .. TIMES .. " sessions)", T.async(function()
    local session = [[
task.map({ 1, 2, 3 }, function(i) if i == 1 then task.sleep(0.15) error("x") end local sb <close> = render.sandboxes.create {} end)
n = 0; for _ in render.sandboxes.list {} do n = n + 1 end; print("live after the chunk: " .. n)
]]
    local answered = runs.repeat_failing(B, home, { times = TIMES, label = "session", failure = "stdin:1: x",
      faults = "GET /v1/sandboxes/*=latency:400",
      run = function()
        local argv = home:argv({ "repl" })
        argv.input = session
        return proc.run(argv) -- exits 1: the failing chunk
      end,
      check = function(r, what)
        -- Counted by the session itself before it ended: not its exit-time cleanup's doing.
        assert.matches("live after the chunk: 0\n", r.stdout, 1, false, what)
      end })
    assert.is_true(answered >= TIMES, "creates answered: " .. answered)
  end))
end)
