--- moonbox.local — `moonbox local`: Render's sandbox API on this machine (DESIGN.md §5).
--
-- This file is the wire layer: routes under /v1 that speak render-api.md exactly (paths, JSON
-- shapes, status codes, error bodies and codes, ownerId and pagination rules), the data-plane
-- endpoints that connect tokens point at (/proxy/...), and the control endpoint /_moonbox for
-- fault injection and the request journal. Records and their persistence are
-- moonbox.local.state; the host side of sandboxes (namespaces, overlay layers, processes,
-- files) is moonbox.local.engine. Every request is handled in its own task; long operations
-- (boot, capture, exec) run in tasks of their own, so no request waits for another.
local task = require "moonbox.task"
local httpd = require "moonbox.httpd"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local host = require "moonbox.local.engine.host"
local core = require "moonbox.core"
local ids = require "moonbox.local.ids"
local State = require "moonbox.local.state"
local Faults = require "moonbox.local.faults"
local wire = require "moonbox.local.wire"

local M = {}
local Backend = {}
Backend.__index = Backend

local DEFAULTS = {
  plan = "1c-2g",
  region = "oregon",
  timeout_seconds = 86400,
  idle_timeout_seconds = 900,
  concurrency_limit = 1000,
  snapshot_lifetime = 30 * 86400,
  token_ttl = 120,
  keepalive = 15,
  max_upload = 8 * 1024 * 1024 * 1024,
  journal_max = 10000,
  log_max = 5000,
  log_bytes = 4 * 1024 * 1024,
}

local PLANS = { ["1c-2g"] = true, ["2c-4g"] = true, ["4c-8g"] = true, ["8c-16g"] = true,
  starter = true, standard = true, pro = true }
local SANDBOX_STATUSES = { creating = true, running = true, suspending = true, suspended = true,
  resuming = true, errored = true, terminated = true }
local SNAPSHOT_STATUSES = { creating = true, available = true, failed = true }
local LIVE = { creating = true, running = true, suspending = true, suspended = true, resuming = true }

-- ---- errors ------------------------------------------------------------------------------

--- Raises an API error that the request wrapper turns into a JSON error response.
local function fail(status, message, code, headers)
  error(setmetatable({ status = status, message = message, code = code, headers = headers },
    wire.ApiError), 0)
end
M.fail = fail

-- ---- small helpers -----------------------------------------------------------------------

local function now() return core.time() end

local function mkdir_p(path, mode)
  sys.mkdir_p(path, tonumber(mode or "0700", 8)) -- its error names the path and the reason
end

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local function write_secret(path, content)
  local tmp = path .. ".tmp"
  local r = proc.run { "sh", "-c", 'umask 077 && cat > "$1" && mv "$1" "$2"', "sh", tmp, path,
    input = content }
  if r.code ~= 0 then error("cannot write " .. path .. ": " .. r.stderr, 0) end
end

-- ---- the backend -----------------------------------------------------------------------------

--- local.start(opts) -> Backend. Starts the API on opts.host:opts.port (default 127.0.0.1:8120)
-- with its state under opts.state_dir. opts: image (base image dir), faults (spec), seed,
-- api_key, workspace, concurrency_limit, log (function(line)), engine (an Engine, for tests).
-- Raises when the state dir, the port or the isolation engine cannot be set up. [yields]
function M.start(opts)
  opts = opts or {}
  local state_dir = assert(opts.state_dir, "local.start: state_dir is required")
  mkdir_p(state_dir)
  mkdir_p(state_dir .. "/layers")
  mkdir_p(state_dir .. "/tmp")

  local self = setmetatable({
    opts = opts, state_dir = state_dir,
    limits = setmetatable({}, { __index = DEFAULTS }),
    tokens = {}, runtime = {}, journal = {}, journal_seq = 0, logs = {}, log_conds = {},
    tasks = {}, closing = false,
    log = opts.log or function(line) io.stderr:write("moonbox local: ", line, "\n") end,
  }, Backend)
  if opts.concurrency_limit then self.limits.concurrency_limit = opts.concurrency_limit end
  -- Test-only: how long connect tokens live (so specs can see one expire).
  local ttl = tonumber(os.getenv("MOONBOX_LOCAL_TOKEN_TTL") or "")
  if ttl then self.limits.token_ttl = ttl end

  -- Credentials: fixed by flags, else generated at first start and kept (0600) in the state dir.
  local key_file = state_dir .. "/api-key"
  self.api_key = opts.api_key or (read_file(key_file) or ""):match("^%s*(%S+)")
  if not self.api_key then
    self.api_key = "rnd_" .. ids.token()
    write_secret(key_file, self.api_key .. "\n")
  elseif opts.api_key then
    write_secret(key_file, self.api_key .. "\n")
  end

  self.st = State.open(state_dir .. "/local.db")
  self.workspace = opts.workspace or self.st:meta("workspace") or ids.new("tea")
  if not ids.valid("tea", self.workspace) then
    error("--workspace must look like tea- followed by 20 characters of 0-9a-v, got " ..
      tostring(self.workspace), 0)
  end
  self.st:set_meta("workspace", self.workspace)
  self.user = self.st:meta("user") or ids.new("usr")
  self.st:set_meta("user", self.user)

  self.faults = Faults.new(opts.faults, opts.seed)

  local Engine = require "moonbox.local.engine"
  self.engine = opts.engine or Engine.new { state_dir = state_dir, image = opts.image }
  -- Say at once what this machine cannot do (no root, no overlayfs, ...), rather than only
  -- through sandboxes that end errored later; the API itself still serves.
  local ok_check, chk = pcall(self.engine.check, self.engine)
  if ok_check and not chk.ok then
    for _, problem in ipairs(chk.problems) do self.log("cannot run sandboxes here: " .. problem) end
  end
  self.check = ok_check and chk or { ok = false, problems = { tostring(chk) } }

  self.srv = httpd.listen { host = opts.host or "127.0.0.1", port = opts.port or 8120,
    max_body = 1024 * 1024, upload_dir = state_dir .. "/tmp", log = function(l) self.log(l) end }
  self.url = self.srv.url
  self.port = self.srv.port
  -- Where clients find a running backend (moonbox.render.conn reuses it): "URL WORKSPACE".
  write_secret(state_dir .. "/endpoint", self.url .. " " .. self.workspace .. "\n")
  require("moonbox.local.routes").install(self)
  self:recover()
  self.tasks.ticker = task.spawn(function() self:tick_loop() end)
  return self
