--- moonbox.schedule.daemon — fires a recipe's schedules: timers, runs, overlap, catch-up.
--
-- One timer task per schedule computes the next slot from the last one handled, waits for it
-- (plus jitter) on moonbox.timer.sleep_until — an ev_periodic on the wall clock, armed for
-- exactly that time: nothing wakes in between — and fires. Each fire that runs is a task of its
-- own, attached to its own ledger run (ledger.attach), with an optional watchdog that cancels
-- it at its timeout. The root task starts the runs a finished run leaves queued (buffer_one),
-- so run tasks never spawn runs (spawn chains stay short), and it is the task SIGINT/SIGTERM
-- cancel: it then stops the timers and cancels (or, with drain, waits for) the runs.
--
-- Every decision is written to the store before it takes effect (the slot's record first), so
-- a daemon killed at any point leaves history that a restart can finish: runs left queued or
-- running become "interrupted" and what their ledger runs hold is terminated; slots missed
-- while no daemon ran are caught up once (inside the catch-up window) or recorded skipped.
--
-- On a shared store (PostgreSQL; store.shared) several daemons, on several machines, fire the
-- same schedules: each slot is claimed by the INSERT of its record, so exactly one of them runs
-- it and the others count it handled. Every daemon renews the leases of the runs it holds
-- (ledger:keep_alive) and sweeps (Daemon:sweep_loop): a queued or running record whose lease
-- expired is recorded interrupted by the one daemon whose UPDATE gets it, and what its ledger
-- run holds is terminated. While the database is away, a timer neither fires nor marks its
-- slot handled (db_down / await_db): when it is back, the timer's next turn catches the missed
-- slots up under the schedule's policy.
--
-- Requests from other machines ride on the lease keeper's wake (every third of the lease;
-- Daemon:on_renew): a `moonbox schedule FILE --stop [--drain]` row in table daemons makes the
-- daemon acknowledge and shut down as on SIGTERM (cancelling, or draining, its runs); a
-- cancel_request another daemon's cancel_other left on a run this daemon holds cancels that
-- run here, and the other daemon waits for its end before it starts the newer slot. A
-- buffer_one fire behind another daemon's run queues its slot in the shared history; the first
-- daemon that sees no run of the schedule running takes it (store:take_queued).
--
-- A durable schedule's run (durable = true; docs/schedule.md, "Durable schedules") is a durable
-- run (moonbox.durable) in this process: its ledger run is opened durable before the recipe
-- starts, and a journal attached to its task tree (each run has its own: the daemon runs
-- several at once). When its daemon dies, the sweep that finds the record orphaned does not
-- record it interrupted: exactly one daemon claims it (store:claim_resume, then ledger:claim_run
-- of its ledger run) and resumes it here — the recipe again from the top, its journal answering
-- what was done, its sandboxes adopted — in the same history record, which counts the resumes
-- and names the daemon that made the latest. On SQLite, where one daemon fires a schedule, the
-- daemon started after a kill resumes what it finds dead at its start (Daemon:recover).
local task = require "moonbox.task"
local core = require "moonbox.core"
local schedule = require "moonbox.schedule"
local clock_mod = require "moonbox.schedule.clock"
local ledger_mod = require "moonbox.ledger"
local reap = require "moonbox.reap"
local trace = require "moonbox.trace"
local durable = require "moonbox.durable"
local dstore = require "moonbox.durable.store"
local drun = require "moonbox.durable.run"
local conn_mod = require "moonbox.render.conn"

local M = {}
local Daemon = {}
Daemon.__index = Daemon

-- Missed slots recorded one by one after an outage; older ones share one summary record.
local MAX_LISTED = 100

local fmt = clock_mod.format

local function one_line(err)
  local s
  if type(err) == "table" and core.Error.is(err) then
    s = tostring(err)
  else
    local ok, v = pcall(tostring, err)
    s = ok and v or "(an error object)"
  end
  s = trace.redact(s) -- the history must not keep the API key or an env value a message quoted
  if #s > 2000 then s = s:sub(1, 2000) .. " [...]" end
  return s
end

--- Whether err says the database is unavailable (the store raises code "db_unavailable").
local function db_down(err)
  return type(err) == "table" and rawget(err, "code") == "db_unavailable"
end
M.db_down = db_down

--- shielded(fn, ...) -> fn's results: runs fn in a task of its own and waits for it, also when
-- the caller is cancelled meanwhile (it waits again), so bookkeeping that yields (a run's
-- outcome on PostgreSQL) is written even when a shutdown cancels the run. [yields]
local function shielded(fn, ...)
  local t = task.spawn(fn, ...)
  while true do
    local ok, a, b = pcall(task.join, t)
    if ok then return a, b end
    if task.result(t) ~= nil then error(a, 0) end -- it failed on its own
  end
end

