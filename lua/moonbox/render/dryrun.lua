--- moonbox.render.dryrun — `moonbox run --dry-run`: a recipe runs against a backend simulated
-- in memory, on a simulated clock, and the run reports what it would have done.
--
--   moonbox run --dry-run recipe.lua          -- creates by plan, snapshots, restores, execs,
--   moonbox run --dry-run --json recipe.lua   -- peak live sandboxes, sandbox-seconds
--
-- Three parts:
--   - a transport (sim.transport): the render client's connection sends its requests here
--     instead of to the network (moonbox.render.api asks conn.transport when a connection has
--     one), and it answers Render's wire shapes — sandboxes, run tokens, exec streams and sync
--     runs, file tokens and transfers, snapshots, groups — from tables in memory. Every render.*
--     function therefore runs unchanged, with its own retries, waits, budgets and fan-outs.
--     Nothing is started and nothing is sent: no process, no socket, no embedded backend.
--   - a simulated clock (Clock): operations take simulated time (dryrun.DURATIONS, overridable)
--     and task.sleep, task.now, task.timeout and the budgets' clock follow it while a dry run
--     is active. The clock moves only when every task waits for it: a driver task yields until
--     nothing else is ready, then jumps to the earliest pending simulated wake-up. A recipe
--     that execs `sleep 600` or creates 100 sandboxes finishes in milliseconds and reports the
--     simulated seconds. What waits on core's own clock (core.sleep, task.window's holds) and
--     real I/O the recipe does itself take real time, during which simulated time may pass.
--   - the hooks (render.dry_run): what the recipe says simulated execs and downloads give back;
--     they do nothing outside a dry run, so a recipe can register them unconditionally.
--
-- Execs exit 0 with empty output unless a hook says otherwise; a command that is only
-- `sleep N` takes N simulated seconds. Uploaded files are kept (and copied by snapshots into
-- their restores) so that a download of one gives its bytes; any other download is empty.
-- See docs/reference/render.md, "Dry runs", for what a dry run can and cannot tell.
local core = require "moonbox.core"
local task = require "moonbox.task"
local json = require "moonbox.json"
local ids = require "moonbox.ids"

local M = {}

--- dryrun.DURATIONS: the simulated seconds each operation takes (create: a fresh sandbox until
-- it runs; restore: a sandbox from a snapshot until it runs; exec: a command, unless a hook or a
-- plain `sleep N` says otherwise; snapshot: a capture until available; transfer: one file
-- upload or download). render.dry_run.durations{...} changes them for the run.
M.DURATIONS = { create = 2, restore = 3, exec = 1, snapshot = 5, transfer = 0.2 }

--- dryrun.MAX_SIMULATED: the simulated seconds a dry run may last unless the recipe says
-- otherwise (render.dry_run.limit): one day. A recipe that polls for an output no hook gives
-- would otherwise loop forever on the simulated clock.
M.MAX_SIMULATED = 86400

local PLANS = { ["1c-2g"] = true, ["2c-4g"] = true, ["4c-8g"] = true, ["8c-16g"] = true,
  starter = true, standard = true, pro = true }
local BASE = "http://dry-run.invalid"
local MARKERS = "/dev/.moonbox/" -- where the client's exec wrapper keeps its marker files

local sim -- the active simulation, or nil

-- ---- the simulated clock ------------------------------------------------------------------

local Clock = {}
Clock.__index = Clock

local function new_clock()
  return setmetatable({ t = 0, base = core.now(), timers = {}, wake = core.cond() }, Clock)
end

