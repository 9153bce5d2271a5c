--- spec/support/local_backend.lua — starts a real `moonbox local` process for specs and talks
-- to it over real HTTP. Every backend gets a fresh state directory, a fixed API key and
-- workspace (so request vectors can name them), and an ephemeral port.
local proc = require "moonbox.proc"
local http = require "moonbox.http"
local json = require "moonbox.json"
local build = require "moonbox.build"

local M = {}

M.BIN = os.getenv("MOONBOX_BIN") or build.exe
M.KEY = "rnd_speckey0123456789"
M.WORKSPACE = "tea-cph1rs3idesc73a2b2mg"

local Backend = {}
M.Backend = Backend -- its methods, for another backend of the same interface (dryrun_backend)
Backend.__index = Backend

--- M.edge: whether backends are reached through a TLS + HTTP/2 edge (MOONBOX_SPEC_EDGE=1: the
-- edge_* ctest entries run the render specs so; see spec/support/edge.lua).
M.edge = os.getenv("MOONBOX_SPEC_EDGE") == "1"
if M.edge then io.stderr:write("spec: through the nginx TLS + HTTP/2 edge (MOONBOX_SPEC_EDGE=1)\n") end

--- M.localhost6: whether backends are reached as http://localhost:PORT with localhost resolving
-- to ::1 (MOONBOX_SPEC_LOCALHOST6=1: what Render's SDKs' default URL meets on machines whose
-- localhost is ::1 first). The name is pinned in this process's HTTP client (libcurl's DNS cache,
-- CURLOPT_RESOLVE), so every later request to localhost:PORT, connect URIs included, goes to ::1.
M.localhost6 = os.getenv("MOONBOX_SPEC_LOCALHOST6") == "1"
if M.localhost6 then io.stderr:write("spec: as http://localhost:PORT with localhost = ::1 (MOONBOX_SPEC_LOCALHOST6=1)\n") end

-- Points backend b at http://localhost:PORT with localhost pinned to ::1, and checks that a
-- request really went there. [yields]
local function via_localhost6(b)
  local port = assert(b.url:match(":(%d+)$"), "no port in " .. b.url)
  b.url = "http://localhost:" .. port
  local r = http.request { url = b.url .. "/v1/sandboxes?limit=1", headers = { Authorization = "Bearer " .. b.key },
    resolve = { "localhost:" .. port .. ":[::1]" }, timeout = 30 }
  assert(r.status == 200 and r.remote_ip == "::1", "localhost:" .. port .. " did not answer on ::1: " ..
    tostring(r.status) .. " from " .. tostring(r.remote_ip))
end