end

--- backend:close(): stops serving, stops every sandbox's processes (their records stay, and
-- are reported as the restart left them), and closes the database. [yields]
function Backend:close()
  if self.closing then return end
  self.closing = true
  for _, t in pairs(self.tasks) do task.cancel(t) end
  if self.srv then self.srv:close() end
  for id, rec in pairs(self.st.sandboxes) do
    if LIVE[rec.status] then pcall(self.engine.terminate, self.engine, id, { keep_upper = true }) end
  end
  if self.engine.close then pcall(self.engine.close, self.engine) end
  os.remove(self.state_dir .. "/endpoint")
  self.st:close()
end

-- ---- lifecycle ---------------------------------------------------------------------------

--- Appends a log or lifecycle event to a sandbox's in-memory log and wakes its followers.
function Backend:emit(id, event, data)
  local list = self.logs[id]
  if not list then
    list = {}
    self.logs[id] = list
  end
  data.at = data.at or ids.iso(now())
  local size = data.data and #data.data or 0
  list.n = (list.n or 0) + 1
  list[#list + 1] = { event = event, data = data, t = now(), size = size, n = list.n }
  list.bytes = (list.bytes or 0) + size
  -- Bounded by events and by bytes: a chatty exec must not grow the backend without limit.
  while #list > self.limits.log_max or list.bytes > self.limits.log_bytes do
    local old = table.remove(list, 1)
    list.bytes = list.bytes - old.size
    list.dropped = (list.dropped or 0) + 1
  end
  local c = self.log_conds[id]
  if c then c:broadcast() end
end

--- Sets a sandbox's status, persists it, and records the lifecycle event.
function Backend:set_status(rec, status, extra)
  rec.status = status
  for k, v in pairs(extra or {}) do rec[k] = v end
  self.st:save("sandbox", rec)
  if status ~= "suspending" then self:emit(rec.id, "lifecycle", { type = status }) end
end

--- The runtime (non-persisted) state of a sandbox: its boot task, activity, running execs.
function Backend:rt(id)
  local r = self.runtime[id]
  if not r then
    r = { active = 0, last_activity = now(), ready = core.cond() }
    self.runtime[id] = r
  end
  return r
end

--- Boots a sandbox's namespaces and filesystem in its own task; creating → running or errored.
function Backend:boot(rec)
  local r = self:rt(rec.id)
  r.boot = task.spawn(function()
    local ok, err = pcall(self.engine.create, self.engine, rec.id, {
      lowers = rec._lowers or {}, network = rec.networkPolicy.default, env = rec._env or {},
      dev_tar = rec._dev_tar,
    })
    r.boot = nil
    if rec.status ~= "creating" then return end -- terminated meanwhile
    if ok then
      r.started = now()
      r.last_activity = now()
      self:set_status(rec, "running")
    else
      self.log("sandbox " .. rec.id .. " failed to boot: " .. tostring(err))
      rec._error = tostring(err)
      self:set_status(rec, "errored")
    end
    r.ready:broadcast()
  end)
end

--- Waits until a sandbox can run commands: wakes it if suspended (resuming → running) and
-- waits out a boot. Raises API errors for sandboxes that cannot run. [yields]
function Backend:ensure_running(rec)
  local r = self:rt(rec.id)
  local deadline = now() + 120
  while true do
    local s = rec.status
    if s == "running" then return r end
    if s == "terminated" then fail(404, "sandbox " .. rec.id .. " is terminated") end
    if s == "errored" then fail(409, "sandbox " .. rec.id .. " is errored", "sandbox_not_running") end
    if s == "suspended" or s == "suspending" then
      self:set_status(rec, "resuming")
      local ok, err = pcall(self.engine.thaw, self.engine, rec.id)
      if not ok then
        self.log("waking " .. rec.id .. " failed: " .. tostring(err))
        self:set_status(rec, "errored")
        fail(500, "could not wake sandbox " .. rec.id)
      end
      r.last_activity = now()
      self:set_status(rec, "running")
      return r
    end
    if now() > deadline then
      fail(503, "sandbox " .. rec.id .. " is not ready yet", nil, { ["Retry-After"] = "1" })
    end
    r.ready:wait()
  end
end

--- Marks the start and end of an operation that keeps a sandbox awake.
function Backend:activity(id, delta)
  local r = self:rt(id)
  r.active = r.active + delta
  r.last_activity = now()
end

--- Terminates a sandbox (idempotent): stops its processes, frees its layer, records the time.
function Backend:terminate(rec)
  if rec.status == "terminated" then return end
  local r = self:rt(rec.id)
  if r.boot then task.cancel(r.boot) end
  rec.terminatedAt = ids.iso(now())
  self:set_status(rec, "terminated")
  r.ready:broadcast()
  local ok, err = pcall(self.engine.terminate, self.engine, rec.id)
  if not ok then self.log("terminating " .. rec.id .. ": " .. tostring(err)) end
  self:gc_layers()
end

--- Removes layer directories no live sandbox and no kept snapshot needs.
function Backend:gc_layers()
  local needed = {}
  for _, s in pairs(self.st.sandboxes) do
    if LIVE[s.status] then for _, l in ipairs(s._lowers or {}) do needed[l] = true end end
  end
  for _, s in pairs(self.st.snapshots) do
    if not s._deleted then
      for _, l in ipairs(s._layers or {}) do needed[l] = true end
      if s._dev_tar then needed[s._dev_tar] = true end
    end
  end
  local dir = self.state_dir .. "/layers"
  local ok, names = pcall(sys.listdir, dir)
  if not ok then
    if type(names) == "table" and names.code == "not_found" then return end -- nothing to free
    self.log("cannot list the layers to free: " .. tostring(names))
    return
  end
  table.sort(names)
  for _, name in ipairs(names) do
    local path = dir .. "/" .. name
    if not needed[path] then
      local freed, err = pcall(host.remove_tree, path)
      if not freed then self.log("cannot free layer " .. path .. ": " .. tostring(err)) end
    end
  end
end

--- After a restart: the previous backend's sandbox processes died with it. Their records stay
-- and say so honestly: they become errored, with the reason in the log stream.
function Backend:recover()
  local stale = {}
  for id, rec in pairs(self.st.sandboxes) do
    if LIVE[rec.status] then stale[#stale + 1] = id end
  end
  if self.engine.recover then pcall(self.engine.recover, self.engine) end
  for _, id in ipairs(stale) do
    local rec = self.st.sandboxes[id]
    rec._error = "the moonbox local backend restarted; this sandbox's processes did not survive"
    self:emit(id, "log", { stream = "stderr", data = rec._error .. "\n" })
    self:set_status(rec, "errored")
    -- Its filesystem cannot be reached through the API any more: free the disk it holds.
    pcall(self.engine.terminate, self.engine, id)
  end
  for _, snap in pairs(self.st.snapshots) do
    if snap.status == "creating" then
      snap.status, snap.error = "failed", "the backend restarted during capture"
      self.st:save("snapshot", snap)
    end
  end
end

--- Once a second: idle suspend, lifetime timeouts, snapshot expiry, token expiry.
function Backend:tick_loop()
  while true do
    task.sleep(1)
    local t = now()
    for id, rec in pairs(self.st.sandboxes) do
      local r = self.runtime[id]
      if rec.status == "running" and r then
        local idle = rec.idleTimeoutSeconds or self.limits.idle_timeout_seconds
        if rec.timeoutSeconds and rec.timeoutSeconds > 0 and r.started
          and t - (r.started_total or r.started) >= rec.timeoutSeconds then
          self:emit(id, "log", { stream = "stderr", data = "sandbox reached its timeoutSeconds\n" })
          self:terminate(rec)
        elseif idle > 0 and r.active == 0 and t - r.last_activity >= idle then
          self:set_status(rec, "suspending")
          local ok, err = pcall(self.engine.freeze, self.engine, id)
          if ok then
            self:set_status(rec, "suspended")
          else
            self.log("suspending " .. id .. ": " .. tostring(err))
            self:set_status(rec, "running")
          end
        end
      end
    end
    local expired = false
    for _, snap in pairs(self.st.snapshots) do
      if not snap._deleted and snap.expiresAt and (ids.parse_iso(snap.expiresAt) or math.huge) <= t then
        snap._deleted = true
        self.st:save("snapshot", snap)
        expired = true
      end
    end
    if expired then self:gc_layers() end
    for tok, info in pairs(self.tokens) do
      if info.expires < t - 60 then self.tokens[tok] = nil end
    end
  end
end

M.Backend = Backend
M.DEFAULTS = DEFAULTS
M.PLANS = PLANS
M.SANDBOX_STATUSES = SANDBOX_STATUSES
M.SNAPSHOT_STATUSES = SNAPSHOT_STATUSES
M.LIVE = LIVE
return M
