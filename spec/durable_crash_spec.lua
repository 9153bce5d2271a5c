-- Durable runs survive a SIGKILL anywhere (issue 25, the first "Done when";
-- docs/reference/durable.md): the six-step recipe spec/recipes/durable_six_steps.lua (restore
-- three sandboxes from a snapshot, exec in each, upload, capture, restore and verify, clean up)
-- is run once uncrashed, to learn how many journal writes a run makes
-- (MOONBOX_DURABLE_WRITES_FILE), then SIGKILLed at 30 seeded writes spread over the whole run
-- (MOONBOX_DURABLE_CRASH_AT: the process kills itself right after that write) and each time
-- finished by `moonbox run --resume`. Over the 30: every exec ran exactly once (its sandbox's
-- counter file) but those the resume reported `unknown_outcome` (0 or 1); the backend's request
-- journal shows every logical create (a label mb-<intent>-<run>) sent once and answered once; and
-- nothing is left: no live sandbox on the backend, nothing held and no run shown by `moonbox ps`,
-- and the run has ended (a second resume is refused). Besides, a resume whose first live calls
-- are a fleet's concurrent terminates must not find their sandboxes lost.
--
-- Seeded: the seed and every crash point are printed, and every failure names the seed and the
-- point; MOONBOX_SPEC_SEED=S replays seed S.
local T = require "moonbox.testing"
local json = require "moonbox.json"
local runs = require "spec.support.runs"
local D = require "spec.support.durable"
local S = require "spec.support.store_env"

local POINTS = 30
local SEED = D.seed("durable_crash_spec")
local RECIPE = (debug.getinfo(1, "S").source:match("^@(.*/)") or "./") .. "recipes/durable_six_steps.lua"
if RECIPE:sub(1, 1) ~= "/" then RECIPE = require("moonbox.sys").getcwd() .. "/" .. RECIPE end

local B, home, snapshot

runs.fixture(setup, teardown, function(b, h) B, home = b, h end)
setup(T.async(function()
  snapshot = D.base_snapshot(B, "durable-crash-base")
end))
teardown(T.async(function()
  S.shutdown()
end))

-- What a finished run printed: the fleet's ids, the unknown_outcome lines {i = id}, the final
-- line's fields (nil when there is none).
local function parse(stdout)
  local out = { ids = {}, unknown = {} }
  for line in stdout:gmatch("[^\n]+") do
    local i, id = line:match("^sandbox (%d+): (sbx%-%w+)$")
    if i then out.ids[tonumber(i)] = id end
    i, id = line:match("^unknown_outcome: exec (%d+) in (%S+)$")
    if i then out.unknown[tonumber(i)] = id end
    local counts, unknown, verify = line:match("^six steps done: counts=(%S+) unknown=(%S+) verify=(%d+) upload=ok$")
    if counts then
      out.counts = {}
      for c in counts:gmatch("%d+") do out.counts[#out.counts + 1] = tonumber(c) end
      out.reported = {}
      for u in unknown:gmatch("%d+") do out.reported[tonumber(u)] = true end
      out.verify = tonumber(verify)
    end
  end
  return out
end

-- Raises, naming what, unless a finished run's stdout says each of the three execs ran exactly
-- once, or (reported unknown_outcome, with the id of its sandbox) at most once.
local function check_counts(stdout, what)
  local p = parse(stdout)
  local function fail(why) error(what .. ": " .. why .. "\nstdout:\n" .. stdout, 3) end
  if not p.counts then fail("no final line") end
  if #p.counts ~= 3 then fail("not three counters") end
  for i = 1, 3 do
    if not p.ids[i] then fail("no id for sandbox " .. i) end
    local c = p.counts[i]
    if p.unknown[i] then
      if p.unknown[i] ~= p.ids[i] then fail("exec " .. i .. "'s unknown_outcome names " .. p.unknown[i]) end
      if not p.reported[i] then fail("exec " .. i .. " was unknown_outcome, not in the final line") end
      if c ~= 0 and c ~= 1 then fail(string.format("exec %d (unknown_outcome) ran %d times", i, c)) end
    else
      if p.reported[i] then fail("exec " .. i .. " reported unknown without its line") end
      if c ~= 1 then fail(string.format("exec %d in %s ran %d times, not once", i, p.ids[i], c)) end
    end
  end
  if p.verify ~= p.counts[1] then fail("the restored copy's counter differs from its source's") end
  return p
end

-- Raises, naming what, unless ledger run run_id's creates (nil: any run's) since backend seq mark
-- were four logical creates (three restored, one copy), each sent once and answered once.
local function check_creates(run_id, mark, what)
  local creates = D.creates(B, mark, run_id or "%d+")
  local labels = runs.keys(creates)
  if #labels ~= 4 then
    error(string.format("%s: %d logical creates of run %s, not 4: %s", what, #labels, run_id or "(any)",
      json.encode(creates)), 2)
  end
  for _, label in ipairs(labels) do
    local c = creates[label]
    if c.sent ~= 1 or c.answered ~= 1 then
      error(string.format("%s: the create %s of run %s was sent %d time(s), answered %d time(s)", what, label,
        run_id or "(any)", c.sent, c.answered), 2)
    end
  end
