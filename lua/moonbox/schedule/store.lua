--- moonbox.schedule.store — schedule state and run history, in the ledger's database
-- (moonbox.db: the state dir's SQLite file, or a PostgreSQL database several daemons share).
--
-- Two tables, created by moonbox.db.schema (migration 2) next to the ledger's (and a third,
-- daemons, for the fleet on a shared store: see "the fleet" below):
--   schedules      one row per schedule name: last_slot (the latest slot handled: run, queued
--                  or recorded skipped), next_fire, consecutive failures, paused (+ reason), and
--                  the daemon that owns it (pid + process start time).
--   schedule_runs  one row per slot handled and per manual trigger: slot, trigger (cron,
--                  catchup, manual), due (slot + jitter), fired/started/ended times, outcome (queued,
-- running, ok,
--                  failed, timeout, cancelled, skipped, interrupted), error, and the ledger run
--                  that holds the sandboxes it created.
-- A unique index on (schedule, slot) for non-manual rows makes "never twice for the same slot"
-- a property of the database, not of the daemon's care: a slot is claimed by the INSERT of its
-- record (ON CONFLICT DO NOTHING), so of several daemons sharing a PostgreSQL database exactly
-- one gets it. Times are the schedule clock's (moonbox.schedule.clock), seconds since the epoch.
--
-- The two stores differ in who owns what (store.shared): on SQLite one daemon owns a schedule
-- (claim) and a queued or running record is orphaned when its process is gone; on PostgreSQL
-- every daemon fires every schedule, each record it writes carries a lease its daemon renews
-- (moonbox.ledger keep_alive), and a record is orphaned when its lease has expired. No call
-- yields on SQLite; on PostgreSQL every call may (and raises code "db_unavailable" while the
-- server is away).
local ledger_mod = require "moonbox.ledger"
local task = require "moonbox.task"

local M = {}
local Store = {}
Store.__index = Store

--- store.open(ledger) -> Store over the ledger's database (ledger.open() when nil).
function M.open(ledger)
  ledger = ledger or ledger_mod.open()
  return setmetatable({ ledger = ledger, db = ledger.db, shared = ledger.shared }, Store)
end

--- store:describe() -> where the state lives (a path, or a URL without its password).
function Store:describe()
  return self.db:describe()
end

--- store:wait_available(on_wait): returns once the database answers (at once on SQLite).
-- [yields] on PostgreSQL.
function Store:wait_available(on_wait)
  return self.db:wait_available(on_wait)
end

--- store:state(name) -> the schedule's row, or nil.
function Store:state(name)
  return self.db:row("SELECT * FROM schedules WHERE name = ?", name)
end

--- store:ensure(s, recipe) -> the schedule's row, created when missing; spec/recipe refreshed.
function Store:ensure(s, recipe, now)
  self.db:run([[INSERT INTO schedules (name, recipe, spec, updated_at) VALUES (?, ?, ?, ?)
    ON CONFLICT (name) DO UPDATE SET recipe = excluded.recipe, spec = excluded.spec]],
    s.name, recipe, s.spec, now)
  return self:state(s.name)
end

local alive = ledger_mod.alive

--- store:claim(names) -> true, or nil and the row of a schedule a live daemon already owns.
-- Ownership is all or nothing (one transaction).
function Store:claim(names, now)
  if self.shared then return true end -- every daemon fires; each slot is claimed by its record
  local pid, start = ledger_mod.self_pid(), ledger_mod.self_start()
  local ok, err = pcall(self.db.tx, self.db, function()
    for _, name in ipairs(names) do
      local r = self:state(name)
      if r and r.owner_pid and r.owner_pid ~= pid and alive(r.owner_pid, r.owner_pid_start) then
        error({ owned = r }, 0)
      end
    end
    for _, name in ipairs(names) do
      self.db:run("UPDATE schedules SET owner_pid = ?, owner_pid_start = ?, updated_at = ? WHERE name = ?",
        pid, start, now, name)
    end
  end)
  if ok then return true end
  if type(err) == "table" and err.owned then return nil, err.owned end
  error(err, 0)
