-- Nothing left running, ever (issue 12), for the creates that moonbox makes on a recipe's
-- behalf: render.restore's fleet, render.snapshots.rebuild's builder, and a REPL session's
-- sandboxes — each cancelled while its creates are in flight or waiting for `running`, 20 times,
-- against a real `moonbox local` with injected latency. After every run the backend lists 0
-- sandboxes without any reap and `moonbox ps` shows nothing held.
local T = require "moonbox.testing"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"
local proc = require "moonbox.proc"

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

local function check_clean(what, mark)
  runs.settled(B, mark)
  assert.are.same({}, runs.live(B), what)
  local ps = home:moonbox("ps")
  assert.are.equal(0, ps.code, ps.stderr)
  assert.is_nil(ps.stdout:find("holds", 1, true), ps.stdout)
end

-- The number of sandbox creates the backend answered after `mark`.
local function answered_since(mark)
  local n = 0
  for _, e in ipairs(runs.journal(B, mark)) do
    if e.method == "POST" and e.path == "/v1/sandboxes" and e.status == 201 then n = n + 1 end
  end
  return n
end

describe("render.restore cancelled midway", function()
  it("terminates every sandbox it made, in flight or booting (" .. TIMES .. " runs)", T.async(function()
    local recipe = home:recipe([[
local render = require "moonbox.render"
local task = require "moonbox.task"
task.map({ 1, 2 }, function(i)
  if i == 1 then task.sleep(0.15) error("x") end
  local fleet <close> = render.restore(nil, { count = 6, concurrency = 3 })
end)
]])
    local answered = 0
    for i = 1, TIMES do
      local mark = runs.last_seq(B)
      faults("GET /v1/sandboxes/*=latency:400;POST /v1/sandboxes=latency:50")
      local r = home:moonbox("run", recipe)
      faults("")
      assert.are.equal(1, r.code, r.stderr)
      assert.matches("recipe%-%d+%.lua:4: x", r.stderr)
      answered = answered + answered_since(mark)
      check_clean(string.format("run %d: %s", i, r.stderr), mark)
    end
    assert.is_true(answered >= TIMES, "creates answered: " .. answered)
  end))
end)

describe("render.snapshots.rebuild cancelled while its builder boots", function()
  it("terminates the builder (" .. TIMES .. " runs)", T.async(function()
    local recipe = home:recipe([[
local render = require "moonbox.render"
local task = require "moonbox.task"
task.map({ 1, 2 }, function(i)
  if i == 1 then task.sleep(0.15) error("x") end
  render.snapshots.rebuild("lifecycle", function(sb) sb:exec("true"):check() end)
end)
]])
    local answered = 0
    for i = 1, TIMES do
      local mark = runs.last_seq(B)
      faults("GET /v1/sandboxes/*=latency:400")
      local r = home:moonbox("run", recipe)
      faults("")
      assert.are.equal(1, r.code, r.stderr)
      assert.matches("recipe%-%d+%.lua:4: x", r.stderr)
      answered = answered + answered_since(mark)
      check_clean(string.format("run %d: %s", i, r.stderr), mark)
    end
    assert.is_true(answered >= TIMES // 2, "builders made: " .. answered)
  end))
end)

describe("a REPL chunk whose creates are cancelled", function()
  it("leaves nothing running once the chunk has failed (" .. TIMES .. " sessions)", T.async(function()
    local session = [[
task.map({ 1, 2, 3 }, function(i) if i == 1 then task.sleep(0.15) error("x") end local sb <close> = render.sandboxes.create {} end)
n = 0; for _ in render.sandboxes.list {} do n = n + 1 end; print("live after the chunk: " .. n)
]]
    local answered = 0
    for i = 1, TIMES do
      local mark = runs.last_seq(B)
      faults("GET /v1/sandboxes/*=latency:400")
      local argv = home:argv({ "repl" })
      argv.input = session
      local r = proc.run(argv)
      faults("")
      assert.are.equal(1, r.code, r.stdout .. r.stderr) -- the failing chunk
      assert.matches("stdin:1: x", r.stderr)
      -- Counted by the session itself before it ended: not its exit-time cleanup's doing.
      assert.matches("live after the chunk: 0\n", r.stdout)
      answered = answered + answered_since(mark)
      check_clean(string.format("session %d: %s", i, r.stderr), mark)
    end
    assert.is_true(answered >= TIMES, "creates answered: " .. answered)
  end))
end)
