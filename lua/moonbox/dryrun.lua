--- moonbox.dryrun — `moonbox run --dry-run`: a recipe runs against moonbox local with a simulated
-- engine, on a simulated clock, and the run reports what it would have done.
--
--   moonbox run --dry-run recipe.lua          -- creates by plan, snapshots, restores, execs,
--   moonbox run --dry-run --json recipe.lua   -- peak live sandboxes, sandbox-seconds
--
-- What runs: moonbox local's own service (moonbox.local.service) and routes (moonbox.local.http,
-- the wire rules `moonbox local` serves), on the simulated engine moonbox.local.engine.sim
-- (sandboxes are records with a file tree in memory; no process, no btrfs, no cgroup, no
-- network), its records in a private in-memory SQLite database (moonbox.local.state). The render
-- client's connection reaches it over an in-memory transport (moonbox.local.http.memory: no
-- socket); every render.* function runs unchanged, with its own retries, waits, budgets and
-- fan-outs, and is refused exactly as moonbox local refuses it.
--
-- One clock: operations take simulated time (render.dry_run.durations; by default what moonbox
-- local takes), and task.sleep, task.now, task.timeout, the budgets' clock and every time the
-- service and its routes read (service.new's clock) follow it while a dry run is active. The
-- clock moves only when every task waits for it: a driver task yields until nothing else is
-- ready, then jumps to the earliest pending simulated wake-up. A recipe that execs `sleep 600`
-- or creates 100 sandboxes finishes in milliseconds and reports the simulated seconds. What waits
-- on core's own clock (core.sleep, task.window's holds) and real I/O the recipe does itself take
-- real time, during which simulated time may pass.
--
-- Execs are answered by the recipe's render.dry_run.on_exec hooks (moonbox.render.dryrun), as the
-- structured command the client built: the recipe's own command, never its wrapper. See
-- docs/reference/render.md, "Dry runs", for what a dry run can and cannot tell.
local core = require "moonbox.core"
local task = require "moonbox.task"
local json = require "moonbox.json"
local ids = require "moonbox.ids"
local sys = require "moonbox.sys"
local hooks = require "moonbox.render.dryrun"
local conn = require "moonbox.render.conn"
local budget = require "moonbox.render.budget"
local State = require "moonbox.local.state"
local Faults = require "moonbox.local.faults"
local Journal = require "moonbox.local.journal"
local service = require "moonbox.local.service"
local sim_engine = require "moonbox.local.engine.sim"
local coreutils = require "moonbox.local.engine.coreutils"
local memory = require "moonbox.local.http.memory"
local local_http = require "moonbox.local.http"

local M = {}

local BASE = "http://dry-run.invalid"

local sim -- the active dry run, or nil

-- ---- the simulated clock ------------------------------------------------------------------

local Clock = {}
Clock.__index = Clock

local function new_clock()
  return setmetatable({ t = 0, base = core.now(), wall = core.time(), timers = {}, wake = core.cond(),
    busy = 0 }, Clock)
end

-- Adds a wake-up at simulated time `at` that broadcasts cond, for the task owner (default: the
-- calling one). Only waits make wake-ups: the clock never moves to a moment nobody waits for.
function Clock:at(at, cond, owner)
  local tm = { at = at, cond = cond, owner = owner or core.current() }
  local list, i = self.timers, #self.timers
  while i >= 1 and list[i].at > at do i = i - 1 end
  table.insert(list, i + 1, tm)
  self.wake:broadcast()
  return tm
end

-- The error of a run past its limit of max simulated seconds.
local function limit_error(max)
  return core.Error.new { op = "render.dry_run", code = "simulated_time_limit",
    message = string.format("the dry run passed its limit of %g simulated seconds and was stopped: a " ..
      "loop that waits for an exec's output no hook gives (render.dry_run.on_exec)? A longer run needs " ..
      "render.dry_run.limit(seconds)", max) }
end

