--- moonbox.local.service — what `moonbox local` does, apart from how it is asked over HTTP.
--
-- The service owns the backend's records (moonbox.local.state: groups, sandboxes, snapshots,
-- exec records), the isolation engine (moonbox.local.engine), connect tokens, per-sandbox log
-- streams, and the lifecycle that ties them: create → boot → running; idle suspend and wake;
-- timeouts; terminate and layer garbage collection; snapshot capture; recovery after a restart.
-- Its callers (the handlers in moonbox.local.http.*) decode requests, call one method, and
-- encode the result; they never touch records or the engine themselves.
-- Errors are raised as ServiceError values {kind, message, code, retry_after}: kind is one of
-- invalid, unauthorized, forbidden, not_found, conflict, too_large, rate_limited, unavailable,
-- insufficient_storage, internal (the wire maps each to a status), code is Render's machine code where it
-- has one.
-- Messages name ids and sandbox paths, never a host path.
-- Everything runs on the loop; long work (boot, capture, exec) runs in tasks of its own.
local task = require "moonbox.task"
local core = require "moonbox.core"
local sys = require "moonbox.sys"
local host = require "moonbox.local.engine.host"
local ids = require "moonbox.ids"
local json = require "moonbox.json"
local utf8_cut = require("moonbox.strings").utf8_cut
local image = require "moonbox.local.image"
local State = require "moonbox.local.state"
local Engine = require "moonbox.local.engine"

local M = {}
local Service = {}
Service.__index = Service
M.Service = Service

M.DEFAULTS = {
  plan = "1c-2g",
  region = "oregon",
  timeout_seconds = 86400,
  idle_timeout_seconds = 900,
  concurrency_limit = 1000,
  snapshot_lifetime = 30 * 86400,
  -- A connect token's lifetime: clients use one at once (the slowest of a 16-way fan-out of 100
  -- restores on a saturated 2-core machine waited 43 ms; GET /_moonbox/health "tokens"), and
  -- an unspent token is what a leak exposes. MOONBOX_LOCAL_TOKEN_TTL sets another.
  token_ttl = 30,
  keepalive = 15,
  log_max = 5000,
  log_bytes = 4 * 1024 * 1024,
  sync_output_max = 1024 * 1024, -- bytes kept per stream of a runs/sync answer
  idle_scale = 1, -- specs only: idle timeouts are multiplied by this (MOONBOX_LOCAL_IDLE_SCALE)
  max_upload = 8 * 1024 * 1024 * 1024,
  capture_timeout = 60, -- seconds a capture may keep its sandbox frozen (docs/local.md, "Snapshots")
}

-- Plans and what each limits: CPUs (a quota), memory (no swap beyond it), processes, disk (the
-- sandbox's writable layer: Render's 40 GB of writable storage per sandbox, every plan; `moonbox
-- local --disk PLAN=SIZE` sets another, limits.disk). Render's older names are accepted as the
-- sizes that replaced them.
local GiB = 1024 * 1024 * 1024
M.PLANS = {
  ["1c-2g"] = { cpus = 1, memory = 2 * GiB, pids = 1024, disk = 40 * GiB },
  ["2c-4g"] = { cpus = 2, memory = 4 * GiB, pids = 2048, disk = 40 * GiB },
  ["4c-8g"] = { cpus = 4, memory = 8 * GiB, pids = 4096, disk = 40 * GiB },
  ["8c-16g"] = { cpus = 8, memory = 16 * GiB, pids = 8192, disk = 40 * GiB },
}
-- Older names get the limits of the size that replaced them, and are answered as sent: an
-- older SDK parses the plan into its own enum, which has no "2c-4g".
M.PLAN_ALIASES = { starter = "1c-2g", standard = "2c-4g", pro = "4c-8g" }
for old, new in pairs(M.PLAN_ALIASES) do M.PLANS[old] = M.PLANS[new] end
-- What an unknown plan's error offers: the sizes, and each older name with the size it maps to.
M.PLAN_NAMES = "1c-2g, 2c-4g, 4c-8g or 8c-16g (older names: starter = 1c-2g, standard = 2c-4g, " ..
  "pro = 4c-8g)"

M.SANDBOX_STATUSES = { creating = true, running = true, suspending = true, suspended = true,
  resuming = true, errored = true, terminated = true }
M.SNAPSHOT_STATUSES = { creating = true, available = true, failed = true }
M.LIVE = { creating = true, running = true, suspending = true, suspended = true, resuming = true }

-- ---- errors ------------------------------------------------------------------------------

local ServiceError = { __name = "moonbox.local.ServiceError" }
ServiceError.__index = ServiceError
ServiceError.__tostring = function(e)
  return string.format("%s: %s%s", e.kind, e.message, e.code and (" (" .. e.code .. ")") or "")
end
M.ServiceError = ServiceError

--- service.fail(kind, message[, code[, retry_after]]): raises a ServiceError. Never returns.
local function fail(kind, message, code, retry_after)
  error(setmetatable({ kind = kind, message = message, code = code, retry_after = retry_after },
    ServiceError), 0)
end
M.fail = fail

--- service.is_error(v) -> whether v is a ServiceError.
function M.is_error(v) return getmetatable(v) == ServiceError end

--- M.check_allowed(domains) -> true | false, why. Whether domains (an array of host names) can
-- be a sandbox's allow-list: at most the engine's limit, each a name the engine accepts
-- (moonbox.local.engine: MAX_ALLOWED, check_domain). why is ": at most N names (got M)" or
-- "[i]: reason" for the first bad entry (i counts from 0), to follow the field's name. The wire
-- asks this before create_sandbox so that it never needs the engine itself. Raises nothing and
-- does not yield.
function M.check_allowed(domains)
  if #domains > Engine.MAX_ALLOWED then
    return false, string.format(": at most %d names (got %d)", Engine.MAX_ALLOWED, #domains)
  end
  for i, d in ipairs(domains) do
    local ok, why = Engine.check_domain(d)
    if not ok then return false, string.format("[%d]: %s", i - 1, why) end
  end
  return true
end

--- svc:now() -> the wall-clock time (epoch seconds) the service's records and deadlines read:
-- its clock's (opts.clock of service.new; core.time by default, a dry run's simulated one).
-- Does not yield.
function Service:now() return self.clock.time() end

local function message_of(err)
  if type(err) == "table" and err.message then return tostring(err.message) end
  return tostring(err)
end

-- A message of the engine or a helper as the API may show it: layer files by their names,
-- nothing else of the state dir, the helper by its name.
local function hide_paths(self, msg)
  local dir = self.state_dir:gsub("%p", "%%%0")
  msg = msg:gsub(dir .. "/layers/", ""):gsub("'?" .. dir .. "[^%s:']*'?", "(the state directory)")
  return (msg:gsub("'?/[^%s:']*/moonbox%-sandbox'?", "moonbox-sandbox"))
end

-- ---- construction --------------------------------------------------------------------------

--- service.REAL_CLOCK: core's clocks, what a service reads unless it is handed another: now()
-- (monotonic seconds: run grace, rate windows) and time() (epoch seconds: records, deadlines).
M.REAL_CLOCK = { now = core.now, time = core.time }

--- Service.new(opts) -> Service. opts: st (an open moonbox.local.state), engine, state_dir,
-- workspace, user, limits (overrides of DEFAULTS), log (function(line)), on_token (function(op,
-- token, info): the wire's pre-body gate learns about tokens), faults (a moonbox.local.faults
-- injector: its stall rules stop operations at named points), clock ({now, time}: the monotonic
-- seconds and the wall-clock epoch seconds everything the service does reads; default core's,
-- M.REAL_CLOCK; a dry run hands its simulated one). Does not yield.
function M.new(opts)
  local self = setmetatable({
    clock = opts.clock or M.REAL_CLOCK,
    st = opts.st, engine = opts.engine, state_dir = opts.state_dir, workspace = opts.workspace,
    user = opts.user, log = opts.log or function() end, on_token = opts.on_token or function() end,
    faults = opts.faults,
    limits = setmetatable({}, { __index = M.DEFAULTS }),
    tokens = {}, token_use = { spent = 0, slowest = 0 },
    runtime = {}, logs = {}, log_conds = {}, tasks = {}, closing = false,
    ended_logs = { first = 1, last = 0 }, snap_timers = {},
  }, Service)
  for k, v in pairs(opts.limits or {}) do self.limits[k] = v end
  -- Records of older versions kept create-env values; they are never written now.
  for _, rec in ipairs(self.st:each_with("sandbox", '"_env"')) do
    if rec._env then
      rec._env = nil
      self.st:save("sandbox", rec)
    end
  end
  return self
