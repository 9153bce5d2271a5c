-- `moonbox schedule` as a real subprocess on the test clock (MOONBOX_TEST_CLOCK, 600x: a
-- 10-minute slot every real second): overlap, jitter bounds, timeout, pause after failures and
-- --resume, catch-up after a 3-hour outage, the one-shot modes, `moonbox runs --json`, SIGTERM,
-- and a kill -9 during a run that created a sandbox on a real `moonbox local`. Checks are on the
-- recorded history, never on how long anything took.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local clock = require "moonbox.schedule.clock"
local S = require "spec.support.store_env"
local SE = require "spec.support.schedule_env"

local run = T.async

-- A fresh state dir and recipe per test (spec.support.schedule_env); on PostgreSQL a fresh
-- database of its own, as it has a state dir of its own.
local function env_new(recipe, backend)
  return SE.new(recipe, { backend = backend, env = S.vars(), stderr = "inherit" })
end

teardown(run(function() S.shutdown() end))

local function count(rows, field, value)
  local n = 0
  for _, r in ipairs(rows) do if r[field] == value then n = n + 1 end end
  return n
end

local function one_per_slot(rows)
  local seen = {}
  for _, r in ipairs(rows) do
    if r.trigger ~= "manual" then
      assert.is_nil(seen[r.slot_unix], "slot " .. r.slot .. " has two records")
      seen[r.slot_unix] = true
    end
  end
end

local PRELUDE = [[
local schedule = require "moonbox.schedule"
local task = require "moonbox.task"
]]

