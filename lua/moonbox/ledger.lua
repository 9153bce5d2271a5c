--- moonbox.ledger — what every run created, written down before it exists (docs/reference/ledger.md).
--
-- `$XDG_STATE_HOME/moonbox/moonbox.db` (SQLite, WAL) holds one row per `moonbox run` (pid,
-- process start time, recipe, backend, the embedded backend's state dir when it used one,
-- start, end, outcome) and one row per sandbox create: the *intent* is written before the
-- request goes out, the sandbox id as soon as the answer names it, and the release only when
-- the backend confirms the sandbox is gone (terminated, or unknown to it) or was never made (it
-- refused the create). A run that died (SIGKILL, power loss) therefore leaves exactly what it
-- held behind in the ledger, and `moonbox reap` can finish its cleanup; a create whose answer
-- was lost is an intent without an id, which reap reconciles by the name label every create
-- carries ("mb-<intent id>-<run id>").
--
-- One process may hold several runs at once: `moonbox schedule` gives every scheduled run its
-- own record. A run is attached to the task that performs it (ledger.attach), and every task
-- that task spawns, directly or not, inherits it; creates made outside any attached task go
-- to the process's own run (`moonbox run`), begun at the first create.
--
-- The same database holds the schedule state and history of `moonbox schedule`
-- (lua/moonbox/schedule/store.lua); moonbox.db owns where it is (SQLite by default, PostgreSQL
-- with --state postgres://... or MOONBOX_DATABASE_URL) and its schema.
--
-- Liveness: on SQLite a run is alive while its process is (pid and process start time); on
-- PostgreSQL, whose runs may belong to other machines, while its lease has not expired: the
-- process renews lease_until of every run it owns (ledger.keep_alive) and a run whose lease
-- ran out is dead wherever it ran.
-- moonbox.build is the binary's (main.c): plain lua5.4, which can load moonbox.render, has none,
-- and no `moonbox run` whose creates a ledger would record.
local has_build, build = pcall(require, "moonbox.build")
local db_mod = require "moonbox.db"
local core = require "moonbox.core"
local task = require "moonbox.task"

local M = {}
local Ledger = {}
Ledger.__index = Ledger

--- ledger.LEASE: seconds a lease lasts after each renewal (MOONBOX_LEASE_SECONDS, default 30);
-- the keeper renews it every third of that.
M.LEASE = tonumber(os.getenv("MOONBOX_LEASE_SECONDS") or "") or 30


--- ledger.pid_start(pid) -> the start time of process pid (field 22 of /proc/PID/stat), so a
-- reused pid is not mistaken for the run that died; nil when no such process runs. A zombie
-- (state Z: it has ended, nobody has collected its status yet) counts as ended.
local function pid_start(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  local rest = s:match("%) (.*)$")
  if not rest then return nil end
  local i = 2 -- rest starts at field 3
  for field in rest:gmatch("%S+") do
    i = i + 1
    if i == 3 and field == "Z" then return nil end
    if i == 22 then return field end
  end
end
M.pid_start = pid_start

--- ledger.open([where]) -> Ledger over moonbox.db.open(where) (default: db.target(): the
-- state dir's moonbox.db, created 0600, or the PostgreSQL database named by --state or
-- MOONBOX_DATABASE_URL). [yields] on PostgreSQL.
function M.open(where)
  local db = db_mod.open(where)
  -- leases: the ids of the runs and schedule runs this process holds leases on (renew).
  -- renew_hooks: functions the keeper calls after each renewal (the schedule daemon reads the
  -- requests other machines left it there: one wake for both).
  return setmetatable({ db = db, path = db:describe(), shared = db.shared,
    leases = { runs = {}, schedule_runs = {} }, renew_hooks = {} }, Ledger)
end

--- ledger:now() -> the time leases are reckoned in: the database server's clock on
-- PostgreSQL (one clock for every machine), this machine's otherwise. [yields] on PostgreSQL.
function Ledger:now()
  if self.shared then
    return self.db:value("SELECT extract(epoch FROM clock_timestamp())::float8 AS now")
  end
  return core.time()
end

--- ledger:open_run{recipe, backend, workspace, local_state, durable, args, run_key} -> run id: a
-- new run record owned by this process (not made the process's own run; see begin_run).
-- local_state: the state dir of the embedded backend the run uses, if it does; durable: the run
-- keeps a journal (moonbox.durable) and may be resumed, with args (JSON text: the recipe's
-- arguments); run_key: the run's own name (`moonbox run --run-id`), unique.
function Ledger:open_run(info)
  local lease = self.shared and (self:now() + M.LEASE) or nil
  local _, id = self.db:run([[INSERT INTO runs (pid, pid_start, recipe, backend, workspace, started_at,
    local_state, owner, lease_until, durable, args, run_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)]],
    M.self_pid(), M.self_start(), info.recipe, info.backend, info.workspace, core.time(), info.local_state,
    M.owner(), lease, info.durable and 1 or 0, info.args, info.run_key)
  if self.shared then self.leases.runs[id] = true end
  return id
end

--- ledger:claim_run(id) -> the run's row, now this process's, or nil and why not: takes over a
-- durable run that died (moonbox.durable's resume). Exactly one claimer wins: the UPDATE is
-- conditional on the row still naming the owner that died (its pid and start time on SQLite; an
-- expired lease on PostgreSQL, judged by the database's clock). Records the resume in
-- run_resumes (who, when, from whom, how many journal entries the run had). Refuses a run that
-- is not durable, has ended, or whose owner is alive. [yields] on PostgreSQL.
function Ledger:claim_run(id)
  local r = self.db:row("SELECT * FROM runs WHERE id = ?", id)
  if not r then return nil, string.format("there is no run %s in %s", tostring(id), self.path) end
  if (r.durable or 0) == 0 then
    return nil, string.format("run %d was not durable (moonbox run --durable): it has no journal to " ..
      "resume from", id)
  end
  if r.ended_at ~= nil then
    return nil, string.format("run %d has ended (%s): only a run that died can be resumed", id,
      tostring(r.outcome))
  end
  local now = self:now()
  if self:is_alive(r, now) then
    return nil, string.format("run %d is still running (%s): it can be resumed once it has died", id,
      self.shared and ("its lease runs until " .. os.date("!%H:%M:%SZ", math.floor(r.lease_until)))
        or ("pid " .. tostring(r.pid)))
  end
  local lease = self.shared and (now + M.LEASE) or nil
  local n
  if self.shared then
    n = self.db:run([[UPDATE runs SET pid = ?, pid_start = ?, owner = ?, lease_until = ?,
      resumes = resumes + 1 WHERE id = ? AND ended_at IS NULL AND owner IS NOT DISTINCT FROM ?
      AND (lease_until IS NULL OR lease_until < ?)]], M.self_pid(), M.self_start(), M.owner(), lease, id,
      r.owner, now)
  else
    n = self.db:run([[UPDATE runs SET pid = ?, pid_start = ?, owner = ?, resumes = resumes + 1
      WHERE id = ? AND ended_at IS NULL AND pid = ? AND pid_start IS ?]], M.self_pid(), M.self_start(),
      M.owner(), id, r.pid, r.pid_start)
  end
  if n ~= 1 then return nil, string.format("run %d was resumed by another process first", id) end
  local entries = self.db:value("SELECT count(*) AS n FROM journal WHERE run_id = ?", id) or 0
  self.db:run("INSERT INTO run_resumes (run_id, at, owner, previous_owner, entries) VALUES (?, ?, ?, ?, ?)",
    id, core.time(), M.owner(), r.owner, entries)
  if self.shared then self.leases.runs[id] = true end
  return self.db:row("SELECT * FROM runs WHERE id = ?", id)
end

--- ledger:resumes(id) -> array of the run's resumes {at, owner, previous_owner, entries}, oldest
-- first. [yields] on PostgreSQL.
function Ledger:resumes(id)
  return self.db:rows("SELECT * FROM run_resumes WHERE run_id = ? ORDER BY id", id)
end

--- ledger:begin_run{recipe, backend, workspace, local_state} -> run id: the run record of this
-- process (`moonbox run`), kept in ledger.run_id.
function Ledger:begin_run(info)
  self.run_id = self:open_run(info)
  return self.run_id
end

--- ledger:end_run(outcome [, run_id]): marks a run finished ("ok", "failed", "interrupted",
-- ...); without run_id, this process's own run (nothing happens if it never began).
function Ledger:end_run(outcome, run_id)
  run_id = run_id or self.run_id
  if not run_id then return end
  self.db:run("UPDATE runs SET ended_at = ?, outcome = ? WHERE id = ?", core.time(), outcome, run_id)
  self.leases.runs[run_id] = nil
end

--- ledger:intent([run_id]) -> intent id, label: written before a create is sent; label goes
-- into the sandbox's name so a lost answer can still be attributed. run_id defaults to this
-- process's own run.
function Ledger:intent(run_id)
  run_id = run_id or self.run_id
  local t = core.time()
  local _, id = self.db:run("INSERT INTO intents (run_id, created_at, label) VALUES (?, ?, '')",
    run_id, t)
  local label = "mb-" .. id .. "-" .. (run_id or 0)
  self.db:run("UPDATE intents SET label = ? WHERE id = ?", label, id)
  return id, label
end

--- ledger:bind(intent, sandbox_id): the create answered with this id.
function Ledger:bind(intent, sandbox_id)
  self.db:run("UPDATE intents SET sandbox_id = ? WHERE id = ?", sandbox_id, intent)
end

--- ledger:fail(intent, outcome): the backend refused the create: nothing was made.
function Ledger:fail(intent, outcome)
  self.db:run("UPDATE intents SET released_at = ?, outcome = ? WHERE id = ?", core.time(), outcome, intent)
end

--- ledger:release(sandbox_id [, outcome]): the backend confirmed the sandbox is gone (outcome
-- "terminated", the default, or "gone" when it no longer knows it).
function Ledger:release(sandbox_id, outcome)
  self.db:run([[UPDATE intents SET released_at = ?, outcome = ?
    WHERE sandbox_id = ? AND released_at IS NULL]], core.time(), outcome or "terminated", sandbox_id)
end

--- ledger:settle(intent, outcome [, sandbox_id]): releases one intent (reap: "reaped", "gone",
-- "never_made", "forgotten"), recording the sandbox id it turned out to have.
function Ledger:settle(intent, outcome, sandbox_id)
  self.db:run([[UPDATE intents SET sandbox_id = coalesce(?, sandbox_id), released_at = ?, outcome = ?
    WHERE id = ?]], sandbox_id, core.time(), outcome, intent)
end

--- ledger:unknown(run_id) -> the run's intents without an id and not released (creates whose
-- answer never came), oldest first.
function Ledger:unknown(run_id)
  return self.db:rows([[SELECT * FROM intents WHERE run_id = ? AND sandbox_id IS NULL
    AND released_at IS NULL ORDER BY id]], run_id)
end

--- ledger:forget(run_id) -> how many intents it released: drops what a run holds without
-- touching the backend (`moonbox reap --forget`, for entries a person knows are gone).
function Ledger:forget(run_id)
  local n = self.db:run([[UPDATE intents SET released_at = ?, outcome = 'forgotten'
    WHERE run_id = ? AND released_at IS NULL]], core.time(), run_id)
  return n
end

--- ledger:is_alive(r [, now]) -> whether run row r has not ended and its owner lives: its
-- process (SQLite), its lease (PostgreSQL; now: ledger:now()). [yields] on PostgreSQL.
function Ledger:is_alive(r, now)
  if r.ended_at ~= nil then return false end
  if self.shared then
    return r.lease_until ~= nil and r.lease_until > (now or self:now())
  end
  return M.alive(r.pid, r.pid_start)
end

local function fill_run(L, r, now)
  r.alive = L:is_alive(r, now)
  r.held = L.db:rows("SELECT * FROM intents WHERE run_id = ? AND released_at IS NULL ORDER BY id", r.id)
  return r
end

--- ledger:runs() -> array of runs with `alive` and `held` (unreleased intents) filled in.
function Ledger:runs()
  local out = {}
  local now = self.shared and self:now() or nil
  for _, r in ipairs(self.db:rows("SELECT * FROM runs ORDER BY id")) do
    out[#out + 1] = fill_run(self, r, now)
  end
  return out
end

--- ledger:run(id) -> that run with `alive` and `held` filled in, or nil.
function Ledger:run(id)
  local r = self.db:row("SELECT * FROM runs WHERE id = ?", id)
  return r and fill_run(self, r)
end

local function id_array(set)
  local ids = {}
  for id in pairs(set) do ids[#ids + 1] = tostring(math.tointeger(id) or id) end
  if #ids == 0 then return nil end
  table.sort(ids)
  return "{" .. table.concat(ids, ",") .. "}"
end

--- ledger:renew() -> the new lease_until: extends the lease of the runs this process opened
-- and has not ended, and of the schedule runs it is running (ledger.leases, kept by
-- moonbox.schedule.store) — by id, so a row this process wrote but never learnt of (its answer
-- was lost with the connection) is not kept alive by it. Nothing on SQLite (liveness is the
-- process there). [yields] on PostgreSQL.
function Ledger:renew()
  if not self.shared then return nil end
  local until_ = self:now() + M.LEASE
  local runs, sruns = id_array(self.leases.runs), id_array(self.leases.schedule_runs)
  if runs then
    self.db:run("UPDATE runs SET lease_until = ? WHERE id = ANY (?::bigint[]) AND ended_at IS NULL",
      until_, runs)
  end
  if sruns then
    -- owner: a queued record another daemon took over (buffer_one) is that daemon's to renew
    self.db:run("UPDATE schedule_runs SET lease_until = ? WHERE id = ANY (?::bigint[]) " ..
      "AND outcome IN ('queued', 'running') AND owner = ?", until_, sruns, M.owner())
  end
  return until_
end

--- ledger:keep_alive([on_error]) -> task or nil: on PostgreSQL, the task that renews this
-- ledger's leases (ledger:renew) every third of ledger.LEASE until it is cancelled (one per
-- ledger: a second call returns the running one), then calls each of ledger.renew_hooks (in
-- order; they may yield); on_error(err) hears a renewal or a hook that failed
-- (the next one tries again). nil on SQLite. Does not yield.
function Ledger:keep_alive(on_error)
  if not self.shared then return nil end
  if self.keeper and task.result(self.keeper) == nil then return self.keeper end
  self.keeper = task.spawn(function()
    while true do
      task.sleep(M.LEASE / 3)
      local ok, err = pcall(self.renew, self)
      for _, hook in ipairs(ok and self.renew_hooks or {}) do
        ok, err = pcall(hook)
        if not ok then break end
      end
      if not ok then
        if task.is_cancelled(err) then error(err, 0) end
        if on_error then on_error(err) end
      end
    end
  end)
  return self.keeper
end

--- ledger:stop_keeping(): cancels the keeper (keep_alive), if one runs; the leases then run
-- out unless the runs end first. Does not yield.
function Ledger:stop_keeping()
  if self.keeper then task.cancel(self.keeper) end
  self.keeper = nil
end

--- ledger:sandboxes(run_id) -> array of the sandbox ids that run's creates answered with.
function Ledger:sandboxes(run_id)
  local out = {}
  for r in self.db:each(
    "SELECT sandbox_id FROM intents WHERE run_id = ? AND sandbox_id IS NOT NULL ORDER BY id",
    run_id) do
    out[#out + 1] = r.sandbox_id
  end
  return out
end

function Ledger:close()
  if self.db then self.db:close() end
  self.db = nil
end

local self_pid, self_start -- this process's: they never change, so /proc is read once

--- ledger.self_pid() -> this process's pid (from /proc/self).
function M.self_pid()
  if not self_pid then
    local f = io.open("/proc/self/stat")
    self_pid = tonumber(f:read("a"):match("^(%d+)"))
    f:close()
  end
  return self_pid
end

--- ledger.self_start() -> this process's start time (pid_start of self_pid()).
function M.self_start()
  self_start = self_start or pid_start(M.self_pid())
  return self_start
end

local owner_id, host_name

--- ledger.host() -> this machine's host name (as in owner ids).
function M.host()
  if not host_name then
    local f = io.open("/proc/sys/kernel/hostname")
    host_name = f and f:read("l") or "?"
    if f then f:close() end
  end
  return host_name
end

--- ledger.owner() -> who this process is, for other machines: "HOST/PID/START" (the host name,
-- pid and process start time).
function M.owner()
  owner_id = owner_id or string.format("%s/%d/%s", M.host(), M.self_pid(), tostring(M.self_start()))
  return owner_id
end

--- ledger.elsewhere(r) -> the host of run row r when it ran on another machine and used an
-- embedded backend there (whose sandboxes only that machine can reach), else nil.
function M.elsewhere(r)
  if not (r.local_state and r.owner) then return nil end
  local host = r.owner:match("^(.*)/%d+/[^/]*$")
  if host and host ~= M.host() then return host end
  return nil
end

--- ledger.alive(pid, start) -> whether process pid runs and is the one that started at `start`
-- (not a later process that reused the pid).
function M.alive(pid, start)
  return pid ~= nil and start ~= nil and pid_start(pid) == start
end

-- ---- the run of the current task ----------------------------------------------------------

-- The run a task's creates belong to lives in its task context (task.set_context, inherited
-- by every task it spawns, also after it finished): {ledger = Ledger, recipe = ..., run_id =
-- nil|id, on_begin = fn(id)}.

--- ledger.attach(task, ctx): creates made by task, and by every task it spawns, are recorded in
-- their own run of ctx.ledger, begun at the first create (so a run that creates nothing leaves
-- no ledger row): ctx = {ledger, recipe, on_begin = fn(run_id) (optional)}; ctx.run_id is set
-- then. Does not yield.
function M.attach(t, ctx)
  task.set_context("ledger_run", ctx, t)
end

--- ledger.detach(task): ends the attachment for tasks task spawns from now on (the run record
-- itself is ended by the caller).
function M.detach(t)
  task.set_context("ledger_run", nil, t)
end

--- ledger.context([task]) -> the ctx attached to task (default: the running one) or inherited
-- from the task that spawned it, or nil.
function M.context(t)
  return task.context("ledger_run", t)
end

-- ---- the process's ledger -------------------------------------------------------------------

local process_ledger

--- ledger.set_process(L): the ledger of this process's own run (`moonbox schedule` opens one
-- and shares it with its store). Does not yield.
function M.set_process(L) process_ledger = L end

--- ledger.process() -> the Ledger of this process's own run, or nil when none was opened (it is
-- opened at the first create when the command keeps a ledger: build.ledger, set by moonbox run,
-- repl and schedule). Does not yield.
function M.process() return process_ledger end

--- ledger.close_process(outcome): ends this process's own run with outcome ("ok", "failed",
-- "interrupted"; nothing when it never began) and closes its ledger. Yields only on PostgreSQL.
function M.close_process(outcome)
  local L = process_ledger
  if not L then return end
  process_ledger = nil
  L:stop_keeping()
  L:end_run(outcome)
  L:close()
end

--- ledger.for_create(conn) -> Ledger, run id | nil: where moonbox.render records a create made
-- now: the run attached to the current task (begun now if needed), else the process's own run
-- (begun at the first create). The run records conn's backend URL and, for an embedded
-- backend, its state dir. Yields only on PostgreSQL.
-- Runs make() once for holder: the first caller runs it, callers that come while it is under
-- way (it yields on PostgreSQL) wait for it and see what it made, so concurrent first creates
-- begin one run, not several. make() stores its result; a failure lets the next caller try.
local function once(holder, done, make)
  while not done() and holder.opening do holder.opening:wait() end
  if done() then return end
  local cond = core.cond()
  holder.opening = cond
  local ok, err = pcall(make)
  holder.opening = nil
  cond:broadcast()
  if not ok then error(err, 0) end
end

local process_opening = {}

function M.for_create(c)
  local info = { backend = c.base, workspace = c.workspace, local_state = c.state_dir }
  local ctx = M.context()
  if ctx then
    once(ctx, function() return ctx.run_id ~= nil end, function()
      info.recipe = ctx.recipe
      local id = ctx.ledger:open_run(info)
      ctx.run_id = id
      if ctx.on_begin then ctx.on_begin(id) end
    end)
    return ctx.ledger, ctx.run_id
  end
  if has_build and build.ledger then
    once(process_opening, function() return process_ledger ~= nil end, function()
      process_ledger = M.open()
    end)
  end
  local L = process_ledger
  if not L then return nil end
  once(L, function() return L.run_id ~= nil end, function()
    info.recipe = arg and arg[0]
    L:begin_run(info)
    -- On PostgreSQL the run is alive while its lease lasts: renew it until the process ends
    -- (the keeper is cancelled with the recipe's other tasks, then close_process ends the run).
    if L.shared then L:keep_alive() end
  end)
  return L, L.run_id
end

--- ledger.release_anywhere(sandbox_id, outcome): releases the sandbox in the ledger a create of
-- the current task would use (its run's, else the process's), if any. Yields only on PostgreSQL.
function M.release_anywhere(sandbox_id, outcome)
  local ctx = M.context()
  local L = ctx and ctx.ledger or process_ledger
  if L and L.db then L:release(sandbox_id, outcome) end
end

M.Ledger = Ledger
return M
