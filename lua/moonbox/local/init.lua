--- moonbox.local — `moonbox local`: Render's sandbox API on this machine.
--
-- This module starts and stops a backend; the work is elsewhere:
--   moonbox.local.service   the records, the lifecycle, tokens, logs (what the backend does)
--   moonbox.local.engine    the sandboxes themselves: isolation, processes, files, snapshots
--   moonbox.local.image     the base image sandboxes start from (built once per machine)
--   moonbox.local.http.*    the routes: decode, call the service, encode (how it is asked)
--   moonbox.local.state, .wire, .faults, .journal, .ids   records, shapes, fault injection,
--                           the request journal, Render's ids
-- The server listens on loopback only and checks the API key or a connect token before it
-- reads a request's body (runtime/http_server.c), so no unauthenticated byte is buffered,
-- journaled or written anywhere.
-- Start order: the state dir's lock, the records, the engine, the port (from then on every /v1
-- request is answered 503 with Retry-After: 1, moonbox.local.http's gate), the endpoint file,
-- then the recovery of what the previous backend left (svc:start); local.start returns, and
-- /v1 answers, only once it is done, so the ready line `moonbox local` prints and the
-- embedded backend's start (moonbox.render.embedded) come after the recovery.
local httpd = require "moonbox.httpd"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local ids = require "moonbox.ids"
local State = require "moonbox.local.state"
local Faults = require "moonbox.local.faults"
local Journal = require "moonbox.local.journal"
local service = require "moonbox.local.service"
local image = require "moonbox.local.image"
local Engine = require "moonbox.local.engine"
local public = require "moonbox.local.http.public"
local http = require "moonbox.local.http"
local core = require "moonbox.core"

local M = {}
local Backend = {}
Backend.__index = Backend
M.Backend = Backend

-- Connections accepted at once, and how long a silent one is kept: thousands of idle or
-- half-sent connections must not keep others out.
local CONNECTION_LIMIT = 16384
local IDLE_TIMEOUT = 30

local read_file = require("moonbox.path").read_file

local function write_secret(path, content)
  local tmp = path .. ".tmp." .. ids.token():sub(1, 8)
  local r = proc.run { "sh", "-c", 'umask 077 && cat > "$1" && mv -f "$1" "$2"', "sh", tmp, path,
    input = content }
  if r.code ~= 0 then error("cannot write " .. path .. ": " .. r.stderr, 0) end
end

-- Listens where opts say: by default on both loopback addresses, 127.0.0.1 and ::1, on one port
-- (clients that resolve localhost to ::1 first, as Render's SDKs' default URL makes them do,
-- find it there); a machine without IPv6 loopback gets 127.0.0.1 alone and a line in the log,
-- while ::1's port taken by another program is an error like 127.0.0.1's.
-- opts.host (one loopback address) listens there only.
local function listen(opts, upload_dir, log)
  local o = { host = opts.host or "127.0.0.1", port = opts.port or 8120,
    max_body = 1024 * 1024, upload_dir = upload_dir, connection_limit = CONNECTION_LIMIT,
    idle_timeout = IDLE_TIMEOUT, log = log }
  if opts.host == nil or opts.host == "localhost" then
    o.host, o.also_host = "127.0.0.1", "::1"
    local ok, srv = pcall(httpd.listen, o)
    if ok then return srv end
    -- Only a machine without ::1 falls back: ::1 taken by another program would send the
    -- clients whose localhost is ::1 there.
    local msg = type(srv) == "table" and tostring(srv.message) or ""
    if not msg:find("::1", 1, true) or msg:find("in use", 1, true) then error(srv, 0) end
    log("not listening on ::1 (" .. tostring(srv.message) .. "); serving on 127.0.0.1 only")
    o.also_host = nil
  end
  return httpd.listen(o)
end

