-- Durable runs (issue 25, docs/reference/durable.md): what a resume gives back besides Render
-- calls — task.step's results (a completed step is not run again, a step in flight at the crash
-- runs again), the clock and randomness the first attempt read, and task.map items journaled by
-- their index whichever worker ran them. Real `moonbox run --durable` processes, SIGKILLed by
-- the recipe itself at a known point, against a real `moonbox local`.
local T = require "moonbox.testing"
local runs = require "spec.support.runs"
local proc = require "moonbox.proc"
local read_file = require("moonbox.path").read_file
local S = require "spec.support.store_env"
local D = require "spec.support.durable"

local B, home

-- (ctest runs this spec twice: its journal in SQLite, then in PostgreSQL — spec_durable_steps_pg)
runs.fixture(setup, teardown, function(b, h) B, home = b, h end)
teardown(T.async(function()
  S.shutdown()
end))

local function argv_with(env, ...) return D.argv(home, env, ...) end

-- What every recipe here starts with: the host file the steps append to, and a way to die.
local PRELUDE = D.PRELUDE .. [[
local LOG = os.getenv("STEP_LOG")
local function note(s) local f = assert(io.open(LOG, "a")) f:write(s, "\n") f:close() end
]]

-- Runs recipe durably with CRASH=point (it must die), then resumes it; returns the resume's
-- result and the step log's lines.
local function crash_and_resume(recipe, point, log)
  local first = proc.run(argv_with({ CRASH = point, STEP_LOG = log }, "run", "--durable", recipe))
  assert.are.equal("KILL", first.signal, "the first attempt did not die at " .. point .. ": " .. first.stderr)
  S.after_kill() -- on PostgreSQL a run is dead once its lease has run out
  local ps = home:moonbox("ps")
  assert.matches("dead, resumable", ps.stdout)
  local id = ps.stdout:match("run (%d+) .-dead, resumable")
  local resumed = proc.run(argv_with({ STEP_LOG = log }, "run", "--resume", id))
  local lines = {}
  for l in (read_file(log) or ""):gmatch("[^\n]+") do lines[#lines + 1] = l end
  return resumed, lines, first
end

describe("durable runs", function()
  it("do not run a completed step again, and run again the step in flight at the crash", T.async(function()
    local log = home.dir .. "/steps.log"
    local recipe = home:recipe(PRELUDE .. [[
local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
local a = task.step("a", function() note("a") return { n = 1, list = { "x", "y" } }, "second" end)
local b = task.step("b", function() note("b") die_if("in b") return 2 end)
task.step("c", function() note("c") end)
print(a.n, a.list[2], b, select(2, task.step("again", function() return nil, "nil-then-value" end)))
]])
    local r, lines = crash_and_resume(recipe, "in b", log)
    assert.are.equal(0, r.code, r.stderr)
    -- a ran once (answered from the journal on resume), b twice (in flight), c once
    assert.are.same({ "a", "b", "b", "c" }, lines)
    assert.are.equal("1\ty\t2\tnil-then-value\n", r.stdout)
    assert.matches("resumed run %d+ %(resume 1%)", r.stderr)
    runs.check_clean(B, home, "after the resume", 0)
  end))

  it("read on resume the clock and randomness the first attempt read", T.async(function()
    local log = home.dir .. "/clock.log"
    local recipe = home:recipe(PRELUDE .. [[
local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
local seen = string.format("%.6f %d %s %.17g", task.now(), os.time(), os.date("!%H:%M:%S"), math.random())
sb:refresh()
task.step("note", function() note(seen) end) -- a side effect: in a step, after what it read is kept
die_if("after")
print(seen)
]])
    local r, lines = crash_and_resume(recipe, "after", log)
    assert.are.equal(0, r.code, r.stderr)
    -- the step ran once, before the crash; the resume read the same values again
    assert.are.equal(1, #lines, table.concat(lines, "\n"))
    assert.are.equal(lines[1] .. "\n", r.stdout)
  end))

  it("journal task.map's items by their index, whichever worker runs them", T.async(function()
    local log = home.dir .. "/map.log"
    local recipe = home:recipe(PRELUDE .. [[
local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
local out = task.map({ 5, 1, 4, 2, 3, 6 }, function(ms, i)
  task.sleep(ms / 1000) -- items finish in another order than they start
  sb:refresh()
  return task.step("item", function() note("item " .. i) return i * 10 end)
end, { concurrency = 3 })
die_if("after map")
print(table.concat(out, " "))
]])
    local r, lines = crash_and_resume(recipe, "after map", log)
    assert.are.equal(0, r.code, r.stderr)
    table.sort(lines)
    assert.are.same({ "item 1", "item 2", "item 3", "item 4", "item 5", "item 6" }, lines)
    assert.are.equal("10 20 30 40 50 60\n", r.stdout)
    assert.matches("0 in flight when it stopped, %d+ live", r.stderr)
  end))

  it("refuse a step whose results the journal cannot keep", T.async(function()
    local recipe = home:recipe(PRELUDE .. [[
task.step("fn", function() return function() end end)
]])
    local r = proc.run(argv_with({ STEP_LOG = home.dir .. "/x.log" }, "run", "--durable", recipe))
    assert.are.equal(1, r.code)
    assert.matches('task.step "fn": its results must be JSON values', r.stderr)
  end))
end)