end

--- store:release(names): this process no longer owns them.
function Store:release(names)
  if self.shared then return end
  local pid = ledger_mod.self_pid()
  for _, name in ipairs(names) do
    self.db:run("UPDATE schedules SET owner_pid = NULL, owner_pid_start = NULL, next_fire = NULL " ..
      "WHERE name = ? AND owner_pid = ?", name, pid)
  end
end

--- store:set_last_slot(name, slot): the slot has been handled (last_slot never moves back).
function Store:set_last_slot(name, slot, now)
  self.db:run("UPDATE schedules SET last_slot = ?, updated_at = ? WHERE name = ? " ..
    "AND (last_slot IS NULL OR last_slot < ?)", slot, now, name, slot)
end

--- store:set_next_fire(name, t)
function Store:set_next_fire(name, t)
  self.db:run("UPDATE schedules SET next_fire = ? WHERE name = ?", t, name)
end

--- store:set_paused(name, paused, reason, now): paused = false also clears the failure count.
function Store:set_paused(name, paused, reason, now)
  if paused then
    self.db:run([[UPDATE schedules SET paused = 1, paused_reason = ?, paused_at = ?, updated_at = ?
      WHERE name = ?]],
      reason, now, now, name)
  else
    self.db:run([[UPDATE schedules SET paused = 0, paused_reason = NULL, paused_at = NULL, failures = 0,
      updated_at = ? WHERE name = ?]], now, name)
  end
end

--- store:count_outcome(name, outcome) -> consecutive failures after a run ended with outcome.
function Store:count_outcome(name, outcome)
  if outcome == "ok" then
    self.db:run("UPDATE schedules SET failures = 0 WHERE name = ?", name)
  elseif outcome == "failed" or outcome == "timeout" then
    self.db:run("UPDATE schedules SET failures = failures + 1 WHERE name = ?", name)
  end
  return self.db:value("SELECT failures FROM schedules WHERE name = ?", name) or 0
end

--- store:record(r) -> history id, or nil when that slot already has a record (never twice: the
-- INSERT is the claim). r: schedule, slot, trigger, due_at (slot + jitter), fired_at, started_at,
-- ended_at, outcome, error. When r.last_slot is true the schedule's last_slot moves to r.slot in
-- the same transaction. A queued or running record gets this daemon's lease.
function Store:record(r, now)
  local pid = ledger_mod.self_pid()
  local open = r.outcome == "queued" or r.outcome == "running"
  local lease = (self.shared and open) and (self.ledger:now() + ledger_mod.LEASE) or nil
  local id = self.db:tx(function()
    local n, id = self.db:run([[INSERT INTO schedule_runs (schedule, slot, trigger, due_at, fired_at,
      started_at, ended_at, outcome, error, pid, pid_start, owner, lease_until)
      VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
      ON CONFLICT (schedule, slot) WHERE trigger <> 'manual' DO NOTHING]],
      r.schedule, r.slot, r.trigger, r.due_at, r.fired_at, r.started_at, r.ended_at, r.outcome, r.error, pid,
      ledger_mod.self_start(), ledger_mod.owner(), lease)
    if n == 0 then return nil end
    if r.last_slot then
      self.db:run([[UPDATE schedules SET last_slot = ?, updated_at = ?
        WHERE name = ? AND (last_slot IS NULL OR last_slot < ?)]], r.slot, now, r.schedule, r.slot)
    end
    return id
  end)
  if id and self.shared and open then self.ledger.leases.schedule_runs[id] = true end
  return id
end

--- store:started(id, t): a queued run started.
function Store:started(id, t)
  self.db:run("UPDATE schedule_runs SET started_at = ?, outcome = 'running' WHERE id = ?", t, id)