describe("moonbox schedule on the test clock", function()
  local e
  after_each(run(function() if e then e:destroy() end e = nil end))

  it("skips a fire while a run is active (overlap = skip)", T.async(function()
    e = env_new(PRELUDE .. [[schedule.every("s", "10m", function() task.sleep(1.6) end, { overlap = "skip" })]])
    local d = e:daemon()
    d:wait_for("s: run %d+ ok", 2)
    assert.are.equal(0, d:stop())
    local rows = e:runs("s")
    one_per_slot(rows)
    assert.is_true(count(rows, "outcome", "skipped") >= 1)
    local last_end
    for _, r in ipairs(rows) do
      if r.outcome == "skipped" then assert.matches("overlap = skip", r.error) end
      if r.started_unix then
        if last_end then assert.is_true(r.started_unix >= last_end) end
        last_end = r.ended_unix
      end
    end
  end))

  it("queues at most one fire and runs it when the active run ends (buffer_one)", T.async(function()
    e = env_new(PRELUDE .. [[schedule.every("b", "10m", function() task.sleep(2.6) end, { overlap = "buffer_one" })]])
    local d = e:daemon()
    d:wait_for("b: slot .* skipped")
    d:wait_for("b: run %d+ ok", 2)
    assert.are.equal(0, d:stop())
    local rows = e:runs("b")
    one_per_slot(rows)
    local runs = {}
    for _, r in ipairs(rows) do
      if r.started_unix then runs[#runs + 1] = r end
      if r.outcome == "skipped" then assert.matches("already queued %(overlap = buffer_one%)", r.error) end
    end
    -- the second run was queued at its slot and started only when the first had ended
    assert.is_true(runs[2].fired_unix < runs[1].ended_unix)
    assert.is_true(runs[2].started_unix >= runs[1].ended_unix)
  end))

  it("cancels the active run for a new fire (cancel_other)", T.async(function()
    e = env_new(PRELUDE .. [[schedule.every("c", "10m", function() task.sleep(100) end, { overlap = "cancel_other" })]])
    local d = e:daemon()
    d:wait_for("c: run %d+ started", 2)
    assert.are.equal(0, d:stop())
    local rows = e:runs("c")
    assert.are.equal("cancelled", rows[1].outcome)
    assert.are.equal("cancelled by the fire of slot " .. rows[2].slot .. " (overlap = cancel_other)", rows[1].error)
    assert.are.equal("cancelled", rows[2].outcome) -- by the SIGTERM
    assert.matches("SIGTERM", rows[2].error)
  end))

  it("fires cron schedules at their slots in the schedule's zone, across a DST gap", T.async(function()
    -- 02:30 Berlin time does not exist on 2026-03-29 (02:00 CET -> 03:00 CEST): a fixed-hour
    -- schedule fires once at the end of the gap, 03:00 CEST = 01:00Z (docs/reference/cron.md).
    e = env_new(PRELUDE .. [[
schedule.cron("berlin", "30 2 * * *", function() end, { tz = "Europe/Berlin" })
schedule.cron("hourly", "0 * * * *", function() end)
]])
    local r = e:moonbox({ "schedule", e.recipe, "--next", "berlin", "3" }, "2026-03-28T00:45:00Z")
    assert.are.equal(0, r.code, r.stderr)
    assert.are.equal("2026-03-28T02:30:00+01:00\n2026-03-29T03:00:00+02:00\n2026-03-30T02:30:00+02:00\n",
      r.stdout)
    local d = e:daemon(nil, "2026-03-29T00:45:00Z")
    d:wait_for("berlin: run %d+ ok")
    d:wait_for("hourly: run %d+ ok", 2)
    assert.are.equal(0, d:stop())
    local b = e:runs("berlin")
    assert.are.equal(1, #b)
    assert.are.same({ clock.parse_time("2026-03-29T01:00:00Z"), "ok", "cron" },
      { b[1].slot_unix, b[1].outcome, b[1].trigger })
    local h = e:runs("hourly")
    one_per_slot(h)
    assert.are.same({ clock.parse_time("2026-03-29T01:00:00Z"), clock.parse_time("2026-03-29T02:00:00Z") },
      { h[1].slot_unix, h[2].slot_unix })
  end))

  it("fires within [slot, slot + jitter)", T.async(function()
    e = env_new(PRELUDE .. [[schedule.every("j", "10m", function() end, { jitter = "5m" })]])
    local d = e:daemon()
    d:wait_for("j: run %d+ ok", 4)
    assert.are.equal(0, d:stop())
    local delays = {}
    for _, r in ipairs(e:runs("j")) do
      local delay = r.due_unix - r.slot_unix
      assert.is_true(delay >= 0 and delay < 300, "jitter delay " .. delay)
      assert.is_true(r.fired_unix >= r.due_unix)
      delays[#delays + 1] = delay
    end
    assert.is_true(#delays >= 4)
    assert.are_not.equal(delays[1], delays[2]) -- drawn per fire
  end))

  it("cancels a run at its timeout and records it", T.async(function()
    e = env_new(PRELUDE .. [[
local guarded = false
schedule.every("t", "10m", function()
  local _g <close> = setmetatable({}, { __close = function() print("guard unwound") io.stdout:flush() end })
  task.sleep(100)
end, { timeout = "5m" })]])
    local d = e:daemon()
    d:wait_for("t: run %d+ timeout")
    d:wait_for("guard unwound")
    assert.are.equal(0, d:stop())
    local rows = e:runs("t")
    assert.are.equal("timeout", rows[1].outcome)
    assert.matches("exceeded its timeout of 5m", rows[1].error)
  end))

  it("pauses after N consecutive failures, and --pause/--resume reach the running daemon", T.async(function()
    e = env_new(PRELUDE .. [[schedule.every("f", "10m", function() error("rebuild broke") end,
  { pause_after_failures = 2 })]])
    local d = e:daemon()
    d:wait_for("f: paused after 2 consecutive failures")
    d:wait_for("f: slot .* passed while paused")
    local r = e:moonbox { "schedule", e.recipe, "--resume", "f" }
    assert.are.equal(0, r.code, r.stderr)
    d:wait_for("f: run %d+ failed", 3)
    r = e:moonbox { "schedule", e.recipe, "--pause", "f" }
    assert.are.equal(0, r.code, r.stderr)
    d:wait_for("f: slot .* passed while paused %(paused by %-%-pause", 1)
    assert.are.equal(0, d:stop())
    local rows = e:runs("f")
    assert.are.equal(3, count(rows, "outcome", "failed"))
    assert.matches("recipe.lua:3: rebuild broke", rows[1].error)
    local list = e:moonbox { "schedule", e.recipe, "--list" }
    assert.matches("f%s+every 10m%s+%- %(paused%)%s+failed%s+paused", list.stdout)
  end))

  it("after a 3-hour outage runs one catch-up inside the window and records the rest skipped", T.async(function()
    e = env_new(PRELUDE .. [[schedule.every("q", "15m", function() end, { catchup = "1h" })]])
    local d = e:daemon()
    d:wait_for("q: run %d+ ok", 2)
    assert.are.equal(0, d:stop())
    local before = e:runs("q")
    local last = before[#before].slot_unix
    local restart = last + 3 * 3600 + 1
    d = e:daemon(nil, clock.format(restart))
    d:wait_for("q: run %d+ ok", 1)
    assert.are.equal(0, d:stop())
    local rows = e:runs("q")
    one_per_slot(rows)
    local catchups, skipped_in, skipped_out = {}, 0, 0
    for _, r in ipairs(rows) do
      if r.slot_unix > last and r.slot_unix <= last + 3 * 3600 then
        if r.trigger == "catchup" then
          catchups[#catchups + 1] = r
        else
          assert.are.equal("skipped", r.outcome)
          if restart - r.slot_unix <= 3600 then
            skipped_in = skipped_in + 1
            assert.matches("coalesced into the catch%-up run", r.error)
          else
            skipped_out = skipped_out + 1
            assert.matches("outside the catch%-up window %(1h%)", r.error)
          end
        end
      end
    end
    assert.are.equal(1, #catchups)
    assert.are.equal(last + 3 * 3600, catchups[1].slot_unix)
    assert.are.equal("ok", catchups[1].outcome)
    assert.are.equal(3, skipped_in)   -- +2h15 .. +2h45
    assert.are.equal(8, skipped_out)  -- +15m .. +2h
  end))

  it("answers --list, --next, --trigger and --pause, and moonbox runs --json", T.async(function()
    e = env_new(PRELUDE .. [[
schedule.every("ok", "15m", function(run) print("ran " .. run.trigger) end)
schedule.every("bad", "1h", function() error("no") end)
if not schedule.running() then print("one-off") end]])
    local r = e:moonbox { "schedule", e.recipe, "--next", "ok", "3" }
    assert.are.equal(0, r.code, r.stderr)
    assert.are.equal("2026-03-01T00:15:00Z\n2026-03-01T00:30:00Z\n2026-03-01T00:45:00Z\n", r.stdout)
    r = e:moonbox { "schedule", e.recipe, "--trigger", "ok" }
    assert.are.equal(0, r.code, r.stderr)
    assert.matches("ran manual", r.stdout)
    assert.is_nil(r.stdout:find("one-off", 1, true))
    r = e:moonbox { "schedule", e.recipe, "--trigger", "bad" }
    assert.are.equal(1, r.code)
    r = e:moonbox { "schedule", e.recipe, "--pause", "ok" }
    assert.are.equal(0, r.code, r.stderr)
    r = e:moonbox { "schedule", e.recipe, "--list" }
    assert.matches("ok%s+every 15m%s+%- %(paused%)%s+ok%s+paused", r.stdout)
    assert.matches("bad%s+every 1h%s+2026%-03%-01T01:00:00Z%s+failed%s+active, 1 consecutive failure", r.stdout)
    r = e:moonbox { "schedule", e.recipe, "--trigger", "nope" }
    assert.are.equal(1, r.code)
    assert.matches("has no schedule named 'nope' %(it has: ok, bad%)", r.stderr)
    local rows = e:runs()
    assert.are.equal(2, #rows)
    assert.are.equal("manual", rows[1].trigger)
    assert.are.equal("ok", rows[1].outcome)
    assert.are.equal("failed", rows[2].outcome)
    assert.matches("recipe.lua:4: no", rows[2].error)
  end))

  it("on SIGTERM cancels running runs, or with --drain lets them finish; exit 0 both ways", T.async(function()
    e = env_new(PRELUDE .. [[schedule.every("d", "10m", function() print("working") io.stdout:flush() task.sleep(1) end)]])
    local d = e:daemon()
    d:wait_for("working")
    assert.are.equal(0, d:stop("TERM"))
    local rows = e:runs("d")
    assert.are.equal("cancelled", rows[#rows].outcome)
    d = e:daemon({ "--drain" }, clock.format(rows[#rows].slot_unix + 60))
    d:wait_for("working")
    assert.are.equal(0, d:stop("TERM"))
    rows = e:runs("d")
    assert.are.equal("ok", rows[#rows].outcome)
    assert.matches("waiting for 1 run", table.concat(d.log, "\n"))
  end))
end)

describe("moonbox schedule FILE --stop from another process", function()
  local e, live
  after_each(run(function()
    for _, d in ipairs(live or {}) do pcall(d.stop, d, "KILL") end
    live = nil
    if e then e:destroy() end
    e = nil
  end))

  it("stops the daemon, cancelling its run; with --drain lets the run finish; exit 0 each time", T.async(function()
    -- each run holds until DIR/release exists; the spec removes it before the next daemon
    e = env_new(PRELUDE .. [[schedule.every("h", "10m", function()
  print("holding") io.stdout:flush()
  while not io.open("]] .. "RELEASE" .. [[") do task.sleep(0.05) end
end)]])
    local release = e.dir .. "/release"
    local f = assert(io.open(e.recipe))
    local text = f:read("a"):gsub("RELEASE", release)
    f:close()
    f = assert(io.open(e.recipe, "w"))
    f:write(text)
    f:close()
    live = {}
    local d = e:daemon()
    live[1] = d
    d:wait_for("holding")
    local r = e:moonbox { "schedule", e.recipe, "--stop" }
    assert.are.equal(0, r.code, r.stdout .. r.stderr)
    assert.matches("asked 1 daemon%(s%) to stop: ", r.stdout)
    assert.matches("1 stopped", r.stdout)
    assert.are.equal(0, d:stop("CONT"), table.concat(d.log, "\n")) -- it exits by itself
    local rows = e:runs("h")
    assert.are.equal("cancelled", rows[#rows].outcome)
    assert.matches("a %-%-stop request from ", rows[#rows].error)
    d = e:daemon(nil, clock.format(rows[#rows].slot_unix + 60))
    live[2] = d
    d:wait_for("holding")
    local drain = task.spawn(function() return e:moonbox { "schedule", e.recipe, "--stop", "--drain" } end)
    d:wait_for("waiting for 1 run%(s%) to finish")
    assert(io.open(release, "w")):close()
    r = task.join(drain)
    assert.are.equal(0, r.code, r.stdout .. r.stderr)
    assert.matches("1 of 1 daemon%(s%) acknowledged, 1 stopped", r.stdout)
    assert.are.equal(0, d:stop("CONT"), table.concat(d.log, "\n"))
    rows = e:runs("h")
    assert.are.equal("ok", rows[#rows].outcome, rows[#rows].error)
    r = e:moonbox { "schedule", e.recipe, "--stop" }
    assert.are.equal(0, r.code, r.stderr)
    assert.matches("no live daemon fires h", r.stdout)
  end))
end)

describe("a schedule's budget (max_sandboxes, max_sandbox_seconds)", function()
  local B, e
  SE.with_backend(setup, teardown, function(b) B = b end, function() return e end)

  it("holds each run to its own budget: the create beyond is refused, the run fails with budget_exceeded",
    T.async(function()
      e = env_new(PRELUDE .. [[
local render = require "moonbox.render"
schedule.cron("two", "0 3 * * *", function()
  local a <close> = render.sandboxes.create { network = "deny-all" }
  local b <close> = render.sandboxes.create { network = "deny-all" }
end, { max_sandboxes = 1 })
schedule.every("slow", "1h", function()
  local a <close> = render.sandboxes.create { network = "deny-all" }
  a:exec("sleep 60")
end, { max_sandbox_seconds = "2s" })]], B)
      for round = 1, 2 do -- a budget per run: the second run has all of it again
        local r = e:moonbox { "schedule", e.recipe, "--trigger", "two" }
        assert.are.equal(1, r.code, r.stdout)
        assert.matches("budget of 1 sandbox is spent", r.stderr)
        local rows = e:runs("two")
        assert.are.equal(round, #rows)
        assert.are.equal("failed", rows[round].outcome)
        assert.matches("budget_exceeded", rows[round].error)
        assert.are.equal(1, #rows[round].sandboxes)
      end
      local r = e:moonbox { "schedule", e.recipe, "--trigger", "slow" }
      assert.are.equal(1, r.code, r.stdout)
      local rows = e:runs("slow")
      assert.are.equal("failed", rows[1].outcome)
      assert.matches("budget of 2 sandbox%-seconds is spent", rows[1].error)
      assert.matches("budget_exceeded", rows[1].error)
      local _, sb = B:req("GET", "/v1/sandboxes/" .. rows[1].sandboxes[1])
      assert.are.equal("terminated", sb.status)
      assert.are.equal(0, B:live())
    end))
end)

describe("moonbox schedule killed with -9 during a run", function()
  local B, e
  SE.with_backend(setup, teardown, function(b) B = b end, function() return e end)

  it("records the run interrupted on restart, terminates its sandbox, and never repeats the slot", T.async(function()
    e = env_new(PRELUDE .. [[
local render = require "moonbox.render"
schedule.every("k", "10m", function()
  local sb <close> = render.sandboxes.create { network = "deny-all" }
  print("created " .. sb.id) io.stdout:flush()
  task.sleep(100)
end)]], B)
    local d = e:daemon()
    local line = d:wait_for("^created sbx%-")
    local id = line:match("(sbx%-%S+)")
    d:stop("KILL")
    S.after_kill()
    local _, sb = B:req("GET", "/v1/sandboxes/" .. id)
    assert.are.equal("running", sb.status)
    local before = e:runs("k")
    local slot = before[#before].slot_unix
    assert.are.equal("running", before[#before].outcome)
    -- restart inside the same 10 minutes: no slot is due, only the cleanup
    d = e:daemon(nil, clock.format(slot + 60))
    d:wait_for("k: run %d+: reap: run %d+: terminated " .. id:gsub("%-", "%%-"))
    assert.are.equal(0, d:stop())
    _, sb = B:req("GET", "/v1/sandboxes/" .. id)
    assert.are.equal("terminated", sb.status)
    local rows = e:runs("k")
    one_per_slot(rows)
    assert.are.equal(1, #rows)
    assert.are.equal("interrupted", rows[1].outcome)
    assert.are.same({ id }, rows[1].sandboxes)
    assert.are.equal(0, B:live())
  end))
end)
