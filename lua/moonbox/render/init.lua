--- moonbox.render — the Render sandbox API as blocking-style calls that park the calling task.
--
--   local render = require "moonbox.render"
--   local sb <close> = render.sandboxes.create { network = "deny-all" }   -- waits until running
--   print(sb:exec("echo hi"):check().stdout)                               -- terminated on scope exit
--
-- This first part covers the connection (backend selection, DESIGN.md §7), sandboxes (create,
-- get, list, terminate, suspend, wait_running) and exec over the streaming run. Every function
-- documents its arguments, results, what it raises, and whether it yields.
local api = require "moonbox.render.api"
local conn_mod = require "moonbox.render.conn"
local json = require "moonbox.json"
local http = require "moonbox.http"
local task = require "moonbox.task"
local core = require "moonbox.core"
local trace = require "moonbox.trace"

local M = {}
local default_conn

-- ---- observers ---------------------------------------------------------------------------------

local observers = {}

--- render.observe(fn) -> unsubscribe(): fn(event, subject, info) is called synchronously (it
-- must not yield) for each sandbox life event of this process: "creating" (subject nil,
-- info.name), "created" (the Sandbox), "running" (the Sandbox), "create_failed" (subject nil,
-- info.error), "terminated" (the sandbox id), "kept" (the Sandbox). The trace, the progress line
-- and the REPL use it. An observer that raises is dropped with a message on stderr.
function M.observe(fn)
  local key = {}
  observers[key] = fn
  return function() observers[key] = nil end
end

local function emit(event, subject, info)
  if next(observers) == nil then return end
  for key, fn in pairs(observers) do
    local ok, err = pcall(fn, event, subject, info or {})
    if not ok then
      observers[key] = nil
      io.stderr:write("moonbox.render: an observer failed and was removed: " .. tostring(err) .. "\n")
    end
  end
end
M._emit = emit

-- A sandbox was terminated: release it in the ledger and tell the observers.
local function terminated(id)
  if M.ledger then M.ledger:release(id) end
  emit("terminated", id)
end

--- render.connect(opts) -> Conn: chooses the backend (see moonbox.render.conn) and makes it
-- the default for the module's functions. Called implicitly by the first API call. [yields]
function M.connect(opts)
  default_conn = conn_mod.connect(opts)
  return default_conn
end

--- render.close(): stops the embedded local backend this process started, if any (moonbox run
-- calls it when the recipe ends, also after a failure or SIGINT). [yields]
local last_conn
function M.close()
  local c = default_conn
  last_conn = c or last_conn
  default_conn = nil
  if c then c:close() end
end

--- The Conn in use (or the last one, after render.close), without connecting.
function M._current_conn() return default_conn or last_conn end

--- render.connection() -> the current Conn (connecting with the defaults first). [yields]
function M.connection()
  if not default_conn then M.connect() end
  return default_conn
end

local function owner(c)
  if c.workspace then return c.workspace end
  error("moonbox.render: no workspace id: set RENDER_WORKSPACE_ID (the ownerId of your Render workspace)", 0)
end

-- ---- field names ------------------------------------------------------------------------------

--- snake_case → camelCase ("sandbox_group_id" → "sandboxGroupId").
local function camel(s)
  return (s:gsub("_(%l)", function(c) return c:upper() end))
end
M.camel = camel

-- ---- sandboxes --------------------------------------------------------------------------------

local Sandbox = {}
local sandbox_methods = {}
Sandbox.__index = function(sb, k)
  local m = sandbox_methods[k]
  if m then return m end
  local data = rawget(sb, "_data")
  local v = data[k]
  if v == nil and type(k) == "string" then v = data[camel(k)] end
  if v == json.null then return nil end
  return v
end
Sandbox.__tostring = function(sb)
  return string.format("Sandbox %s (%s, %s)", sb.id, sb.status or "?", sb.plan or "?")
end
Sandbox.__close = function(sb)
  if not rawget(sb, "_kept") and rawget(sb, "_data").status ~= "terminated" then
    sb:terminate()
  end
end
Sandbox.__name = "moonbox.render.Sandbox"

local function wrap(c, data)
  return setmetatable({ _data = data, _conn = c }, Sandbox)
end

local NETWORK = { ["allow-all"] = true, ["deny-all"] = true }