--- daemon.new{recipe, schedules, clock, store, out, errout, drain} -> Daemon. out(line) gets
-- the event log; errout(text) failures with their tracebacks.
function M.new(o)
  local d = setmetatable({ recipe = o.recipe, schedules = o.schedules, clock = o.clock, store = o.store,
    out = o.out, errout = o.errout or o.out, drain = o.drain, format_error = o.format_error or one_line,
    wake = core.cond(), pending = {}, names = {}, rt = {}, last = {}, timers = {}, subscribers = {},
    -- records this daemon queued behind another daemon's run (buffer_one), by id
    queued_elsewhere = {},
    -- resumed runs that are not their schedule's active run (another run of it was active here)
    extra_runs = {}, by_name = {} },
    Daemon)
  for _, s in ipairs(d.schedules) do
    d.names[#d.names + 1] = s.name
    d.rt[s.name] = {}
    d.by_name[s.name] = s
  end
  return d
end

--- daemon:subscribe(fn) -> unsubscribe(): fn(event, e) is called, synchronously, for what the
-- daemon does (moonbox.schedule.ops: metrics, alerts, traces, the status page):
--   "loop"      e.running: the fire loop started (true) or stopped (false)
--   "next_fire" e.schedule (name), e.at: the schedule's timer is armed for e.at
--   "started"   e.schedule, e.run (id, slot, trigger, started_at; a subscriber may add fields,
--               e.g. trace): a run started
--   "finished"  e.schedule, e.id, e.outcome, e.message, e.slot, e.trigger, e.started_at,
--               e.ended_at, e.run (nil for a record that never ran: skipped, or interrupted or
--               cancelled while queued), e.error (code, op, sandbox_id, request_id of a failed
--               run's error, when it had them), e.failures (consecutive, after this one),
--               e.failures_before, e.ledger_run, e.sandboxes: a history record got its final
--               outcome
--   "paused"    e.schedule, e.reason, e.failures, e.run: paused after N failures
-- Subscribers must not wait; one that raises is reported on errout and dropped.
function Daemon:subscribe(fn)
  local key = {}
  self.subscribers[key] = fn
  return function() self.subscribers[key] = nil end
end

function Daemon:emit(event, e)
  for key, fn in pairs(self.subscribers) do
    local ok, err = pcall(fn, event, e)
    if not ok then
      self.subscribers[key] = nil
      self.errout(string.format("moonbox schedule: a %s subscriber failed and was removed: %s\n", event,
        one_line(err)))
    end
  end
end

function Daemon:log(fmt_, ...)
  self.out(fmt(self.clock:now()) .. " " .. string.format(fmt_, ...))
end

-- The slot is handled: remember it (in memory; the store was updated with the record).
function Daemon:handled(s, slot)
  if self.last[s.name] == nil or slot > self.last[s.name] then self.last[s.name] = slot end
end

function Daemon:record_skipped(s, slot, trigger, why, due)
  local now = self.clock:now()
  local id = self.store:record({ schedule = s.name, slot = slot, trigger = trigger, due_at = due,
      fired_at = now,
    ended_at = now,
    outcome = "skipped", error = why, last_slot = true }, now)
  self:handled(s, slot)
  if id then
    self:log("%s: slot %s skipped (record %d): %s", s.name, fmt(slot), id, why)
    self:emit("finished", { schedule = s.name, id = id, outcome = "skipped", message = why, slot = slot,
      trigger = trigger, ended_at = now })
  end
end

-- ---- runs -----------------------------------------------------------------------------------

--- Starts a run for q = {slot, trigger, fired_at, id (a queued record)}; returns it, or nil when
-- the slot already has a record.
function Daemon:start(s, q)
  local now = self.clock:now()
  local id = q.id
  if q.resume then return self:start_resumed(s, q.resume) end
  if id and q.take then
    q.pending = nil
    if not self.store:take_queued(id, s.name, now) then
      local r = self.store:run_row(id)
      if not r or r.outcome ~= "queued" then
        -- another daemon started it (or it ended): no longer this daemon's to renew or start
        if self.queued_elsewhere[id] then self.store:drop_lease(id) end
        self.queued_elsewhere[id] = nil
      end
      return nil
    end
    self.queued_elsewhere[id] = nil
  elseif id then
    self.store:started(id, now)
  else
    id = self.store:record({ schedule = s.name, slot = q.slot, trigger = q.trigger, due_at = q.due_at,
      fired_at = q.fired_at or now,
      started_at = now, outcome = "running", last_slot = q.trigger ~= "manual" }, now)
    if not id then
      if self.store.shared then
        self:log("%s: slot %s was claimed by another daemon", s.name, fmt(q.slot))
      else
        self:log("%s: slot %s already has a record; not running it again", s.name, fmt(q.slot))
      end
      if q.trigger ~= "manual" then self:handled(s, q.slot) end -- or the timer finds it again
      return nil
    end
  end
  if q.trigger ~= "manual" then self:handled(s, q.slot) end
  local run = { id = id, slot = q.slot, trigger = q.trigger, started_at = now }
  self.rt[s.name].active = run
  self:log("%s: run %d started (slot %s, %s)", s.name, id, fmt(q.slot), q.trigger)
  self:emit("started", { schedule = s.name, run = run })
  run.task = task.spawn(self.run_body, self, s, run)
  return run
end

--- The body of run's task (spawned by start): runs s.fn(info) with info = {id, schedule, slot,
-- slot_text, trigger, started_at} under the ledger (its creates go to a ledger run, recorded on
-- the run row as soon as it begins), with a watchdog task that cancels it after s.timeout.
-- Decides the outcome: ok, failed (message is the error's first line; its code and ids go to
-- run.error, the whole error to errout), timeout, or cancelled (by a shutdown or another
-- daemon's cancel_other, whose reason is in run.stop_reason). Then records it with finish,
-- shielded from cancellation and retried while the database is down. Never raises: a failure to record is
-- written to errout and the schedule is freed to fire again. [yields]
function Daemon:run_body(s, run)
  local me = task.current()
  local lctx = { ledger = self.store.ledger,
    recipe = string.format("%s (schedule %s, run %d)", self.recipe, s.name, run.id),
    on_begin = function(lid)
      run.ledger_run = lid
      self.store:set_ledger_run(run.id, lid)
    end }
  ledger_mod.attach(me, lctx)
  local watchdog
  if s.timeout then
    watchdog = task.spawn(function()
      self.clock:sleep_until(run.started_at + s.timeout)
      if not run.finished then
        run.stop_reason = "timeout"
        run.stop_message = string.format("the run exceeded its timeout of %s and was cancelled",
          schedule.format_duration(s.timeout))
        task.cancel(me)
      end
    end)
  end
  -- (after the watchdog's spawn: the journal is the recipe's, not the daemon's)
  local jerr
  if s.durable then
    local bok, berr = pcall(self.durable_begin, self, s, run, lctx, me)
    if not bok then jerr = berr end
  end
  local info = { id = run.id, schedule = s.name, slot = run.slot, slot_text = schedule.format_slot(s,
      run.slot),
    trigger = run.trigger, started_at = run.started_at }
  local ok, err
  if jerr then
    ok, err = false, jerr
  else
    ok, err = xpcall(s.fn, core.msgh, info)
  end
  if run.journal then self:durable_end(s, run) end
  run.finished = true
  if watchdog then
    task.cancel(watchdog)
    pcall(task.join, watchdog)
  end
  local outcome, message
  if run.stop_reason then
    outcome = run.stop_reason == "timeout" and "timeout" or "cancelled"
    message = run.stop_message
    if not ok and not task.is_cancelled(err) then
      message = message .. "; while unwinding: " .. one_line(err)
    end
  elseif ok then
    outcome = "ok"
  elseif task.is_cancelled(err) then
    outcome, message = "cancelled", "the run's task was cancelled"
  else
    outcome, message = "failed", one_line(err)
    if type(err) == "table" then
      run.error = { code = err.code, op = err.op, sandbox_id = err.sandbox_id, request_id = err.request_id,
        snapshot_id = err.snapshot_id, exec_id = err.exec_id }
    end
    self.errout(string.format("moonbox schedule: %s: run %d failed: %s\n", s.name, run.id,
        self.format_error(err)))
  end
  ledger_mod.detach(me)
  local function record()
    local fok, ferr = pcall(self.finish, self, s, run, outcome, message)
    while not fok and db_down(ferr) do
      -- Its outcome is kept until the database is back (its lease may run out meanwhile).
      local wok, werr = pcall(self.await_db, self, ferr)
      if not wok then return false, werr end
      fok, ferr = pcall(self.finish, self, s, run, outcome, message)
    end
    return fok, ferr
  end
  local fok, ferr = shielded(record)
  if not fok then
    -- Recording failed (the database): still let the schedule fire again.
    local rt = self.rt[s.name]
    if rt.active == run then rt.active = nil end
    self.errout(string.format("moonbox schedule: %s: run %d (%s) could not be recorded: %s\n", s.name,
      run.id, outcome, self.format_error(ferr)))
  end
end

-- ---- durable runs ------------------------------------------------------------------------------

local FINAL = { ok = true, failed = true, timeout = true, cancelled = true, interrupted = true }

--- Sets up run's journal in its task me (run_body, for a durable schedule s): a fresh run opens
-- its ledger run now, durable (the journal is kept under its id, so it must exist before the
-- first call), and records it on the history record; a resumed run (run.resume, claimed by
-- Daemon:resume) goes on in the ledger run it claimed, with the journal that run wrote, checking
-- the sandboxes it holds before its first live call. Raises when the run store cannot be
-- written or a resume cannot go on here. [yields] on PostgreSQL.
function Daemon:durable_begin(s, run, lctx, me)
  local L = self.store.ledger
  local entries = {}
  local ok, c = pcall(conn_mod.default)
  if not ok then c = {} end
  if run.resume and run.resume.ledger then
    local lr = run.resume.ledger
    if c.base and lr.backend ~= c.base then
      error(string.format("moonbox schedule: %s: run %d (ledger run %d) was journaled against the " ..
        "backend %s and this daemon uses %s: it cannot be resumed here (the daemons of a schedule " ..
        "must share one backend)", s.name, run.id, lr.id, tostring(lr.backend), tostring(c.base)), 0)
    end
    lctx.run_id = lr.id
    entries = dstore.db(L.db, lr.id):load()
  else
    lctx.run_id = L:open_run { recipe = lctx.recipe, backend = c.base or "(none)", workspace = c.workspace,
      local_state = c.state_dir, durable = true }
    run.ledger_run = lctx.run_id
    self.store:set_ledger_run(run.id, lctx.run_id)
  end
  run.ledger_run = lctx.run_id
  local j = durable.new { mode = "durable", store = dstore.db(L.db, lctx.run_id), entries = entries,
    on_live = run.resume and drun.check_sandboxes or nil }
  j.run_id = lctx.run_id
  durable.attach(j, me)
  run.journal = j
end

--- Ends run's journal (run_body, after the recipe returned or raised, in the run's task): what
-- waits to be written is written; a resumed run terminates the sandboxes its journal holds that
-- the recipe never reached again (it went another way, or failed first), and logs what its
-- journal answered. [yields]
function Daemon:durable_end(s, run)
  local j = run.journal
  local stats = durable.detach(j)
  run.journal_stats = stats
  if run.resume then
    drun.terminate_unreached(j, function(line) self:log("%s: run %d: %s", s.name, run.id, line) end)
    self:log("%s: run %d: resumed (resume %d of ledger run %d): %d call(s) answered from its journal, " ..
      "%d in flight when it stopped, %d live, %d journal write(s)", s.name, run.id, run.resume.resumes,
      run.ledger_run, stats.replayed, stats.in_flight, stats.live, stats.writes)
  else
    self:log("%s: run %d: durable (ledger run %d): %d call(s), %d journal write(s)", s.name, run.id,
      run.ledger_run, stats.live, stats.writes)
  end
end

--- Takes over the orphaned record r of durable schedule s, whose daemon died during the run
-- (Daemon:recover): returns true when r is dealt with here (resumed by this daemon, settled, or
-- left for a later sweep), false when it is to be recorded interrupted as any other run (its
-- ledger run is not durable). The claim is store:claim_resume (one daemon wins), then
-- ledger:claim_run of its ledger run; the run then starts from the fire loop (start_resumed).
-- [yields] on PostgreSQL.
function Daemon:resume(s, r, now)
  local L = self.store.ledger
  local lr = r.ledger_run and L:run(r.ledger_run)
  if lr and lr.alive then return true end -- renewed with the record: a later sweep judges it
  if lr and (lr.durable or 0) == 0 then return false end
  if lr and lr.ended_at ~= nil then
    -- the run had ended, and its daemon died before the record said so
    local msg = string.format("its daemon %s stopped after the run ended (%s), before recording it",
      tostring(r.owner), tostring(lr.outcome))
    -- (a ledger outcome a record does not have, e.g. `moonbox reap --abandon`'s: interrupted)
    local outcome = FINAL[lr.outcome] and lr.outcome or "interrupted"
    if self.store:settle(r.id, outcome, outcome ~= "ok" and msg or nil, now) then
      self:log("%s: run %d (slot %s) recorded %s: %s", r.schedule, r.id, fmt(r.slot), outcome, msg)
      self:emit("finished", { schedule = r.schedule, id = r.id, outcome = outcome, message = msg,
        slot = r.slot, trigger = r.trigger, started_at = r.started_at, ended_at = now,
        ledger_run = r.ledger_run })
    end
    return true
  end
  if not self.store:claim_resume(r) then return true end -- another daemon took it
  local claimed
  if lr then
    local why
    claimed, why = L:claim_run(lr.id)
    if not claimed then
      local msg = string.format("its daemon %s stopped during the run, and resuming it failed: %s",
        tostring(r.owner), why)
      self.store:finish(r.id, "interrupted", msg, now)
      self:log("%s: run %d (slot %s) recorded interrupted: %s", r.schedule, r.id, fmt(r.slot), msg)
      self:emit("finished", { schedule = r.schedule, id = r.id, outcome = "interrupted", message = msg,
        slot = r.slot, trigger = r.trigger, started_at = r.started_at, ended_at = now,
        ledger_run = r.ledger_run })
      return true
    end
  end
  local row = self.store:run_row(r.id) or r
  local resume = { record = row, ledger = claimed, resumes = row.resumes or 1, from = r.owner }
  -- The run is its schedule's active run here from now on (overlap), unless another one is.
  local run = { id = r.id, slot = r.slot, trigger = r.trigger, started_at = row.started_at or row.fired_at,
    resume = resume, ledger_run = claimed and claimed.id or nil }
  resume.run = run
  local rt = self.rt[s.name]
  if rt.active == nil then
    rt.active = run
  else
    self.extra_runs[run] = s
  end
  self:log("%s: run %d (slot %s): its daemon %s stopped during the run; resuming it here (resume %d%s)",
    s.name, r.id, fmt(r.slot), tostring(r.owner), resume.resumes,
    claimed and string.format(", ledger run %d: %d journal entries", claimed.id,
      dstore.db(L.db, claimed.id):count()) or ", no journal yet: from the start")
  self.pending[#self.pending + 1] = { s = s, q = { id = r.id, slot = r.slot, trigger = r.trigger,
    resume = resume } }
  self.wake:signal()
  return true
end

--- Starts the run of a record this daemon claimed to resume (Daemon:resume; from the fire loop
-- in the root task, as every run): the same record, slot and start, in its ledger run. Returns
-- the run. Does not yield.
function Daemon:start_resumed(s, resume)
  local run = resume.run
  self:emit("started", { schedule = s.name, run = run })
  run.task = task.spawn(self.run_body, self, s, run)
  return run
end

--- Records the end of run of s: ends its ledger run and its run row with outcome and message,
-- emits "finished" (with the consecutive failure count, before and after, and the sandboxes the
-- run made) and logs it; after failures >= s.pause_after_failures (failed or timeout) pauses
-- the schedule and emits "paused". Frees the schedule for its next fire, then hands a slot
-- queued behind this run (buffer_one) to the fire loop, or on a shared store looks for one that
-- another daemon queued. Raises the store's errors (run_body retries it while the database is
-- down); [yields] on PostgreSQL.
function Daemon:finish(s, run, outcome, message)
  local now = self.clock:now()
  if run.ledger_run then self.store.ledger:end_run(outcome, run.ledger_run) end
  self.store:finish(run.id, outcome, message, now)
  run.outcome, run.message = outcome, message
  local before = next(self.subscribers) and self.store:state(s.name)
  local failures = self.store:count_outcome(s.name, outcome)
  local sandboxes = run.ledger_run and self.store.ledger:sandboxes(run.ledger_run) or {}
  self:emit("finished", { schedule = s.name, id = run.id, outcome = outcome, message = message,
    slot = run.slot, trigger = run.trigger, started_at = run.started_at, ended_at = now, run = run,
    error = run.error, failures = failures, failures_before = before and before.failures or 0,
    ledger_run = run.ledger_run, sandboxes = sandboxes })
  self:log("%s: run %d %s%s%s", s.name, run.id, outcome,
    #sandboxes > 0 and (" (sandboxes " .. table.concat(sandboxes, ", ") .. ")") or "",
    message and (": " .. message) or "")
  if (outcome == "failed" or outcome == "timeout") and s.pause_after_failures
    and failures >= s.pause_after_failures then
    local st = self.store:state(s.name)
    if st and st.paused ~= 1 then
      local reason = string.format("paused after %d consecutive failures (last: run %d, %s)", failures,
          run.id,
        outcome)
      self.store:set_paused(s.name, true, reason, now)
      self:log("%s: %s; `moonbox schedule %s --resume %s` resumes it", s.name, reason, self.recipe, s.name)
      self:emit("paused", { schedule = s.name, reason = reason, failures = failures, run = run })
    end
  end
  local rt = self.rt[s.name]
  if rt.active == run then rt.active = nil end
  self.extra_runs[run] = nil
  if rt.queued and not self.stopping then
    self.pending[#self.pending + 1] = { s = s, q = rt.queued }
    rt.queued = nil
    self.wake:signal()
  elseif self.store.shared and s.overlap == "buffer_one" and not self.stopping and self.looping then
    -- a slot another daemon queued behind this run: whichever daemon sees the end first takes it
    local q = self.store:queued_record(s.name)
    if q then self:take_later(s, q) end
  end
end

--- Has the fire loop try to take the shared queued record q of s (buffer_one). Does not yield.
function Daemon:take_later(s, q)
  for _, p in ipairs(self.pending) do if p.q.id == q.id then return end end
  self.pending[#self.pending + 1] = { s = s, q = { id = q.id, slot = q.slot, trigger = q.trigger,
    fired_at = q.fired_at, due_at = q.due_at, take = true } }
  self.wake:signal()
end

-- ---- fires ----------------------------------------------------------------------------------

--- Fires slot of s (trigger: how it came due, e.g. "cron" or "catchup"; due: when) — applies
-- pause and overlap, then starts a run. A paused schedule only advances its last slot. With a
-- run active here or on another daemon: skip records the slot skipped, buffer_one queues it
-- (one queued record; a further slot is recorded skipped), cancel_other cancels that run and
-- waits for it before starting. Returns nothing; returns early without a run if the daemon
-- began stopping meanwhile. Raises the store's errors. [yields] (for cancel_other; the store may
-- yield on PostgreSQL.)
function Daemon:fire(s, slot, trigger, due)
  local now = self.clock:now()
  local st = self.store:state(s.name)
  if st and st.paused == 1 then
    self.store:set_last_slot(s.name, slot, now)
    self:handled(s, slot)
    self:log("%s: slot %s passed while paused (%s)", s.name, fmt(slot), st.paused_reason or "paused")
    return
  end
  local rt = self.rt[s.name]
  local active = rt.active
  if not active and s.overlap == "skip" then
    local other = self.store:running_elsewhere(s.name)
    if other then
      return self:record_skipped(s, slot, trigger, string.format(
        "run %d (slot %s) was still running on %s (overlap = skip)", other.id, fmt(other.slot),
        tostring(other.owner)), due)
    end
  end
  if not active and s.overlap == "buffer_one" then
    local other = self.store:running_elsewhere(s.name)
    if other then return self:queue_elsewhere(s, other, slot, trigger, due) end
  end
  if not active and s.overlap == "cancel_other" then
    local other = self.store:running_elsewhere(s.name)
    if other then
      self:cancel_elsewhere(s, other, slot)
      if self.stopping then return end
    end
  end
  if active then
    if s.overlap == "skip" then
      return self:record_skipped(s, slot, trigger,
        string.format("run %d (slot %s) was still running (overlap = skip)", active.id, fmt(active.slot)),
            due)
    elseif s.overlap == "buffer_one" then
      if rt.queued then
        return self:record_skipped(s, slot, trigger, string.format(
          "run %d was running and slot %s was already queued (overlap = buffer_one)", active.id,
              fmt(rt.queued.slot)),
          due)
      end
      local id = self.store:record({ schedule = s.name, slot = slot, trigger = trigger, due_at = due,
        fired_at = now, outcome = "queued", last_slot = true }, now)
      self:handled(s, slot)
      if id then
        rt.queued = { id = id, slot = slot, trigger = trigger, fired_at = now, due_at = due }
        self:log("%s: slot %s queued (record %d) behind run %d (overlap = buffer_one)", s.name, fmt(slot), id,
          active.id)
      end
      return
    end
    if not active.task then
      -- a resume this daemon claimed, about to start: it goes on
      return self:record_skipped(s, slot, trigger,
        string.format("run %d (slot %s) is being resumed (overlap = cancel_other)", active.id,
          fmt(active.slot)), due)
    end
    active.stop_reason = "cancel_other"
    active.stop_message = string.format("cancelled by the fire of slot %s (overlap = cancel_other)",
        fmt(slot))
    task.cancel(active.task)
    pcall(task.join, active.task)
    -- That join also swallows a cancellation of this timer (the daemon stopping): look.
    if self.stopping then return end
  end
  self:start(s, { slot = slot, trigger = trigger, fired_at = now, due_at = due })