end

--- svc:start(): recovers what a previous backend left and arms the snapshots' expiry timers.
-- Nothing runs on a tick: each deadline (a sandbox's timeout and idle timeout, a snapshot's
-- expiry, the connect tokens' sweep) has a timer of its own. [yields]
function Service:start()
  self:recover()
  for _, snap in pairs(self.st.snapshots) do self:expire_later(snap) end
end

--- svc:close(): stops the timers and every sandbox's processes (their records stay and are
-- reported as a restart leaves them). [yields]
function Service:close()
  if self.closing then return end
  self.closing = true
  for _, t in pairs(self.tasks) do task.cancel(t) end
  for _, t in pairs(self.snap_timers) do task.cancel(t) end
  for _, runtime in pairs(self.runtime) do if runtime.watch then task.cancel(runtime.watch) end end
  for id, rec in pairs(self.st.sandboxes) do
    if M.LIVE[rec.status] then pcall(self.engine.terminate, self.engine, id) end
  end
  -- A terminate in flight (its task may have been cancelled above) is finished here.
  for id in pairs(self.runtime) do pcall(self.engine.terminate, self.engine, id) end
  if self.engine.close then pcall(self.engine.close, self.engine) end
end

-- ---- logs ----------------------------------------------------------------------------------

--- svc:emit(id, event, data): appends a log or lifecycle event to a sandbox's log stream
-- (bounded by events and bytes: the oldest go first) and wakes its followers.
function Service:emit(id, event, data)
  local list = self.logs[id]
  if not list then
    list = {}
    self.logs[id] = list
  end
  data.at = data.at or ids.iso(self:now())
  local size = data.data and #data.data or 0
  list.n = (list.n or 0) + 1
  list[#list + 1] = { event = event, data = data, t = self:now(), size = size, n = list.n }
  list.bytes = (list.bytes or 0) + size
  while #list > self.limits.log_max or list.bytes > self.limits.log_bytes do
    local old = table.remove(list, 1)
    list.bytes = list.bytes - old.size
  end
  local c = self.log_conds[id]
  if c then c:broadcast() end
end

-- How many terminated sandboxes keep their log streams in memory (the newest ones); an older
-- one's log answers its end only.
local ENDED_LOGS = 100

--- svc:log_events(rec) -> the sandbox's log events, oldest first (each {event, data, t, n}).
-- A terminated sandbox whose stream was dropped (ENDED_LOGS) answers its terminated event.
function Service:log_events(rec)
  local list = self.logs[rec.id]
  if list then return list end
  if rec.status == "terminated" then
    local t = ids.parse_iso(rec.terminatedAt or "") or self:now()
    return { { event = "lifecycle", data = { type = "terminated", at = rec.terminatedAt }, t = t, size = 0,
      n = 1 } }
  end
  return {}
end

-- Keeps the log streams of the ENDED_LOGS most recently terminated sandboxes; drops older ones.
local function retire_logs(self, id)
  local q = self.ended_logs
  q.last = q.last + 1
  q[q.last] = id
  while q.last - q.first + 1 > ENDED_LOGS do
    local old = q[q.first]
    q[q.first] = nil
    q.first = q.first + 1
    self.logs[old], self.log_conds[old] = nil, nil
  end
end

--- svc:log_cond(id) -> the condition a log follower of sandbox id waits on.
function Service:log_cond(id)
  local c = self.log_conds[id] or core.cond()
  self.log_conds[id] = c
  return c
end

-- ---- sandbox lifecycle ---------------------------------------------------------------------

-- A crash point (docs/local.md, "Fault injection": stall:POINT): when a stall rule fires at
-- point, the operation on id stops here until the server stops, so that a spec can SIGKILL the
-- server with the operation half done. [yields] when it stalls.
local function crash_point(self, point, id)
  if not (self.faults and self.faults:stall(point)) then return end
  self.log("stalled at " .. point .. " of " .. id .. " (injected fault stall:" .. point .. ")")
  while true do task.sleep(3600) end
end

-- Writes fields into a sandbox's record, in memory only once the database has them
-- (moonbox.local.state: update). Raises insufficient_storage when the disk is full, internal
-- for another failed write, both naming the sandbox; nothing has changed then. Does not yield.
local function persist(self, rec, fields)
  local ok, err = pcall(self.st.update, self.st, "sandbox", rec, fields)
  if ok then return end
  self.log(message_of(err))
  if type(err) == "table" and err.code == "disk_full" then
    fail("insufficient_storage", "sandbox " .. rec.id .. ": the backend's disk is full, so its record " ..
      "could not be written; nothing was changed (free space and retry)")
  end
  fail("internal", "sandbox " .. rec.id .. ": its record could not be written (" ..
    message_of(err):gsub("^cannot write the record of sandbox %S+: ", "") .. "); nothing was changed")
end

-- Records a sandbox's new status (and the extra fields) once the database has it, then tells
-- its log stream and its watcher. Raises as persist, with nothing changed. Does not yield.
local function set_status(self, rec, status, extra)
  local fields = { status = status }
  for k, v in pairs(extra or {}) do fields[k] = v end
  persist(self, rec, fields)
  if status ~= "suspending" then self:emit(rec.id, "lifecycle", { type = status }) end
  local runtime = self.runtime[rec.id]
  if runtime and runtime.wake then runtime.wake:broadcast() end
end

-- set_status for a task of the service's own (a boot, a freeze): a write that fails is logged
-- and leaves the record as it was (the next start's recovery settles it). Returns whether it
-- was written. Does not yield.
local function try_status(self, rec, status, extra)
  local ok, err = pcall(set_status, self, rec, status, extra)
  if not ok then
    self.log("sandbox " .. rec.id .. ": could not record " .. status .. ": " .. message_of(err))
  end
  return ok
end

--- svc:runtime_of(id) -> the runtime (unpersisted) state of a sandbox, made on first use: its
-- boot task, its start time, the `ready` condition, the deadline watcher and its `wake`, the
-- count of operations in flight (`active`) and the last activity, the capture lock. Does not
-- yield.
function Service:runtime_of(id)
  local runtime = self.runtime[id]
  if not runtime then
    runtime = { active = 0, last_activity = self:now(), ready = core.cond() }
    self.runtime[id] = runtime
  end
  return runtime
end

--- service.plan(name) -> the plan's limits, or raises invalid naming the plans.
function M.plan(name)
  local p = M.PLANS[name]
  if not p then
    fail("invalid", "unknown plan " .. string.format("%q", tostring(name)) .. " (use " .. M.PLAN_NAMES .. ")")
  end
  return p
end

--- svc:plan_limits(name) -> the limits a sandbox of plan name gets: the plan's, with the disk
-- size limits.disk[PLAN] sets (`moonbox local --disk PLAN=SIZE`; an older name follows the size
-- it maps to).
function Service:plan_limits(name)
  local p = M.PLANS[name]
  local disk = self.limits.disk and self.limits.disk[M.PLAN_ALIASES[name] or name]
  if not (p and disk) then return p end
  local out = {}
  for k, v in pairs(p) do out[k] = v end
  out.disk = disk
  return out
end

-- Boots a sandbox's namespaces and filesystem in its own task: creating → running or errored
-- (its log stream says why, naming ids and layer names, never a host path).
function Service:boot(rec, env)
  local runtime = self:runtime_of(rec.id)
  runtime.boot = task.spawn(function()
    -- The record names what it boots from (its lowers, its snapshot's /dev capture), which the
    -- collector keeps while it boots and lives, its snapshot deleted or not.
    local ok, err = pcall(self.engine.create, self.engine, rec.id, {
      lowers = rec._lowers or {}, network = rec.networkPolicy.default, env = env,
      allowed = rec.networkPolicy.allowedDomains,
      dev_records = rec._dev, limits = self:plan_limits(rec.plan), plan = rec.plan,
    })
    if ok then crash_point(self, "boot", rec.id) end
    if not ok then err = hide_paths(self, message_of(err)) end
    runtime.boot = nil
    if rec.status ~= "creating" or rec._pending then return end -- terminated meanwhile
    if ok then
      runtime.started = self:now()
      runtime.last_activity = self:now()
      if try_status(self, rec, "running") then
        self:watch(rec)
      else
        -- Not recorded running: it must not run unrecorded.
        pcall(self.engine.terminate, self.engine, rec.id)
        try_status(self, rec, "errored", { _error = "its record could not be written (disk full?)" })
      end
    else
      self.log("sandbox " .. rec.id .. " failed to boot: " .. message_of(err))
      self:emit(rec.id, "log", { stream = "stderr", data = "the sandbox could not start: " .. message_of(
        err) .. "\n" })
      try_status(self, rec, "errored", { _error = message_of(err) })
    end
    runtime.ready:broadcast()
  end)
end

--- svc:ensure_running(rec) -> the runtime record. Waits until a sandbox can run commands:
-- wakes it if suspended (resuming → running) and waits out a boot. Raises not_found for a
-- terminated sandbox, conflict sandbox_not_running for an errored one, unavailable when a boot
-- takes over two minutes. [yields]
function Service:ensure_running(rec)
  local runtime = self:runtime_of(rec.id)
  local deadline = self:now() + 120
  while true do
    local s = rec.status
    if rec._pending == "terminate" then fail("not_found", "sandbox " .. rec.id .. " is being terminated") end
    if s == "running" then return runtime end
    if s == "terminated" then fail("not_found", "sandbox " .. rec.id .. " is terminated") end
    if s == "errored" then fail("conflict", "sandbox " .. rec.id .. " is errored", "sandbox_not_running") end
    if s == "suspended" or s == "suspending" then
      set_status(self, rec, "resuming")
      local ok, err = pcall(self.engine.thaw, self.engine, rec.id)
      if not ok then
        self.log("waking " .. rec.id .. " failed: " .. message_of(err))
        set_status(self, rec, "errored")
        fail("internal", "could not wake sandbox " .. rec.id)
      end
      runtime.last_activity = self:now()
      set_status(self, rec, "running")
      return runtime
    end
    if self:now() > deadline then fail("unavailable", "sandbox " .. rec.id .. " is not ready yet", nil, 1) end
    runtime.ready:wait()
  end
end

--- svc:activity(id, delta): marks the start (+1) and end (-1) of an operation that keeps a
-- sandbox awake.
function Service:activity(id, delta)
  local runtime = self:runtime_of(id)
  runtime.active = runtime.active + delta
  runtime.last_activity = self:now()
  if runtime.active == 0 and runtime.wake then runtime.wake:broadcast() end
end

--- svc:terminate(rec): terminates a sandbox (idempotent): stops its processes, frees its disk
-- and the layers nothing needs any more, records the time. Write-ahead: the record says
-- `_pending = "terminate"` (durable) before anything is torn down, and `terminated` once it
-- is; a backend killed in between finishes the terminate at its next start (svc:recover).
-- Raises insufficient_storage (internal) when the first write fails: then nothing changed and
-- the sandbox runs on. [yields]
function Service:terminate(rec)
  if rec.status == "terminated" then return end
  if rec._pending ~= "terminate" then persist(self, rec, { _pending = "terminate" }) end
  local runtime = self:runtime_of(rec.id)
  if runtime.boot then task.cancel(runtime.boot) end
  runtime.watch = nil -- its deadlines are over; close() must not cancel a watcher terminating it
  crash_point(self, "terminate", rec.id)
  runtime.ready:broadcast()
  local ok, err = pcall(self.engine.terminate, self.engine, rec.id)
  -- What the engine could not free is freed by the next start (its recovery removes the
  -- directory and cgroups of every sandbox not live).
  if not ok then self.log("terminating " .. rec.id .. ": " .. message_of(err)) end
  if rec.status == "terminated" then return end -- a concurrent terminate finished first
  set_status(self, rec, "terminated", { terminatedAt = ids.iso(self:now()), _pending = State.NONE })
  runtime.ready:broadcast()
  self.runtime[rec.id] = nil
  retire_logs(self, rec.id)
  self:gc_layers()
end

-- Freezes a sandbox already marked suspending: suspended, or back to running (logged) when the
-- freeze fails; nothing when its status changed meanwhile (a terminate). [yields]
local function suspend_now(self, rec)
  local ok, err = pcall(self.engine.freeze, self.engine, rec.id)
  if rec.status ~= "suspending" or rec._pending then return end
  if ok then
    if not try_status(self, rec, "suspended") then pcall(self.engine.thaw, self.engine, rec.id) end
  else
    self.log("suspending " .. rec.id .. ": " .. message_of(err))
    try_status(self, rec, "running")
  end
end

--- svc:suspend(rec) -> rec. Starts suspending a running sandbox (suspending → suspended in a
-- task); idempotent for a suspended one. Raises conflict sandbox_not_running otherwise.
function Service:suspend(rec)
  if rec.status == "suspended" or rec.status == "suspending" then return rec end
  if rec.status ~= "running" then
    fail("conflict", "sandbox " .. rec.id .. " is " .. rec.status .. ", not running", "sandbox_not_running")
  end
  set_status(self, rec, "suspending")
  task.spawn(suspend_now, self, rec)
  return rec
end

-- The files a snapshot owns under <state>/layers: its layer, the layer while it is being
-- copied (.partial), its /dev capture (.dev, runtime snapshots) and its manifest (.manifest).
-- Named from the snapshot's id, so a record written before its capture starts names them all.
local function own_files(self, snap)
  local layer = snap._layer or (self.state_dir .. "/layers/" .. snap.id)
  return { layer, layer .. ".partial", layer .. ".dev", layer .. ".manifest" }
end

-- The layer files something still needs: the lowers and /dev capture of every sandbox that is
-- booting or live, and every file of every snapshot that is being captured or is available and
-- not deleted (its own files and the lower layers it stacks on). A lower layer is needed with
-- its manifest: a restore (and a capture's snapshot, which stacks on the same lowers) checks
-- every layer of its stack against its manifest.
local function needed_files(self)
  local needed = {}
  local function layer(l)
    needed[l] = true
    needed[l .. ".manifest"] = true
  end
  for _, s in pairs(self.st.sandboxes) do
    if M.LIVE[s.status] then
      for _, l in ipairs(s._lowers or {}) do layer(l) end
      if s._dev then needed[s._dev] = true end
    end
  end
  for _, s in pairs(self.st.snapshots) do
    if s.status == "creating" or (s.status == "available" and not s._deleted) then
      for _, f in ipairs(own_files(self, s)) do needed[f] = true end
      for _, l in ipairs(s._layers or {}) do layer(l) end
      if s._dev_records then needed[s._dev_records] = true end
    end
  end
  return needed
end

-- The snapshots whose files wait to be freed (deleted or failed, not yet _freed), by id; on
-- first use, those a previous backend left so.
local function pending(self)
  if not self.unfreed then
    self.unfreed = {}
    for _, row in ipairs(self.st.db:rows([[SELECT id FROM records WHERE kind = 'snapshot'
        AND status IN ('deleted', 'failed') AND instr(doc, '"_freed"') = 0]])) do
      self.unfreed[row.id] = true
    end
  end
  return self.unfreed
end

-- One pass of the collector: frees the files of each snapshot waiting for it (deleted or
-- failed, its capture over) that nothing needs; a snapshot all of whose files are gone is
-- marked _freed and leaves the list. [yields]
local function collect(self)
  local needed = needed_files(self)
  local ids_ = {}
  for sid in pairs(self.unfreed) do ids_[#ids_ + 1] = sid end
  table.sort(ids_)
  for _, sid in ipairs(ids_) do
    local snap = self.st.snapshots[sid]
    if not snap or snap._freed or not (snap._deleted or snap.status == "failed") then
      self.unfreed[sid] = nil
    elseif snap.status ~= "creating" then -- a capture's files are its own until it ends
      local all = true
      for _, f in ipairs(own_files(self, snap)) do
        if needed[f] then
          all = false
        elseif host.exists(f) then
          local freed, err = pcall(host.remove_tree, f)
          if freed then
            if self.engine.forget_layer then self.engine:forget_layer(f) end
          else
            all = false
            self.log("cannot free " .. f:match("[^/]*$") .. " of snapshot " .. sid .. ": " .. message_of(err))
          end
        end
      end
      if all then
        snap._freed = true
        self.st:save("snapshot", snap)
        self.unfreed[sid] = nil
      end
    end
  end
end

--- svc:gc_layers(): frees the layer files of deleted and failed snapshots that no booting or
-- live sandbox and no kept snapshot needs. It works only from the records: a capture's files
-- are named by its snapshot record (status creating) before the capture starts, a sandbox
-- record names the lowers and the /dev capture it boots from; nothing is removed because a
-- directory listing shows it (recovery at start sweeps what no record names). Passes never
-- overlap: a call made while one runs waits for the next, which sees its change. [yields]
function Service:gc_layers()
  pending(self)
  local gc = self.gc or { wanted = 0, done = 0, cond = core.cond() }
  self.gc = gc
  gc.wanted = gc.wanted + 1
  local mine = gc.wanted
  if gc.running then
    while gc.done < mine do gc.cond:wait() end
    return
  end
  gc.running = true
  local ok, err = pcall(function()
    while gc.done < gc.wanted do
      local target = gc.wanted
      collect(self)
      gc.done = target
      gc.cond:broadcast()
    end
  end)
  gc.running = false
  if not ok then
    gc.done = gc.wanted
    gc.cond:broadcast()
    error(err, 0)
  end
end

-- A snapshot that no longer keeps its files (deleted, or failed): the collector frees them once
-- nothing needs them. [yields]
local function release(self, snap)
  pending(self)[snap.id] = true
  self:gc_layers()
end

-- Removes path (a file or a tree), logging what it cannot. [yields]
local function remove(self, path, what)
  local ok, err = pcall(host.remove_tree, path)
  if not ok then self.log("cannot remove " .. what .. ": " .. message_of(err)) end
end

local function listdir(path)
  local ok, names = pcall(sys.listdir, path)
  if not ok then return {} end
  table.sort(names)
  return names
end

-- Whether id can name a sandbox directory the engine may be asked to free.
local function sandbox_id_ok(id)
  return id:match("^[%w][%w._-]*$") ~= nil and #id <= 63
end

--- svc:recover(): at start, before the server answers (moonbox.local's gate), finishes or rolls
-- back what the previous backend left in progress and removes what a crash leaves on disk:
-- - a sandbox whose terminate was in progress (`_pending = "terminate"`) is terminated;
-- - a sandbox that was live (creating, running, suspended, ...) died with the previous backend's
--   keepers: it is errored, saying so in its log stream;
-- - a capture in progress is failed;
-- - everything in <state>/tmp (spooled uploads, decompressed ones, archives: the state dir's lock
--   is exclusive, so they belong to a dead process);
-- - the directories and cgroups of every sandbox (none is live at this point), and the mounts
--   a previous backend left under the state dir (moonbox.local.engine: recover, terminate);
--   anything else under sandboxes/ but the sandbox disk's spool;
-- - every file in <state>/layers that no snapshot kept (not deleted, not failed) needs: a layer
--   snp-X, its /dev records snp-X.dev, its manifest snp-X.manifest, an unfinished snp-X.partial.
-- Nothing runs yet, so the listings see no operation in flight. Raises (and the backend does
-- not start) when a record cannot be written. [yields]
function Service:recover()
  local tmp = self.state_dir .. "/tmp"
  for _, name in ipairs(listdir(tmp)) do remove(self, tmp .. "/" .. name, "tmp/" .. name) end
  local report = {}
  if self.engine.recover then
    local ok, got = pcall(self.engine.recover, self.engine)
    if ok then
      report = got or {}
    else
      self.log("recovering the previous run's sandboxes: " .. message_of(got))
    end
  end
  local ended = {}
  for id, rec in pairs(self.st.sandboxes) do
    if rec._pending == "terminate" or M.LIVE[rec.status] then ended[#ended + 1] = id end
  end
  table.sort(ended)
  for _, id in ipairs(ended) do
    local rec = self.st.sandboxes[id]
    pcall(self.engine.terminate, self.engine, id)
    if rec._pending == "terminate" then
      set_status(self, rec, "terminated", { terminatedAt = ids.iso(self:now()), _pending = State.NONE })
      retire_logs(self, id)
    else
      local why = "the moonbox local backend restarted; this sandbox's processes did not survive"
      self:emit(id, "log", { stream = "stderr", data = why .. "\n" })
      set_status(self, rec, "errored", { _error = why })
    end
  end
  -- What is left of sandboxes the records no longer count as live (a terminate that got as far
  -- as its last write, an older backend's leftovers, a directory without a record).
  for _, item in ipairs(report) do
    local ok, err = pcall(self.engine.terminate, self.engine, item.id)
    if not ok then self.log("freeing what sandbox " .. item.id .. " left: " .. message_of(err)) end
  end
  for _, id in ipairs(listdir(self.state_dir .. "/sandboxes")) do
    if sandbox_id_ok(id) then
      local ok, err = pcall(self.engine.terminate, self.engine, id)
      if not ok then self.log("freeing what sandbox " .. id .. " left: " .. message_of(err)) end
    elseif id ~= ".spool" then -- the sandbox disk's upload spool (emptied when the disk is prepared)
      remove(self, self.state_dir .. "/sandboxes/" .. id, "sandboxes/" .. id)
    end
  end
  for _, snap in pairs(self.st.snapshots) do
    if snap.status == "creating" then
      local ok, err = pcall(self.st.update, self.st, "snapshot", snap,
        { status = "failed", error = "the backend restarted during capture" })
      if not ok then error(err, 0) end
    end
  end
  -- Layers are named by the file's name, not its path: a state dir reached by another path
  -- (a symlink) holds the same layers.
  local needed = {}
  local function need(path) needed[path:match("([^/]+)$")] = true end
  for _, snap in pairs(self.st.snapshots) do
    if not snap._deleted and snap.status ~= "failed" then
      for _, l in ipairs(snap._layers or {}) do
        need(l)
        need(l .. ".manifest")
      end
      if snap._dev_records then need(snap._dev_records) end
    end
  end
  local layers = self.state_dir .. "/layers"
  for _, name in ipairs(listdir(layers)) do
    if not needed[name] then remove(self, layers .. "/" .. name, "layers/" .. name) end
  end
end

-- ---- timers ------------------------------------------------------------------------------
-- Each deadline has a timer of its own, so an idle backend wakes only when something is due.

-- Idle suspend: running → suspending → suspended (back to running when the freeze fails).
local function idle_suspend(self, rec)
  if try_status(self, rec, "suspending") then
    suspend_now(self, rec)
  else
    self:runtime_of(rec.id).last_activity = self:now() -- not recorded: try again an idle timeout later
  end
end

-- Waits on cond for at most secs (math.huge: without a deadline); re-raises a cancellation.
local function wait_for(cond, secs)
  if secs == math.huge then return cond:wait() end
  local ok, err = pcall(task.timeout, math.max(secs, 0), cond.wait, cond)
  if not ok and not task.is_timeout(err) then error(err, 0) end
end

--- svc:watch(rec): starts the task that keeps a running sandbox's deadlines: its timeoutSeconds
-- (counted from when it first ran; a running or suspended sandbox is terminated) and its idle
-- timeout (a running one with no operation keeping it awake is suspended). It sleeps until the
-- nearer deadline, or until runtime.wake (a status change, the end of the last activity) says the
-- deadlines moved; it ends with the sandbox. Idempotent.
function Service:watch(rec)
  local runtime = self:runtime_of(rec.id)
  if runtime.watch then return end
  runtime.wake = runtime.wake or core.cond()
  runtime.watch = task.spawn(function()
    while M.LIVE[rec.status] do
      local t = self:now()
      local lifetime = rec.timeoutSeconds and rec.timeoutSeconds > 0 and runtime.started
        and runtime.started + rec.timeoutSeconds or math.huge
      local idle = (rec.idleTimeoutSeconds or self.limits.idle_timeout_seconds) * self.limits.idle_scale
      local idle_due = (rec.status == "running" and idle > 0 and runtime.active == 0)
        and runtime.last_activity + idle
        or math.huge
      if t >= lifetime and (rec.status == "running" or rec.status == "suspended") then
        self:emit(rec.id, "log", { stream = "stderr", data = "sandbox reached its timeoutSeconds\n" })
        local ok, err = pcall(self.terminate, self, rec)
        if not ok then
          if task.is_cancelled(err) then error(err, 0) end
          self.log("sandbox " .. rec.id .. " reached its timeoutSeconds; terminating it failed: " ..
            message_of(err))
          wait_for(runtime.wake, 5) -- and try again
        end
      elseif t >= idle_due then
        idle_suspend(self, rec)
      else
        wait_for(runtime.wake, math.min(lifetime, idle_due) - t)
      end
    end
    runtime.watch = nil
  end)
end

--- svc:expire_later(snap): arms the timer that deletes a snapshot at its expiresAt.
function Service:expire_later(snap)
  local at = not snap._deleted and snap.expiresAt and ids.parse_iso(snap.expiresAt)
  if not at or self.snap_timers[snap.id] then return end
  self.snap_timers[snap.id] = task.spawn(function()
    task.sleep(math.max(0, at - self:now()))
    self.snap_timers[snap.id] = nil
    if not snap._deleted then
      -- A snapshot still being captured keeps its files until its capture ends (which frees them).
      snap._deleted = true
      self.st:save("snapshot", snap)
      release(self, snap)
    end
  end)
end

-- Starts the sweep of expired connect tokens unless it runs: it wakes once per token lifetime
-- while tokens exist (a token is dropped a minute after it expires) and ends when none is left.
local function sweep_tokens(self)
  if self.tasks.tokens then return end
  self.tasks.tokens = task.spawn(function()
    while next(self.tokens) do
      task.sleep(self.limits.token_ttl + 60)
      local t = self:now()
      for tok, info in pairs(self.tokens) do
        if info.expires < t - 60 then
          self.tokens[tok] = nil
          self.on_token("drop", tok)
        end
      end
    end
    self.tasks.tokens = nil
  end)
end

-- ---- groups ----------------------------------------------------------------------------------

local function new_group(self, name, is_default, limit)
  local t = ids.iso(self:now())
  local g = {
    id = ids.new("sbg"), ownerId = self.workspace, name = name, region = self.limits.region,
    isDefault = is_default, environmentId = nil, concurrencyLimit = limit or self.limits.concurrency_limit,
    createdAt = t, updatedAt = t,
  }
  self.st:save("group", g)
  self.st.groups[g.id] = g
  return g
end

--- svc:default_group() -> the workspace's default group, created with the first sandbox.
function Service:default_group()
  for _, g in pairs(self.st.groups) do
    if g.isDefault and not g._deleted then return g end
  end
  return new_group(self, "Default", true)
end

--- svc:find_group(gid) -> group. Raises invalid invalid_sandbox_group_id, not_found.
function Service:find_group(gid)
  if not ids.valid("sbg", gid) then
    fail("invalid", "invalid sandbox group id " .. tostring(gid), "invalid_sandbox_group_id")
  end
  local g = self.st.groups[gid]
  if not g or g._deleted then fail("not_found", "sandbox group " .. gid .. " not found") end
  return g
end

local function live_count(self, gid)
  local n = 0
  for _, s in pairs(self.st.sandboxes) do
    if s.sandboxGroupId == gid and M.LIVE[s.status] then n = n + 1 end
  end
  return n
end

--- svc:list_groups() -> groups, newest first.
function Service:list_groups()
  return self.st.sorted(self.st.groups, function(g) return not g._deleted end)
end

--- svc:create_group{name, region, limit} -> group. Raises conflict at 10 groups.
function Service:create_group(p)
  local n = 0
  for _, g in pairs(self.st.groups) do if not g._deleted then n = n + 1 end end
  if n >= 10 then fail("conflict", "a workspace has at most 10 sandbox groups") end
  return new_group(self, p.name, n == 0, p.limit)
end

--- svc:delete_group(g). Raises conflict while it has sandboxes or when it is the default.
function Service:delete_group(g)
  if g.isDefault then fail("conflict", "sandbox group " .. g.id
    .. " is the default group, which cannot be " ..
    "deleted") end
  local live = {}
  for _, rec in pairs(self.st.sandboxes) do
    if rec.sandboxGroupId == g.id and M.LIVE[rec.status] then live[#live + 1] = rec.id end
  end
  if #live > 0 then
    table.sort(live)
    fail("conflict", string.format("sandbox group %s still has %d sandbox%s that %s not terminated: %s%s",
      g.id,
      #live, #live == 1 and "" or "es", #live == 1 and "is" or "are", table.concat(live, ", ", 1, math.min(
        #live, 10)),
      #live > 10 and ", ..." or ""))
  end
  g._deleted = true
  self.st:save("group", g)
end

-- ---- sandboxes -----------------------------------------------------------------------------

local SNAPSHOT_NAME_MAX = 64

--- service.valid_snapshot_name(name) -> whether name is a snapshot name Render accepts.
function M.valid_snapshot_name(name)
  return type(name) == "string" and #name >= 1 and utf8.len(name) ~= nil and utf8.len(
    name) <= SNAPSHOT_NAME_MAX
    and name:sub(1, 4) ~= "snp-"
end

-- Resolves and checks the snapshot of a restore, in the order Render's fake does.
local function restore_source(self, p, group)
  local sid, sname = p.snapshot_id, p.snapshot_name
  if sid ~= nil and sname ~= nil then fail("invalid",
    "snapshotId and snapshotName are mutually exclusive") end
  if sid == nil and sname == nil then return nil end
  local snap
  if sname ~= nil then
    if not M.valid_snapshot_name(sname) then
      fail("invalid", "invalid snapshot name " .. string.format("%q", sname), "invalid_snapshot_name")
    end
    for _, s in pairs(self.st.snapshots) do
      if not s._deleted and s.name == sname and s.sandboxGroupId == group.id and s.status == "available"
        and (not snap or s._seq > snap._seq) then
        snap = s
      end
    end
    if not snap then fail("not_found", "no available snapshot named " .. sname, "snapshot_not_found") end
  else
    snap = self.st.snapshots[sid]
    if not snap or snap._deleted then fail("not_found", "snapshot " .. sid .. " not found",
      "snapshot_not_found") end
    if snap.sandboxGroupId ~= group.id then
      fail("conflict", "snapshot " .. sid .. " belongs to another sandbox group", "snapshot_not_available")
    end
    if snap.status ~= "available" then
      fail("conflict", "snapshot " .. sid .. " is " .. snap.status, "snapshot_not_available")
    end
  end
  if snap.kind == "runtime" and p.plan and M.PLANS[p.plan] ~= M.PLANS[snap.plan] then
    fail("conflict", string.format("runtime snapshot %s was captured on plan %s, not %s", snap.id, snap.plan,
      p.plan), "snapshot_plan_mismatch")
  end
  return snap
end

-- The layer of a snapshot whose record says its capture wrote a manifest (a layer's name is its
-- snapshot's id).
local function had_manifest(self, layer)
  local owner = self.st.snapshots[layer:match("[^/]*$")]
  return owner ~= nil and owner._manifest ~= nil
end

-- Checks that a restore's data is there and is what was captured, before the sandbox starts:
-- each layer of its stack against its manifest (the quick check: names, types, sizes, modes,
-- owners; kept per layer for the life of the backend), its /dev capture there. Layers captured
-- before manifests existed are only looked for. On a mismatch the snapshot becomes failed,
-- saying why, and the restore answers conflict snapshot_not_available. [yields]
local function check_restore(self, snap)
  local why
  for _, l in ipairs(snap._layers or {}) do
    local ok, res, diff, code = pcall(self.engine.verify_layer, self.engine, l)
    if not ok then
      fail("internal", "snapshot " .. snap.id .. " could not be checked: " ..
        hide_paths(self, message_of(res)))
    end
    if not res and (code ~= "no_manifest" or had_manifest(self, l)) then
      why = code == "missing" and "its data is gone (" .. diff .. ")" or diff
      break
    end
  end
  if not why and snap._dev_records and not host.exists(snap._dev_records) then
    why = "its /dev capture is gone"
  end
  if not why then return end
  if snap.status == "available" then
    snap.status, snap.error = "failed", "snapshot " .. snap.id .. " does not match what was captured: " .. why
    self.st:save("snapshot", snap)
    self.log(snap.error)
    release(self, snap)
  end
  fail("conflict", "snapshot " .. snap.id .. " cannot be restored: " .. why, "snapshot_not_available")
end

--- svc:create_sandbox(p) -> rec (status creating; it boots in a task). p: plan, timeout,
-- idle_timeout, network ("allow-all" | "deny-all" | "allow-list"), allowed_domains (with
-- allow-list: names checked by the caller), env, name, snapshot_id, snapshot_name,
-- group_id — decoded and type-checked by the caller. A restore's layers are checked against
-- their manifests first (check_restore). Raises invalid (plan, snapshot name), not_found (group,
-- snapshot), conflict (snapshot rules; snapshot_not_available for data that does not match),
-- rate_limited (group at its limit). [yields]
function Service:create_sandbox(p)
  if p.plan then M.plan(p.plan) end
  local group = p.group_id and self:find_group(p.group_id) or self:default_group()
  local snap = restore_source(self, p, group)
  -- The check yields: the snapshot may be deleted or fail meanwhile, so it is resolved again.
  for _ = 1, 3 do
    if not snap then break end
    check_restore(self, snap)
    local again = restore_source(self, p, group)
    if again == snap then break end
    snap = again
  end
  if live_count(self, group.id) >= group.concurrencyLimit then
    fail("rate_limited", string.format("sandbox group %s is at its concurrency limit (%d)", group.id,
      group.concurrencyLimit), nil, 1)
  end
  local rec = {
    id = ids.new("sbx"), status = "creating",
    plan = p.plan or (snap and snap.plan) or self.limits.plan,
    networkPolicy = { default = p.network or "allow-all",
      allowedDomains = p.network == "allow-list" and json.array(p.allowed_domains or {}) or nil },
    region = self.limits.region,
    timeoutSeconds = p.timeout or self.limits.timeout_seconds,
    idleTimeoutSeconds = p.idle_timeout or self.limits.idle_timeout_seconds,
    createdAt = ids.iso(self:now()), terminatedAt = nil,
    sandboxGroupId = group.id, name = p.name,
    _lowers = snap and snap._layers or {}, _snapshot = snap and snap.id, _dev = snap and snap._dev_records,
  }
  set_status(self, rec, "creating") -- its first write: in memory only once recorded
  self:boot(rec, p.env or {})
  return rec
end

--- svc:find_sandbox(id) -> rec. Raises not_found.
function Service:find_sandbox(id)
  local s = self.st.sandboxes[id]
  if not s then fail("not_found", "sandbox not found") end
  return s
end

--- svc:list_sandboxes{statuses = set|nil, name, group_id, after = seq|nil, limit} -> one page of
-- records newest first (sequence below after, at most limit; an indexed query). Without
-- statuses, terminated sandboxes are left out.
function Service:list_sandboxes(q)
  local statuses = {}
  for s in pairs(q.statuses or M.SANDBOX_STATUSES) do
    if q.statuses or s ~= "terminated" then statuses[#statuses + 1] = s end
  end
  table.sort(statuses)
  return self.st:page_sandboxes { statuses = statuses, name = q.name, group_id = q.group_id, after = q.after,
    limit = q.limit or 100 }
end

-- ---- tokens and exec records ------------------------------------------------------------------

local function new_exec(self, rec, typ, operation, command)
  local e = {
    id = ids.new("exe"), sandboxId = rec.id, type = typ, operation = operation,
    command = command and (#command > 4096 and command:sub(1, 4096) or command) or nil,
    userId = self.user, startedAt = ids.iso(self:now()),
  }
  self.st:save("exec", e)
  return e
end

local function mint(self, rec, exec, scope, path)
  local token = ids.token()
  local expires = self:now() + self.limits.token_ttl
  local info = { sandbox = rec.id, op = scope, path = path, exec = exec.id, expires = expires,
    minted = self:now() }
  self.tokens[token] = info
  self.on_token("put", token, info, self.limits.token_ttl)
  sweep_tokens(self)
  return token, expires
end

--- svc:mint_run(rec, op, command) -> exec, token, expires. op is "stream" or "sync". Wakes a
-- suspended sandbox. Raises not_found (terminated), conflict (errored). [yields]
function Service:mint_run(rec, op, command)
  if rec.status == "terminated" then fail("not_found", "sandbox " .. rec.id .. " is terminated") end
  self:ensure_running(rec)
  local e = new_exec(self, rec, "runs", op, command)
  return e, mint(self, rec, e, "runs/" .. op, nil)
end

--- svc:mint_file(rec, op, path, shown) -> exec, token, expires. op is "upload" or "download";
-- path the absolute path inside, shown the path as the client sent it. [yields]
function Service:mint_file(rec, op, path, shown)
  if rec.status == "terminated" then fail("not_found", "sandbox " .. rec.id .. " is terminated") end
  self:ensure_running(rec)
  local e = new_exec(self, rec, "files", op, shown)
  return e, mint(self, rec, e, "files/" .. op, path)
end

--- svc:check_token(token, sandbox_id, scope) -> rec, info. The wire's gate has checked the
-- token before the body was read; this is the second look, with the records, and spends it (a
-- token opens its endpoint once). Raises unauthorized, forbidden (another sandbox or
-- operation, used already), not_found.
function Service:check_token(token, sandbox_id, scope)
  local info = token and self.tokens[token]
  if not info then fail("unauthorized", "invalid or missing connect token") end
  if info.expires < self:now() then fail("unauthorized", "connect token expired; mint a new one") end
  if info.sandbox ~= sandbox_id or info.op ~= scope then
    fail("forbidden", "this connect token is for another sandbox or operation")
  end
  -- Single use (the wire's gate spends it first): a run's command comes from the data-plane
  -- body, so a token that opened its endpoint twice would run anything its holder sends.
  if info.used then
    fail("forbidden", "this connect token was used already: a token opens its endpoint once")
  end
  info.used = true
  -- How long clients take from mint to use (GET /_moonbox/health "tokens"): what the token's
  -- lifetime must cover.
  local u, age = self.token_use, self:now() - info.minted
  u.spent = u.spent + 1
  if age > u.slowest then u.slowest = age end
  local rec = self.st.sandboxes[info.sandbox]
  if not rec or rec.status == "terminated" then fail("not_found", "sandbox is gone") end
  return rec, info
end

--- svc:list_execs(rec, after, limit) -> one page of the sandbox's exec records, newest first
-- (sequence below after, at most limit; an indexed query).
function Service:list_execs(rec, after, limit)
  return self.st:page_children("exec", rec.id, after, limit or 100)
end

--- svc:find_exec(rec, eid) -> exec record. Raises not_found.
function Service:find_exec(rec, eid)
  local e = self.st.execs[eid]
  if not e or e.sandboxId ~= rec.id then fail("not_found", "execution not found") end
  return e
end

--- svc:finish_exec(e, code): records an exec's exit code and stop time.
function Service:finish_exec(e, code)
  e.exitCode = code
  e.stoppedAt = e.stoppedAt or ids.iso(self:now())
  self.st:save("exec", e)
end

-- ---- runs ---------------------------------------------------------------------------------------

--- svc:start_run(rec, command[, intent]) -> handle: starts `bash -c command` (an engine exec
-- handle: read/wait/kill/detach), the sandbox kept awake until svc:end_run(rec). intent: the
-- structured command the client built (moonbox.render.exec: argv or text, env, cwd, timeout, or
-- a kill), which only an in-memory request carries (moonbox.local.http.memory) and only the
-- dry run's engine reads (moonbox.local.engine.sim); the real engine runs command. Raises
-- internal when it cannot start. [yields]
function Service:start_run(rec, command, intent)
  self:ensure_running(rec)
  self:activity(rec.id, 1)
  local ok, h = pcall(self.engine.exec, self.engine, rec.id, command, intent and { intent = intent } or nil)
  if not ok then
    self:activity(rec.id, -1)
    if type(h) == "table" and h.code == "not_running" then
      -- Its processes died under it (killed from the host, or the init gone): say so.
      rec._error = "the sandbox's processes ended"
      self:emit(rec.id, "log", { stream = "stderr", data = rec._error .. "\n" })
      set_status(self, rec, "errored")
      fail("conflict", "sandbox " .. rec.id .. " is errored: its processes ended", "sandbox_not_running")
    end
    fail("internal", "could not start the command in sandbox " .. rec.id .. ": " .. message_of(h))
  end
  return h
end

--- svc:end_run(rec): the run started by start_run no longer keeps the sandbox awake.
function Service:end_run(rec) self:activity(rec.id, -1) end

-- Splits s into the longest prefix of whole UTF-8 sequences and the (up to 3) trailing bytes of
-- a sequence that continues in the next chunk (moonbox.strings.utf8_cut, the one boundary rule).
local function utf8_split(s)
  local n = utf8_cut(s)
  if n == #s then return s, "" end -- the usual case: no copy of a whole chunk
  return s:sub(1, n), s:sub(n + 1)
end

--- Output may go on this long after `bash -c` exited, then it ends: a background process
-- (`sleep 100 &`) may hold the pipes open long after the command itself is done.
M.RUN_GRACE = 0.1

local Run = {}
Run.__index = Run

--- svc:run(rec, info, command, sink[, intent]) -> run: one command's output, collected the same way for
-- runs/sync and runs/stream. Starts `bash -c command` (svc:start_run: the sandbox kept awake
-- until run:close()) and reads both pipes, each in a task of its own: every chunk, cut at whole
-- UTF-8 sequences, goes to sink(stream, data), which may wait (the reader then waits: a slow
-- consumer holds the command back) and returns the part it keeps (nil: all of it); that part goes
-- to the sandbox's log, tagged with the exec id. run.cond is broadcast on each change (a stream
-- ended, the command exited); a consumer may broadcast it too. intent: as start_run's. Raises
-- what start_run raises. [yields]
function Service:run(rec, info, command, sink, intent)
  local handle = self:start_run(rec, command, intent)
  local run = setmetatable({ svc = self, rec = rec, handle = handle, cond = core.cond(), ended = 0,
    tasks = {} }, Run)
  for _, stream in ipairs({ "stdout", "stderr" }) do
    run.tasks[#run.tasks + 1] = task.spawn(function()
      local function pass(data)
        local kept = sink(stream, data)
        if kept == nil then kept = data end
        if kept ~= "" then self:emit(rec.id, "log", { stream = stream, data = kept, execId = info.exec }) end
      end
      local carry = ""
      for chunk in function() return handle:read(stream) end do
        local whole
        whole, carry = utf8_split(carry .. chunk)
        if whole ~= "" then pass(whole) end
      end
      if carry ~= "" then pass(carry) end
      run.ended = run.ended + 1
      run.cond:broadcast()
    end)
  end
  run.tasks[#run.tasks + 1] = task.spawn(function()
    run.ok, run.code = pcall(handle.wait, handle)
    run.exited_at = self.clock.now()
    run.cond:broadcast()
  end)
  return run
end

--- run:output_ended() -> whether no more output comes: both pipes at EOF, or RUN_GRACE
-- seconds since the command exited. Does not yield.
function Run:output_ended()
  return self.ended == 2 or (self.exited_at ~= nil and self.svc.clock.now() >= self.exited_at + M.RUN_GRACE)
end

--- run:wait_change(): waits for run.cond, or until the output's grace ends once the command
-- exited. [yields]
function Run:wait_change()
  if self.exited_at then
    local left = self.exited_at + M.RUN_GRACE - self.svc.clock.now()
    if left > 0 then pcall(task.timeout, left, self.cond.wait, self.cond) end
  else
    self.cond:wait()
  end
end

--- run:exit_code() -> code: waits for the command's end. Raises internal when the engine could
-- not wait for it. [yields]
function Run:exit_code()
  while not self.exited_at do self.cond:wait() end
  if not self.ok then fail("internal", "the command failed to run: " .. message_of(self.code)) end
  return self.code
end

--- run:close(): stops reading (what the command still prints is read and dropped by the
-- engine, and it is reaped when it ends: a run that stops early leaves the command running)
-- and ends the run's hold on the sandbox. Idempotent. Does not yield.
function Run:close()
  if self.closed then return end
  self.closed = true
  for _, t in ipairs(self.tasks) do task.cancel(t) end
  self.handle:detach()
  self.svc:end_run(self.rec)
end

--- svc:run_sync(rec, info, command[, intent]) -> {stdout, stderr, exit_code, truncated}. Runs a command
-- to its end and answers with its output, at most limits.sync_output_max bytes per stream (the
-- rest is read and dropped, truncated says so): a command printing a gigabyte costs the
-- backend a megabyte. What is kept goes to the sandbox's log, tagged with the exec id. [yields]
function Service:run_sync(rec, info, command, intent)
  local cap = self.limits.sync_output_max
  local got = { stdout = { n = 0 }, stderr = { n = 0 } }
  local cut = false
  local run = self:run(rec, info, command, function(stream, data)
    local into, part = got[stream], ""
    if into.n < cap then
      part = data:sub(1, cap - into.n)
      into[#into + 1] = part
    end
    if into.n + #data > cap then cut = true end
    into.n = into.n + #data
    return part
  end, intent)
  local ok, code = pcall(function()
    while not run:output_ended() do run:wait_change() end
    return run:exit_code()
  end)
  run:close()
  if not ok then error(code, 0) end
  return { stdout = table.concat(got.stdout), stderr = table.concat(got.stderr), exit_code = code,
    truncated = cut }
end

-- ---- files --------------------------------------------------------------------------------------

-- Maps an engine or archive error of a file operation to a ServiceError. The engine's messages
-- name the sandbox and the path inside it; the archive's name its temporary file, which is
-- replaced by "the upload".
local function file_error(err, what)
  if M.is_error(err) or task.is_cancelled(err) then error(err, 0) end
  local code = type(err) == "table" and err.code
  local msg = message_of(err)
  if type(err) == "table" and err.path then msg = msg:gsub(host.trim(err.path):gsub("%p", "%%%0"),
    "the upload") end
  msg = msg:gsub("/[^%s:]*/tmp/[^%s:]+", "the upload")
  if code == "not_found" and (err.op or ""):match("^local%.engine%.") and not msg:find("not running") then
    fail("not_found", "no file or directory at path", "file_not_found")
  end
  if code == "not_running" then fail("conflict", msg, "sandbox_not_running") end
  if code == "is_directory" then fail("conflict", "path is a directory") end
  if code == "not_directory" then fail("invalid", (msg:gsub("^sandbox %S+: ", ""))) end
  if code == "not_regular" then
    fail("invalid", "path is not a regular file or directory (a device, fifo or socket cannot be " .. what
      .. ")",
      "not_regular_file")
  end
  if code == "permission_denied" then fail("forbidden", (msg:gsub("^sandbox %S+: ", ""))) end
  if code == "path_too_long" then fail("invalid", (msg:gsub("^sandbox %S+: ", "")), "path_too_long") end
  if code == "read_only_path" then
    fail("forbidden", (msg:gsub("^sandbox %S+: ", "")), "read_only_path")
  end
  if code == "too_many" then fail("invalid", (msg:gsub("^sandbox %S+: ", ""))) end
  if code == "unsafe_archive" then fail("invalid", msg .. "; nothing was extracted", "unsafe_archive") end
  if code == "corrupt_archive" then
    fail("invalid", "the upload is not a readable (gzip'd) tar archive: " .. (msg:gsub("^the upload ",
      "")), "invalid_archive")
  end
  if code == "archive_too_large" or code == "too_large" then fail("too_large", (msg:gsub("^sandbox %S+: ",
    ""))) end
  if code == "invalid_path" then fail("invalid", "path contains a NUL byte or a newline") end
  if msg:find("Disk quota exceeded", 1, true) then
    fail("insufficient_storage", "the sandbox's disk (its plan's disk size) is full; nothing was written")
  end
  if msg:find("No space left on device", 1, true) then
    fail("insufficient_storage", "the backend's disk is full; nothing was written")
  end
  fail("internal", "the file operation failed: " .. msg)
end
M.file_error = file_error

--- svc:upload(rec, info, body_file, kind) writes an upload to the token's path: kind "file"
-- (the bytes become the file, mode 0600) or "archive" (a gzip'd or plain tar extracted into the
-- directory). Raises invalid (unsafe_archive, invalid_archive, not a directory), conflict (a
-- directory), too_large. [yields]
function Service:upload(rec, info, body_file, kind)
  self:ensure_running(rec)
  self:activity(rec.id, 1)
  local ok, err = pcall(function()
    crash_point(self, "upload", rec.id)
    if kind == "archive" then
      self.engine.files:tar_in(rec.id, info.path, body_file, { max_bytes = self.limits.max_upload })
    else
      self.engine.files:write(rec.id, info.path, body_file, { mode = tonumber("600", 8) })
    end
  end)
  self:activity(rec.id, -1)
  if not ok then file_error(err, "uploaded") end
end

--- svc:download(rec, info) -> {kind = "file", stream = p, size, name} or {kind = "directory",
-- file = a temporary .tar.gz the caller serves and removes}. The sandbox is kept awake until
-- svc:end_run(rec). Raises not_found file_not_found, invalid not_regular_file. [yields]
function Service:download(rec, info)
  self:ensure_running(rec)
  self:activity(rec.id, 1)
  local ok, res = pcall(function()
    local st = self.engine.files:stat(rec.id, info.path, { follow = true })
    if not st then fail("not_found", "no file or directory at path", "file_not_found") end
    if st.type == "directory" then
      return { kind = "directory", file = self.engine.files:tar_out(rec.id, info.path) }
    end
    local p, size = self.engine.files:read(rec.id, info.path)
    return { kind = "file", stream = p, size = size, name = info.path:match("([^/]+)$") or "download" }
  end)
  if not ok then
    self:activity(rec.id, -1)
    file_error(res, "downloaded")
  end
  return res
end

--- svc:list_files(rec, path, depth) -> entries. Raises conflict sandbox_not_running unless the
-- sandbox runs, not_found file_not_found, invalid. [yields]
function Service:list_files(rec, path, depth)
  if rec.status ~= "running" then
    fail("conflict", "sandbox " .. rec.id .. " is " .. rec.status .. ", not running", "sandbox_not_running")
  end
  local ok, entries = pcall(self.engine.files.list, self.engine.files, rec.id, path, depth)
  if not ok then file_error(entries, "listed") end
  if not entries then fail("not_found", "no file or directory at path", "file_not_found") end
  return entries
end

-- ---- snapshots -------------------------------------------------------------------------------

--- svc:create_snapshot(rec, p) -> snap (status creating; captured in a task). p: kind, name,
-- expires (epoch seconds), fail_capture (fault injection: the capture fails as a full disk
-- would make it). Raises conflict sandbox_not_running. Does not yield: the capture (freeze,
-- copy, thaw, under the sandbox's capture lock, its freeze bounded by limits.capture_timeout)
-- runs in a task that sets the status. Write-ahead: the record saved before the capture starts
-- names every file the capture makes (the layer, .partial, .dev, .manifest) and the lower
-- layers it stacks on, so the collector keeps them from that moment. It becomes available only
-- once the layer is complete, synced and matches the manifest written at capture (sizeBytes is
-- the manifest's bytes, plus the /dev capture's of a runtime snapshot); failed otherwise, its
-- files then freed.
function Service:create_snapshot(rec, p)
  if rec.status ~= "running" then fail("conflict", "sandbox is " .. rec.status, "sandbox_not_running") end
  local t = self:now()
  local snap = {
    id = ids.new("snp"), sandboxGroupId = rec.sandboxGroupId, sourceSandboxId = rec.id,
    kind = p.kind, status = "creating", plan = rec.plan, requestedAt = ids.iso(t),
    expiresAt = ids.iso(p.expires or (t + self.limits.snapshot_lifetime)), name = p.name,
    capturedAt = nil, sizeBytes = nil, error = nil,
  }
  local layer = self.state_dir .. "/layers/" .. snap.id
  snap._layer = layer
  snap._layers = { layer }
  for _, l in ipairs(rec._lowers or {}) do snap._layers[#snap._layers + 1] = l end
  if p.kind == "runtime" then snap._dev_records = layer .. ".dev" end
  self.st.snapshots[snap.id] = snap
  self.st:save("snapshot", snap)
  self:expire_later(snap)
  self:activity(rec.id, 1)
  local runtime = self:runtime_of(rec.id)
  runtime.capture_lock = runtime.capture_lock or task.semaphore(1)
  task.spawn(function()
    local why, result
    if p.fail_capture then
      task.sleep(0.05)
      why = "injected capture failure (disk full)"
    else
      -- Captures of one sandbox take turns: each freezes it, and a thaw by one must not land in
      -- the middle of another's copy.
      local ok
      ok, result = pcall(runtime.capture_lock.with, runtime.capture_lock, self.engine.capture,
        self.engine, rec.id, layer, { kind = p.kind, timeout = self.limits.capture_timeout })
      if not ok then
        self.log("snapshot " .. snap.id .. " of " .. rec.id .. " failed: " .. message_of(result))
        why = "the capture failed: " .. hide_paths(self, message_of(result))
      elseif result.manifest then
        local vok, v, vwhy = pcall(self.engine.verify_layer, self.engine, layer)
        if not vok then
          why = "its layer could not be checked: " .. hide_paths(self, message_of(v))
        elseif not v then
          why = "its layer does not match the manifest written at capture: " .. vwhy
        elseif v.bytes ~= result.manifest.bytes or v.files ~= result.manifest.files then
          why = "its layer's manifest is not the one its capture wrote"
        end
      end
    end
    if not why then crash_point(self, "capture", snap.id) end
    self:activity(rec.id, -1)
    if not why then
      snap.status, snap.capturedAt, snap.sizeBytes = "available", ids.iso(self:now()), result.size
      snap._layers = result.layers
      snap._dev_records = result.dev_records
      snap._manifest = result.manifest and { files = result.manifest.files, bytes = result.manifest.bytes,
        tree = result.manifest.tree } or nil
      if result.manifest then
        self.log(string.format("snapshot %s of %s captured: %d files, %d bytes; the capture helper peaked " ..
          "at %s KiB", snap.id, rec.id, result.manifest.files, result.manifest.bytes,
          tostring(result.helper_kib or "?")))
      end
      if p.kind == "runtime" then
        snap.note = "moonbox local keeps the filesystem and /dev of a runtime snapshot; " ..
          "processes and memory are not restored"
      end
    else
      snap.status, snap.error = "failed", why
    end
    self.st:save("snapshot", snap)
    if snap.status == "failed" or snap._deleted then release(self, snap) end
  end)
  return snap
end

--- svc:find_snapshot(group, sid) -> snap (deleted ones included). Raises invalid
-- invalid_snapshot_id, not_found snapshot_not_found.
function Service:find_snapshot(group, sid)
  if not ids.valid("snp", sid) then fail("invalid", "invalid snapshot id " .. tostring(sid),
    "invalid_snapshot_id") end
  local snap = self.st.snapshots[sid]
  if not snap or snap.sandboxGroupId ~= group.id then fail("not_found", "snapshot not found",
    "snapshot_not_found") end
  return snap
end

--- svc:list_snapshots(group, statuses) -> snapshots of the group, newest first.
function Service:list_snapshots(group, statuses)
  return self.st.sorted(self.st.snapshots, function(s)
    return s.sandboxGroupId == group.id and not s._deleted and (not statuses or statuses[s.status])
  end)
end

--- svc:delete_snapshot(snap). Idempotent. Its files are freed once no booting or live sandbox
-- restored from it needs them. Raises conflict snapshot_creating. [yields]
function Service:delete_snapshot(snap)
  if snap.status == "creating" then fail("conflict", "snapshot is still being captured",
    "snapshot_creating") end
  if not snap._deleted then
    snap._deleted = true
    self.st:save("snapshot", snap)
    local timer = self.snap_timers[snap.id]
    self.snap_timers[snap.id] = nil
    if timer then task.cancel(timer) end
    release(self, snap)
  end
end

M.image = image
return M
