-- Durable schedules (issue 25, docs/schedule.md "Durable schedules"): a schedule with
-- `durable = true` runs each slot as a durable run inside its daemon, and when that daemon dies
-- another daemon resumes the run from its journal, adopting its sandbox, in the same history
-- record. Real `moonbox schedule` daemons against a real `moonbox local`:
--
--   * PostgreSQL: two daemons share one database; the daemon running a slot is SIGKILLed at 10
--     seeded points of the run (MOONBOX_DURABLE_CRASH_AT=@FILE: the next fresh durable run, in
--     whichever daemon, dies after its N-th journal write); the other resumes each after the
--     lease expires and completes it;
--   * SQLite: one daemon, killed in a run and started again, resumes it at its start; `moonbox
--     run --resume` of the schedule's ledger run is refused; `moonbox runs` and the status page
--     show the resume.
--
-- The run: a sandbox, steps, three execs that each increment a counter inside the sandbox and
-- append their number to a file there, a read of both, a last step writing them to the host.
-- Two durable schedules have that body, so a daemon runs several durable runs at once (each
-- with a journal of its own), and a daemon that dies may leave two runs for the other to resume.
-- Checked from what was recorded and what the sandboxes counted, never from how long anything
-- took: each slot has one history record, each crashed run one completed run resumed by the
-- other daemon, every exec ran once or was reported unknown_outcome, no sandbox was created
-- twice, nothing is left running. The seed is printed; MOONBOX_SPEC_SEED=N replays it, and
-- every failure names the seed and the crash point.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local task = require "moonbox.task"
local core = require "moonbox.core"
local json = require "moonbox.json"
local http = require "moonbox.http"
local L = require "spec.support.local_backend"
local PG = require "spec.support.postgres"
local SE = require "spec.support.schedule_env"
local runs = require "spec.support.runs"

local SEED = tonumber(os.getenv("MOONBOX_SPEC_SEED") or "") or (os.time() % 100000)
io.stderr:write("schedule_durable_spec: seed ", SEED, " (MOONBOX_SPEC_SEED=", SEED, " replays it)\n")
math.randomseed(SEED)

local START = "2026-03-01T00:00:00Z"
local LEASE = 2 -- seconds (MOONBOX_LEASE_SECONDS): renewed every third; short, but well above a stall under load
local run = T.async

local B, server
L.fixture(setup, teardown, function(b)
  B = b
  return function() end
end, { render = false })
teardown(run(function() if server then server:destroy() end end))