end

--- buffer_one against a run another daemon holds (record other): queues slot (one queued record
-- per schedule, whichever daemon queued it; a later fire meanwhile is recorded skipped). The
-- queued record is started by the first daemon that sees no run of the schedule running any
-- more: the holder when its run ends (finish), or this one at a lease renewal (on_renew).
-- [yields]
function Daemon:queue_elsewhere(s, other, slot, trigger, due)
  local now = self.clock:now()
  local q = self.store:queued_record(s.name)
  if q then
    return self:record_skipped(s, slot, trigger, string.format(
      "run %d was running on %s and slot %s was already queued (overlap = buffer_one)", other.id,
      tostring(other.owner), fmt(q.slot)), due)
  end
  local id = self.store:record({ schedule = s.name, slot = slot, trigger = trigger, due_at = due,
    fired_at = now, outcome = "queued", last_slot = true }, now)
  self:handled(s, slot)
  if id then
    self.queued_elsewhere[id] = { s = s, id = id, slot = slot, trigger = trigger }
    self:log("%s: slot %s queued (record %d) behind run %d on %s (overlap = buffer_one)", s.name, fmt(slot),
      id, other.id, tostring(other.owner))
  end
end

--- cancel_other against a run another daemon holds (record other): leaves it a cancel request
-- naming slot, which that daemon reads at its next renewal (on_renew) and records the run
-- cancelled itself; then waits until the record has ended or its lease has run out (its
-- daemon is gone: the sweep records it interrupted). [yields]
function Daemon:cancel_elsewhere(s, other, slot)
  local msg = string.format("cancelled by the fire of slot %s on %s (overlap = cancel_other)", fmt(slot),
    ledger_mod.owner())
  self.store:request_cancel(other.id, msg)
  self:log("%s: slot %s: asked %s to cancel run %d (slot %s; overlap = cancel_other)", s.name, fmt(slot),
    tostring(other.owner), other.id, fmt(other.slot))
  local step = math.min(0.5, ledger_mod.LEASE / 3)
  while not self.stopping do
    local r = self.store:run_row(other.id)
    if not r or (r.outcome ~= "running" and r.outcome ~= "queued") then
      self:log("%s: run %d ended (%s); starting slot %s", s.name, other.id, r and r.outcome or "gone",
        fmt(slot))
      return
    end
    if (r.lease_until or 0) < self.store.ledger:now() then
      self:log("%s: run %d's lease expired; not waiting for it any more", s.name, other.id)
      return
    end
    task.sleep(step)
  end
