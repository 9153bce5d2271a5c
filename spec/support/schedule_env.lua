--- spec.support.schedule_env — a state dir + recipe for `moonbox schedule` specs (the daemon
-- spec and the operations layer's: --listen, --webhook, the status page): the daemon as a real
-- subprocess on the test clock, its log read line by line, its listener's URL taken from the
-- log, and the history read back with `moonbox runs --json`.
local proc = require "moonbox.proc"
local task = require "moonbox.task"
local json = require "moonbox.json"
local http = require "moonbox.http"
local L = require "spec.support.local_backend"

local M = {}
local Env = {}
Env.__index = Env

M.START = "2026-03-01T00:00:00Z"

--- schedule_env.with_backend(setup, teardown, ready, env): for a describe whose test schedules
-- against a real `moonbox local`, through its busted setup and teardown (pass them: a support
-- module does not see a spec's environment): setup starts one and hands it to ready(B);
-- teardown destroys the test's env (whatever env() returns then: an Env, or anything with a
-- destroy method), then the backend.
function M.with_backend(setup, teardown, ready, env)
  L.fixture(setup, teardown, function(b)
    ready(b)
    return function()
      local e = env()
      if e then e:destroy() end
    end
  end, { render = false })
end

--- schedule_env.new(recipe, o) -> Env: o.scale (test clock speed, default 600), o.env (extra
-- NAME=VALUE strings, e.g. a PostgreSQL store's), o.backend (a spec.support.local_backend whose
-- key, workspace and URL the commands get; default: an address nothing listens on),
-- o.stderr ("inherit": the daemon's stderr is the spec's; default: a file, see d:stderr()).
-- [yields]
function M.new(recipe, o)
  o = o or {}
  local dir = proc.run({ "mktemp", "-d", "/tmp/moonbox-schedule-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  local e = setmetatable({ dir = dir, recipe = dir .. "/recipe.lua", scale = o.scale or 600,
    extra_env = o.env or {}, backend = o.backend, stderr = o.stderr }, Env)
  e:write("recipe.lua", recipe)
  return e
end

function Env:write(name, text, mode)
  local f = assert(io.open(self.dir .. "/" .. name, "w"))
  f:write(text)
  f:close()
  if mode then proc.run { "chmod", mode, self.dir .. "/" .. name } end
  return self.dir .. "/" .. name
end

function Env:vars(start)
  local v = { "env", "HOME=" .. self.dir, "XDG_STATE_HOME=" .. self.dir .. "/state",
    "MOONBOX_TEST_CLOCK=start=" .. (start or M.START) .. ",scale=" .. self.scale }
  if self.backend then
    v[#v + 1] = "RENDER_API_KEY=" .. self.backend.key
    v[#v + 1] = "RENDER_WORKSPACE_ID=" .. self.backend.workspace
    v[#v + 1] = "RENDER_LOCAL_DEV_URL=" .. self.backend.url
  else
    v[#v + 1] = "RENDER_LOCAL_DEV_URL=http://127.0.0.1:9"
    v[#v + 1] = "RENDER_API_KEY=spec-api-key-0123456789"
  end
  for _, x in ipairs(self.extra_env) do v[#v + 1] = x end -- last: env(1) lets them override
  return v
end

--- env:moonbox(args[, start]) -> proc.run result of a one-shot command (on the test clock from
-- start, default START). [yields]
function Env:moonbox(args, start)
  local argv = self:vars(start)
  argv[#argv + 1] = L.BIN
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  return proc.run(argv)
end

--- env:daemon(extra, start) -> a running daemon: d:wait_for(pattern[, n]), d:stop(), d.url (the
-- listener's, when --listen was given), d.log (stdout lines), d:stderr(). [yields]
function Env:daemon(extra, start)
  local argv = self:vars(start)
  for _, a in ipairs { L.BIN, "schedule", self.recipe } do argv[#argv + 1] = a end
  for _, a in ipairs(extra or {}) do argv[#argv + 1] = a end
  argv.stderr = self.stderr or { file = self.dir .. "/daemon.stderr", append = true }
  local p = proc.spawn(argv)
  local d = { p = p, lines = p:lines("stdout"), log = {} }
  function d.wait_for(_, pattern, n)
    n = n or 1
    return task.timeout(60, function()
      local seen = 0
      for _, l in ipairs(d.log) do if l:match(pattern) then seen = seen + 1 end end
      if seen >= n then return end
      while true do
        local line = d.lines()
        if not line then
          error("the daemon exited before logging " .. pattern .. ":\n" .. table.concat(d.log, "\n") ..
            "\nstderr:\n" .. d.stderr())
        end
        d.log[#d.log + 1] = line
        if line:match(pattern) then
          seen = seen + 1
          if seen >= n then return line end
        end
      end
    end)
  end
  function d.stderr()
    local f = io.open(self.dir .. "/daemon.stderr")
    if not f then return "" end
    local s = f:read("a")
    f:close()
    return s
  end
  function d.stop(_, sig)
    p:kill(sig or "TERM")
    local code = p:wait()
    for line in d.lines do d.log[#d.log + 1] = line end
    return code
  end
  local listening = false
  for _, a in ipairs(extra or {}) do if a == "--listen" then listening = true end end
  if listening then
    local line = d:wait_for("listening on http://")
    d.url = line:match("listening on (http://[%d%.:]+)")
  end
  return d
end

--- SE.history(moonbox, name) -> the history's rows (oldest first, without JSON nulls) from
-- `moonbox runs --json --limit 0 [NAME]`, run by moonbox(args) -> proc.run's result. [yields]
function M.history(moonbox, name)
  local args = { "runs", "--json", "--limit", "0" }
  if name then args[#args + 1] = name end
  local r = moonbox(args)
  assert(r.code == 0, r.stderr)
  local rows = json.decode(r.stdout)
  local out = {}
  for i = #rows, 1, -1 do
    local row = {}
    for k, v in pairs(rows[i]) do
      if v ~= json.null then row[k] = v end
    end
    out[#out + 1] = row
  end
  return out
end

--- env:runs(name) -> history rows (oldest first) from `moonbox runs --json`. [yields]
function Env:runs(name)
  return M.history(function(args) return self:moonbox(args) end, name)
end

--- env:destroy(): removes the state dir and recipe. [yields]
function Env:destroy() proc.run { "rm", "-rf", self.dir } end

--- env:get(d, path, opts) -> http.request result against the daemon's listener. [yields]
function Env.get(_, d, path, opts)
  opts = opts or {}
  opts.url = d.url .. path
  opts.timeout = opts.timeout or 30
  return http.request(opts)
end

function Env:destroy() proc.run { "rm", "-rf", self.dir } end

return M