-- The error a wait of the main task raises: the limit's, when passing it is what cancelled it.
function Clock:why(err)
  if self.over and task.is_cancelled(err) and core.current() == self.main then return self.over end
  return err
end

-- Raises once the simulated time is past the limit (render.dry_run.limit).
function Clock:check_limit()
  local max = hooks.limit_seconds()
  if self.t > max then error(limit_error(max), 0) end
end

--- clock:wait_for(cond, seconds[, owner]): waits until cond is broadcast or `seconds` of
-- simulated time have passed, whichever comes first (owner: the task the wait is for, default
-- the calling one). Raises simulated_time_limit past the limit. [yields]
function Clock:wait_for(cond, seconds, owner)
  local tm = self:at(self.t + math.max(seconds, 0), cond, owner)
  local ok, err = pcall(cond.wait, cond)
  tm.dead = true
  if not ok then error(self:why(err), 0) end
  self:check_limit()
end

--- clock:sleep(seconds): waits `seconds` of simulated time. Raises simulated_time_limit past the
-- limit. [yields]
function Clock:sleep(seconds)
  if seconds <= 0 then return task.yield() end
  local cond, done = core.cond(), false
  local tm = self:at(self.t + seconds, cond)
  tm.fire = function() done = true end
  while not done do
    local ok, err = pcall(cond.wait, cond)
    if not ok then
      tm.dead = true
      error(self:why(err), 0)
    end
  end
  self:check_limit()
end

--- clock:timeout(seconds, fn, ...) -> fn's results: task.timeout on the simulated clock. A
-- watcher task cancels the calling task once `seconds` of simulated time have passed while fn
-- runs, and that cancellation becomes task.timeout's error (op "task.timeout", code "timeout").
-- Unlike a real deadline it interrupts one wait, not every wait after it. [yields]
function Clock:timeout(seconds, fn, ...)
  local me, cond, st = core.current(), core.cond(), {}
  local watcher = task.spawn(function()
    self:wait_for(cond, seconds, me)
    if not st.done then
      st.fired = true
      core.cancel(me)
    end
  end)
  core.observe(watcher)
  local r = table.pack(xpcall(fn, core.msgh, ...))
  st.done = true
  cond:broadcast()
  if st.fired and not r[1] and task.is_cancelled(r[2]) then
    error(core.Error.new { op = "task.timeout", code = "timeout", retryable = true, seconds = seconds,
      message = string.format("timed out after %g s (simulated)", seconds),
      traceback = type(r[2]) == "table" and r[2].traceback or nil }, 0)
  end
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- clock:now() -> the simulated time on the scale of core.now() (the real time the run began,
-- plus the simulated seconds since); clock:time() the same on core.time()'s (epoch seconds).
function Clock:now() return self.base + self.t end
function Clock:time() return self.wall + self.t end

