-- Several `moonbox schedule` daemons on one PostgreSQL database (issue 14): a real server from
-- Debian's package, three daemons on one virtual timeline (MOONBOX_TEST_CLOCK with at=), a
-- fourth process reading `moonbox runs` / `moonbox ps`. Pinned: every slot is claimed by one
-- daemon and run at most once, none is lost; a daemon SIGKILLed in a run is found by another
-- through its expired lease, recorded interrupted and its sandbox terminated on a real
-- `moonbox local`, and the others keep firing; a restart of PostgreSQL crashes no daemon and
-- the missed slots are caught up as the policy says. Checks are on what was recorded and what
-- the run bodies wrote, never on how long anything took.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local task = require "moonbox.task"
local core = require "moonbox.core"
local clock = require "moonbox.schedule.clock"
local L = require "spec.support.local_backend"
local PG = require "spec.support.postgres"
local SE = require "spec.support.schedule_env"

local START = "2026-03-01T00:00:00Z"
local T0 = clock.parse_time(START)

local run = T.async
local server

setup(run(function() server = PG.start() end))
teardown(run(function() if server then server:destroy() end end))

-- A test's world: a temp dir with the recipe, a fresh database, the daemons it started.
local World = {}
World.__index = World

local function world(name, recipe, scale, backend)
  local dir = proc.run({ "mktemp", "-d", "/tmp/moonbox-shared-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  local f = assert(io.open(dir .. "/recipe.lua", "w"))
  f:write((recipe:gsub("DIR", dir)))
  f:close()
  local w = setmetatable({ dir = dir, recipe = dir .. "/recipe.lua", url = server:create_database(name),
    backend = backend, daemons = {}, changed = core.cond(),
    -- every daemon's virtual clock reads START at the same real moment
    clock = string.format("start=%s,scale=%g,at=%.6f", START, scale, core.time() + 0.5) }, World)
  return w
end

function World:env(i)
  local home = self.dir .. "/home" .. i
  local v = { "env", "HOME=" .. home, "XDG_STATE_HOME=" .. home .. "/state", "MOONBOX_DATABASE_URL=" .. self.url,
    "MOONBOX_TEST_CLOCK=" .. self.clock, "MOONBOX_LEASE_SECONDS=2" }
  local b = self.backend
  v[#v + 1] = "RENDER_API_KEY=" .. (b and b.key or "unused")
  v[#v + 1] = "RENDER_WORKSPACE_ID=" .. (b and b.workspace or "tea-none")
  v[#v + 1] = "RENDER_LOCAL_DEV_URL=" .. (b and b.url or "http://127.0.0.1:9")
  return v
end

--- world:daemon([args]) -> d: a running `moonbox schedule FILE [args]` whose log is read into
-- d.log. [yields]
function World:daemon(args)
  local i = #self.daemons + 1
  local argv = self:env(i)
  for _, a in ipairs { L.BIN, "schedule", self.recipe } do argv[#argv + 1] = a end
  for _, a in ipairs(args or {}) do argv[#argv + 1] = a end
  argv.stderr = "inherit"
  local d = { i = i, p = proc.spawn(argv), log = {} }
  local lines = d.p:lines("stdout")
  d.reader = task.spawn(function()
    for line in lines do
      d.log[#d.log + 1] = line
      self.changed:broadcast()
    end
    d.eof = true
    self.changed:broadcast()
  end)
  self.daemons[i] = d
  return d
end

--- world:wait(what, pred): waits until pred() is true, re-checked whenever a daemon logs. [yields]
function World:wait(what, pred)
  task.timeout(90, function()
    while not pred() do self.changed:wait() end
  end)
  return what
end

--- world:count(pattern [, d]) -> log lines matching pattern (of daemon d, or of all).
function World:count(pattern, only)
  local n = 0
  for _, d in ipairs(self.daemons) do
    if not only or d == only then
      for _, l in ipairs(d.log) do if l:match(pattern) then n = n + 1 end end
    end
  end
  return n
end

function World.stop(_, d, sig)
  d.p:kill(sig or "TERM")
  local code = d.p:wait()
  pcall(task.join, d.reader)
  return code
end

--- world:moonbox(args) -> proc.run of a fourth process on the same database. [yields]
function World:moonbox(args)
  local argv = self:env(0)
  argv[#argv + 1] = L.BIN
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  return proc.run(argv)
end

function World:runs()
  return SE.history(function(args) return self:moonbox(args) end)
end

--- The slots the run bodies wrote to DIR/marks, slot -> how many times.
function World:marks()
  local seen = {}
  local f = io.open(self.dir .. "/marks")
  if not f then return seen end
  for l in f:lines() do
    local slot = tonumber(l:match("^slot (%S+)"))
    seen[slot] = (seen[slot] or 0) + 1
  end
  f:close()
  return seen
end

function World:destroy()
  for _, d in ipairs(self.daemons) do
    if not d.eof then pcall(self.stop, self, d, "KILL") end
  end
  proc.run { "rm", "-rf", self.dir }
end

-- Every slot between the first and the last record has exactly one record; no run body ran a
-- slot twice, and each slot recorded ok was run exactly once.
local function exactly_once(w, rows, interval)
  local by_slot, first, last = {}, math.huge, -math.huge
  for _, r in ipairs(rows) do
    assert.is_nil(by_slot[r.slot_unix], "slot " .. r.slot .. " has two records")
    by_slot[r.slot_unix] = r
    first, last = math.min(first, r.slot_unix), math.max(last, r.slot_unix)
  end
  for t = first, last, interval do
    assert.is_not_nil(by_slot[t], "slot " .. clock.format(t) .. " has no record (lost)")
  end
  local marks, ran = w:marks(), 0
  for slot, n in pairs(marks) do
    assert.are.equal(1, n, "slot " .. clock.format(slot) .. " ran " .. n .. " times")
    ran = ran + 1
  end
  for t, r in pairs(by_slot) do
    if r.outcome == "ok" then assert.are.equal(1, marks[t], "slot " .. r.slot .. " recorded ok but not run") end
  end
  return ran, first, last
end

local TICK = [[
local schedule = require "moonbox.schedule"
schedule.every("tick", "1s", function(run)
  local f = assert(io.open("DIR/marks", "a"))
  f:write(string.format("slot %.3f\n", run.slot))
  f:close()
end)
]]

describe("three moonbox schedule daemons on one PostgreSQL database", function()
  local w
  after_each(run(function() if w then w:destroy() end w = nil end))

  it("fire each of 200 every-second slots exactly once, none lost", T.async(function()
    w = world("three", TICK, 40)
    for _ = 1, 3 do w:daemon() end
    local goal = clock.format(T0 + 200):gsub("%-", "%%-")
    w:wait("slot 200", function() return w:count("slot " .. goal) > 0 end)
    for _, d in ipairs(w.daemons) do assert.are.equal(0, w:stop(d), table.concat(d.log, "\n")) end
    local rows = w:runs()
    local ran, first, last = exactly_once(w, rows, 1)
    assert.is_true(last - first >= 200, "recorded from " .. clock.format(first) .. " to " .. clock.format(last))
    assert.is_true(ran > 0)
    -- every daemon took part in claiming: each logged slots it found already recorded
    for _, d in ipairs(w.daemons) do
      assert.is_true(w:count("was claimed by another daemon", d) + w:count("run %d+ started", d) > 0)
    end
  end))

  it("survive a restart of PostgreSQL: none crashes, none runs a slot twice, the outage is caught up",
    T.async(function()
      w = world("restart", TICK, 40)
      for _ = 1, 3 do w:daemon() end
      w:wait("30 runs", function() return w:count("run %d+ ok") >= 30 end)
      server:restart("fast")
      w:wait("all back", function() return w:count("the database is back") >= 3 end)
      local after = w:count("run %d+ ok")
      w:wait("30 more runs", function() return w:count("run %d+ ok") >= after + 30 end)
      for _, d in ipairs(w.daemons) do
        assert.are.equal(0, w:stop(d), table.concat(d.log, "\n"))
        assert.is_true(w:count("the database is unavailable", d) >= 1)
      end
      local rows = w:runs()
      exactly_once(w, rows, 1)
      -- the slots that passed while it was away: the latest inside the window ran as catch-up,
      -- the others were recorded skipped, coalesced into it
      local caught, coalesced = 0, 0
      for _, r in ipairs(rows) do
        if r.trigger == "catchup" then caught = caught + 1 end
        if r.outcome == "skipped" and (r.error or ""):match("^the database was unavailable; coalesced") then
          coalesced = coalesced + 1
        end
      end
      assert.is_true(caught >= 1, "no catch-up run")
      assert.is_true(coalesced >= 1, "no slot recorded as coalesced into the catch-up")
    end))
end)

describe("a daemon started while PostgreSQL is down", function()
  local w
  after_each(run(function()
    if not server.running then server:start_server() end
    if w then w:destroy() end
    w = nil
  end))

  it("waits for it, then fires; a one-shot command fails at once", T.async(function()
    w = world("late", TICK, 40)
    server:stop_server("fast")
    local d = w:daemon()
    w:wait("waiting", function() return w:count("not starting until it answers") > 0 end)
    local r = w:moonbox { "schedule", w.recipe, "--list" }
    assert.are.equal(1, r.code)
    assert.matches("^moonbox schedule: the database postgresql:///late%?.- is unavailable", r.stderr)
    server:start_server()
    w:wait("3 runs", function() return w:count("tick: run %d+ ok") >= 3 end)
    assert.are.equal(0, w:stop(d), table.concat(d.log, "\n"))
  end))
end)

describe("the one-shot modes on a shared database", function()
  local w
  after_each(run(function() if w then w:destroy() end w = nil end))

  it("--pause, --resume and --trigger from a fourth process act on every daemon", T.async(function()
    w = world("modes", TICK, 40)
    for _ = 1, 2 do w:daemon() end
    w:wait("5 runs", function() return w:count("tick: run %d+ ok") >= 5 end)
    local r = w:moonbox { "schedule", w.recipe, "--pause", "tick" }
    assert.are.equal(0, r.code, r.stderr)
    w:wait("both skip", function()
      for _, d in ipairs(w.daemons) do
        if w:count("passed while paused", d) == 0 then return false end
      end
      return true
    end)
    r = w:moonbox { "schedule", w.recipe, "--list" }
    assert.are.equal(0, r.code, r.stderr)
    assert.matches("tick%s+every 1s%s+%- %(paused%)", r.stdout)
    r = w:moonbox { "schedule", w.recipe, "--trigger", "tick" }
    assert.are.equal(0, r.code, r.stderr)
    r = w:moonbox { "schedule", w.recipe, "--resume", "tick" }
    assert.are.equal(0, r.code, r.stderr)
    local oks = w:count("tick: run %d+ ok")
    w:wait("5 more runs", function() return w:count("tick: run %d+ ok") >= oks + 5 end)
    for _, d in ipairs(w.daemons) do assert.are.equal(0, w:stop(d), table.concat(d.log, "\n")) end
    local rows = w:runs()
    local manual = 0
    for _, x in ipairs(rows) do
      if x.trigger == "manual" then
        manual = manual + 1
        assert.are.equal("ok", x.outcome)
      end
    end
    assert.are.equal(1, manual)
    -- slots that pass while paused are not recorded: no slot twice, none run twice
    local seen = {}
    for _, x in ipairs(rows) do
      if x.trigger ~= "manual" then
        assert.is_nil(seen[x.slot_unix], "slot " .. x.slot .. " has two records")
        seen[x.slot_unix] = true
      end
    end
    for slot, n in pairs(w:marks()) do assert.are.equal(1, n, "slot " .. slot .. " ran " .. n .. " times") end
  end))

  it("never shows the database password in an error", T.async(function()
    w = world("secret", TICK, 40)
    local r = w:moonbox { "runs", "--state", "postgres://moonbox:s3cr3t-pw@127.0.0.1:1/x" }
    assert.are.equal(1, r.code)
    assert.matches("postgres://moonbox:%*%*%*@127%.0%.0%.1:1/x is unavailable", r.stderr)
    assert.is_nil((r.stdout .. r.stderr):find("s3cr3t", 1, true))
  end))
end)

describe("a daemon SIGKILLed during a run, with two others on the same database", function()
  local B, w
  SE.with_backend(setup, teardown, function(b) B = b end, function() return w end)

  it("is recorded interrupted by another, its sandbox terminated, and the next slots fire", T.async(function()
    w = world("kill", [[
local schedule = require "moonbox.schedule"
local render = require "moonbox.render"
local task = require "moonbox.task"
schedule.every("k", "10s", function(run)
  -- <close>: a run cancelled by the daemons' SIGTERM at the end still terminates its sandbox
  local sb <close> = render.sandboxes.create { network = "deny-all" }
  local held = io.open("DIR/held")
  if held then return held:close() end
  assert(io.open("DIR/held", "w")):close()
  print(string.format("HELD %s by %d", sb.id, require("moonbox.ledger").self_pid())) io.stdout:flush()
  task.sleep(600) -- until its daemon is SIGKILLed: nothing unwinds, the ledger keeps the sandbox
end)
]], 10, B)
    for _ = 1, 3 do w:daemon() end
    local id, pid
    w:wait("a held sandbox", function()
      for _, d in ipairs(w.daemons) do
        for _, l in ipairs(d.log) do
          id, pid = l:match("^HELD (sbx%-%S+) by (%d+)")
          if id then return true end
        end
      end
    end)
    local victim
    for _, d in ipairs(w.daemons) do if d.p.pid == tonumber(pid) then victim = d end end
    assert.is_not_nil(victim, "no daemon has pid " .. pid)
    -- a fourth process sees the run, alive, holding the sandbox
    local ps = w:moonbox { "ps" }
    assert.are.equal(0, ps.code, ps.stderr)
    assert.matches("alive.-holds " .. id:gsub("%-", "%%-"), ps.stdout)
    w:stop(victim, "KILL")
    local esc = id:gsub("%-", "%%-")
    w:wait("reaped", function() return w:count("reap: run %d+: terminated " .. esc) == 1 end)
    local oks = w:count("k: run %d+ ok")
    w:wait("two more runs", function() return w:count("k: run %d+ ok") >= oks + 2 end)
    for _, d in ipairs(w.daemons) do
      if d ~= victim then assert.are.equal(0, w:stop(d), table.concat(d.log, "\n")) end
    end
    assert.are.equal(0, B:live())
    local rows = w:runs()
    local interrupted = {}
    local seen = {}
    for _, r in ipairs(rows) do
      assert.is_nil(seen[r.slot_unix], "slot " .. r.slot .. " has two records")
      seen[r.slot_unix] = true
      if r.outcome == "interrupted" then interrupted[#interrupted + 1] = r end
    end
    assert.are.equal(1, #interrupted)
    assert.are.same({ id }, interrupted[1].sandboxes)
    assert.matches("lease expired", interrupted[1].error)
    local after = 0
    for _, r in ipairs(rows) do
      if r.outcome == "ok" and r.slot_unix > interrupted[1].slot_unix then after = after + 1 end
    end
    assert.is_true(after >= 2)
    ps = w:moonbox { "ps" }
    assert.are.equal(0, ps.code, ps.stderr)
    assert.is_nil(ps.stdout:find("holds", 1, true), ps.stdout)
  end))
end)

--- world:background(args) -> t: a fourth process run in a task; task.join(t) -> its proc.run
-- result. [yields when joined]
function World:background(args)
  return task.spawn(function() return self:moonbox(args) end)
end

--- The lines of daemon d's log after the first one matching pattern (nil when none matches).
local function after_line(d, pattern)
  for i, l in ipairs(d.log) do
    if l:match(pattern) then return { table.unpack(d.log, i + 1) } end
  end
end

-- The first run holds until DIR/release exists (or its task is cancelled); the others return.
local HOLD = [[
local schedule = require "moonbox.schedule"
local task = require "moonbox.task"
schedule.every("h", "1s", function(run)
  if io.open("DIR/held") then return end
  assert(io.open("DIR/held", "w")):close()
  print(string.format("HELD run %d", run.id)) io.stdout:flush()
  while not io.open("DIR/release") do task.sleep(0.05) end
  assert(io.open("DIR/released", "w")):close()
end)
]]

describe("moonbox schedule FILE --stop from a fourth process", function()
  local w
  after_each(run(function() if w then w:destroy() end w = nil end))

  local function held_run(w_)
    local id
    w_:wait("a held run", function()
      for _, d in ipairs(w_.daemons) do
        for _, l in ipairs(d.log) do
          id = id or tonumber(l:match("^HELD run (%d+)"))
        end
      end
      return id ~= nil
    end)
    return id
  end

  it("--drain: every daemon stops firing, the run in progress finishes ok, all exit 0; a daemon " ..
    "started after the request is not stopped by it", T.async(function()
    w = world("drain", HOLD, 10)
    for _ = 1, 3 do w:daemon() end
    local id = held_run(w)
    local stop = w:background { "schedule", w.recipe, "--stop", "--drain", "--timeout", "60" }
    w:wait("all acknowledged", function() return w:count("request from .*: acknowledged") == 3 end)
    local late = w:daemon() -- after the request: it must not be stopped by it
    w:wait("late one started", function() return w:count("^%S+ started: ", late) == 1 end)
    assert(io.open(w.dir .. "/release", "w")):close()
    local r = task.join(stop)
    assert.are.equal(0, r.code, r.stdout .. r.stderr)
    assert.matches("asked 3 daemon%(s%) to stop after their runs in progress", r.stdout)
    assert.matches("3 of 3 daemon%(s%) acknowledged, 3 stopped", r.stdout)
    for i = 1, 3 do
      local d = w.daemons[i]
      assert.are.equal(0, d.p:wait(), table.concat(d.log, "\n"))
      pcall(task.join, d.reader)
      -- once acknowledged, it fired nothing more
      for _, l in ipairs(after_line(d, "acknowledged")) do
        assert.is_nil(l:match("run %d+ started") or l:match("skipped") or l:match("claimed by another"), l)
      end
    end
    local oks = w:count("h: run %d+ ok", late)
    w:wait("the late daemon fires", function() return w:count("h: run %d+ ok", late) >= oks + 2 end)
    assert.are.equal(0, w:count("acknowledged", late))
    assert.are.equal(0, w:stop(late), table.concat(late.log, "\n"))
    local held
    for _, x in ipairs(w:runs()) do if x.id == id then held = x end end
    assert.are.equal("ok", held.outcome, held.error)
    assert.is_not_nil(io.open(w.dir .. "/released"))
  end))

  it("without --drain: the run in progress is recorded cancelled by its daemon and all exit 0",
    T.async(function()
      w = world("stop", HOLD, 10)
      for _ = 1, 2 do w:daemon() end
      local id = held_run(w)
      local r = w:moonbox { "schedule", w.recipe, "--stop" }
      assert.are.equal(0, r.code, r.stdout .. r.stderr)
      assert.matches("asked 2 daemon%(s%) to stop: ", r.stdout)
      assert.matches("2 of 2 daemon%(s%) acknowledged, 2 stopped", r.stdout)
      for _, d in ipairs(w.daemons) do
        assert.are.equal(0, d.p:wait(), table.concat(d.log, "\n"))
        pcall(task.join, d.reader)
      end
      local held
      for _, x in ipairs(w:runs()) do
        assert.is_true(x.outcome ~= "running" and x.outcome ~= "queued", x.id .. " " .. x.outcome)
        if x.id == id then held = x end
      end
      assert.are.equal("cancelled", held.outcome)
      assert.matches("^cancelled: the daemon stopped %(a %-%-stop request from ", held.error)
      assert.is_nil(io.open(w.dir .. "/released"))
      -- nobody left to ask: it says so and succeeds
      r = w:moonbox { "schedule", w.recipe, "--stop" }
      assert.are.equal(0, r.code, r.stderr)
      assert.matches("no live daemon fires h", r.stdout)
    end))
end)

describe("a plain --stop while the daemons drain", function()
  local w
  after_each(run(function() if w then w:destroy() end w = nil end))

  it("cancels the runs the drain waits for; both commands see the daemon stop", T.async(function()
    w = world("escalate", HOLD, 10)
    local d = w:daemon()
    w:wait("a held run", function() return w:count("^HELD run %d+") == 1 end)
    local id
    for _, l in ipairs(d.log) do id = tonumber(l:match("^HELD run (%d+)")) or id end
    local drain = w:background { "schedule", w.recipe, "--stop", "--drain" }
    w:wait("draining", function() return w:count("waiting for 1 run%(s%) to finish", d) == 1 end)
    local r = w:moonbox { "schedule", w.recipe, "--stop" }
    assert.are.equal(0, r.code, r.stdout .. r.stderr)
    assert.matches("1 of 1 daemon%(s%) acknowledged, 1 stopped", r.stdout)
    local r2 = task.join(drain)
    assert.are.equal(0, r2.code, r2.stdout .. r2.stderr)
    assert.matches("1 stopped", r2.stdout)
    assert.are.equal(0, d.p:wait(), table.concat(d.log, "\n"))
    pcall(task.join, d.reader)
    local held
    for _, x in ipairs(w:runs()) do if x.id == id then held = x end end
    assert.are.equal("cancelled", held.outcome)
    assert.matches("after a drain%)$", held.error)
    assert.is_nil(io.open(w.dir .. "/released"))
  end))
end)

describe("overlap = cancel_other across processes on one database", function()
  local w
  after_each(run(function() if w then w:destroy() end w = nil end))

  it("the older run is cancelled by the process that holds it, then the new slot runs", T.async(function()
    w = world("cancel", [[
local schedule = require "moonbox.schedule"
local task = require "moonbox.task"
schedule.every("c", "10s", function(run)
  if run.trigger == "manual" then
    print("HELD") io.stdout:flush()
    task.sleep(600) -- until a cancel reaches it
  end
end, { overlap = "cancel_other" })
]], 10)
    -- the older run: a --trigger in a process of its own, holding it under its lease
    local holder = w:daemon { "--trigger", "c" }
    w:wait("held", function() return w:count("^HELD$", holder) == 1 end)
    local d = w:daemon()
    w:wait("the next slot ran", function() return w:count("c: run %d+ ok", d) >= 1 end)
    w:wait("the holder exits", function() return holder.eof end)
    assert.are.equal(1, holder.p:wait(), table.concat(holder.log, "\n")) -- its run did not succeed
    pcall(task.join, holder.reader)
    assert.are.equal(1, w:count("asked %S+ to cancel run", d))
    assert.are.equal(1, w:count("another daemon asked to cancel it", holder))
    assert.are.equal(0, w:stop(d), table.concat(d.log, "\n"))
    local manual, next_run
    for _, x in ipairs(w:runs()) do
      if x.trigger == "manual" then
        manual = x
      elseif manual and not next_run and x.outcome == "ok" then
        next_run = x
      end
    end
    assert.are.equal("cancelled", manual.outcome)
    local slot = manual.error:match("^cancelled by the fire of slot (%S+) on %S+ %(overlap = cancel_other%)$")
    assert.is_not_nil(slot, manual.error)
    assert.are.equal(slot, next_run.slot)
    assert.is_true(next_run.id > manual.id)
    assert.is_true(next_run.started_unix >= manual.ended_unix)
  end))
end)

describe("overlap = buffer_one across processes on one database", function()
  local w
  after_each(run(function() if w then w:destroy() end w = nil end))

  it("queues one slot behind a run another process holds, skips the next, and starts the queued " ..
    "one when that run ends", T.async(function()
    w = world("buffer", [[
local schedule = require "moonbox.schedule"
local task = require "moonbox.task"
schedule.every("b", "10s", function(run)
  if run.trigger == "manual" then
    print("HELD") io.stdout:flush()
    while not io.open("DIR/release") do task.sleep(0.05) end
  end
end, { overlap = "buffer_one" })
]], 10)
    local holder = w:daemon { "--trigger", "b" }
    w:wait("held", function() return w:count("^HELD$", holder) == 1 end)
    local d = w:daemon()
    w:wait("queued, then a skip", function()
      return w:count("queued %(record %d+%) behind run %d+ on", d) == 1
        and w:count("was already queued %(overlap = buffer_one%)", d) >= 1
    end)
    assert(io.open(w.dir .. "/release", "w")):close()
    w:wait("the holder exits", function() return holder.eof end)
    assert.are.equal(0, holder.p:wait(), table.concat(holder.log, "\n"))
    pcall(task.join, holder.reader)
    w:wait("the queued slot ran", function() return w:count("b: run %d+ ok", d) >= 1 end)
    assert.are.equal(0, w:stop(d), table.concat(d.log, "\n"))
    local manual, queued, skipped = nil, nil, 0
    for _, x in ipairs(w:runs()) do
      if x.trigger == "manual" then manual = x end
      if x.outcome == "skipped" then skipped = skipped + 1 end
      if x.trigger ~= "manual" and x.outcome ~= "skipped" and not queued then queued = x end
    end
    assert.are.equal("ok", manual.outcome)
    assert.is_true(skipped >= 1)
    assert.are.equal("ok", queued.outcome, queued.error)
    assert.is_true(queued.fired_unix < manual.ended_unix, "it was fired while the other run held")
    assert.is_true(queued.started_unix >= manual.ended_unix, "it started after the other run ended")
  end))
end)
