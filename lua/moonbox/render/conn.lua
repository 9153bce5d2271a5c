--- moonbox.render.conn — which backend a recipe talks to, with what credentials, and the
-- process's default connection.
--
-- Selection (docs/reference/render.md, "Which backend"), first match wins:
--   1. an explicit choice: render.connect{ backend = URL | "local" | "render", ... } (the CLI's
--      --backend sets it);
--   2. RENDER_LOCAL_DEV_URL, or RENDER_USE_LOCAL_DEV=true (http://localhost:8120);
--   3. RENDER_API_KEY: Render's cloud (https://api.render.com);
--   4. otherwise the embedded local backend of the state directory (moonbox.render.embedded):
--      the one already serving there is shared, else one is started, with a one-line notice on
--      stderr either way.
-- The key is read from RENDER_API_KEY, or from the local backend's state dir (its api-key
-- file), and is only ever put in the Authorization header. The default connection is made once
-- however many tasks ask for it at the same moment (the first connects, the others wait).
local M = {}
local Conn = {}
Conn.__index = Conn
Conn.__tostring = function(c) return string.format("render connection to %s (%s)", c.base, c.kind) end

local CLOUD = "https://api.render.com/v1"

local read_file = require("moonbox.path").read_file
local state_home = require("moonbox.path").state_home
local trace = require "moonbox.trace"
local embedded = require "moonbox.render.embedded"
local core = require "moonbox.core"

--- conn.default_state_dir() -> the embedded backend's state directory ($XDG_STATE_HOME/moonbox/
-- local, default ~/.local/state/moonbox/local).
function M.default_state_dir() return state_home() .. "/local" end

--- conn:note(op, method, path, status, attempt): records a call, for traces and tests
-- (conn.calls is a bounded list, oldest first: the last 1000 to 2000 calls). The oldest 1000
-- go at once when it reaches 2000, not one per call (shifting 1000 entries on every call cost
-- every Render call of a long run O(1000)).
function Conn:note(op, method, path, status, attempt)
  local calls = self.calls
  local n = #calls + 1
  calls[n] = { op = op, method = method, path = path, status = status, attempt = attempt }
  if n >= 2000 then
    table.move(calls, 1001, n, 1)
    for i = n - 999, n do calls[i] = nil end
  end
end

--- conn:owner() -> the workspace id (the API's ownerId). Raises when none is known.
function Conn:owner()
  if self.workspace then return self.workspace end
  error("moonbox.render: no workspace id: set RENDER_WORKSPACE_ID (the ownerId of your Render workspace)", 0)
end

local function new(kind, url, key, workspace)
  url = url:gsub("/+$", "")
  if not url:match("/v1$") then url = url .. "/v1" end
  trace.secret(key, true)
  return setmetatable({ kind = kind, base = url, api_key = key, workspace = workspace, calls = {} }, Conn)
end

-- A dry run (moonbox.dryrun) in force: every connection is to its simulated backend.
local simulated

local function simulated_conn(opts)
  local sim = simulated()
  local c = new(sim.kind or "dry-run", sim.url, sim.api_key, opts.workspace or sim.workspace)
  c.transport = sim.transport
  return c
end

--- conn.simulate(fn): while fn is set, conn.connect (hence render.connect and the default
-- connection) makes a connection whose requests go to fn().transport (an object with request
-- and stream, as moonbox.http has) at fn().url with the API key fn().api_key, whatever backend
-- was asked for (of kind fn().kind, default "dry-run"); nil ends that. The transport gets each
-- request's options as moonbox.http would,
-- plus opts.intent where the client put one (moonbox.render.exec: the structured command beside
-- the wire body, which moonbox.http ignores). For moonbox.dryrun. Does not yield.
function M.simulate(fn)
  simulated = fn
end

--- conn.connect(opts) -> Conn. opts: backend ("local", "render" or a URL), api_key, workspace,
-- state_dir (the embedded backend's; default conn.default_state_dir()). An embedded Conn has
-- c.state_dir set and must be closed (c:close()) when done. Raises when the choice cannot work
-- (e.g. "render" without a key). [yields] when it joins or starts an embedded backend.
function M.connect(opts)
  opts = opts or {}
  if simulated then return simulated_conn(opts) end
  local backend = opts.backend
  local key = opts.api_key or os.getenv("RENDER_API_KEY")
  local workspace = opts.workspace or os.getenv("RENDER_WORKSPACE_ID")
  local local_url = os.getenv("RENDER_LOCAL_DEV_URL")
  if not local_url and os.getenv("RENDER_USE_LOCAL_DEV") == "true" then
    local_url = "http://localhost:8120"
  end
  if backend == nil then
    if local_url and local_url ~= "" then
      backend = local_url
    elseif key and key ~= "" then
      backend = "render"
    else
      backend = "local"
    end
  end
  if backend == "render" then
    if not key or key == "" then
      error("moonbox: --backend render needs RENDER_API_KEY (a Render API key) in the environment", 0)
    end
    return new("render", CLOUD, key, workspace)
  end
  if backend == "local" then
    local dir = opts.state_dir or M.default_state_dir()
    local member = embedded.join(dir)
    local c = new("local", member.url, member.key, workspace or member.workspace)
    c.state_dir, c.member = dir, member
    return c
  end
  if type(backend) ~= "string" or not backend:match("^https?://") then
    error("moonbox: --backend must be local, render or an http(s) URL, got " .. tostring(backend), 0)
  end
  if not key or key == "" then
    -- A local backend started with its state in the default place: its key file says it.
    key = (read_file(M.default_state_dir() .. "/api-key") or ""):match("%S+")
  end
  if not key then
    error("moonbox: no API key for " .. backend .. ": set RENDER_API_KEY", 0)
  end
  local kind = (backend:match("//127%.0%.0%.1") or backend:match("//localhost") or backend:match("//%[::1%]"))
    and "local" or "url"
  return new(kind, backend, key, workspace)
end

--- conn:close(): an embedded connection stops using its backend (the last user stops it). Other
-- connections hold nothing. Idempotent. [yields]
function Conn:close()
  local m = self.member
  if m then
    self.member = nil
    embedded.leave(m)
  end
end

-- ---- the default connection ---------------------------------------------------------------

local default_conn, last_conn
local connecting -- a cond while the default connection is being made

--- conn.set_default(opts) -> Conn: connects with opts and makes that the default (closing the
-- previous default). [yields]
function M.set_default(opts)
  while connecting do connecting:wait() end
  local done = core.cond()
  connecting = done
  local ok, c = pcall(M.connect, opts)
  connecting = nil
  done:broadcast()
  if not ok then error(c, 0) end
  local old = default_conn
  default_conn = c
  if old and old ~= c then old:close() end
  return c
end

--- conn.default() -> the default Conn, connecting with the defaults first if there is none.
-- Concurrent first calls make one connection. [yields]
function M.default()
  while connecting do connecting:wait() end
  if default_conn then return default_conn end
  return M.set_default()
end

--- conn.current() -> the default Conn, or the last one after conn.close_default(), or nil;
-- never connects.
function M.current() return default_conn or last_conn end

--- conn.close_default(): closes the default connection (an embedded backend this process uses is
-- left, and stopped if it was the last user); the next call connects again. [yields]
function M.close_default()
  local c = default_conn
  last_conn = c or last_conn
  default_conn = nil
  if c then c:close() end
end

M.Conn = Conn
return M