--- clock:hold(fn, ...) -> fn's results: runs fn while the clock stands still — real work a task
-- waits for (a worker thread's archive job, a process) during which no task is ready, and the
-- clock would otherwise jump to the next simulated wake-up. Raises what fn raises. [yields] as fn.
function Clock:hold(fn, ...)
  self.busy = self.busy + 1
  local r = table.pack(pcall(fn, ...))
  self.busy = self.busy - 1
  self.wake:broadcast()
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

-- Whether a wake-up is for something that is waited for: not one of the backend's own deadline
-- timers (clock.background(task), set by dryrun.start: idle and lifetime watchers, snapshot
-- expiries, the token sweep), which wait on the clock all the time.
function Clock:foreground_pending()
  for _, tm in ipairs(self.timers) do
    if not tm.dead and not (self.background and self.background(tm.owner)) then return true end
  end
  return false
end

-- The driver: whenever no other task is ready, no real work holds the clock and something other
-- than the backend's own deadlines waits on it, it jumps to the next wake-up (a deadline due
-- before it fires on the way). Between the tasks that use a dry run (a spec's tests) it stands
-- still.
function Clock:drive()
  while true do
    task.yield()
    if core.stats().queued == 0 and (self.busy > 0 or not self:foreground_pending()) then
      self.wake:wait()
    elseif core.stats().queued == 0 then
      local tm = table.remove(self.timers, 1)
      while tm and tm.dead do tm = table.remove(self.timers, 1) end
      if tm then
        -- Passing the limit stops the recipe, whatever it waits on (a wait on the backend's
        -- answer too, whose own task is the one the clock wakes): its main task is cancelled and
        -- dryrun.over() says why (moonbox run reports that error).
        local max = hooks.limit_seconds()
        if tm.at > max and not self.over and self.main then
          self.over = limit_error(max)
          core.cancel(self.main)
        end
        if tm.at > self.t then self.t = tm.at end
        if tm.fire then tm.fire() end
        if tm.cond then tm.cond:broadcast() end
      else
        self.wake:wait()
      end
    end
  end
end

-- ---- the report -----------------------------------------------------------------------------

local Sim = {}
Sim.__index = Sim

local LOG_MAX = 200 -- steps the text report lists

-- Records one step of the run (the first LOG_MAX are kept for the report); returns its fields,
-- which the caller may still complete.
function Sim:step(what, fields)
  local s = self.stats
  s.steps = s.steps + 1
  fields = fields or {}
  fields.t = math.floor(self.clock.t * 1000 + 0.5) / 1000
  fields.what = what
  if #self.log < LOG_MAX then self.log[#self.log + 1] = fields end
  return fields
end

-- Counts the sandbox-seconds up to now and changes the live count (of plan) by delta.
function Sim:live_changed(delta, plan)
  local now = self.clock.t
  -- sandbox-seconds accrue between changes of the live count
  self.stats.seconds = self.stats.seconds + self.live * (now - self.live_since)
  for p, n in pairs(self.live_by_plan) do
    self.stats.by_plan_seconds[p] = (self.stats.by_plan_seconds[p] or 0) + n * (now - self.live_since)
  end
  self.live_since = now
  self.live = self.live + delta
  self.live_by_plan[plan] = (self.live_by_plan[plan] or 0) + delta
  if self.live > self.stats.peak_live then self.stats.peak_live = self.live end
end

-- What the simulated engine tells (moonbox.local.engine.sim's opts.observe): counts, the live
-- sandboxes, the steps. Returns the step's fields.
function Sim:observed(what, f)
  local st = self.stats
  if what == "create" or what == "restore" then
    st.creates = st.creates + 1
    st.creates_by_plan[f.plan] = (st.creates_by_plan[f.plan] or 0) + 1
    if what == "restore" then st.restores = st.restores + 1 end
    self:live_changed(1, f.plan)
  elseif what == "terminate" then
    self:live_changed(-1, f.plan)
    f.plan = nil
  elseif what == "exec" then
    st.execs = st.execs + 1
  elseif what == "upload" then
    st.uploads = st.uploads + 1
  elseif what == "download" then
    st.downloads = st.downloads + 1
  end
  return self:step(what, f)
end

-- The transport the connection uses: the in-memory server's, noting the snapshot steps from the
-- answers (the engine sees captures, not the names and deletes the wire carries).
function Sim:wrap_transport(t)
  local s = self
  local function note(opts, r)
    local method = opts.method or "GET"
    local path = (opts.url or ""):match("^https?://[^/]+(/[^?]*)") or ""
    if method == "POST" and r.status == 202 then
      local sandbox = path:match("^/v1/sandboxes/([^/]+)/snapshots$")
      if sandbox then
        local ok, snap = pcall(json.decode, r.body)
        if ok and type(snap) == "table" then
          s.stats.snapshots = s.stats.snapshots + 1
          s:step("snapshot", { sandbox = sandbox, snapshot = snap.id,
            name = snap.name ~= json.null and snap.name or nil })
        end
      end
    elseif method == "DELETE" and r.status == 204 then
      local sid = path:match("^/v1/sandbox%-groups/[^/]+/snapshots/([^/]+)$")
      if sid then s:step("delete snapshot", { snapshot = sid }) end
    end
  end
  return {
    request = function(opts)
      local r = t.request(opts)
      note(opts, r)
      return r
    end,
    stream = t.stream,
  }
end

--- sim:report() -> {creates, creates_by_plan, restores, snapshots, execs, uploads, downloads,
-- peak_live, sandbox_seconds, sandbox_seconds_by_plan, simulated_s, live_at_end, durations,
-- api_requests (what the simulated backend received, data plane included), steps (the first
-- LOG_MAX: {t, what, sandbox, ...}), steps_total}. Does not yield.
function Sim:report()
  self:live_changed(0, "1c-2g")
  local st = self.stats
  local function round(x) return math.floor(x * 1000 + 0.5) / 1000 end
  local by_plan = {}
  for p, v in pairs(st.by_plan_seconds) do by_plan[p] = round(v) end
  return { creates = st.creates, creates_by_plan = st.creates_by_plan, restores = st.restores,
    snapshots = st.snapshots, execs = st.execs, uploads = st.uploads, downloads = st.downloads,
    peak_live = st.peak_live, sandbox_seconds = round(st.seconds), sandbox_seconds_by_plan = by_plan,
    simulated_s = round(self.clock.t), live_at_end = self.live, durations = hooks.hooks.durations(),
    api_requests = self.backend.srv.requests, steps = self.log, steps_total = st.steps }
end

-- ---- start and stop ---------------------------------------------------------------------------

local saved -- what start() replaced, put back by stop()

-- The functions whose real work holds the simulated clock still during a dry run (clock:hold).
local HELD = { { "moonbox.archive", "pack" }, { "moonbox.archive", "unpack" }, { "moonbox.archive", "list" },
  { "moonbox.archive", "to_records" }, { "moonbox.archive", "from_records" }, { "moonbox.proc", "run" } }

--- dryrun.start() -> Sim: makes this process's render calls go to a new moonbox local with a
-- simulated engine, on a simulated clock (render.connect and the default connection both give
-- a dry-run connection), and task.sleep, task.now, task.timeout and the budgets' clock follow
-- the simulated one, until dryrun.stop(). Spawns the clock's driver task, so it must run inside
-- a task. Raises when a dry run is already active. [yields] (the service's start).
function M.start()
  if sim then error("moonbox.dryrun: a dry run is already active", 2) end
  local clock = new_clock()
  local s = setmetatable({
    clock = clock, log = {}, live = 0, live_since = 0, live_by_plan = {},
    stats = { creates = 0, creates_by_plan = {}, restores = 0, snapshots = 0, execs = 0, uploads = 0,
      downloads = 0, peak_live = 0, seconds = 0, by_plan_seconds = {}, steps = 0 },
  }, Sim)
  sim = s
  clock.main = core.current()
  saved = { sleep = task.sleep, now = task.now, timeout = task.timeout, clock = budget.clock }
  task.sleep = function(seconds)
    if type(seconds) ~= "number" or seconds ~= seconds or seconds < 0 then
      error("task.sleep: expected a number of seconds >= 0", 2)
    end
    return clock:sleep(seconds)
  end
  task.now = function() return clock:now() end
  task.timeout = function(seconds, fn, ...)
    if type(seconds) ~= "number" or seconds ~= seconds or seconds < 0 then
      error("task.timeout: expected seconds >= 0, got " .. tostring(seconds), 2)
    end
    if type(fn) ~= "function" then error("task.timeout: expected a function", 2) end
    return clock:timeout(seconds, fn, ...)
  end
  budget.clock = { now = function() return clock:now() end,
    wait = function(cond, seconds) clock:wait_for(cond, seconds) end }
  -- Real work that tasks wait for holds the clock still: the archive jobs (worker threads: the
  -- client's sb:put_dir and sb:get_dir, the engine's directory transfers) and proc.run.
  saved.real = {}
  for _, name in ipairs(HELD) do
    local mod, fname = name[1], name[2]
    -- lazy: moonbox.archive (libarchive) and moonbox.proc, loaded only once a dry run starts
    local m = require(mod)
    local real = m[fname]
    saved.real[#saved.real + 1] = { m, fname, real }
    m[fname] = function(...) return clock:hold(real, ...) end
  end
  hooks.set_active(true)
  s.driver = task.spawn(function() clock:drive() end)
  core.observe(s.driver)

  -- The service's clock is the simulated one too: records, deadlines, token lifetimes, rate
  -- windows, the run grace.
  local sclock = { now = function() return clock:now() end, time = function() return clock:time() end }
  -- A private directory for the archives of directory transfers, made on first use, removed at
  -- the end; the service's state directory is named under it and never made.
  local tmp = os.tmpname()
  os.remove(tmp)
  s.temp_dir = tmp
  local st = State.open(":memory:")
  local workspace, user = ids.new("tea"), ids.new("usr")
  local engine = sim_engine.new { now = sclock.time, duration = hooks.duration, answer = hooks.exec_answer,
    download = hooks.download_answer, observe = function(what, f) return s:observed(what, f) end,
    temp_dir = tmp .. "/transfers", hold = function(fn, ...) return clock:hold(fn, ...) end,
    builtin = coreutils.run }
  local srv = memory.new(sclock)
  local backend = { journal = Journal.new(), faults = Faults.new(nil, nil), workspace = workspace,
    state_dir = tmp .. "/state", url = BASE, public_url = BASE, srv = srv, st = st, engine = engine,
    api_key = "rnd_" .. ids.token(), ready = false, lines = {} }
  backend.log = function(line)
    if #backend.lines < 100 then backend.lines[#backend.lines + 1] = line end
  end
  srv:set_key(backend.api_key)
  backend.svc = service.new {
    st = st, engine = engine, state_dir = backend.state_dir, workspace = workspace, user = user,
    log = backend.log, clock = sclock,
    on_token = function(op, token, info, ttl)
      if op == "put" then srv:token_put(token, info.sandbox, info.op, ttl) else srv:token_drop(token) end
    end,
  }
  local_http.install(backend)
  local svc = backend.svc
  clock.background = function(t)
    if t == nil then return false end
    if svc.tasks.tokens == t then return true end
    for _, timer in pairs(svc.snap_timers) do if timer == t then return true end end
    for _, runtime in pairs(svc.runtime) do if runtime.watch == t then return true end end
    return false
  end
  backend.svc:start()
  backend.ready = true
  s.backend = backend
  s.transport = s:wrap_transport(srv:transport())
  conn.simulate(function()
    return { url = BASE, transport = s.transport, workspace = workspace, api_key = backend.api_key }
  end)
  return s
end

--- dryrun.current() -> the active Sim, or nil.
function M.current() return sim end

--- dryrun.hold(fn, ...) -> fn's results: runs fn with the simulated clock held still (see
-- clock:hold): for real work a recipe or a spec waits for during a dry run (a process, a file
-- job), which would otherwise let simulated time jump ahead. Outside a dry run, calls fn.
-- Raises what fn raises. [yields] as fn.
function M.hold(fn, ...)
  if not sim then return fn(...) end
  return sim.clock:hold(fn, ...)
end

--- dryrun.over() -> the simulated_time_limit error once the active dry run passed its limit (its
-- main task, the one that called dryrun.start, was cancelled then), else nil. Does not yield.
function M.over() return sim and sim.clock.over or nil end

--- dryrun.stop() -> report: ends the dry run (the service and its records are closed, the
-- temporary directory removed, the driver stopped; task.sleep, task.now, task.timeout and the
-- budgets' clock are real again; render connects for real again; the hooks and durations are
-- cleared) and returns its report (see sim:report()). Returns nil when none is active. [yields]
function M.stop()
  local s = sim
  if not s then return nil end
  local rep = s:report()
  sim = nil
  local b = s.backend
  pcall(b.svc.close, b.svc)
  b.srv:close()
  b.st:close()
  if s.backend.engine.temp_made then pcall(sys.remove_tree, s.temp_dir) end
  task.cancel(s.driver)
  task.sleep, task.now, task.timeout = saved.sleep, saved.now, saved.timeout
  for i = #saved.real, 1, -1 do
    local r = saved.real[i]
    r[1][r[2]] = r[3]
  end
  budget.clock = saved.clock
  conn.simulate(nil)
  hooks.set_active(false)
  return rep
end

-- ---- the report as text and JSON --------------------------------------------------------------

-- Sorted "k: v" pairs of a table.
local function pairs_text(t, fmt)
  local keys = {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for _, k in ipairs(keys) do parts[#parts + 1] = string.format("%s: " .. (fmt or "%s"), k, t[k]) end
  return #parts > 0 and table.concat(parts, ", ") or "none"
end

--- dryrun.text(report, recipe) -> what `moonbox run --dry-run` prints: the steps in simulated
-- time, then the totals. Does not yield.
function M.text(rep, recipe)
  local out = { string.format("dry run of %s: nothing was created, started or sent", recipe or "the recipe") }
  for _, s in ipairs(rep.steps) do
    local detail
    if s.what == "create" or s.what == "restore" then
      detail = string.format("%s plan %s%s", s.sandbox, s.plan, s.snapshot and (" from " .. s.snapshot) or "")
    elseif s.what == "exec" then
      local cmd = s.command:gsub("\n", "\\n")
      if #cmd > 60 then cmd = cmd:sub(1, 57) .. "..." end
      detail = string.format("%s `%s` (%gs, %s %s)", s.sandbox, cmd, s.seconds,
        s.killed and "killed, exit" or "exit", tostring(s.code))
    elseif s.what == "snapshot" then
      detail = string.format("%s -> %s%s", s.sandbox, s.snapshot, s.name and (" " .. s.name) or "")
    elseif s.what == "upload" or s.what == "download" then
      detail = string.format("%s %s (%d bytes)", s.sandbox, s.path, s.bytes)
    else
      detail = s.sandbox or s.snapshot or ""
    end
    out[#out + 1] = string.format("  %8.3fs  %-15s %s", s.t, s.what, detail)
  end
  if rep.steps_total > #rep.steps then
    out[#out + 1] = string.format("  ... %d more steps", rep.steps_total - #rep.steps)
  end
  out[#out + 1] = string.format("creates: %d (%s); restores among them: %d", rep.creates,
    pairs_text(rep.creates_by_plan), rep.restores)
  out[#out + 1] = string.format("snapshots: %d; execs: %d; uploads: %d; downloads: %d", rep.snapshots,
    rep.execs, rep.uploads, rep.downloads)
  out[#out + 1] = string.format("peak live sandboxes: %d; sandbox-seconds: %.1f (%s); simulated time: %.1f s",
    rep.peak_live, rep.sandbox_seconds, pairs_text(rep.sandbox_seconds_by_plan, "%.1f"), rep.simulated_s)
  if rep.live_at_end > 0 then
    out[#out + 1] = string.format("left running at the end: %d sandbox(es) (kept, or leaked by the recipe)",
      rep.live_at_end)
  end
  out[#out + 1] = "simulated durations: " .. pairs_text(rep.durations, "%gs")
  return table.concat(out, "\n")
end

--- dryrun.json(report, fields) -> the report as one JSON object (fields: more keys, e.g.
-- recipe, outcome, exit_code, error, api_calls). Does not yield.
function M.json(rep, fields)
  local o = {}
  for k, v in pairs(rep) do o[k] = v end
  o.creates_by_plan = json.object(rep.creates_by_plan)
  o.sandbox_seconds_by_plan = json.object(rep.sandbox_seconds_by_plan)
  local steps = json.array()
  for i, s in ipairs(rep.steps) do steps[i] = s end
  o.steps = steps
  for k, v in pairs(fields or {}) do o[k] = v end
  o.dry_run = true
  return json.encode(o)
end

return M