end

--- The lease keeper's hook (ledger.renew_hooks): cancels the runs another daemon asked this one
-- to cancel (cancel_other), and on a registered daemon renews its rows in table daemons and
-- takes up a --stop request addressed to it: wakes the fire loop, which shuts down (draining
-- when the request says so) and acknowledges it once no timer fires any more. [yields]
function Daemon:on_renew()
  if next(self.store.ledger.leases.schedule_runs) then
    for _, r in ipairs(self.store:cancel_requests()) do
      for name, rt in pairs(self.rt) do
        local run = rt.active
        if run and run.id == r.id and not run.stop_reason and not run.finished then
          run.stop_reason = "cancel_other"
          run.stop_message = r.cancel_request
          self:log("%s: run %d: another daemon asked to cancel it: %s", name, run.id, r.cancel_request)
          task.cancel(run.task)
        end
      end
    end
  end
  if self.looping and not self.stopping then
    for _, q in pairs(self.queued_elsewhere) do
      local r = self.store:run_row(q.id)
      if r and r.outcome == "queued" and not self.store:running_elsewhere(q.s.name) then
        self:take_later(q.s, r)
      elseif not r or r.outcome ~= "queued" then
        self.store:drop_lease(q.id)
        self.queued_elsewhere[q.id] = nil
      end
    end
  end
  if self.registered then
    local c = self.store:renew_daemon()
    local req = self.stop_request
    if c and not req and not self.stopping then
      self.stop_request = c -- shutdown acknowledges it, once the timers have stopped
      self.wake:signal()
    elseif c and req and req.acked and c.command_by ~= req.command_by then
      -- a later request while this daemon stops: a plain --stop cancels what a drain waits for
      self.store:ack_command()
      self:log("a --stop%s request from %s: acknowledged (already stopping)",
        c.command == "drain" and " --drain" or "", (tostring(c.command_by):gsub("@[%d.]+$", "")))
      if c.command == "stop" and self.drain then
        self.drain = false
        for name, rt in pairs(self.rt) do
          local run = rt.active
          if run and not run.stop_reason and not run.finished then
            run.stop_reason = "shutdown"
            run.stop_message = string.format("cancelled: the daemon stopped (a --stop request from %s, " ..
              "after a drain)", (tostring(c.command_by):gsub("@[%d.]+$", "")))
            self:log("%s: cancelling run %d", name, run.id)
            task.cancel(run.task)
          end
        end
      end
      self.stop_request = c
      c.acked = true
    end
  end