--- M.start(opts) -> backend. opts.args: extra `moonbox local` arguments; opts.state: reuse a
-- state directory (restart specs); opts.edge: put an nginx TLS + HTTP/2 edge in front (default
-- M.edge); opts.port: listen there (default 0: any free port); opts.nowait = true (with a
-- port): return at once, before the backend has printed its address or even listens (specs of
-- what a client sent the moment the port opens meets). With an edge, backend.url is the edge's
-- https URL (what clients use), backend.direct_url the backend's own, and backend.edge the edge
-- (spec/support/edge.lua). [yields]
function M.start(opts)
  opts = opts or {}
  local state = opts.state or proc.run({ "mktemp", "-d", "/tmp/moonbox-local-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  local argv = { M.BIN, "local", "--port", tostring(opts.port or 0), "--state", state, "--api-key", M.KEY,
    "--workspace", M.WORKSPACE }
  for _, a in ipairs(opts.args or {}) do argv[#argv + 1] = a end
  argv.stderr = opts.stderr or "inherit"
  argv.env = opts.env
  local p = proc.spawn(argv)
  if opts.nowait then
    assert(opts.port and opts.port > 0, "local_backend.start: nowait needs a port")
    local url = "http://127.0.0.1:" .. opts.port
    return setmetatable({ p = p, state = state, url = url, direct_url = url, key = M.KEY,
      workspace = M.WORKSPACE }, Backend)
  end
  local lines = p:lines("stdout")
  local env = {}
  for _ = 1, 3 do
    local line = lines()
    if not line then error("moonbox local exited before printing its address") end
    local k, v = line:match("^([%w_]+)=(.*)$")
    if k then env[k] = v end
  end
  local self = setmetatable({ p = p, state = state, url = env.RENDER_LOCAL_DEV_URL,
    key = env.RENDER_API_KEY, workspace = env.RENDER_WORKSPACE_ID }, Backend)
  self.direct_url = self.url
  if M.localhost6 and opts.edge ~= true then
    local ok, err = pcall(via_localhost6, self)
    if not ok then
      self:stop()
      error(err, 0)
    end
  end
  local want_edge = opts.edge
  if want_edge == nil then want_edge = M.edge end
  if want_edge then
    local ok, edge = pcall(require("spec.support.edge").start, { upstream = self.url })
    if not ok then
      self:stop()
      error(edge, 0)
    end
    self.edge, self.url = edge, edge.url
  end
  return self
end

--- M.fixture(setup, teardown, ready, opts): the preamble of the specs that drive moonbox.render
-- in their own process: through the spec's busted setup and teardown (pass them: a support
-- module does not see a spec's environment), setup starts a backend (M.start(opts)), points
-- moonbox.render at it and hands it to ready(backend), which may make more (a kept sandbox)
-- and return a function that undoes that; teardown calls it, then destroys the backend.
-- opts.render = false: leave moonbox.render alone (specs that only run moonbox commands).
function M.fixture(setup, teardown, ready, opts)
  local T = require "moonbox.testing"
  local b, undo
  setup(T.async(function()
    b = M.start(opts)
    if not (opts and opts.render == false) then b:connect_render() end
    undo = ready(b)
  end))
  teardown(T.async(function()
    if undo then undo() end
    if b then b:destroy() end
  end))
end

--- backend:connect_render(): points moonbox.render at this backend. [yields]
function Backend:connect_render()
  require("moonbox.render").connect { backend = self.url, api_key = self.key, workspace = self.workspace }
end

--- backend:live() -> how many sandboxes are not terminated (Render's default list). [yields]
function Backend:live()
  local n, cursor = 0, nil
  repeat
    local status, page = self:req("GET", "/v1/sandboxes", { query = { limit = 100, cursor = cursor } })
    assert(status == 200, "listing sandboxes failed: " .. tostring(status))
    n = n + #page
    cursor = page[#page] and page[#page].cursor
  until #page < 100
  return n
end

--- backend:stop(): SIGTERM and wait (its sandboxes stop with it). [yields]
function Backend:stop()
  if self.stopped then return end
  self.stopped = true
  self.p:kill("TERM")
  self.p:wait()
  if self.edge then self.edge:stop() end
end

--- backend:faults(spec): replaces the backend's injected faults with spec (the --faults rule
-- text, or a table of rules; "" clears them); raises unless the backend took them. [yields]
function Backend:faults(spec)
  local status, body = self:req("PUT", "/_moonbox/faults", { body = spec })
  if status ~= 200 then error("PUT /_moonbox/faults answered " .. tostring(status) .. ": " .. json.encode(body), 2) end
end

--- M.remove_tree(dir): removes dir and everything in it, having first detached (lazily,
-- deepest first) every mount under it: a state directory's sandbox disk is a loop-mounted
-- filesystem at <dir>/sandboxes, and a backend that was SIGKILLed leaves it mounted (its loop
-- device goes when the mount does). Never follows a mount. [yields]
function M.remove_tree(dir)
  if not dir or dir == "" or dir == "/" then return end
  local f = io.open("/proc/self/mountinfo")
  local info = f and f:read("a") or ""
  if f then f:close() end
  local under = {}
  for line in info:gmatch("[^\n]+") do
    local mp = line:match("^%S+ %S+ %S+ %S+ (%S+)")
    mp = mp and mp:gsub("\\(%d%d%d)", function(o) return string.char(tonumber(o, 8)) end)
    if mp and (mp == dir or mp:sub(1, #dir + 1) == dir .. "/") then under[#under + 1] = mp end
  end
  table.sort(under, function(a, b) return #a > #b end)
  for _, mp in ipairs(under) do proc.run { "umount", "-l", mp } end
  proc.run { "rm", "-rf", "--one-file-system", dir }
end

--- L.cgroup_dirs(id) -> the cgroup directories of sandbox id in every hierarchy (cgroup v1
-- controllers, or v2), under any backend's tag. [yields]
function M.cgroup_dirs(id)
  local r = proc.run { "sh", "-c", 'for d in /sys/fs/cgroup/*/moonbox/*/"$1" /sys/fs/cgroup/moonbox/*/"$1"; do ' ..
    '[ -d "$d" ] && echo "$d"; done; true', "sh", id }
  local dirs = {}
  for d in r.stdout:gmatch("[^\n]+") do dirs[#dirs + 1] = d end
  return dirs
end

--- L.remove_trees(dir): L.remove_tree of dir and of every sibling named dir-*. [yields]
function M.remove_trees(dir)
  M.remove_tree(dir)
  local parent, base = dir:match("^(.*)/([^/]+)$")
  local r = proc.run { "find", parent, "-mindepth", "1", "-maxdepth", "1", "-name", base .. "-*", "-print0" }
  for sib in (r.stdout or ""):gmatch("([^%z]+)%z") do M.remove_tree(sib) end
end

--- backend:destroy(): stop and remove the state directory. [yields]
function Backend:destroy()
  self:stop()
  M.remove_tree(self.state)
end

local encode_query = require("moonbox.render.api").encode_query
M.encode_query = encode_query

--- backend:req(method, path, opts) -> status, decoded JSON (or raw body), headers. opts: query
-- (table), body (table → JSON, string → raw), headers, auth (false to omit; a string to use
-- another key). Control-plane requests carry the API key by default. [yields]
function Backend:req(method, path, opts)
  opts = opts or {}
  local headers = { Accept = "application/json" }
  if opts.auth ~= false then headers.Authorization = "Bearer " .. (opts.auth or self.key) end
  local body = opts.body
  if type(body) == "table" then
    body = json.encode(body)
    headers["Content-Type"] = "application/json"
  end
  for k, v in pairs(opts.headers or {}) do headers[k] = v end
  local url = (opts.base or self.url) .. path .. encode_query(opts.query)
  local r = http.request { method = method, url = url, headers = headers, body = body,
    timeout = opts.timeout or 60, fresh_connect = opts.fresh_connect }
  local decoded = r.body
  if (r.headers["content-type"] or ""):find("json") then decoded = json.decode(r.body) end
  return r.status, decoded, r.headers, r.body
end

--- backend:create(body) -> the created sandbox, once it is running. [yields]
function Backend:create(body)
  body = body or {}
  body.ownerId = body.ownerId or self.workspace
  local status, sb = self:req("POST", "/v1/sandboxes", { body = body })
  assert(status == 201, "create failed: " .. status .. " " .. json.encode(sb))
  return self:wait_status(sb.id, "running")
end

--- backend:wait_status(id, status) -> the sandbox once it has that status (30 s at most). [yields]
function Backend:wait_status(id, want)
  local task = require "moonbox.task"
  for _ = 1, 600 do
    local _, sb = self:req("GET", "/v1/sandboxes/" .. id)
    if sb.status == want then return sb end
    if sb.status == "errored" or (sb.status == "terminated" and want ~= "terminated") then
      error("sandbox " .. id .. " became " .. sb.status)
    end
    task.sleep(0.05)
  end
  error("sandbox " .. id .. " did not become " .. want)
end

--- L.snapshot_path(snap) -> the wire path of a snapshot record ({id, sandboxGroupId}).
function M.snapshot_path(snap) return "/v1/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id end

--- backend:snapshot(id[, kind]) -> the snapshot record the capture's 202 answered (kind
-- "filesystem" by default); raises on any other status. [yields]
function Backend:snapshot(id, kind)
  local s, snap = self:req("POST", "/v1/sandboxes/" .. id .. "/snapshots", { body = { kind = kind or "filesystem" } })
  assert(s == 202, "capture of " .. id .. ": " .. s .. " " .. json.encode(snap))
  return snap
end

--- backend:settled(snap[, within]) -> the snapshot once it is no longer creating (within
-- seconds, 60 by default); raises after that. [yields]
function Backend:settled(snap, within)
  local task = require "moonbox.task"
  local core = require "moonbox.core"
  local deadline = core.now() + (within or 60)
  repeat
    local _, got = self:req("GET", M.snapshot_path(snap))
    if got.status ~= "creating" then return got end
    task.sleep(0.05)
  until core.now() > deadline
  error("snapshot " .. snap.id .. " is still creating after " .. (within or 60) .. " s")
end

--- backend:exec(id, command) -> {code=, stdout=, stderr=, events=} through a stream token (over
-- backend.http when it has one: a dry run's in-memory transport). [yields]
function Backend:exec(id, command, opts)
  opts = opts or {}
  local status, tok = self:req("POST", "/v1/sandboxes/" .. id .. "/runs/stream/token",
    { body = { command = command } })
  assert(status == 201, "token: " .. status .. " " .. json.encode(tok))
  local resp <close> = (self.http or http).stream { method = "POST", url = tok.uri, body = json.encode({ command = command }),
    headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream",
      ["Content-Type"] = "application/json" }, timeout = opts.timeout or 120 }
  local out = { stdout = {}, stderr = {}, events = {}, status = resp.status, exec_id = tok.executionId }
  if resp.status ~= 200 then
    out.body = resp:read()
    return out
  end
  while true do
    local ev = resp:read_event()
    if not ev then break end
    out.events[#out.events + 1] = ev
    local d = json.decode(ev.data)
    if ev.event == "output" then
      table.insert(out[d.stream], d.data)
    elseif ev.event == "exit" then
      out.code = d.exit_code
    end
  end
  out.stdout, out.stderr = table.concat(out.stdout), table.concat(out.stderr)
  return out
end

return M