--- Builds the create body from recipe options: snake_case names and short forms (DESIGN §4).
-- Unset options are not sent (the SDKs' rule).
local function create_body(c, opts)
  local body = { ownerId = owner(c) }
  local function set(wire, v) if v ~= nil then body[wire] = v end end
  set("plan", opts.plan)
  set("region", opts.region)
  set("name", opts.name)
  set("timeoutSeconds", opts.timeout_seconds or opts.timeout)
  set("idleTimeoutSeconds", opts.idle_timeout_seconds)
  set("sandboxGroupId", opts.sandbox_group_id)
  set("env", opts.env)
  if type(opts.env) == "table" then
    for _, v in pairs(opts.env) do trace.secret(tostring(v)) end
  end
  local np = opts.network_policy
  if opts.network ~= nil then
    if not NETWORK[opts.network] then
      error("render.sandboxes.create: network must be \"allow-all\" or \"deny-all\" (got " ..
        tostring(opts.network) .. "); use allow = {domains} for an allow-list", 3)
    end
    np = { default = opts.network }
  end
  if opts.allow ~= nil then
    np = { default = "allow-list", allowedDomains = json.array(opts.allow) }
  end
  set("networkPolicy", np)
  local snap = opts.snapshot
  if snap ~= nil then
    if type(snap) == "table" then
      body.snapshotId = snap.id
      body.sandboxGroupId = body.sandboxGroupId or snap.sandbox_group_id or snap.sandboxGroupId
      body.plan = body.plan or snap.plan
    elseif type(snap) == "string" and snap:match("^snp%-[0-9a-v]+$") and #snap == 24 then
      body.snapshotId = snap
    else
      body.snapshotName = snap
    end
  end
  set("snapshotId", opts.snapshot_id)
  set("snapshotName", opts.snapshot_name)
  return body
end

--- render.sandboxes.create(opts) -> Sandbox, once it is running (opts.wait = false returns at
-- once, status "creating"). opts: plan, region, name, timeout / timeout_seconds,
-- idle_timeout_seconds, network ("deny-all"|"allow-all") or network_policy, allow (domains),
-- env, snapshot (a Snapshot, an id or a name), snapshot_id, snapshot_name, sandbox_group_id,
-- wait_timeout (seconds, default 120). The Sandbox is a `<close>` guard: leaving its scope
-- terminates it unless sb:keep() was called. Never re-sends the create: a lost answer raises
-- code "unknown_outcome". Raises structured errors (op "sandboxes.create"). [yields]
function M.sandboxes_create(opts)
  opts = opts or {}
  local c = M.connection()
  local body = create_body(c, opts)
  -- The ledger writes the intent before the request goes out, in the run of this task (a
  -- scheduled run) or of this process (moonbox run); the label in the sandbox's name lets
  -- `moonbox reap` attribute it even if the answer is lost.
  local ledger, run_id = require("moonbox.ledger").for_create(M, c)
  local intent
  if ledger then
    local label
    intent, label = ledger:intent(run_id)
    if body.name == nil then body.name = label end
  end
  emit("creating", nil, { name = body.name, snapshot_id = body.snapshotId })
  local ok, data = pcall(api.call, c, "sandboxes.create", "POST", "/sandboxes",
    { body = body, idempotent = false, snapshot_id = body.snapshotId })
  if not ok then
    if ledger and not (type(data) == "table" and data.code == "unknown_outcome") then
      ledger:fail(intent, type(data) == "table" and data.code or "error")
    end
    emit("create_failed", nil, { name = body.name, error = data })
    error(data, 0)
  end
  if ledger then ledger:bind(intent, data.id) end
  local sb = wrap(c, data)
  emit("created", sb)
  if opts.wait ~= false then sb:wait_running { timeout = opts.wait_timeout } end
  return sb
end

--- render.sandboxes.get(id) -> Sandbox (not a guard: it is not terminated on scope exit
-- unless you adopt it with sb:adopt()). Raises code "not_found" for an unknown id. [yields]
function M.sandboxes_get(id)
  local c = M.connection()
  local data = api.call(c, "sandboxes.get", "GET", "/sandboxes/" .. id, { sandbox_id = id })
  local sb = wrap(c, data)
  rawset(sb, "_kept", true)
  return sb
end

--- render.sandboxes.list(opts) -> iterator over every Sandbox (all pages). opts.status: a
-- status or a list of them (default: Render's, which hides terminated). [yields]
function M.sandboxes_list(opts)
  opts = opts or {}
  local c = M.connection()
  local status = opts.status
  if type(status) == "string" then status = { status } end
  local cursor, page, i, done = nil, {}, 0, false
  return function()
    i = i + 1
    if i > #page then
      if done then return nil end
      page = api.call(c, "sandboxes.list", "GET", "/sandboxes",
        { query = { ownerId = c.workspace, status = status, cursor = cursor, limit = 100 } })
      i = 1
      if #page < 100 then done = true end
      if #page == 0 then return nil end
      cursor = page[#page].cursor
    end
    local sb = wrap(c, page[i].sandbox)
    rawset(sb, "_kept", true)
    return sb
  end
end

--- render.sandboxes.terminate(id): terminates by id (idempotent). [yields]
function M.sandboxes_terminate(id)
  local c = M.connection()
  api.call(c, "sandboxes.terminate", "POST", "/sandboxes/" .. id .. "/terminate",
    { idempotent = true, sandbox_id = id })
  terminated(id)
end

M.sandboxes = {
  create = M.sandboxes_create, get = M.sandboxes_get, list = M.sandboxes_list,
  terminate = M.sandboxes_terminate,
}

--- sb:refresh() -> sb with its fields re-read from the API. [yields]
function sandbox_methods.refresh(sb)
  local c = rawget(sb, "_conn")
  rawset(sb, "_data", api.call(c, "sandboxes.get", "GET", "/sandboxes/" .. sb.id, { sandbox_id = sb.id }))
  return sb
end

--- sb:terminate(): terminates it (idempotent); afterwards sb.status is "terminated". [yields]
function sandbox_methods.terminate(sb)
  local c = rawget(sb, "_conn")
  api.call(c, "sandboxes.terminate", "POST", "/sandboxes/" .. sb.id .. "/terminate",
    { idempotent = true, sandbox_id = sb.id })
  rawget(sb, "_data").status = "terminated"
  terminated(sb.id)
end

--- sb:suspend(): asks for an idle suspend now (it resumes on the next exec or file transfer).
-- [yields]
function sandbox_methods.suspend(sb)
  local c = rawget(sb, "_conn")
  local data = api.call(c, "sandboxes.suspend", "POST", "/sandboxes/" .. sb.id .. "/suspend",
    { idempotent = true, sandbox_id = sb.id })
  if type(data) == "table" then rawset(sb, "_data", data) end
end

--- sb:keep() -> sb: leaving its scope will no longer terminate it.
function sandbox_methods.keep(sb)
  rawset(sb, "_kept", true)
  emit("kept", sb)
  return sb
end

--- sb:adopt() -> sb: make a sandbox obtained by get/list a guard again.
function sandbox_methods.adopt(sb)
  rawset(sb, "_kept", false)
  return sb
end

--- sb:wait_running{timeout = 120, interval = 0.01} -> sb once it is running. Polls the
-- sandbox, the interval doubling from `interval` up to 1 s (a local create runs in ~20 ms, a
-- cloud one in seconds: 10 ms first keeps the first without flooding the second). Raises code
-- "sandbox_not_running" if it becomes errored or terminated, and "timeout" after the deadline
-- (the sandbox is then left as it is). Does not wake a suspended sandbox. [yields]
function sandbox_methods.wait_running(sb, opts)
  opts = opts or {}
  local deadline = core.now() + (opts.timeout or 120)
  local interval = opts.interval or 0.01
  while true do
    local s = rawget(sb, "_data").status
    if s == "running" then
      if not rawget(sb, "_seen_running") then
        rawset(sb, "_seen_running", true)
        emit("running", sb)
      end
      return sb
    end
    if s == "errored" or s == "terminated" then
      error(api.error { op = "sandboxes.wait_running", code = "sandbox_not_running", sandbox_id = sb.id,
        message = "sandbox " .. sb.id .. " became " .. s .. " instead of running" }, 2)
    end
    if core.now() >= deadline then
      error(api.error { op = "sandboxes.wait_running", code = "timeout", sandbox_id = sb.id,
        message = string.format("sandbox %s still %s after %g s", sb.id, s, opts.timeout or 120) }, 2)
    end
    task.sleep(interval)
    interval = math.min(interval * 2, 1)
    sb:refresh()
  end
end

-- ---- exec ----------------------------------------------------------------------------------

--- Quotes one argument for bash so it arrives literally.
local function shell_quote(s)
  s = tostring(s)
  if s:match("^[%w%-_%./=:,+@%%]+$") then return s end
  return "'" .. s:gsub("'", "'\\''") .. "'"
end
M.shell_quote = shell_quote

local Result = {}
Result.__index = Result

--- result:check() -> result, or raises code "exit_status" naming the command and its stderr
-- tail when the exit code is not 0.
function Result:check()
  if self.code == 0 then return self end
  local tail = self.stderr:sub(-400)
  error(api.error { op = "sandbox:exec", code = "exit_status", sandbox_id = self.sandbox_id,
    exec_id = self.exec_id, exit_code = self.code,
    message = string.format("command exited with %s: %s%s", tostring(self.code), self.command_summary,
      tail ~= "" and ("; stderr: " .. tail) or "") }, 2)
end

local EXEC_OPTS = { timeout = true, on_output = true, max_output = true, cwd = true }

--- sb:exec(cmd, opts) -> {code, stdout, stderr, truncated, exec_id} with :check(). cmd is a
-- bash command string or an argv table (each element quoted so it arrives literally). opts:
-- cwd (a directory; default the home directory), timeout (seconds for the whole call),
-- on_output(stream, chunk) (called as output arrives), max_output (bytes kept per stream,
-- default 8 MiB; beyond it the rest of that stream is dropped and truncated is true). A stream
-- that ends without its exit event raises code "unknown_outcome". [yields]
function sandbox_methods.exec(sb, cmd, opts)
  opts = opts or {}
  for k in pairs(opts) do
    if not EXEC_OPTS[k] then
      error("sb:exec: unknown option '" .. tostring(k) .. "'" .. (k == "env" and
        " (per-call env is not available yet: it must travel as a file, never in command text)" or ""), 2)
    end
  end
  local command
  if type(cmd) == "table" then
    local parts = {}
    for i, a in ipairs(cmd) do parts[i] = shell_quote(a) end
    command = table.concat(parts, " ")
  elseif type(cmd) == "string" then
    command = cmd
  else
    error("sb:exec: cmd must be a string or an argv table, got " .. type(cmd), 2)
  end
  if opts.cwd then command = "cd -- " .. shell_quote(opts.cwd) .. " && " .. command end
  local max = opts.max_output or 8 * 1024 * 1024
  local c = rawget(sb, "_conn")
  local function run()
    local tok = api.call(c, "sandbox:exec", "POST", "/sandboxes/" .. sb.id .. "/runs/stream/token",
      { body = { command = command }, idempotent = true, sandbox_id = sb.id })
    local span_info = { exec_id = tok.executionId }
    local _span <close> = trace.on and api.span("sandbox:exec.stream", "POST",
      "/sandboxes/" .. sb.id .. "/runs/stream", { sandbox_id = sb.id }, span_info) or nil
    local resp <close> = http.stream { method = "POST", url = tok.uri,
      body = json.encode({ command = command }),
      headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream",
        ["Content-Type"] = "application/json" }, idle_timeout = 60 }
    span_info.status = resp.status
    if resp.status ~= 200 then
      local text = resp:read() or ""
      error(api.error { op = "sandbox:exec", code = "exec_refused", status = resp.status, sandbox_id = sb.id,
        exec_id = tok.executionId, message = "the run was refused: " .. text:sub(1, 300) }, 0)
    end
    local out = { stdout = {}, stderr = {} }
    local kept = { stdout = 0, stderr = 0 }
    local res = setmetatable({ exec_id = tok.executionId, sandbox_id = sb.id, truncated = false,
      command_summary = #command > 80 and (command:sub(1, 77) .. "...") or command }, Result)
    while true do
      local ev = resp:read_event()
      if not ev then break end
      local d = json.decode(ev.data)
      if ev.event == "output" and type(d) == "table" then
        local stream, data = d.stream, d.data or ""
        if opts.on_output then opts.on_output(stream, data) end
        local room = max - (kept[stream] or 0)
        if room > 0 and out[stream] then
          if #data > room then
            -- cut at a character boundary: never half a UTF-8 sequence
            local cut = room
            while cut > 0 and (data:byte(cut + 1) or 0) & 0xC0 == 0x80 do cut = cut - 1 end
            data = data:sub(1, cut)
            res.truncated = true
          end
          out[stream][#out[stream] + 1] = data
          kept[stream] = kept[stream] + #data
        elseif #data > 0 then
          res.truncated = true
        end
      elseif ev.event == "exit" and type(d) == "table" then
        res.code = math.tointeger(d.exit_code) or d.exit_code
      elseif ev.event == "error" and type(d) == "table" then
        error(api.error { op = "sandbox:exec", code = "exec_error", status = d.status, sandbox_id = sb.id,
          exec_id = tok.executionId, message = tostring(d.message) }, 0)
      end
    end
    if res.code == nil then
      error(api.error { op = "sandbox:exec", code = "unknown_outcome", sandbox_id = sb.id,
        exec_id = tok.executionId,
        message = "the output stream ended without an exit event: the command's outcome is unknown " ..
          "(it may still be running)" }, 0)
    end
    res.stdout, res.stderr = table.concat(out.stdout), table.concat(out.stderr)
    return res
  end
  if opts.timeout then return task.timeout(opts.timeout, run) end
  return run()
end

M.Sandbox = Sandbox
-- For the parts of the client that live in their own files (they extend M and the methods).
M._methods = sandbox_methods
M._wrap = wrap
M._api = api
M._owner = owner
M.Result = Result
package.loaded["moonbox.render"] = M
-- The parts in their own files (each extends M and the Sandbox methods when loaded).
require "moonbox.render.exec"
require "moonbox.render.snapshots"
require "moonbox.render.files"
require "moonbox.render.fleet"
return M