end

describe("a durable run", function()
  it("resumed into concurrent terminates does not call their sandboxes lost", T.async(function()
    -- The first call past the journal checks every sandbox the run holds (lost_sandbox); the
    -- fleet's other terminates go live meanwhile, and must not be sent before that check is done.
    local recipe = home:recipe(D.PRELUDE .. [[
local fleet <close> = render.restore(nil, { count = 10, concurrency = 10, network = "deny-all", lifetime = 600 })
task.step("all running", function() end) -- a write: what the waits read is journaled with it
die_if("before cleanup")
fleet:terminate()
print("terminated " .. #fleet)
]])
    local mark = runs.last_seq(B)
    local first = D.moonbox(home, { CRASH = "before cleanup" }, "run", "--durable", "--run-id", "terminates", recipe)
    assert(first.signal == "KILL", "the first attempt did not die at its die_if: " .. first.stderr)
    S.after_kill()
    local resumed = D.moonbox(home, {}, "run", "--resume", "terminates")
    assert(resumed.code == 0, "the resume exited " .. tostring(resumed.code) .. "\n" .. resumed.stderr)
    assert.are.equal("terminated 10\n", resumed.stdout)
    D.check_nothing_left(B, home, "after the resume", mark)
  end))

  it("SIGKILLed at any of 30 seeded journal writes is finished by its resume, each exec run once",
    T.async(function()
    -- the uncrashed run: how many journal writes a run makes
    local writes_file = home.dir .. "/writes"
    local mark = runs.last_seq(B)
    local r = D.moonbox(home, { MOONBOX_DURABLE_WRITES_FILE = writes_file }, "run", "--durable", "--run-id",
      "uncrashed", RECIPE, snapshot, "uncrashed")
    local what = string.format("seed %d, the uncrashed run", SEED)
    assert(r.code == 0, what .. ": exited " .. tostring(r.code) .. "\n" .. r.stdout .. r.stderr)
    local p = check_counts(r.stdout, what)
    assert(next(p.unknown) == nil, what .. ": an unknown_outcome without a crash:\n" .. r.stdout)
    local total = D.read_number(writes_file)
    assert(total and total >= POINTS, what .. ": made " .. tostring(total) .. " journal writes, fewer than " ..
      POINTS .. " crash points")
    check_creates(nil, mark, what)
    D.check_nothing_left(B, home, what, mark)

    local points = D.crash_points(SEED, total, POINTS)
    io.stderr:write(string.format("spec: durable_crash_spec: seed %d: %d journal writes a run; crash points %s\n",
      SEED, total, table.concat(points, " ")))
    local unknowns, ran = 0, 0
    for i, point in ipairs(points) do
      what = string.format("seed %d, crash point %d (%d of %d, of %d journal writes; all: %s)", SEED, point, i,
        POINTS, total, table.concat(points, " "))
      mark = runs.last_seq(B)
      local key = "crash-" .. i
      local first = D.moonbox(home, { MOONBOX_DURABLE_CRASH_AT = tostring(point) }, "run", "--durable", "--run-id",
        key, RECIPE, snapshot, "c" .. i)
      assert(first.signal == "KILL", what .. ": the first attempt did not die by SIGKILL (exit " ..
        tostring(first.code) .. ", signal " .. tostring(first.signal) .. ")\n" .. first.stderr)
      assert(first.stderr:find("MOONBOX_DURABLE_CRASH_AT=" .. point .. ": killed after writing", 1, true),
        what .. ": the first attempt died elsewhere:\n" .. first.stderr)
      S.after_kill()
      -- what the killed process had sent is finished by the backend before the resume looks
      local settled, serr = pcall(runs.settled, B, mark)
      assert(settled, what .. ": " .. tostring(serr))
      local resumed = D.moonbox(home, {}, "run", "--resume", key)
      local run_id = resumed.stderr:match("moonbox: resumed run (%d+) %(resume 1%)")
      assert(resumed.code == 0 and run_id, what .. ": the resume exited " .. tostring(resumed.code) .. "\n" ..
        resumed.stdout .. resumed.stderr)
      p = check_counts(resumed.stdout, what)
      for u in pairs(p.unknown) do
        unknowns = unknowns + 1
        ran = ran + p.counts[u]
      end
      check_creates(run_id, mark, what)
      D.check_nothing_left(B, home, what, mark)
      local again = D.moonbox(home, {}, "run", "--resume", key)
      assert(again.code == 1 and again.stderr:find("run " .. run_id .. " has ended (ok)", 1, true),
        what .. ": a second resume was not refused as ended: " .. tostring(again.code) .. "\n" .. again.stderr)
    end
    io.stderr:write(string.format("spec: durable_crash_spec: seed %d: %d exec(s) reported unknown_outcome over %d " ..
      "crashes (%d of them had run)\n", SEED, unknowns, POINTS, ran))
  end))
end)