-- The recipe: DIR is the world's directory.
local RECIPE = [[
local schedule = require "moonbox.schedule"
local render = require "moonbox.render"
local task = require "moonbox.task"
local function mark(line)
  local f = assert(io.open("DIR/marks", "a"))
  f:write(line, "\n")
  f:close()
end
-- two schedules with the same body: their runs overlap, in one daemon or in both
local function body(run)
  local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
  task.step("begin", function() mark(string.format("begin %d %s", run.id, sb.id)) end)
  local unknown = {}
  for i = 1, 3 do
    local ok, err = pcall(function()
      return sb:exec("n=$(cat /tmp/count 2>/dev/null || echo 0); echo $((n + 1)) > /tmp/count; " ..
        "echo " .. i .. " >> /tmp/ran"):check()
    end)
    if not ok then
      if type(err) ~= "table" or err.code ~= "unknown_outcome" then error(err, 0) end
      unknown[#unknown + 1] = i
    end
    task.step("after exec " .. i, function() end)
  end
  local seen = sb:exec("cat /tmp/count 2>/dev/null || echo 0; tr '\\n' , < /tmp/ran || true",
    { idempotent = true }):check().stdout
  local count, ran = seen:match("^(%d+)\n(.*)$")
  task.step("end", function()
    mark(string.format("end %d count=%s ran=%s unknown=%s", run.id, count, ran, table.concat(unknown, ",")))
  end)
end
schedule.every("d", "30s", body, { durable = true })
schedule.every("e", "30s", body, { durable = true })
]]

-- A test's world: a directory with the recipe, a store, the daemons it started.
local World = {}
World.__index = World

local function world(db_url)
  local dir = proc.run({ "mktemp", "-d", "/tmp/moonbox-sdurable-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  local f = assert(io.open(dir .. "/recipe.lua", "w"))
  f:write((RECIPE:gsub("DIR", dir)))
  f:close()
  return setmetatable({ dir = dir, recipe = dir .. "/recipe.lua", db_url = db_url, daemons = {}, n = 0,
    changed = core.cond(),
    -- every daemon's virtual clock reads START at the same real moment: one timeline
    clock = string.format("start=%s,scale=30,at=%.6f", START, core.time() + 0.2) }, World)
end

function World:env()
  local v = { "env", "HOME=" .. self.dir, "XDG_STATE_HOME=" .. self.dir .. "/state",
    "MOONBOX_TEST_CLOCK=" .. self.clock, "MOONBOX_LEASE_SECONDS=" .. LEASE,
    "MOONBOX_DURABLE_CRASH_AT=@" .. self.dir .. "/crash",
    "RENDER_API_KEY=" .. B.key, "RENDER_WORKSPACE_ID=" .. B.workspace, "RENDER_LOCAL_DEV_URL=" .. B.url }
  if self.db_url then v[#v + 1] = "MOONBOX_DATABASE_URL=" .. self.db_url end
  return v
end

--- world:daemon([args]) -> d: a running `moonbox schedule FILE [args]`, its stdout read into
-- d.log, its stderr in d.err (a file); d.exited once it has. [yields]
function World:daemon(args)
  self.n = self.n + 1
  local argv = self:env()
  for _, a in ipairs { L.BIN, "schedule", self.recipe } do argv[#argv + 1] = a end
  for _, a in ipairs(args or {}) do argv[#argv + 1] = a end
  local d = { n = self.n, log = {}, err = string.format("%s/daemon%d.stderr", self.dir, self.n) }
  argv.stderr = { file = d.err }
  d.p = proc.spawn(argv)
  local lines = d.p:lines("stdout")
  d.reader = task.spawn(function()
    for line in lines do
      d.log[#d.log + 1] = line
      self.changed:broadcast()
    end
    d.code, d.signal = d.p:wait()
    d.exited = true
    self.changed:broadcast()
  end)
  self.daemons[#self.daemons + 1] = d
  return d
end

function World.stderr(_, d)
  local f = io.open(d.err)
  if not f then return "" end
  local s = f:read("a")
  f:close()
  return s
end

--- world:wait(what, pred, why): waits until pred() is true, re-checked whenever a daemon logs or
-- exits; raises naming what and why() (the seed and point) after 60 s. [yields]
function World:wait(what, pred, why)
  local ok, err = pcall(task.timeout, 60, function()
    while not pred() do self.changed:wait() end
  end)
  if not ok then
    local logs = {}
    for _, d in ipairs(self.daemons) do
      logs[#logs + 1] = string.format("daemon %d%s:\n%s\nstderr:\n%s", d.n, d.exited and " (exited)" or "",
        table.concat(d.log, "\n"), self:stderr(d))
    end
    error(string.format("%s: waiting for %s: %s\n%s", why(), what, tostring(err), table.concat(logs, "\n")), 0)
  end
end

function World.count(_, d, pattern)
  local n = 0
  for _, l in ipairs(d.log) do if l:match(pattern) then n = n + 1 end end
  return n
end

function World.stop(_, d)
  if not d.exited then
    d.p:kill("TERM")
    pcall(task.join, d.reader)
  end
  return d.code
end

function World:moonbox(args)
  local argv = self:env()
  argv[#argv + 1] = L.BIN
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  return proc.run(argv)
end

--- world:records() -> the history, oldest first, from `moonbox runs --json`. [yields]
function World:records()
  return SE.history(function(args) return self:moonbox(args) end)
end

--- world:marks() -> record id -> {begin = n, sandbox, ends = {lines}}: what the runs' steps wrote.
function World:marks()
  local out = {}
  local f = io.open(self.dir .. "/marks")
  if not f then return out end
  for l in f:lines() do
    local id, sb = l:match("^begin (%d+) (%S+)")
    if id then
      local m = out[tonumber(id)] or { begins = 0, ends = {} }
      m.begins, m.sandbox = m.begins + 1, sb
      out[tonumber(id)] = m
    end
    id = l:match("^end (%d+) ")
    if id then
      local m = out[tonumber(id)] or { begins = 0, ends = {} }
      m.ends[#m.ends + 1] = l
      out[tonumber(id)] = m
    end
  end
  f:close()
  return out
end

--- world:arm(point): the next fresh durable run dies after its point-th journal write.
function World:arm(point)
  local f = assert(io.open(self.dir .. "/crash.part", "w"))
  f:write(tostring(point))
  f:close()
  assert(os.rename(self.dir .. "/crash.part", self.dir .. "/crash"))
end

function World:destroy()
  for _, d in ipairs(self.daemons) do
    if not d.exited then
      d.p:kill("KILL")
      pcall(task.join, d.reader)
    end
  end
  proc.run { "rm", "-rf", self.dir }
end

-- Checks what one run recorded in the marks: its execs ran once each, or were reported
-- unknown_outcome (then at most once); raises naming why().
local function check_execs(m, id, why)
  if not m or m.begins == 0 then error(why() .. ": run " .. id .. " never began", 2) end
  if #m.ends == 0 then error(why() .. ": run " .. id .. " never ended", 2) end
  for _, e in ipairs(m.ends) do
    if e ~= m.ends[1] then
      error(why() .. ": run " .. id .. " ended twice, differently:\n" .. table.concat(m.ends, "\n"), 2)
    end
  end
  local count, ran, unknown = m.ends[1]:match("count=(%d+) ran=(%S*) unknown=(%S*)")
  assert(count, why() .. ": " .. m.ends[1])
  local seen, n = {}, 0
  for i in ran:gmatch("%d+") do
    if seen[i] then error(string.format("%s: run %s: exec %s ran twice (%s)", why(), id, i, m.ends[1]), 2) end
    seen[i] = true
    n = n + 1
  end
  if tonumber(count) ~= n then
    error(string.format("%s: run %s: the counter says %s, the execs that ran say %d (%s)", why(), id, count, n,
      m.ends[1]), 2)
  end
  local unk = {}
  for i in unknown:gmatch("%d+") do unk[i] = true end
  for i = 1, 3 do
    if not seen[tostring(i)] and not unk[tostring(i)] then
      error(string.format("%s: run %s: exec %d neither ran nor was reported unknown_outcome (%s)", why(), id, i,
        m.ends[1]), 2)
    end
  end
end

-- The crash line a killed daemon wrote: the point and the ledger run.
local function crash_line(w, d)
  local text = w:stderr(d)
  local point, lrun = text:match("MOONBOX_DURABLE_CRASH_AT=(%d+): killed after writing .- of run (%d+)")
  return tonumber(point), tonumber(lrun), text
end

-- Nothing left running: no live sandbox on the backend, `moonbox ps` holds nothing.
local function check_clean(w, why)
  local live = runs.live(B)
  if next(live) then error(why() .. ": sandboxes left running: " .. json.encode(live), 2) end
  local ps = w:moonbox { "ps" }
  assert(ps.code == 0, why() .. ": moonbox ps: " .. ps.stderr)
  if ps.stdout:find("holds", 1, true) then error(why() .. ": moonbox ps still holds:\n" .. ps.stdout, 2) end
end

describe("a durable schedule on PostgreSQL with two daemons", function()
  local w
  after_each(run(function() if w then w:destroy() end w = nil end))

  it("has the run of a daemon SIGKILLed at 10 seeded points resumed by the other, once each",
    T.async(function()
      server = server or PG.start()
      w = world(server:create_database("sdurable"))
      local mark0 = runs.last_seq(B)
      local ds = { w:daemon(), w:daemon() }
      local context = "before the first crash"
      local function why() return string.format("seed %d (MOONBOX_SPEC_SEED=%d), %s", SEED, SEED, context) end
      -- One run that is not killed says how many journal writes a run makes.
      local writes
      w:wait("a durable run to finish", function()
        for _, d in ipairs(ds) do
          for _, l in ipairs(d.log) do
            writes = writes or tonumber(l:match("[de]: run %d+: durable %(ledger run %d+%): %d+ call%(s%), (%d+) journal"))
          end
        end
        return writes ~= nil
      end, why)
      local points = {}
      for k = 1, 10 do points[k] = math.random(1, writes - 1) end
      io.stderr:write(string.format("schedule_durable_spec: seed %d: a run makes %d journal writes; crash points %s\n",
        SEED, writes, table.concat(points, " ")))
      local resumed = {} -- record id -> {point, by (daemon), victim}
      for k, point in ipairs(points) do
        context = string.format("crash %d of 10, after journal write %d of %d", k, point, writes)
        w:arm(point)
        local victim
        w:wait("a daemon to die at the crash point", function()
          for i, d in ipairs(ds) do if d.exited then victim = i end end
          return victim ~= nil
        end, why)
        local vd = ds[victim]
        local other = ds[3 - victim]
        local got, lrun, text = crash_line(w, vd)
        assert(got == point, why() .. ": the daemon that died did not say it was killed at that point:\n" .. text)
        local rec
        for _, r in ipairs(w:records()) do if r.ledger_run == lrun then rec = r end end
        assert(rec, why() .. ": no history record has ledger run " .. tostring(lrun))
        context = context .. string.format(", record %d (ledger run %d)", rec.id, lrun)
        -- the other daemon resumes it once the lease has expired, and finishes it (and the run of
        -- the other schedule the dead daemon may have had under way: the same, or at the restart)
        local sname = rec.schedule
        w:wait("the other daemon to finish the run", function()
          return w:count(other, sname .. ": run " .. rec.id .. " ok") > 0
            or w:count(other, sname .. ": run " .. rec.id .. " failed") > 0
        end, why)
        assert(w:count(other, sname .. ": run " .. rec.id .. " ok") == 1,
          why() .. ": the resumed run did not finish ok:\n" .. table.concat(other.log, "\n") .. "\n" .. w:stderr(other))
        assert(w:count(other, sname .. ": run " .. rec.id .. " %(slot .-%): its daemon .- stopped during the run; " ..
          "resuming it here %(resume 1") == 1, why() .. ": not resumed by the other daemon")
        resumed[rec.id] = { point = point, k = k, by = other }
        ds[victim] = w:daemon()
        w:wait("the restarted daemon", function() return w:count(ds[victim], "started: ") > 0 end, why)
      end
      context = "after the 10 crashes"
      -- no new runs; every run under way (a resume of the last victim's other run too) finishes
      for _, name in ipairs { "d", "e" } do
        local r = w:moonbox { "schedule", w.recipe, "--pause", name }
        assert(r.code == 0, why() .. ": --pause " .. name .. ": " .. r.stderr)
      end
      local settled = pcall(task.timeout, 60, function()
        while true do
          local open = false
          for _, r in ipairs(w:records()) do
            if r.outcome == "running" or r.outcome == "queued" then open = true end
          end
          if not open then return end
          task.sleep(0.25)
        end
      end)
      assert(settled, why() .. ": runs still running 60 s after the schedules were paused")
      for _, d in ipairs(ds) do
        assert(w:stop(d) == 0, why() .. ": a daemon did not stop cleanly:\n" .. table.concat(d.log, "\n"))
      end
      local rows = w:records()
      local marks = w:marks()
      local by_slot, n_resumed, sandboxes, others = {}, 0, 0, 0
      for _, r in ipairs(rows) do
        local slot_key = r.schedule .. " " .. r.slot
        if by_slot[slot_key] then error(why() .. ": slot " .. slot_key .. " has two records", 0) end
        by_slot[slot_key] = r
        sandboxes = sandboxes + #(r.sandboxes or {})
        assert((#(r.sandboxes or {})) <= 1, why() .. ": record " .. r.id .. " has several sandboxes")
        local res = resumed[r.id]
        if res then
          local function rwhy()
            return string.format("%s: record %d, crash %d at journal write %d", why(), r.id, res.k, res.point)
          end
          n_resumed = n_resumed + 1
          assert(r.outcome == "ok", rwhy() .. ": outcome " .. tostring(r.outcome) .. ": " .. tostring(r.error))
          assert(r.resumes == 1, rwhy() .. ": resumes " .. tostring(r.resumes))
          assert(r.resumed_by == r.owner, rwhy() .. ": resumed_by " .. tostring(r.resumed_by))
          check_execs(marks[r.id], r.id, rwhy)
          -- the sandbox it ends with is the one the first attempt made, when it got that far
          if marks[r.id].sandbox then
            assert(r.sandboxes and r.sandboxes[1] == marks[r.id].sandbox, rwhy() .. ": the run began with " ..
              marks[r.id].sandbox .. ", its record holds " .. json.encode(r.sandboxes or {}))
          end
        elseif (r.resumes or 0) > 0 then
          -- a run the dead daemon had under way besides the one that crashed it
          others = others + 1
          assert(r.outcome == "ok", why() .. ": record " .. r.id .. " (resumed beside a crash): outcome " ..
            tostring(r.outcome) .. ": " .. tostring(r.error))
          check_execs(marks[r.id], r.id, why)
        elseif r.outcome == "ok" then
          check_execs(marks[r.id], r.id, why)
        else
          assert(r.outcome == "skipped" or r.outcome == "cancelled",
            why() .. ": record " .. r.id .. ": " .. tostring(r.outcome) .. ": " .. tostring(r.error))
        end
      end
      assert(n_resumed == 10, why() .. ": " .. n_resumed .. " resumed records")
      io.stderr:write(string.format("schedule_durable_spec: seed %d: %d records, 10 crashed runs resumed, %d " ..
        "other runs of the dead daemons resumed beside them\n", SEED, #rows, others))
      -- no sandbox created twice: the backend answered one create per sandbox the records hold
      runs.settled(B, mark0)
      local created = runs.creates_answered(B, mark0)
      assert(created == sandboxes, string.format("%s: the backend made %d sandboxes, the records hold %d", why(),
        created, sandboxes))
      check_clean(w, why)
    end))
end)

describe("a durable schedule on SQLite", function()
  local w
  after_each(run(function() if w then w:destroy() end w = nil end))

  it("is resumed by its daemon started again after a kill, and shown resumed", T.async(function()
    w = world(nil)
    local mark0 = runs.last_seq(B)
    local point = math.random(2, 12)
    local function why() return string.format("seed %d (MOONBOX_SPEC_SEED=%d), crash after journal write %d",
      SEED, SEED, point) end
    w:arm(point)
    local d = w:daemon()
    w:wait("the daemon to die at the crash point", function() return d.exited end, why)
    local got, lrun, text = crash_line(w, d)
    assert(got == point, why() .. ": the daemon did not say it was killed at that point:\n" .. text)
    local rec
    for _, r in ipairs(w:records()) do if r.ledger_run == lrun then rec = r end end
    assert(rec and rec.outcome == "running", why() .. ": no running record of ledger run " .. tostring(lrun))
    -- the daemons own it: `moonbox run --resume` refuses
    local r = w:moonbox { "run", "--resume", tostring(lrun) }
    assert(r.code == 1, why() .. ": moonbox run --resume exited " .. tostring(r.code) .. ": " .. r.stderr)
    assert(r.stderr:find("cannot resume: run " .. lrun .. " is schedule '" .. rec.schedule .. "''s run (record " ..
      rec.id .. ")", 1, true),
      why() .. ": " .. r.stderr)
    assert(r.stderr:find("daemons resume it themselves", 1, true), why() .. ": " .. r.stderr)
    -- `moonbox ps` says whose it is, and `moonbox reap` leaves it to them (the resume adopts
    -- its sandbox: one reap terminated would make the resume fail with lost_sandbox)
    local ps = w:moonbox { "ps" }
    assert(ps.stdout:find(string.format("dead, resumable (by a daemon of schedule '%s': record %d)", rec.schedule,
      rec.id), 1, true), why() .. ": moonbox ps:\n" .. ps.stdout .. ps.stderr)
    local reap = w:moonbox { "reap" }
    assert(reap.code == 0, why() .. ": moonbox reap: " .. reap.stderr)
    assert(reap.stdout:find(string.format("wait for a daemon of schedule '%s' to resume it (record %d)",
      rec.schedule, rec.id), 1, true), why() .. ": moonbox reap:\n" .. reap.stdout .. reap.stderr)
    local d2 = w:daemon { "--listen", "127.0.0.1:0" }
    w:wait("the listener", function() return w:count(d2, "listening on http://") > 0 end, why)
    local sname = rec.schedule
    -- it resumes at its start every run the dead daemon had under way (both schedules' perhaps)
    w:wait("the resumed runs to finish", function()
      return w:count(d2, sname .. ": run " .. rec.id .. " ok") > 0
        and w:count(d2, ": run %d+: resumed %(resume") == w:count(d2, "resuming it here")
    end, why)
    assert(w:count(d2, sname .. ": run " .. rec.id .. " %(slot .-%): its daemon .- stopped during the run; resuming " ..
      "it here %(resume 1") == 1, why() .. ": " .. table.concat(d2.log, "\n"))
    -- the status page shows it resumed
    local url
    for _, l in ipairs(d2.log) do url = url or l:match("listening on (http://[%d%.:]+)") end
    local page = http.request { url = url .. "/", timeout = 30 }
    assert(page.status == 200, why() .. ": status page " .. tostring(page.status))
    local row = page.body:match('<tr class="run [^"]*" data%-run="' .. rec.id .. '">(.-)</tr>')
    assert(row and row:find("resumed 1&times; by ", 1, true), why() .. ": the page's row: " .. tostring(row))
    assert(w:stop(d2) == 0, why() .. ": " .. table.concat(d2.log, "\n"))
    -- moonbox runs: one record, ok, resumed once
    local rows = w:records()
    local mine = {}
    for _, x in ipairs(rows) do
      if x.slot_unix == rec.slot_unix and x.schedule == rec.schedule then mine[#mine + 1] = x end
      if (x.resumes or 0) > 0 then
        assert(x.outcome == "ok", why() .. ": resumed record " .. x.id .. ": " .. tostring(x.outcome))
        check_execs(w:marks()[x.id], x.id, why)
      end
    end
    assert(#mine == 1, why() .. ": slot " .. rec.slot .. " has " .. #mine .. " records")
    assert(mine[1].outcome == "ok" and mine[1].resumes == 1 and mine[1].resumed_by ~= nil,
      why() .. ": " .. json.encode(mine[1]))
    local text_runs = w:moonbox { "runs", rec.schedule }
    assert(text_runs.stdout:find("(resumed 1 time, last by ", 1, true), why() .. ": " .. text_runs.stdout)
    check_execs(w:marks()[rec.id], rec.id, why)
    runs.settled(B, mark0)
    local sandboxes = 0
    for _, x in ipairs(rows) do sandboxes = sandboxes + #(x.sandboxes or {}) end
    assert(runs.creates_answered(B, mark0) == sandboxes, why() .. ": a sandbox was created twice")
    check_clean(w, why)
  end))
end)
