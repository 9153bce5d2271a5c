--- moonbox.render.conn — which backend a recipe talks to, and with what credentials.
--
-- Selection (DESIGN.md §7), first match wins:
--   1. an explicit choice: render.connect{ backend = URL | "local" | "render", ... } (the CLI's
--      --backend sets it);
--   2. RENDER_LOCAL_DEV_URL, or RENDER_USE_LOCAL_DEV=true (http://localhost:8120);
--   3. RENDER_API_KEY: Render's cloud (https://api.render.com);
--   4. otherwise the embedded local backend: a `moonbox local` already serving from the default
--      state dir is reused, else one is started for this process (a one-line notice on stderr).
-- The key is read from RENDER_API_KEY, or from the local backend's state dir (its api-key
-- file), and is only ever put in the Authorization header.
local proc = require "moonbox.proc"
local http = require "moonbox.http"
local build = require "moonbox.build"

local M = {}
local Conn = {}
Conn.__index = Conn
Conn.__tostring = function(c) return string.format("render connection to %s (%s)", c.base, c.kind) end

local CLOUD = "https://api.render.com/v1"

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local state_home = require("moonbox.path").state_home

--- Records the calls made, for traces and tests: conn.calls is a bounded list.
function Conn:note(op, method, path, status, attempt)
  local calls = self.calls
  calls[#calls + 1] = { op = op, method = method, path = path, status = status, attempt = attempt }
  if #calls > 1000 then table.remove(calls, 1) end
end

local function new(kind, url, key, workspace)
  url = url:gsub("/+$", "")
  if not url:match("/v1$") then url = url .. "/v1" end
  require("moonbox.trace").secret(key, true)
  return setmetatable({ kind = kind, base = url, api_key = key, workspace = workspace, calls = {} }, Conn)
end

--- Starts (or reuses) the embedded local backend; returns its URL, key and workspace. [yields]
local function embedded(opts)
  local state = opts.state_dir or (state_home() .. "/local")
  local key = (read_file(state .. "/api-key") or ""):match("%S+")
  local endpoint = read_file(state .. "/endpoint")
  if key and endpoint then
    local url, ws = endpoint:match("^(%S+)%s+(%S+)")
    if url then
      local ok, r = pcall(http.request, { url = url .. "/_moonbox/health", timeout = 2,
        headers = { Authorization = "Bearer " .. key } })
      if ok and r.status == 200 then return url, key, ws, nil end
    end
  end
  local p = proc.spawn { build.exe, "local", "--quiet", "--port", "0", "--state", state, stderr = "inherit" }
  local lines = p:lines("stdout")
  local env = {}
  for _ = 1, 3 do
    local line = lines()
    if not line then error("moonbox: could not start the embedded local backend (see above)", 0) end
    local k, v = line:match("^([%w_]+)=(.*)$")
    if k then env[k] = v end
  end
  io.stderr:write("moonbox: no RENDER_API_KEY; using an embedded local backend at ",
    env.RENDER_LOCAL_DEV_URL, " (state in ", state, ")\n")
  return env.RENDER_LOCAL_DEV_URL, env.RENDER_API_KEY, env.RENDER_WORKSPACE_ID, p
end

--- conn.connect(opts) -> Conn. opts: backend ("local", "render" or a URL), api_key, workspace,
-- state_dir (embedded backend). Raises when the choice cannot work (e.g. "render" without a
-- key). [yields] when it starts or probes a local backend.
function M.connect(opts)
  opts = opts or {}
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
    local url, k, ws, p = embedded(opts)
    local c = new("local", url, k, workspace or ws)
    c.process = p
    return c
  end
  if not backend:match("^https?://") then
    error("moonbox: --backend must be local, render or an http(s) URL, got " .. tostring(backend), 0)
  end
  if not key or key == "" then
    -- A local backend started with its state in the default place: its key file says it.
    key = (read_file(state_home() .. "/local/api-key") or ""):match("%S+")
  end
  if not key then
    error("moonbox: no API key for " .. backend .. ": set RENDER_API_KEY", 0)
  end
  local kind = (backend:match("//127%.0%.0%.1") or backend:match("//localhost")) and "local" or "url"
  return new(kind, backend, key, workspace)
end

--- conn:close(): stops an embedded backend this connection started. [yields]
function Conn:close()
  if self.process then
    self.process:kill("TERM")
    self.process:wait()
    self.process = nil
  end
end

M.Conn = Conn
return M