-- Adds a wake-up at simulated time `at` that broadcasts cond. Only waits make wake-ups: the
-- clock never moves to a moment nobody waits for (a sandbox's boot ends when its poller looks).
function Clock:at(at, cond)
  local tm = { at = at, cond = cond }
  local list, i = self.timers, #self.timers
  while i >= 1 and list[i].at > at do i = i - 1 end
  table.insert(list, i + 1, tm)
  self.wake:broadcast()
  return tm
end

-- Raises once the simulated time is past dryrun.MAX_SIMULATED.
function Clock:check_limit()
  local max = self.limit or M.MAX_SIMULATED
  if self.t > max then
    error(core.Error.new { op = "render.dry_run", code = "simulated_time_limit",
      message = string.format("the dry run passed its limit of %g simulated seconds and was stopped: a " ..
        "loop that waits for an exec's output no hook gives (render.dry_run.on_exec)? A longer run needs " ..
        "render.dry_run.limit(seconds)", max) }, 0)
  end
end

--- clock:wait_for(cond, seconds): waits until cond is broadcast or `seconds` of simulated time
-- have passed, whichever comes first. Raises simulated_time_limit past dryrun.MAX_SIMULATED.
-- [yields]
function Clock:wait_for(cond, seconds)
  local tm = self:at(self.t + math.max(seconds, 0), cond)
  local ok, err = pcall(cond.wait, cond)
  tm.dead = true
  if not ok then error(err, 0) end
  self:check_limit()
end

--- clock:sleep(seconds): waits `seconds` of simulated time. Raises simulated_time_limit past
-- dryrun.MAX_SIMULATED. [yields]
function Clock:sleep(seconds)
  if seconds <= 0 then return task.yield() end
  local cond, done = core.cond(), false
  local tm = self:at(self.t + seconds, cond)
  tm.fire = function() done = true end
  while not done do
    local ok, err = pcall(cond.wait, cond)
    if not ok then
      tm.dead = true
      error(err, 0)
    end
  end
  self:check_limit()
end

--- clock:timeout(seconds, fn, ...) -> fn's results: task.timeout on the simulated clock. A
-- watcher task cancels the calling task once `seconds` of simulated time have passed while fn
-- runs, and that cancellation becomes task.timeout's error (op "task.timeout", code "timeout").
-- Unlike a real deadline it interrupts one wait, not every wait after it. [yields]
function Clock:timeout(seconds, fn, ...)
  local me, cond, state = core.current(), core.cond(), {}
  local watcher = task.spawn(function()
    self:wait_for(cond, seconds)
    if not state.done then
      state.fired = true
      core.cancel(me)
    end
  end)
  core.observe(watcher)
  local r = table.pack(xpcall(fn, core.msgh, ...))
  state.done = true
  cond:broadcast()
  if state.fired and not r[1] and task.is_cancelled(r[2]) then
    error(core.Error.new { op = "task.timeout", code = "timeout", retryable = true, seconds = seconds,
      message = string.format("timed out after %g s (simulated)", seconds),
      traceback = type(r[2]) == "table" and r[2].traceback or nil }, 0)
  end
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- clock:now() -> the simulated time on the scale of core.now() (the real time the run began,
-- plus the simulated seconds since).
function Clock:now() return self.base + self.t end

-- The driver: whenever no other task is ready, the clock jumps to the next wake-up.
function Clock:drive()
  while true do
    task.yield()
    if core.stats().queued == 0 then
      local tm = table.remove(self.timers, 1)
      while tm and tm.dead do tm = table.remove(self.timers, 1) end
      if tm then
        if tm.at > self.t then self.t = tm.at end
        if tm.fire then tm.fire() end
        if tm.cond then tm.cond:broadcast() end
      else
        self.wake:wait()
      end
    end
  end
end

-- ---- hooks (render.dry_run) ---------------------------------------------------------------

local hooks = { exec = {}, download = {} }
local durations = {}

local H = {}

--- render.dry_run.active() -> whether this run is a dry run (moonbox run --dry-run).
function H.active() return sim ~= nil end

local function add_hook(kind, fname, pattern, answer)
  if type(pattern) ~= "string" then
    error(string.format("render.dry_run.%s: the pattern must be a string (a Lua pattern), got %s", fname,
      type(pattern)), 3)
  end
  local t = type(answer)
  if t ~= "function" and t ~= "table" and t ~= "string" then
    error("render.dry_run." .. fname .. ": the answer must be a function or a " ..
      (kind == "exec" and "table {code, stdout, stderr, seconds}" or "string") .. ", got " .. t, 3)
  end
  if kind == "exec" and t == "string" then
    error("render.dry_run.on_exec: the answer must be a function or a table {code, stdout, stderr, seconds}",
      3)
  end
  local list = hooks[kind]
  list[#list + 1] = { pattern = pattern, answer = answer }
end

--- render.dry_run.on_exec(pattern, answer): in a dry run, an exec (sb:exec, sb:spawn,
-- sb:run_sync) whose command matches the Lua pattern gets answer: a table {code = 0, stdout =
-- "", stderr = "", seconds = simulated duration}, or a function(command, sandbox_id) returning
-- one (or nil: the next hook, then the default, decides). The newest matching hook is asked
-- first. Raises on a bad argument; does nothing outside a dry run. Does not yield.
function H.on_exec(pattern, answer) add_hook("exec", "on_exec", pattern, answer) end

--- render.dry_run.on_download(pattern, answer): in a dry run, a download of a file whose path
-- (absolute, as the backend resolves it) matches the pattern gives answer: a string, or a
-- function(path, sandbox_id) returning one (or nil: the next hook, then the default, decides).
-- Raises on a bad argument; does nothing outside a dry run. Does not yield.
function H.on_download(pattern, answer) add_hook("download", "on_download", pattern, answer) end

--- render.dry_run.durations{create =, restore =, exec =, snapshot =, transfer =} -> the
-- simulated seconds in force (those given replace the defaults, dryrun.DURATIONS). Raises on an
-- unknown name or a value that is not seconds >= 0. Does not yield.
function H.durations(t)
  if t ~= nil then
    if type(t) ~= "table" then error("render.dry_run.durations: expected a table of seconds", 2) end
    for k, v in pairs(t) do
      if M.DURATIONS[k] == nil then
        error("render.dry_run.durations: unknown operation '" .. tostring(k) ..
          "' (create, restore, exec, snapshot, transfer)", 2)
      end
      if type(v) ~= "number" or v ~= v or v < 0 or v == math.huge then
        error("render.dry_run.durations: " .. k .. " must be seconds >= 0, got " .. tostring(v), 2)
      end
      durations[k] = v
    end
  end
  local out = {}
  for k, v in pairs(M.DURATIONS) do out[k] = durations[k] or v end
  return out
end

local function duration(kind) return durations[kind] or M.DURATIONS[kind] end

--- render.dry_run.limit(seconds): the simulated seconds this dry run may last before it stops
-- with simulated_time_limit (default dryrun.MAX_SIMULATED, a day). Raises on a value that is
-- not seconds > 0; does nothing outside a dry run. Does not yield.
function H.limit(seconds)
  if type(seconds) ~= "number" or seconds ~= seconds or seconds <= 0 then
    error("render.dry_run.limit: expected seconds > 0, got " .. tostring(seconds), 2)
  end
  if sim then sim.clock.limit = seconds end
end

M.hooks = H

-- ---- the simulated backend: helpers -------------------------------------------------------

local function iso(t) return ids.iso(os.time() + math.floor(t)) end

local function answer(status, body, headers)
  headers = headers or {}
  headers["render-request-id"] = "req-dryrun"
  local text = ""
  if type(body) == "table" then
    text = json.encode(body)
    headers["content-type"] = "application/json"
  elseif body then
    text = body
  end
  return { status = status, headers = headers, body = text }
end

local function fail(status, message, code) return answer(status, { message = message, code = code }) end

local function unescape(s)
  return (s:gsub("+", " "):gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end))
end

local function parse_url(url)
  local path, q = url:match("^https?://[^/]+(/[^?]*)%??(.*)$")
  local query = {}
  for pair in (q or ""):gmatch("[^&]+") do
    local k, v = pair:match("^([^=]*)=?(.*)$")
    query[unescape(k)] = unescape(v)
  end
  return path or "/", query
end

local function body_of(opts)
  if opts.body_file then
    local f = io.open(opts.body_file, "rb")
    if not f then error(core.Error.new { op = "http.request", code = "file_error",
      message = "cannot read " .. opts.body_file }, 0) end
    local s = f:read("a")
    f:close()
    return s
  end
  return opts.body
end

local function decode(s)
  if s == nil or s == "" then return {} end
  local ok, v = pcall(json.decode, s)
  return ok and type(v) == "table" and v or {}
end

--- dryrun.unwrap(script) -> the command the client's exec wrapper (moonbox.render.exec) runs,
-- as the recipe gave it (an argv table arrives shell-quoted), or script itself when it is not a
-- wrapper.
local function unwrap(script)
  local run = script:match("\n([^\n]*bash %-c .-) </dev/null; rc=%$%?\n")
  if not run then return script end
  local quoted = run:match("^cd %-%- .- && bash %-c (.*)$") or run:match("^bash %-c (.*)$")
  if not quoted then return script end
  if quoted:sub(1, 1) == "'" and quoted:sub(-1) == "'" then
    return (quoted:sub(2, -2):gsub("'\\''", "'"))
  end
  return quoted
end
M.unwrap = unwrap

-- ---- the simulated backend: state and report ----------------------------------------------

local Sim = {}
Sim.__index = Sim

local LOG_MAX = 200 -- steps the text report lists

-- Records one step of the run (the first LOG_MAX are kept for the report); returns its fields,
-- which the caller may still complete.
function Sim:step(what, fields)
  local s = self.stats
  s.steps = s.steps + 1
  fields = fields or {}
  fields.t = self.clock.t
  fields.what = what
  if #self.log < LOG_MAX then self.log[#self.log + 1] = fields end
  return fields
end

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

function Sim:group()
  if not self.default_group then
    local g = { id = ids.new("sbg"), name = "default", region = "oregon", isDefault = true,
      concurrencyLimit = 1000, createdAt = iso(self.clock.t), environmentId = json.null }
    self.groups[g.id], self.group_order[#self.group_order + 1] = g, g
    self.default_group = g
  end
  return self.default_group
end

-- rec's status as of the simulated clock: "creating" becomes `ready` once ready_at has passed.
function Sim:ripen(rec, ready)
  if rec.status == "creating" and self.clock.t >= rec.ready_at then rec.status = ready end
  return rec.status
end

function Sim:sandbox_wire(sb)
  local status = self:ripen(sb, "running")
  return { id = sb.id, status = status, plan = sb.plan, region = "oregon", name = sb.name,
    networkPolicy = sb.networkPolicy, timeoutSeconds = sb.timeoutSeconds or 86400,
    idleTimeoutSeconds = sb.idleTimeoutSeconds or 900, sandboxGroupId = sb.group,
    createdAt = iso(sb.created_at), terminatedAt = sb.terminated_at and iso(sb.terminated_at) or json.null,
    snapshotId = sb.snapshot_id }
end

function Sim:snapshot_wire(sn)
  local status = self:ripen(sn, "available")
  return { id = sn.id, name = sn.name or json.null, kind = sn.kind, status = status, plan = sn.plan,
    sandboxGroupId = sn.group, sourceSandboxId = sn.source, createdAt = iso(sn.created_at),
    capturedAt = status == "available" and iso(sn.ready_at) or json.null, sizeBytes = sn.size,
    expiresAt = sn.expires_at or json.null, error = json.null }
end

function Sim:find(id)
  local sb = self.sandboxes[id]
  if not sb then return nil, fail(404, "sandbox " .. tostring(id) .. " not found (dry run)") end
  return sb
end

-- What an exec gives: the hooks, newest first, then a plain `sleep N`, then exit 0.
function Sim.exec_result(_, command, sandbox_id)
  local list = hooks.exec
  for i = #list, 1, -1 do
    local h = list[i]
    if command:find(h.pattern) then
      local r = h.answer
      if type(r) == "function" then r = r(command, sandbox_id) end
      if r ~= nil then
        if type(r) ~= "table" then
          error("render.dry_run.on_exec hook for '" .. h.pattern .. "' returned a " .. type(r) ..
            ", not a table {code, stdout, stderr, seconds}", 0)
        end
        return { code = math.tointeger(r.code) or r.code or 0, stdout = tostring(r.stdout or ""),
          stderr = tostring(r.stderr or ""), seconds = tonumber(r.seconds) or duration("exec") }
      end
    end
  end
  local n = command:match("^%s*sleep%s+(%d+%.?%d*)%s*$")
  return { code = 0, stdout = "", stderr = "", seconds = n and tonumber(n) or duration("exec") }
end

-- Runs one exec on the simulated clock; a kill (from the client's kill runs) ends it early.
function Sim:run_exec(sb, command, kind, marker)
  local r = self:exec_result(command, sb.id)
  self.stats.execs = self.stats.execs + 1
  local step = self:step("exec", { sandbox = sb.id, command = command, kind = kind, seconds = r.seconds,
    code = r.code })
  local run, t0 = { cond = core.cond() }, self.clock.t
  if marker then sb.running[marker] = run end
  local ok, err = pcall(self.clock.wait_for, self.clock, run.cond, r.seconds)
  if marker then sb.running[marker] = nil end
  if not ok then error(err, 0) end
  if run.signal then
    step.code, step.killed, step.seconds = 128 + run.signal, true, self.clock.t - t0
    return { code = 128 + run.signal, stdout = "", stderr = "" }
  end
  return r
end

-- The client's kill script: "... if [ -s /dev/.moonbox/ID.pgid ]; then kill -SIG ...".
function Sim.kill(_, sb, script)
  local id, sig = script:match("/dev/%.moonbox/([%w]+)%.pgid %]; then kill %-(%d+)")
  local run = id and sb.running[id]
  if not run then return script:find("echo gone", 1, true) and "gone\n" or "marked\n" end
  run.signal = tonumber(sig)
  run.cond:broadcast()
  return "signalled\n"
end

-- ---- the simulated backend: routes --------------------------------------------------------

local ROUTES = {}
local function route(method, pattern, fn) ROUTES[#ROUTES + 1] = { method, "^" .. pattern .. "$", fn } end

-- A route whose first capture is a sandbox id: fn(self, sb, q, body) gets the sandbox, and an
-- id the simulation does not know is answered 404 before fn runs.
local function sandbox_route(method, pattern, fn)
  route(method, pattern, function(self, q, body, id)
    local sb, err = self:find(id)
    if not sb then return err end
    return fn(self, sb, q, body)
  end)
end

-- The simulated routes: each is fn(sim, query, body, capture...) -> an answer (answer(status,
-- value), or fail(status, message, code) for Render's error shape).
-- Simulated POST /v1/sandboxes: checks the plan, finds the group and the snapshot to restore
-- (by id, or the newest available one of that name: 404 snapshot_not_found, 409
-- snapshot_not_available), makes a sandbox that becomes running after the simulated create or
-- restore duration, copies the snapshot's files, and counts the create in the report. Does
-- not yield.
route("POST", "/v1/sandboxes", function(self, _, body)
  local plan = body.plan or "1c-2g"
  if not PLANS[plan] then
    return fail(400, string.format("unknown plan %q (use 1c-2g, 2c-4g, 4c-8g or 8c-16g; older names: " ..
      "starter = 1c-2g, standard = 2c-4g, pro = 4c-8g)", tostring(plan)))
  end
  local g = body.sandboxGroupId and self.groups[body.sandboxGroupId] or self:group()
  local snap
  if body.snapshotId or body.snapshotName then
    if body.snapshotId then
      snap = self.snapshots[body.snapshotId]
    else
      for i = #self.snapshot_order, 1, -1 do
        local s = self.snapshot_order[i]
        if s.name == body.snapshotName and not s.deleted and self:snapshot_wire(s).status == "available" then
          snap = s
          break
        end
      end
    end
    if not snap or snap.deleted then
      return fail(404, "snapshot " .. tostring(body.snapshotId or body.snapshotName) .. " not found",
        "snapshot_not_found")
    end
    if self:snapshot_wire(snap).status ~= "available" then
      return fail(409, "snapshot " .. snap.id .. " is " .. snap.status, "snapshot_not_available")
    end
    if not body.plan then plan = snap.plan end
  end
  local now = self.clock.t
  local sb = { id = ids.new("sbx"), plan = plan, status = "creating", name = body.name, group = g.id,
    networkPolicy = body.networkPolicy or { default = "allow-all" }, timeoutSeconds = body.timeoutSeconds,
    idleTimeoutSeconds = body.idleTimeoutSeconds, created_at = now, snapshot_id = snap and snap.id,
    ready_at = now + duration(snap and "restore" or "create"), files = {}, running = {} }
  if snap then
    for p, f in pairs(snap.files) do sb.files[p] = f end
  end
  self.sandboxes[sb.id], self.order[#self.order + 1] = sb, sb
  local st = self.stats
  st.creates = st.creates + 1
  st.creates_by_plan[plan] = (st.creates_by_plan[plan] or 0) + 1
  if snap then st.restores = st.restores + 1 end
  self:live_changed(1, plan)
  self:step(snap and "restore" or "create", { sandbox = sb.id, plan = plan, snapshot = snap and snap.id })
  return answer(201, self:sandbox_wire(sb))
end)

route("GET", "/v1/sandboxes", function(self, q)
  local items = json.array()
  local want = q.status and {} or nil
  if want then want[q.status] = true end
  for i = #self.order, 1, -1 do
    local sb = self.order[i]
    local w = self:sandbox_wire(sb)
    if (want and want[w.status]) or (not want and w.status ~= "terminated") then
      items[#items + 1] = { sandbox = w, cursor = tostring(i) }
    end
  end
  return answer(200, self:page(items, q))
end)

sandbox_route("GET", "/v1/sandboxes/([^/]+)", function(self, sb)
  return answer(200, self:sandbox_wire(sb))
end)

sandbox_route("POST", "/v1/sandboxes/([^/]+)/terminate", function(self, sb)
  if sb.status ~= "terminated" then
    sb.status, sb.terminated_at = "terminated", self.clock.t
    self:live_changed(-1, sb.plan)
    self:step("terminate", { sandbox = sb.id })
    for _, run in pairs(sb.running) do
      run.signal = 9
      run.cond:broadcast()
    end
  end
  return answer(204)
end)

sandbox_route("POST", "/v1/sandboxes/([^/]+)/suspend", function(self, sb)
  return answer(202, self:sandbox_wire(sb))
end)

-- A token names what it opens; a mint waits for a sandbox that is still booting (as moonbox
-- local does).
function Sim:mint(id, op, path, command)
  local sb, err = self:find(id)
  if not sb then return nil, err end
  if sb.status == "terminated" then return nil, fail(404, "sandbox " .. id .. " is terminated") end
  if self:sandbox_wire(sb).status == "creating" then
    self.clock:sleep(sb.ready_at - self.clock.t)
    self:sandbox_wire(sb)
  end
  local token = ids.token()
  local exe = ids.new("exe")
  self.tokens[token] = { sandbox = id, op = op, path = path, command = command }
  return { executionId = exe, token = token, method = op == "files/upload" and "PUT" or
    op == "files/download" and "GET" or "POST", expiresAt = iso(self.clock.t + 30),
    uri = string.format("%s/proxy/%s/%s", BASE, id, op) }
end

route("POST", "/v1/sandboxes/([^/]+)/runs/([%a]+)/token", function(self, _, body, id, op)
  local t, err = self:mint(id, "runs/" .. op, nil, body.command)
  return t and answer(201, t) or err
end)

-- A path as the backend resolves it: relative ones are under the home directory, /root.
local function sandbox_path(p)
  p = p or "."
  if p:sub(1, 1) == "/" then return p end
  return p == "." and "/root" or ("/root/" .. p)
end

route("POST", "/v1/sandboxes/([^/]+)/files/([%a]+)/token", function(self, q, _, id, op)
  local t, err = self:mint(id, "files/" .. op, sandbox_path(q.path))
  return t and answer(201, t) or err
end)

route("GET", "/v1/sandboxes/([^/]+)/execs", function() return answer(200, json.array()) end)

sandbox_route("GET", "/v1/sandboxes/([^/]+)/files/list", function(_, sb, q)
  local dir = sandbox_path(q.path):gsub("(.)/$", "%1")
  local prefix = dir == "/" and "/" or dir .. "/"
  -- The files put under dir: those directly in it, and the directories that lead to the others.
  local entries, seen = json.array(), {}
  for p, f in pairs(sb.files) do
    local rest = p:sub(1, #prefix) == prefix and not p:find(MARKERS, 1, true) and p:sub(#prefix + 1)
    local name = rest and rest:match("^[^/]+")
    if name and not seen[name] then
      seen[name] = true
      local direct = name == rest
      entries[#entries + 1] = { name = name, type = (f.dir or not direct) and "directory" or "file",
        size = direct and not f.dir and #f.data or 0, modifiedAt = iso(f.t) }
    end
  end
  table.sort(entries, function(a, b) return a.name < b.name end)
  return answer(200, { path = dir, entries = entries })
end)

sandbox_route("POST", "/v1/sandboxes/([^/]+)/snapshots", function(self, sb, _, body)
  if self:sandbox_wire(sb).status ~= "running" then
    return fail(409, "sandbox " .. sb.id .. " is " .. sb.status, "sandbox_not_running")
  end
  local now = self.clock.t
  local sn = { id = ids.new("snp"), name = body.name, kind = body.kind or "filesystem", status = "creating",
    plan = sb.plan, group = sb.group, source = sb.id, created_at = now, ready_at = now + duration("snapshot"),
    expires_at = body.expiresAt, files = {}, size = 0 }
  for p, f in pairs(sb.files) do
    if not p:find(MARKERS, 1, true) then
      sn.files[p] = f
      sn.size = sn.size + #f.data
    end
  end
  self.snapshots[sn.id], self.snapshot_order[#self.snapshot_order + 1] = sn, sn
  self.stats.snapshots = self.stats.snapshots + 1
  self:step("snapshot", { sandbox = sb.id, snapshot = sn.id, name = body.name })
  return answer(201, self:snapshot_wire(sn))
end)

route("GET", "/v1/sandbox%-groups/([^/]+)/snapshots/([^/]+)", function(self, _, _, _, sid)
  local sn = self.snapshots[sid]
  if not sn or sn.deleted then return fail(404, "snapshot " .. sid .. " not found", "snapshot_not_found") end
  return answer(200, self:snapshot_wire(sn))
end)

route("DELETE", "/v1/sandbox%-groups/([^/]+)/snapshots/([^/]+)", function(self, _, _, _, sid)
  local sn = self.snapshots[sid]
  if sn and not sn.deleted then
    sn.deleted = true
    self:step("delete snapshot", { snapshot = sid })
  end
  return answer(204)
end)

route("GET", "/v1/sandbox%-groups/([^/]+)/snapshots", function(self, q, _, gid)
  local items = json.array()
  for i = #self.snapshot_order, 1, -1 do
    local sn = self.snapshot_order[i]
    local w = self:snapshot_wire(sn)
    if sn.group == gid and not sn.deleted and (not q.status or q.status == w.status) then
      items[#items + 1] = { snapshot = w, cursor = tostring(i) }
    end
  end
  return answer(200, self:page(items, q))
end)

route("GET", "/v1/sandbox%-groups", function(self, q)
  local items = json.array()
  for i, g in ipairs(self.group_order) do
    if not g.deleted then items[#items + 1] = { sandboxGroup = g, cursor = tostring(i) } end
  end
  return answer(200, self:page(items, q))
end)

route("POST", "/v1/sandbox%-groups", function(self, _, body)
  local g = { id = ids.new("sbg"), name = body.name, region = body.region or "oregon", isDefault = false,
    concurrencyLimit = body.concurrencyLimit or 1000, createdAt = iso(self.clock.t),
    environmentId = json.null }
  self.groups[g.id], self.group_order[#self.group_order + 1] = g, g
  return answer(201, g)
end)

route("DELETE", "/v1/sandbox%-groups/([^/]+)", function(self, _, _, gid)
  local g = self.groups[gid]
  if not g or g.deleted then return fail(404, "sandbox group " .. gid .. " not found") end
  g.deleted = true
  return answer(204)
end)

-- Data plane: a token from a mint above opens one of these.
local DATA = {}

function DATA.runs_stream(self, sb, body)
  local command = unwrap(body.command or "")
  local marker = (body.command or ""):match("echo %$%$ > /dev/%.moonbox/([%w]+)%.pgid")
  local events
  local function produce()
    local r = self:run_exec(sb, command, "stream", marker)
    events = {}
    for _, s in ipairs({ "stdout", "stderr" }) do
      if r[s] ~= "" then
        events[#events + 1] = { event = "output", data = json.encode({ stream = s, data = r[s] }) }
      end
    end
    events[#events + 1] = { event = "exit", data = json.encode({ exit_code = r.code }) }
  end
  local resp = { status = 200, headers = { ["content-type"] = "text/event-stream",
    ["render-request-id"] = "req-dryrun" } }
  local next_event = 1
  function resp.read_event()
    if not events then produce() end
    local e = events[next_event]
    events[next_event] = nil
    next_event = next_event + 1
    return e
  end
  -- As moonbox.http's read_output: output events as (event, stream, bytes), others raw.
  function resp.read_output()
    local e = resp.read_event()
    if not e then return nil end
    if e.event == "output" then
      local d = json.decode(e.data)
      return "output", d.stream, d.data
    end
    return e.event, nil, e.data
  end
  function resp.read() return nil end
  function resp.close() end
  return setmetatable(resp, { __close = function() end })
end

function DATA.runs_sync(self, sb, body)
  local script = body.command or ""
  if script:find("/dev/.moonbox/", 1, true) and script:find("echo signalled", 1, true) then
    return answer(200, { stdout = self:kill(sb, script), stderr = "", exit_code = 0 })
  end
  local r = self:run_exec(sb, script, "sync")
  return answer(200, { stdout = r.stdout, stderr = r.stderr, exit_code = r.code })
end

function DATA.files_upload(self, sb, _, opts, tok)
  local data = body_of(opts) or ""
  local ctype = ((opts.headers or {})["Content-Type"] or ""):lower()
  self.clock:sleep(duration("transfer"))
  sb.files[tok.path] = { data = data, t = self.clock.t, dir = ctype:find("x-tar", 1, true) ~= nil }
  if not tok.path:find(MARKERS, 1, true) then
    self.stats.uploads = self.stats.uploads + 1
    self:step("upload", { sandbox = sb.id, path = tok.path, bytes = #data })
  end
  return answer(204)
end

-- A gzip'd tar with no member, for a directory download of a path nothing was put at.
local function empty_tgz()
  local archive = require "moonbox.archive"
  local sys = require "moonbox.sys"
  local dir = os.tmpname()
  os.remove(dir)
  sys.mkdir_p(dir, tonumber("700", 8))
  local out = os.tmpname()
  local ok, err = pcall(archive.pack, dir, out)
  os.remove(dir)
  local f = ok and io.open(out, "rb")
  local data = f and f:read("a")
  if f then f:close() end
  os.remove(out)
  if not ok then error(err, 0) end
  return data
end

function DATA.files_download(self, sb, _, opts, tok)
  self.clock:sleep(duration("transfer"))
  -- sb:get_dir asks without accept_encoding, sb:download and download_file with gzip.
  local want_dir = opts.accept_encoding == nil
  local f = sb.files[tok.path]
  local data, is_dir
  if f then
    data, is_dir = f.data, f.dir
  else
    local list = hooks.download
    for i = #list, 1, -1 do
      local h = list[i]
      if tok.path:find(h.pattern) then
        local v = h.answer
        if type(v) == "function" then v = v(tok.path, sb.id) end
        if v ~= nil then
          data = tostring(v)
          break
        end
      end
    end
    if data == nil and want_dir then data, is_dir = empty_tgz(), true end
    data = data or ""
  end
  self.stats.downloads = self.stats.downloads + 1
  self:step("download", { sandbox = sb.id, path = tok.path, bytes = #data })
  local r = answer(200, data, is_dir and
    { ["content-type"] = "application/x-tar", ["content-encoding"] = "gzip" } or
    { ["content-type"] = "application/octet-stream" })
  if opts.output_file then
    local out = assert(io.open(opts.output_file, "wb"))
    out:write(data)
    out:close()
    r.body = ""
  end
  return r
end

function Sim.page(_, items, q)
  local limit = tonumber(q.limit) or 20
  local out, start = json.array(), 1
  if q.cursor then
    for i, it in ipairs(items) do
      if it.cursor == q.cursor then start = i + 1 end
    end
  end
  for i = start, math.min(#items, start + limit - 1) do out[#out + 1] = items[i] end
  return out
end

-- ---- the transport --------------------------------------------------------------------------

--- sim:request(opts) -> {status, headers, body}, as http.request answers: the control plane
-- and the data plane's whole requests. Raises only as http.request would for an unreadable
-- body_file. [yields] on the simulated clock.
function Sim:request(opts)
  local path, q = parse_url(opts.url)
  local method = opts.method or "GET"
  self.stats.requests = self.stats.requests + 1
  local id, op = path:match("^/proxy/([^/]+)/(%a+/%a+)$")
  if id then
    local auth = ((opts.headers or {}).Authorization or ""):match("^Bearer (%S+)$")
    local tok = auth and self.tokens[auth]
    if not tok or tok.sandbox ~= id or tok.op ~= op then return fail(401, "invalid connect token") end
    local sb, err = self:find(id)
    if not sb then return err end
    if sb.status == "terminated" then return fail(404, "sandbox " .. id .. " is terminated") end
    local fn = DATA[op:gsub("/", "_")]
    if not fn then return fail(404, "no data-plane route " .. op .. " (dry run)") end
    return fn(self, sb, decode(body_of(opts)), opts, tok)
  end
  local body = decode(body_of(opts))
  for _, r in ipairs(ROUTES) do
    if r[1] == method then
      local caps = table.pack(path:match(r[2]))
      if caps[1] then return r[3](self, q, body, table.unpack(caps, 1, caps.n)) end
    end
  end
  return fail(404, "the dry run does not simulate " .. method .. " " .. path)
end

--- sim:stream(opts) -> a response as http.stream gives it (status, headers, read_event,
-- read_output, read,
-- close): the exec streams. [yields] on the simulated clock when read.
function Sim:stream(opts)
  local r = self:request(opts)
  if r.read_event then return r end
  local body = r.body
  r.read_event = function() return nil end
  r.read_output = function() return nil end
  r.read = function()
    local b = body
    body = nil
    return b ~= "" and b or nil
  end
  r.close = function() end
  return setmetatable(r, { __close = function() end })
end

-- ---- start, stop, report ----------------------------------------------------------------------

local saved -- what start() replaced, put back by stop()

--- dryrun.start() -> Sim: makes this process's render calls go to a new simulated backend on a
-- simulated clock (render.connect and the default connection both give a dry-run connection),
-- and task.sleep, task.now, task.timeout and the budgets' clock follow the simulated one, until
-- dryrun.stop(). Spawns the clock's driver task, so it must run inside a task. Raises when a dry
-- run is already active. Does not yield.
function M.start()
  if sim then error("moonbox.render.dryrun: a dry run is already active", 2) end
  local clock = new_clock()
  local s = setmetatable({
    clock = clock, sandboxes = {}, order = {}, snapshots = {}, snapshot_order = {}, groups = {},
    group_order = {}, tokens = {}, log = {}, live = 0, live_since = 0, live_by_plan = {},
    stats = { creates = 0, creates_by_plan = {}, restores = 0, snapshots = 0, execs = 0, uploads = 0,
      downloads = 0, requests = 0, peak_live = 0, seconds = 0, by_plan_seconds = {}, steps = 0 },
  }, Sim)
  sim = s
  local budget = require "moonbox.render.budget"
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
  s.transport = { request = function(o) return s:request(o) end, stream = function(o) return s:stream(o) end }
  s.workspace = ids.new("tea")
  require("moonbox.render.conn").simulate(function()
    return { url = BASE, transport = s.transport, workspace = s.workspace }
  end)
  s.driver = task.spawn(function() clock:drive() end)
  core.observe(s.driver)
  return s
end

--- dryrun.current() -> the active Sim, or nil.
function M.current() return sim end

--- dryrun.stop() -> report: ends the dry run (the driver stops; task.sleep, task.now,
-- task.timeout and the budgets' clock are real again; render connects for real again; the
-- hooks and durations are cleared) and returns its report (see sim:report()). Does nothing and
-- returns nil when none is active. Does not yield.
function M.stop()
  local s = sim
  if not s then return nil end
  sim = nil
  local rep = s:report()
  task.cancel(s.driver)
  task.sleep, task.now, task.timeout = saved.sleep, saved.now, saved.timeout
  require("moonbox.render.budget").clock = saved.clock
  require("moonbox.render.conn").simulate(nil)
  hooks.exec, hooks.download = {}, {}
  durations = {}
  return rep
end

--- sim:report() -> {creates, creates_by_plan, restores, snapshots, execs, uploads, downloads,
-- peak_live, sandbox_seconds, sandbox_seconds_by_plan, simulated_s, live_at_end, durations,
-- steps (the first LOG_MAX: {t, what, sandbox, ...}), steps_total}. Does not yield.
function Sim:report()
  self:live_changed(0, "1c-2g")
  local st = self.stats
  local function round(x) return math.floor(x * 1000 + 0.5) / 1000 end
  local by_plan = {}
  for p, v in pairs(st.by_plan_seconds) do by_plan[p] = round(v) end
  return { creates = st.creates, creates_by_plan = st.creates_by_plan, restores = st.restores,
    snapshots = st.snapshots, execs = st.execs, uploads = st.uploads, downloads = st.downloads,
    peak_live = st.peak_live, sandbox_seconds = round(st.seconds), sandbox_seconds_by_plan = by_plan,
    simulated_s = round(self.clock.t), live_at_end = self.live, durations = H.durations(),
    api_requests = st.requests, steps = self.log, steps_total = st.steps }
end

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
    out[#out + 1] = string.format("  %8.1fs  %-15s %s", s.t, s.what, detail)
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
-- recipe, outcome, exit_code, error). Does not yield.
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