--- local.start(opts) -> Backend. Starts the API on opts.host:opts.port (default
-- 127.0.0.1 and ::1, port 8120) with its state under opts.state_dir. opts: image (a root filesystem
-- directory; default: the "debian-12" image, built on first use), host_root (use the host's /
-- as the base: discouraged), faults (spec), seed, api_key, workspace, concurrency_limit, log
-- (function(line)), dns (the resolver allow-list sandboxes' gates ask; default slirp4netns's),
-- engine (an Engine, for tests), public_url (the base of the connect URIs it hands out; default:
-- from each request's Host or a loopback proxy's X-Forwarded-*), on_image_build (function(line):
-- progress of a first image build), disk ({PLAN = bytes}: plans' disk sizes other than Render's),
-- disk_size (bytes: the sandbox disk's size when it is made; docs/local.md, "Disk"). Raises when
-- the state dir, the port or the image cannot be set up.
-- [yields]
function M.start(opts)
  opts = opts or {}
  local state_dir = assert(opts.state_dir, "local.start: state_dir is required")
  for _, d in ipairs({ state_dir, state_dir .. "/layers", state_dir .. "/tmp" }) do
    sys.mkdir_p(d, tonumber("700", 8))
  end
  -- One backend per state directory: a second one's recovery would kill the first one's
  -- sandboxes. The lock dies with the process, SIGKILL included.
  local lock = sys.try_lock(state_dir .. "/backend.lock", "exclusive")
  if not lock then
    local endpoint = read_file(state_dir .. "/endpoint")
    error("another moonbox local already serves the state directory " .. state_dir ..
      (endpoint and (" (at " .. endpoint:match("^(%S+)") .. ")") or "") ..
      "; use it, stop it, or start this one with --state DIR", 0)
  end
  -- An endpoint file now is a killed backend's: nobody serves there.
  os.remove(state_dir .. "/endpoint")
  local self = setmetatable({
    opts = opts, state_dir = state_dir, lock = lock, ready = false,
    log = opts.log or function(line) io.stderr:write("moonbox local: ", line, "\n") end,
    journal = Journal.new(),
  }, Backend)

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
    error("--workspace must look like tea- followed by 20 characters of 0-9a-v, got " .. tostring(
      self.workspace), 0)
  end
  self.st:set_meta("workspace", self.workspace)
  local user = self.st:meta("user") or ids.new("usr")
  self.st:set_meta("user", user)
  self.faults = Faults.new(opts.faults, opts.seed)
  self.rate_limit = opts.rate_limit -- /v1 requests per minute (moonbox.local.http.route.meter)

  local engine = opts.engine
  if not engine then
    local base = opts.image
    if not base and not opts.host_root then
      if not image.exists(image.DEFAULT) then
        self.log("building the default sandbox image " .. image.DEFAULT .. " in " .. image.dir() ..
          " (once per machine; a few minutes)")
      end
      base = image.build(image.DEFAULT, { log = opts.on_image_build })
    end
    if opts.host_root then
      self.log("warning: sandboxes use this machine's own root filesystem as their base (--host-root): " ..
        "they can read every file of it that is not masked; use an image instead")
    end
    engine = Engine.new { state_dir = state_dir, image = base,
      host_root = opts.host_root, dns = opts.dns, disk_size = opts.disk_size,
      fairness = os.getenv("MOONBOX_LOCAL_FAIRNESS") ~= "off" } -- off: bench/neighbour.lua's "before"
  end
  self.engine = engine
  -- Say at once what this machine cannot do, rather than only through sandboxes that end
  -- errored later; the API itself still serves.
  local ok_check, chk = pcall(engine.check, engine)
  if ok_check and not chk.ok then
    for _, problem in ipairs(chk.problems) do self.log("cannot run sandboxes here: " .. problem) end
  end
  self.check = ok_check and chk or { ok = false, problems = { tostring(chk) } }
  -- Fairness (engine/cgroup.lua): this process, and every helper it starts, in the engine's
  -- host-side CPU cgroup, weighted above all sandboxes together.
  if not opts.engine and self.check.ok then
    local ok_host, err_host = pcall(engine.join_host, engine)
    if not ok_host then
      self.log("warning: sandboxes can take CPU from the server: " ..
        tostring(type(err_host) == "table" and err_host.message or err_host))
    end
  end

  if opts.public_url then
    local url, why = public.valid_url(opts.public_url)
    if not url then error("--public-url " .. tostring(opts.public_url) .. ": " .. why, 0) end
    self.public_url = url
  end
  -- Upload spools and file-operation temporaries live on the sandbox disk when there is one,
  -- so that they cannot eat the state directory's reserve (moonbox.local.engine.disk).
  local disk = engine.disk
  self.spool_dir = disk and disk.spool or state_dir .. "/tmp"
  self.space_dir = disk and disk.mnt or nil
  self.srv = listen(opts, self.spool_dir, self.log)
  self.srv:set_key(self.api_key)
  self.url = self.srv.url
  self.port = self.srv.port
  local srv = self.srv
  self.svc = service.new {
    st = self.st, engine = engine, state_dir = state_dir, workspace = self.workspace, user = user,
    log = self.log, faults = self.faults,
    limits = { concurrency_limit = opts.concurrency_limit,
      token_ttl = tonumber(os.getenv("MOONBOX_LOCAL_TOKEN_TTL") or ""),
      idle_scale = tonumber(os.getenv("MOONBOX_LOCAL_IDLE_SCALE") or ""), disk = opts.disk,
      capture_timeout = tonumber(os.getenv("MOONBOX_LOCAL_CAPTURE_TIMEOUT") or "") },
        -- test only: tokens that expire fast, idle timeouts scaled down (0.005: 300 s → 1.5 s);
        -- the bound on a capture's freeze (seconds, default 60; docs/local.md, "Snapshots")
    on_token = function(op, token, info, ttl)
      if srv.closed then return end
      if op == "put" then srv:token_put(token, info.sandbox, info.op, ttl) else srv:token_drop(token) end
    end,
  }
  http.install(self)
  -- Where clients find a running backend (moonbox.render.embedded reuses it): "URL WORKSPACE".
  -- Written as soon as the port is open, before the recovery: a client that finds the backend
  -- while it recovers is answered 503 (its /_moonbox/health says ready: false) and waits,
  -- rather than taking the backend for gone and starting another on the same state dir.
  write_secret(state_dir .. "/endpoint", self.url .. " " .. self.workspace .. "\n")
  local t0 = core.now()
  self.svc:start()
  self.ready = true
  self.recovered_in = core.now() - t0
  return self
end

--- backend:disk_health() -> { ok, problems = {sentence...}, sandboxes = {size, avail, low} | nil,
-- state = {size, avail, reserve, low} }: the free space of the sandbox disk and of the state
-- directory's filesystem (bytes; state.avail leaves out what the sparse sandbox disk may still
-- grow by). low: the sandbox disk has less than a tenth of its size (at most 4 GiB) left, or
-- the state directory less than half its reserve. Does not yield.
function Backend:disk_health()
  local problems = {}
  local out = { problems = problems }
  local disk = self.engine.disk
  local ok, sp = pcall(function()
    if disk then return disk:space() end
    local sv = sys.statvfs(self.state_dir)
    return { state = { size = sv.size, avail = sv.avail, reserve = 64 * 1024 * 1024 } }
  end)
  if not ok then
    problems[1] = "cannot read the free space: " .. tostring(type(sp) == "table" and sp.message or sp)
    out.ok = false
    return out
  end
  local st = sp.state
  out.state = { size = st.size, avail = st.avail, reserve = st.reserve, low = st.avail < st.reserve // 2 }
  if out.state.low then
    problems[#problems + 1] = string.format("the state directory's filesystem has %d MiB left, less " ..
      "than half its reserve of %d MiB", st.avail // 1048576, st.reserve // 1048576)
  end
  if sp.disk then
    local d = sp.disk
    local floor = math.min(d.size // 10, 4 * 1024 * 1024 * 1024)
    out.sandboxes = { size = d.size, avail = d.avail, low = d.avail < floor }
    if out.sandboxes.low then
      problems[#problems + 1] = string.format("the sandbox disk has %d MiB of %d MiB left",
        d.avail // 1048576, d.size // 1048576)
    end
  end
  out.ok = #problems == 0
  return out
end

--- backend:close(): stops serving, stops every sandbox's processes (their records stay, and
-- are reported as the restart left them), and closes the database. [yields]
function Backend:close()
  if self.closing then return end
  self.closing = true
  if self.srv then self.srv:close() end
  if self.svc then self.svc:close() end
  os.remove(self.state_dir .. "/endpoint")
  self.st:close()
  self.lock:unlock()
end

M.DEFAULTS = service.DEFAULTS
M.PLANS = service.PLANS
M.LIVE = service.LIVE
return M