end

--- Slots of s strictly after `after` and not after `now`: the latest MAX_LISTED (ascending),
-- how many there are in all, and the first.
local function missed_slots(s, after, now)
  local first = schedule.next_after(s, after)
  if not first or first > now then return {}, 0 end
  if s.kind == "every" then
    local n = math.floor((now - first) / s.interval) + 1
    local list = {}
    for i = math.max(1, n - MAX_LISTED + 1), n do list[#list + 1] = first + (i - 1) * s.interval end
    return list, n, first
  end
  local ring, count, t = {}, 0, after
  while true do
    local slot = schedule.next_after(s, t)
    if not slot or slot > now then break end
    count = count + 1
    ring[(count - 1) % MAX_LISTED + 1] = slot
    t = slot
  end
  local list = {}
  local start = count > MAX_LISTED and (count % MAX_LISTED) or 0
  for i = 1, math.min(count, MAX_LISTED) do list[i] = ring[(start + i - 1) % MAX_LISTED + 1] end
  return list, count, first
end

--- Handles the slots of s after `after` that already passed (an outage, or a late wake):
-- at most one of them runs — the latest, if it is inside the catch-up window — and every other
-- one is recorded skipped, saying why. [yields] when it fires.
function Daemon:catch_up(s, after, why, trigger)
  local now = self.clock:now()
  local list, count, first = missed_slots(s, after, now)
  if count == 0 then return end
  local st = self.store:state(s.name)
  if st and st.paused == 1 then
    self.store:set_last_slot(s.name, list[#list], now)
    self:handled(s, list[#list])
    self:log("%s: %d slot(s) passed while paused", s.name, count)
    return
  end
  local latest = list[#list]
  local window = s.catchup
  local run_slot = window and (now - latest <= window) and latest or nil
  local outside = string.format("%s, outside the catch-up window (%s)", why,
    window and schedule.format_duration(window) or "catchup = false")
  if count > #list then
    self:record_skipped(s, first, trigger,
        string.format("%s; this record stands for %d missed slots from %s " ..
      "up to (not including) %s", outside, count - #list, fmt(first), fmt(list[1])))
  end
  for _, slot in ipairs(list) do
    if slot ~= run_slot then
      if window and now - slot <= window then
        self:record_skipped(s, slot, trigger, string.format("%s; coalesced into the catch-up run of slot %s",
            why,
          fmt(run_slot)))
      else
        self:record_skipped(s, slot, trigger, outside)
      end
    end
  end
  if run_slot then
    self:log("%s: catching up slot %s (%d missed)", s.name, fmt(run_slot), count)
    self:fire(s, run_slot, trigger == "cron" and "catchup" or trigger)
  end
end

-- One turn of a schedule's timer: handles what is due (catch-up when late), else sets the next
-- fire and waits for it. Returns "done" when the expression matches no later time. [yields]
function Daemon:timer_step(s)
  local last = self.last[s.name]
  local slot = schedule.next_after(s, last)
  if not slot then
    self:log("%s: the expression matches no later time; this schedule is done", s.name)
    return "done"
  end
  if slot <= self.clock:now() then
    local why = self.db_was_down and "the database was unavailable"
      or "the daemon was late (stalled, stopped or the machine slept)"
    self:catch_up(s, last, why, "cron")
    self.db_was_down = nil
  else
    local at = slot
    if s.jitter > 0 then at = slot + math.random() * s.jitter end
    self.store:set_next_fire(s.name, at)
    self:emit("next_fire", { schedule = s.name, at = at })
    self.clock:sleep_until(at)
    self:fire(s, slot, "cron", at)
  end
end

--- Waits until the database answers again after err (db_down); logs the outage and the return.
-- [yields]
function Daemon:await_db(err, what)
  self.db_was_down = true
  if not self.db_outage then
    self.db_outage = true
    self:log("the database is unavailable (%s): not firing until it is back", one_line(err.message or err))
  end
  self.store:wait_available()
  if self.db_outage then
    self.db_outage = nil
    self.db_ok_since = core.time()
    self:log("the database is back%s", what and ("; " .. what) or "")
  end
end

function Daemon:timer_loop(s)
  while not self.stopping do
    local ok, r = pcall(self.timer_step, self, s)
    if ok then
      if r == "done" then return end
    elseif db_down(r) then
      self:await_db(r, "catching up under each schedule's policy")
    else
      error(r, 0)
    end
  end
end

-- ---- start and stop -------------------------------------------------------------------------

--- Marks the runs of dead daemons interrupted and terminates what their ledger runs hold. On a
-- shared store "dead" is "lease expired", and each orphan is settled by the one daemon whose
-- store:interrupt takes it. [yields]
function Daemon:recover()
  local now = self.clock:now()
  local ledger = self.store.ledger
  for _, r in ipairs(self.store:orphans()) do
    -- A run this daemon holds is alive, whatever its lease says (a stalled renewal).
    if ledger.leases.schedule_runs[r.id] then goto next end
    do
      local s = self.by_name[r.schedule]
      if s and s.durable and r.outcome == "running" and self:resume(s, r, now) then goto next end
    end
    local who = self.store.shared and string.format("%s (lease expired)", tostring(r.owner))
      or string.format("(pid %d)", r.pid)
    local msg = r.outcome == "queued" and "its daemon %s stopped before this queued run started"
      or "its daemon %s stopped during the run"
    msg = string.format(msg, who)
    if self.store:interrupt(r.id, msg, now) then
      self:emit("finished", { schedule = r.schedule, id = r.id, outcome = "interrupted",
        message = msg, slot = r.slot, trigger = r.trigger, started_at = r.started_at,
        ended_at = now, ledger_run = r.ledger_run })
      self:log("%s: run %d (slot %s) recorded interrupted: %s", r.schedule, r.id, fmt(r.slot), msg)
      local lr = r.ledger_run and ledger:run(r.ledger_run)
      -- The daemon that held r held its ledger run too (one renewal covers both).
      if lr and (not lr.alive or (self.store.shared and lr.owner == r.owner)) then
        lr.alive = false
        local result = { terminated = 0, unattributed = 0, would = 0 }
        local ok, err = pcall(reap.reap_run, ledger, lr, {}, function(line)
          self:log("%s: run %d: reap: %s", r.schedule, r.id, line) -- line names the ledger run
        end, result)
        if not ok then
          if db_down(err) or task.is_cancelled(err) then error(err, 0) end
          self:log("%s: run %d (ledger run %d): could not terminate what it holds " ..
            "(`moonbox reap` retries): %s",
              r.schedule, r.id, lr.id,
            one_line(err))
        end
        if lr.ended_at == nil then ledger:end_run("interrupted", lr.id) end
      end
    end
    ::next::
  end
end

--- On a shared store: every half lease, recovers the runs of daemons that stopped renewing
-- (recover). It sweeps only after the database has answered for a whole lease, so that after
-- an outage the live daemons have renewed their leases before anyone judges them. [yields]
function Daemon:sweep_loop()
  while not self.stopping do
    task.sleep(ledger_mod.LEASE / 2)
    if core.time() - (self.db_ok_since or 0) >= ledger_mod.LEASE then
      local ok, err = pcall(self.recover, self)
      if not ok then
        if task.is_cancelled(err) then error(err, 0) end
        if db_down(err) then
          self:await_db(err)
        else
          self.errout(string.format("moonbox schedule: recovering interrupted runs failed: %s\n",
            self.format_error(err)))
        end
      end
    end
  end
end

--- On a shared store: the task that renews this daemon's leases, and the sweeper. Does not
-- yield.
function Daemon:start_shared()
  if not self.store.shared then return end
  self.db_ok_since = core.time()
  self:add_hook()
  self.store.ledger:keep_alive()
  self.sweeper = task.spawn(function()
    local ok, err = xpcall(self.sweep_loop, core.msgh, self)
    if not ok and not task.is_cancelled(err) then
      self.errout(string.format("moonbox schedule: the sweeper stopped: %s\n", self.format_error(err)))
    end
  end)
end

--- Puts on_renew on the ledger's renew_hooks (once). Does not yield.
function Daemon:add_hook()
  if self.hook then return end
  self.hook = function() return self:on_renew() end
  table.insert(self.store.ledger.renew_hooks, self.hook)
end

function Daemon:stop_shared()
  local hooks = self.store.ledger.renew_hooks
  for i = #hooks, 1, -1 do
    if hooks[i] == self.hook then table.remove(hooks, i) end
  end
  self.hook = nil
  if self.sweeper then
    task.cancel(self.sweeper)
    pcall(task.join, self.sweeper)
    self.sweeper = nil
  end
  self.store.ledger:stop_keeping()
end

--- daemon:run(): claims the schedules, recovers, catches up, fires until cancelled, then stops.
-- Raises when another live daemon owns one of the schedules. [yields]
function Daemon:run()
  local now = self.clock:now()
  for _, s in ipairs(self.schedules) do self.store:ensure(s, self.recipe, now) end
  local ok, owned = self.store:claim(self.names, now)
  if not ok then
    error(string.format("moonbox schedule: schedule '%s' is already run by another moonbox schedule " ..
      "(pid %d, recipe %s); stop it first", owned.name, owned.owner_pid, tostring(owned.recipe)), 0)
  end
  self:log("started: %d schedule(s) from %s (%s)%s", #self.schedules, self.recipe, self.clock:describe(),
    self.store.shared and (", shared state in " .. self.store:describe()) or "")
  self.store:register_daemon(self.names, self.recipe) -- where a --stop finds it
  self.registered = true
  self:start_shared()
  self:recover()
  for _, s in ipairs(self.schedules) do
    local st = self.store:state(s.name)
    if st.last_slot == nil then
      self.store:set_last_slot(s.name, now, now) -- first start: nothing before now is owed
      self.last[s.name] = now
    else
      self.last[s.name] = st.last_slot
      self:catch_up(s, st.last_slot, "missed while no daemon was running", "cron")
    end
  end
  local me = task.current()
  for _, s in ipairs(self.schedules) do
    self.timers[#self.timers + 1] = task.spawn(function()
      local tok, terr = xpcall(self.timer_loop, core.msgh, self, s)
      if not tok and not task.is_cancelled(terr) then
        self.fatal = self.fatal or terr
        task.cancel(me)
      end
    end)
  end
  self:emit("loop", { running = true })
  self.looping = true
  local lok, lerr = pcall(function()
    while true do
      while #self.pending > 0 do
        local p = self.pending[1]
        local sok, serr = pcall(self.start, self, p.s, p.q)
        if sok then
          table.remove(self.pending, 1)
        elseif db_down(serr) then
          self:await_db(serr)
        else
          table.remove(self.pending, 1)
          error(serr, 0)
        end
      end
      if self.stop_request then return end
      self.wake:wait()
    end
  end)
  self:emit("loop", { running = false })
  self.looping = false
  self:shutdown()
  if self.fatal then error(self.fatal, 0) end
  if not lok and not task.is_cancelled(lerr) then error(lerr, 0) end
end

local function wait_all(runs)
  for _, run in ipairs(runs) do
    -- Until it has ended: interrupted again while waiting, cancel it again and wait again (a
    -- run that ended in failure makes join raise too, but then it has ended).
    while task.result(run.task) == nil do
      if not pcall(task.join, run.task) and task.result(run.task) == nil then task.cancel(run.task) end
    end
  end
end

--- daemon:shutdown(): stops firing; cancels the active runs (or waits for them when draining;
-- a second signal while draining cancels them); records everything; releases the schedules.
-- [yields]
function Daemon:shutdown()
  self.stopping = true
  local now = self.clock:now()
  for _, t in ipairs(self.timers) do task.cancel(t) end
  for _, t in ipairs(self.timers) do pcall(task.join, t) end
  if not self.stop_request and not self.store.shared and self.registered and core.signal_received() then
    -- on SQLite a --stop arrives as SIGTERM: its row says whether to drain
    local ok, c = pcall(self.store.renew_daemon, self.store)
    if ok and c then self.stop_request = c end
  end
  local req = self.stop_request
  if req then
    local ok, err = pcall(self.store.ack_command, self.store)
    if not ok and not db_down(err) then error(err, 0) end
    req.acked = true
    self:log("a --stop%s request from %s: acknowledged; %s", req.command == "drain" and " --drain" or "",
      (tostring(req.command_by):gsub("@[%d.]+$", "")), req.command == "drain"
      and "firing no more, exiting when the runs in progress have finished" or "stopping now")
  end
  local sig = core.signal_received()
  local why = sig and ("SIG" .. sig) or "the daemon stopped"
  if req then
    why = string.format("a --stop%s request from %s", req.command == "drain" and " --drain" or "",
      (tostring(req.command_by):gsub("@[%d.]+$", "")))
    self.drain = req.command == "drain"
  end
  for _, p in ipairs(self.pending) do
    -- a manual request not yet started is dropped; a take (buffer_one) stays queued_elsewhere's;
    -- a resume claimed but not started is let go: its lease runs out, and a daemon (this one's
    -- next start, on SQLite) claims it again
    if p.q.resume then
      self.store:drop_lease(p.q.id)
      if p.q.resume.ledger then self.store.ledger.leases.runs[p.q.resume.ledger.id] = nil end
      local rt = self.rt[p.s.name]
      if rt.active == p.q.resume.run then rt.active = nil end
      self.extra_runs[p.q.resume.run] = nil
    elseif p.q.id and not p.q.take then
      self.rt[p.s.name].queued = p.q
    end
  end
  self.pending = {}
  local actives = {}
  for _, s in ipairs(self.schedules) do
    local rt = self.rt[s.name]
    if rt.queued then
      local qmsg = "the daemon stopped (" .. why .. ") before this queued run started"
      self.store:finish(rt.queued.id, "cancelled", qmsg, now)
      self:emit("finished", { schedule = s.name, id = rt.queued.id, outcome = "cancelled", message = qmsg,
        slot = rt.queued.slot, trigger = rt.queued.trigger, ended_at = now })
      rt.queued = nil
    end
    if rt.active then actives[#actives + 1] = rt.active end
  end
  for run in pairs(self.extra_runs) do actives[#actives + 1] = run end
  for id, q in pairs(self.queued_elsewhere) do
    local qmsg = "the daemon stopped (" .. why .. ") before this queued run started"
    local ok, done = pcall(self.store.cancel_queued, self.store, id, qmsg, now)
    if ok and done then
      self:emit("finished", { schedule = q.s.name, id = id, outcome = "cancelled", message = qmsg,
        slot = q.slot, trigger = q.trigger, ended_at = now })
    elseif not ok and not db_down(done) then
      error(done, 0)
    end
  end
  self.queued_elsewhere = {}
  if #actives > 0 and self.drain then
    self:log("stopping (%s): waiting for %d run(s) to finish (%s)", why, #actives,
      req and "a signal cancels them" or "--drain; a second signal cancels them")
    for _, run in ipairs(actives) do
      if not pcall(task.join, run.task) then break end
    end
  end
  local left = {}
  for _, run in ipairs(actives) do
    if not run.outcome then
      run.stop_reason = "shutdown"
      run.stop_message = "cancelled: the daemon stopped (" .. why .. ")"
      task.cancel(run.task)
      left[#left + 1] = run
    end
  end
  if #left > 0 then self:log("stopping (%s): cancelling %d run(s)", why, #left) end
  wait_all(left)
  if self.registered then
    local ok, err = pcall(self.store.daemon_stopped, self.store)
    if not ok and not db_down(err) then error(err, 0) end
  end
  self:stop_shared()
  self.store:release(self.names)
  self:log("stopped")
end

--- daemon:request_trigger(name) -> true, or nil and a message: the fire loop starts a manual
-- run of that schedule as soon as it next looks (the status page's trigger button). Manual runs
-- ignore overlap, as --trigger does. Does not yield.
function Daemon:request_trigger(name)
  local s
  for _, x in ipairs(self.schedules) do if x.name == name then s = x end end
  if not s then return nil, "no schedule named '" .. tostring(name) .. "'" end
  if self.stopping then return nil, "the daemon is stopping" end
  local now = self.clock:now()
  self.pending[#self.pending + 1] = { s = s, q = { slot = now, trigger = "manual", fired_at = now } }
  self.wake:signal()
  return true
end

--- daemon:trigger(s) -> the finished run (run.outcome, run.message): runs s once now, recorded
-- with trigger "manual"; SIGINT/SIGTERM cancel it. [yields]
function Daemon:trigger(s)
  local now = self.clock:now()
  self.store:ensure(s, self.recipe, now)
  if self.store.shared then self:add_hook() end -- another daemon's cancel_other reaches this run
  self.store.ledger:keep_alive()
  local run = self:start(s, { slot = now, trigger = "manual", fired_at = now })
  local ok = pcall(task.join, run.task)
  if not ok then
    run.stop_reason = "shutdown"
    local sig = core.signal_received()
    run.stop_message = "cancelled: interrupted by " .. (sig and ("SIG" .. sig)
      or "a cancellation")
    task.cancel(run.task)
    wait_all({ run })
  end
  self:stop_shared()
  return run
end

M.Daemon = Daemon
return M