end

--- store:finish(id, outcome, message, t)
function Store:finish(id, outcome, message, t)
  self.db:run("UPDATE schedule_runs SET ended_at = ?, outcome = ?, error = ? WHERE id = ?", t, outcome,
      message, id)
  self.ledger.leases.schedule_runs[id] = nil
end

--- store:interrupt(id, message, t) -> whether this call recorded the orphaned record id
-- interrupted (false: it had already ended, or another daemon got there first).
function Store:interrupt(id, message, t)
  local n = self.db:run([[UPDATE schedule_runs SET ended_at = ?, outcome = 'interrupted', error = ?
    WHERE id = ? AND outcome IN ('queued', 'running')]], t, message, id)
  return n == 1
end

--- store:settle(id, outcome, message, t) -> whether this call gave the orphaned record id its
-- final outcome (a durable run whose ledger run had ended when its daemon died before writing
-- the record; false: it had already ended, or another daemon got there first).
function Store:settle(id, outcome, message, t)
  local n = self.db:run([[UPDATE schedule_runs SET ended_at = ?, outcome = ?, error = ?
    WHERE id = ? AND outcome IN ('queued', 'running')]], t, outcome, message, id)
  return n == 1
end

--- store:claim_resume(r) -> whether this daemon took over the orphaned running record r (a
-- durable schedule's run whose daemon died) to resume it: one conditional UPDATE, which
-- succeeds only while the record still names the owner that died (its pid and process start
-- time on SQLite; on PostgreSQL its owner, with the lease expired by the database's clock), so
-- of several daemons exactly one wins. It counts the resume (resumes) and names this daemon
-- (resumed_by, owner), whose lease the record now carries. [yields] on PostgreSQL.
function Store:claim_resume(r)
  local me, pid, start = ledger_mod.owner(), ledger_mod.self_pid(), ledger_mod.self_start()
  local n
  if self.shared then
    local now = self.ledger:now()
    n = self.db:run([[UPDATE schedule_runs SET owner = ?, pid = ?, pid_start = ?, lease_until = ?,
      resumes = resumes + 1, resumed_by = ? WHERE id = ? AND outcome = 'running'
      AND owner IS NOT DISTINCT FROM ? AND (lease_until IS NULL OR lease_until < ?)]], me, pid, start,
      now + ledger_mod.LEASE, me, r.id, r.owner, now)
  else
    n = self.db:run([[UPDATE schedule_runs SET owner = ?, pid = ?, pid_start = ?, resumes = resumes + 1,
      resumed_by = ? WHERE id = ? AND outcome = 'running' AND pid = ? AND pid_start IS ?]], me, pid, start,
      me, r.id, r.pid, r.pid_start)
  end
  if n == 1 and self.shared then self.ledger.leases.schedule_runs[r.id] = true end
  return n == 1
end

--- store:set_ledger_run(id, run_id): the run's first create began ledger run run_id.
function Store:set_ledger_run(id, run_id)
  self.db:run("UPDATE schedule_runs SET ledger_run = ? WHERE id = ?", run_id, id)
end

--- store:orphans() -> rows left queued or running by a daemon that is gone.
function Store:orphans()
  if self.shared then
    return self.db:rows([[SELECT * FROM schedule_runs WHERE outcome IN ('queued', 'running')
      AND (lease_until IS NULL OR lease_until < ?) ORDER BY id]], self.ledger:now())
  end
  local out = {}
  for _, r in ipairs(self.db:rows(
    "SELECT * FROM schedule_runs WHERE outcome IN ('queued', 'running') ORDER BY id")) do
    if not alive(r.pid, r.pid_start) then out[#out + 1] = r end
  end
  return out
end

--- store:history{schedule, limit} -> rows, newest first, each with `sandboxes` (ids).
function Store:history(opts)
  local rows
  local limit = opts.limit or -1
  if opts.schedule and limit >= 0 then
    rows = self.db:rows("SELECT * FROM schedule_runs WHERE schedule = ? ORDER BY id DESC LIMIT ?",
      opts.schedule, limit)
  elseif opts.schedule then
    rows = self.db:rows("SELECT * FROM schedule_runs WHERE schedule = ? ORDER BY id DESC", opts.schedule)
  elseif limit >= 0 then
    rows = self.db:rows("SELECT * FROM schedule_runs ORDER BY id DESC LIMIT ?", limit)
  else
    rows = self.db:rows("SELECT * FROM schedule_runs ORDER BY id DESC")
  end
  for _, r in ipairs(rows) do
    r.sandboxes = r.ledger_run and self.ledger:sandboxes(r.ledger_run) or {}
  end
  return rows
end

--- store:running_elsewhere(name) -> the newest running record of schedule name that another
-- daemon holds a live lease on, or nil (always nil on SQLite, where one daemon owns a
-- schedule).
function Store:running_elsewhere(name)
  if not self.shared then return nil end
  return self.db:row([[SELECT * FROM schedule_runs WHERE schedule = ? AND outcome = 'running'
    AND lease_until >= ? AND owner <> ? ORDER BY id DESC LIMIT 1]], name, self.ledger:now(),
    ledger_mod.owner())
end

-- ---- the fleet: daemons, and the requests other machines leave them (shared store) -------
--
-- Table daemons (migration 5) has a row per (daemon, schedule it fires): the daemon's owner id
-- (moonbox.ledger owner()), when it started, and a lease it renews with its other leases. A
-- one-shot `--stop` sets command ('stop' or 'drain') and command_by (a token naming the
-- request) on the rows of the daemons alive at that moment only, so a daemon started after the
-- request never sees it; each daemon acknowledges (acked_at) and, once stopped, sets
-- stopped_at. Schedule runs carry cancel_request: the message of another daemon's
-- cancel_other, which the run's own daemon reads at its next renewal.

-- On SQLite the rows carry no lease: a daemon is alive while its process is (the pid and start
-- time in its owner id), and a --stop reaches it as SIGTERM (moonbox.schedule.cli) after which
-- it reads its row for the request's mode (Daemon:shutdown).

--- Whether the daemon of row r (owner, lease_until, stopped_at) is alive at now.
function Store:daemon_alive(r, now)
  if r.stopped_at then return false end
  if self.shared then return r.lease_until ~= nil and r.lease_until >= now end
  local pid, start = tostring(r.owner):match("/(%d+)/([^/]*)$")
  return pid ~= nil and alive(tonumber(pid), start) or false
end

--- store:register_daemon(names, recipe): this daemon fires the schedules names. Rows of
-- daemons gone an hour ago (PostgreSQL: their lease ran out; SQLite: the process is gone) are
-- dropped on the way. [yields] on PostgreSQL.
function Store:register_daemon(names, recipe)
  local now = self.ledger:now()
  local me = ledger_mod.owner()
  if self.shared then
    self.db:run("DELETE FROM daemons WHERE lease_until < ?", now - 3600)
  else
    for _, r in ipairs(self.db:rows("SELECT owner, lease_until, stopped_at FROM daemons")) do
      if not self:daemon_alive(r, now) then self.db:run("DELETE FROM daemons WHERE owner = ?", r.owner) end
    end
  end
  for _, name in ipairs(names) do
    self.db:run([[INSERT INTO daemons (owner, schedule, recipe, started_at, lease_until)
      VALUES (?, ?, ?, ?, ?) ON CONFLICT (owner, schedule) DO NOTHING]], me, name, recipe, now,
      now + ledger_mod.LEASE)
  end
end

--- store:renew_daemon() -> the pending stop request addressed to this daemon ({command,
-- command_by, command_at}), or nil; renews this daemon's rows first (PostgreSQL). [yields]
function Store:renew_daemon()
  local now = self.ledger:now()
  local me = ledger_mod.owner()
  if self.shared then
    self.db:run("UPDATE daemons SET lease_until = ? WHERE owner = ? AND stopped_at IS NULL",
      now + ledger_mod.LEASE, me)
  end
  return self.db:row([[SELECT command, command_by, command_at FROM daemons WHERE owner = ?
    AND command IS NOT NULL AND acked_at IS NULL ORDER BY command_at LIMIT 1]], me)
end

--- store:ack_command(): this daemon has seen its stop request. [yields]
function Store:ack_command()
  self.db:run("UPDATE daemons SET acked_at = ? WHERE owner = ? AND command IS NOT NULL",
    self.ledger:now(), ledger_mod.owner())
end

--- store:daemon_stopped(): this daemon has stopped (its runs recorded). [yields]
function Store:daemon_stopped()
  self.db:run("UPDATE daemons SET stopped_at = ? WHERE owner = ? AND stopped_at IS NULL",
    self.ledger:now(), ledger_mod.owner())
end

--- store:request_stop(names, command) -> token, owners: asks every daemon alive now (a live
-- lease, not stopped) that fires one of the schedules names to stop ('stop': cancel its runs;
-- 'drain': let them finish); owners (sorted) are the daemons asked. [yields]
function Store:request_stop(names, command)
  local now = self.ledger:now()
  local token = string.format("%s@%.6f", ledger_mod.owner(), now)
  local owners, seen = {}, {}
  self.db:tx(function()
    for _, name in ipairs(names) do
      for _, r in ipairs(self.db:rows([[SELECT owner, lease_until, stopped_at FROM daemons
        WHERE schedule = ? AND stopped_at IS NULL]], name)) do
        if not seen[r.owner] and self:daemon_alive(r, now) then
          seen[r.owner] = true
          owners[#owners + 1] = r.owner
        end
      end
    end
    for _, o in ipairs(owners) do
      self.db:run([[UPDATE daemons SET command = ?, command_by = ?, command_at = ?, acked_at = NULL
        WHERE owner = ? AND stopped_at IS NULL]], command, token, now, o)
    end
  end)
  table.sort(owners)
  return token, owners
end

--- store:stop_status(token) -> owner -> {acked, stopped, alive}: how the daemons asked by
-- request token are doing (alive: their lease still runs). [yields]
function Store:stop_status(token)
  local now = self.ledger:now()
  local out = {}
  for _, r in ipairs(self.db:rows([[SELECT owner, max(acked_at) AS acked, max(stopped_at) AS stopped,
    max(lease_until) AS lease FROM daemons WHERE command_by = ? GROUP BY owner]], token)) do
    out[r.owner] = { acked = r.acked, stopped = r.stopped,
      alive = self:daemon_alive({ owner = r.owner, lease_until = r.lease }, now) }
  end
  return out
end

--- store:request_cancel(id, message): asks the daemon running record id to cancel it (it reads
-- the request at its next renewal: cancel_requests). [yields]
function Store:request_cancel(id, message)
  self.db:run([[UPDATE schedule_runs SET cancel_request = ? WHERE id = ? AND outcome = 'running'
    AND cancel_request IS NULL]], message, id)
end

--- store:cancel_requests() -> rows {id, cancel_request} of the running records this daemon
-- holds that another daemon asked it to cancel. [yields]
function Store:cancel_requests()
  return self.db:rows([[SELECT id, cancel_request FROM schedule_runs WHERE owner = ?
    AND outcome = 'running' AND cancel_request IS NOT NULL]], ledger_mod.owner())
end

--- store:queued_record(name) -> the queued record of schedule name (whichever daemon queued
-- it), or nil. [yields]
function Store:queued_record(name)
  return self.db:row([[SELECT * FROM schedule_runs WHERE schedule = ? AND outcome = 'queued'
    ORDER BY id LIMIT 1]], name)
end

--- store:take_queued(id, name, t) -> whether this daemon took the queued record id of schedule
-- name and made it its running run: one UPDATE, which succeeds only while the record is queued
-- and no run of the schedule is running under a live lease, so of several daemons one wins.
-- [yields]
function Store:take_queued(id, name, t)
  local now = self.ledger:now()
  local n = self.db:run([[UPDATE schedule_runs SET outcome = 'running', started_at = ?, owner = ?,
    pid = ?, pid_start = ?, lease_until = ? WHERE id = ? AND outcome = 'queued' AND NOT EXISTS
    (SELECT 1 FROM schedule_runs r WHERE r.schedule = ? AND r.outcome = 'running'
      AND r.lease_until >= ?)]], t, ledger_mod.owner(), ledger_mod.self_pid(), ledger_mod.self_start(),
    now + ledger_mod.LEASE, id, name, now)
  if n == 1 then self.ledger.leases.schedule_runs[id] = true end
  return n == 1
end

--- store:cancel_queued(id, message, t) -> whether record id was still queued by this daemon and
-- is now recorded cancelled. [yields]
function Store:cancel_queued(id, message, t)
  local n = self.db:run([[UPDATE schedule_runs SET ended_at = ?, outcome = 'cancelled', error = ?
    WHERE id = ? AND outcome = 'queued' AND owner = ?]], t, message, id, ledger_mod.owner())
  self.ledger.leases.schedule_runs[id] = nil
  return n == 1
end

--- store:drop_lease(id): this daemon no longer renews record id.
function Store:drop_lease(id)
  self.ledger.leases.schedule_runs[id] = nil
end

--- store:run_row(id) -> the history record id, or nil.
function Store:run_row(id)
  return self.db:row("SELECT * FROM schedule_runs WHERE id = ?", id)
end

--- store:last_run(name) -> the newest history row of the schedule, or nil.
function Store:last_run(name)
  return self.db:row("SELECT * FROM schedule_runs WHERE schedule = ? ORDER BY id DESC LIMIT 1", name)
end

--- store:ping(timeout_ms) -> true, or nil and a message: a real, cheap query of the state
-- (the schedules table), on a connection of its own opened for it with a busy timeout of
-- timeout_ms (default 250), so a locked database answers within that instead of the daemon's
-- own 5 s; a database file that vanished (deleted, moved, its disk gone) is reported as such
-- and never re-created. On PostgreSQL (store.shared) the query runs on the daemon's own
-- connection under a timeout of timeout_ms. For `moonbox schedule --listen`'s /healthz.
-- SQLite: does not yield (blocks at most timeout_ms); PostgreSQL: [yields]
function Store:ping(timeout_ms)
  local path = self.ledger.path
  if self.shared then
    -- PostgreSQL: the daemon's own connection (it reconnects by itself), bounded by the timeout
    -- so a server that accepts and never answers makes the probe fail instead of hang.
    local ok, err = pcall(task.timeout, (timeout_ms or 250) / 1000, function()
      return self.db:value("SELECT count(*) FROM schedules")
    end)
    if ok then return true end
    return nil, type(err) == "table" and tostring(err.message or err.code) or tostring(err)
  end
  if not path or path == ":memory:" then
    local ok, err = pcall(self.db.value, self.db, "SELECT count(*) FROM schedules")
    if ok then return true end
    return nil, tostring(err)
  end
  local f = io.open(path, "rb")
  if not f then return nil, "the database file " .. path .. " is missing" end
  f:close()
  local ok, err = pcall(function()
    -- lazy: moonbox.store loads SQLite, which a store on PostgreSQL never needs
    local db <close> = require("moonbox.store").open(path, { busy_timeout = timeout_ms or 250,
      statement_cache = 0 })
    db:value("SELECT count(*) FROM schedules")
  end)
  if ok then return true end
  return nil, type(err) == "table" and tostring(err.message or err.code) or tostring(err)
end

return M
