--- moonbox.render.exec — sb:exec and sb:spawn with the semantics of DESIGN.md §4 "Exec".
--
-- Render's exec has no stdin, cwd, per-call env or kill, stores the command text on the
-- sandbox's exec timeline, and keeps a process running when the client drops the stream. So
-- every command runs under a small bash wrapper (no secrets in it) that:
--   * refuses to start (exit 143) when a kill marker for it already exists — a kill that
--     arrived before the command started;
--   * records its process group id (it is the group leader), so kill() — and the
--     cancellation of the waiting task — can signal the whole group from a second exec;
--   * sources, then deletes, a per-call env file uploaded beforehand as a root-only file in
--     the in-memory /dev area (which filesystem snapshots leave out): env values never appear
--     in command text;
--   * after the command, stops whatever it left running in its group before the exit code is
--     reported.
-- Output is capped per stream at max_output bytes (the rest of that stream is dropped, never a
-- gap in the middle); a stream that ends without an exit event is an unknown outcome.
local render = require "moonbox.render"
local api = render._api
local json = require "moonbox.json"
local http = require "moonbox.http"
local task = require "moonbox.task"
local core = require "moonbox.core"
local ids = require "moonbox.local.ids"

local methods = render._methods
local shell_quote = render.shell_quote

local M = {}

local MARKERS = "/dev/.moonbox"
local FORBIDDEN_ENV = { UID = true, EUID = true, PPID = true, SHELLOPTS = true, BASHOPTS = true,
  BASH_VERSINFO = true }
local SIGNALS = { HUP = 1, INT = 2, QUIT = 3, KILL = 9, USR1 = 10, USR2 = 12, TERM = 15, CONT = 18,
  STOP = 19 }

--- The env file's text: one `export NAME='value'` per variable. Raises for names bash cannot
-- export or that are not identifiers.
local function env_file(env)
  local lines = {}
  local names = {}
  for k in pairs(env) do names[#names + 1] = k end
  table.sort(names)
  for _, k in ipairs(names) do
    local v = env[k]
    if type(k) ~= "string" or not k:match("^[A-Za-z_][A-Za-z0-9_]*$") then
      error("sb:exec: env name " .. tostring(k) .. " is not a valid variable name", 4)
    end
    if FORBIDDEN_ENV[k] then
      error("sb:exec: env name " .. k .. " cannot be set: bash makes it read-only", 4)
    end
    if type(v) ~= "string" and type(v) ~= "number" then
      error("sb:exec: env value of " .. k .. " must be a string", 4)
    end
    require("moonbox.trace").secret(tostring(v))
    lines[#lines + 1] = "export " .. k .. "='" .. tostring(v):gsub("'", "'\\''") .. "'"
  end
  return table.concat(lines, "\n") .. "\n"
end

--- The wrapper around a command (see the file's header). id names its marker files.
local function wrapper(id, command, cwd, has_env)
  local m = MARKERS .. "/" .. id
  local parts = {
    -- `[` is a builtin: after the first exec of a sandbox the directory exists, and this costs
    -- no process (a sandbox's mkdir is a fork and exec on every call).
    "[ -d " .. MARKERS .. " ] || mkdir -p " .. MARKERS .. " 2>/dev/null",
    "if [ -e " .. m .. ".kill ]; then rm -f " .. m .. ".kill " .. m .. ".env; exit 143; fi",
    "echo $$ > " .. m .. ".pgid",
  }
  if has_env then
    parts[#parts + 1] = "set -a; . " .. m .. ".env; set +a; rm -f " .. m .. ".env"
  end
  local run = "bash -c " .. shell_quote(command)
  if cwd then run = "cd -- " .. shell_quote(cwd) .. " && " .. run end
  parts[#parts + 1] = run .. " </dev/null; rc=$?"
  -- stop what the command left behind in our group, but not ourselves
  parts[#parts + 1] = "trap '' TERM; kill -TERM -- -$$ 2>/dev/null; rm -f " .. m .. ".pgid; exit $rc"
  return table.concat(parts, "\n")
end

local function command_of(cmd)
  if type(cmd) == "table" then
    local parts = {}
    for i, a in ipairs(cmd) do parts[i] = shell_quote(a) end
    return table.concat(parts, " ")
  elseif type(cmd) == "string" then
    return cmd
  end
  error("sb:exec: cmd must be a string or an argv table, got " .. type(cmd), 3)
end

local function signal_number(sig)
  if sig == nil then return 15 end
  if type(sig) == "number" then return sig end
  local n = SIGNALS[tostring(sig):upper():gsub("^SIG", "")]
  if not n then error("kill: unknown signal " .. tostring(sig), 3) end
  return n
end

local Process = {}
Process.__index = Process
Process.__tostring = function(p) return "Process " .. p.id .. " in " .. p.sb.id end

--- Sends sig to the command's process group from a second exec; if the command has not
-- started yet, leaves a kill marker so it exits 143 without running. [yields]
local function send_kill(sb, id, sig, no_marker)
  local m = MARKERS .. "/" .. id
  local after = sig == 9 and ("; rm -f " .. m .. ".pgid") or ""
  local otherwise = no_marker and "echo gone" or ("touch " .. m .. ".kill; echo marked")
  local script = "mkdir -p " .. MARKERS .. "; if [ -s " .. m .. ".pgid ]; then kill -" .. sig ..
    " -- -$(cat " .. m .. ".pgid) 2>/dev/null" .. after .. "; echo signalled; else " .. otherwise .. "; fi"
  local c = rawget(sb, "_conn")
  local tok = api.call(c, "sandbox:kill", "POST", "/sandboxes/" .. sb.id .. "/runs/sync/token",
    { body = { command = script }, idempotent = true, sandbox_id = sb.id })
  local r = api.traced("sandbox:kill.run", "POST", "/sandboxes/" .. sb.id .. "/runs/sync",
    { sandbox_id = sb.id }, http.request,
    { method = "POST", url = tok.uri, body = json.encode({ command = script }),
    timeout = 30,
    headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/json" } })
  local d = json.decode(r.body)
  return type(d) == "table" and tostring(d.stdout or ""):match("%a+") or nil
end

--- p:kill(sig) -> "signalled" | "marked": signals the whole process group (TERM by default;
-- names like "KILL" or numbers). TERM escalates to KILL after opts.grace seconds (default 5)
-- if the command is still running. [yields]
function Process:kill(sig, opts)
  local n = signal_number(sig)
  local how = send_kill(self.sb, self.id, n)
  if n == 15 and how == "signalled" then
    -- The command may ignore TERM, and its children may outlive it even when the wrapper
    -- itself died of the TERM: after the grace period the whole group gets KILL regardless.
    local grace = (opts and opts.grace) or 5
    task.spawn(function()
      task.sleep(grace)
      pcall(send_kill, self.sb, self.id, 9, true)
    end)
  end
  return how
end

--- Reads the run's SSE stream into p.stdout/p.stderr parts and the line queue until exit.
local function pump(p, resp, opts)
  local max = opts.max_output or 8 * 1024 * 1024
  local kept = { stdout = 0, stderr = 0 }
  while true do
    local ev = resp:read_event()
    if not ev then break end
    local d = json.decode(ev.data)
    if ev.event == "output" and type(d) == "table" and p.out[d.stream] then
      local stream, data = d.stream, d.data or ""
      if opts.on_output then opts.on_output(stream, data) end
      if p.line_stream == stream then
        p.lines_buf[#p.lines_buf + 1] = data
        p.cond:broadcast()
      end
      local room = max - kept[stream]
      if room > 0 then
        if #data > room then
          local cut = room
          while cut > 0 and ((data:byte(cut + 1) or 0) & 0xC0) == 0x80 do cut = cut - 1 end
          data = data:sub(1, cut)
          p.truncated = true
        end
        local t = p.out[stream]
        t[#t + 1] = data
        kept[stream] = kept[stream] + #data
      elseif #data > 0 then
        p.truncated = true
      end
    elseif ev.event == "exit" and type(d) == "table" then
      p.code = math.tointeger(d.exit_code) or d.exit_code
    elseif ev.event == "error" and type(d) == "table" then
      p.failure = api.error { op = "sandbox:exec", code = "exec_error", status = d.status,
        sandbox_id = p.sb.id, exec_id = p.exec_id, message = tostring(d.message) }
      break
    end
  end
  if p.code == nil and not p.failure then
    p.failure = api.error { op = "sandbox:exec", code = "unknown_outcome", sandbox_id = p.sb.id,
      exec_id = p.exec_id, message = "the output stream ended without an exit event: the command's " ..
        "outcome is unknown (it may still be running)" }
  end
end

local EXEC_OPTS = { timeout = true, on_output = true, max_output = true, cwd = true, env = true,
  grace = true, lines = true }

--- Starts a command and returns its Process (the stream is read by a task of its own). [yields]
local function start(sb, cmd, opts)
  for k in pairs(opts) do
    if not EXEC_OPTS[k] then error("sb:exec: unknown option '" .. tostring(k) .. "'", 3) end
  end
  local command = command_of(cmd)
  local id = ids.new("exe"):sub(5) -- a private marker name, not an API id
  local has_env = opts.env ~= nil and next(opts.env) ~= nil
  -- sb:upload (moonbox.render.files): uploads land root-owned 0600, in the in-memory /dev area
  if has_env then sb:upload(MARKERS .. "/" .. id .. ".env", env_file(opts.env)) end
  local script = wrapper(id, command, opts.cwd, has_env)
  local c = rawget(sb, "_conn")
  local tok = api.call(c, "sandbox:exec", "POST", "/sandboxes/" .. sb.id .. "/runs/stream/token",
    { body = { command = script }, idempotent = true, sandbox_id = sb.id })
  local p = setmetatable({ sb = sb, id = id, exec_id = tok.executionId, out = { stdout = {}, stderr = {} },
    truncated = false, cond = core.cond(), lines_buf = {}, line_stream = opts.lines,
    summary = #command > 80 and (command:sub(1, 77) .. "...") or command }, Process)
  local resp = http.stream { method = "POST", url = tok.uri, body = json.encode({ command = script }),
    headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream",
      ["Content-Type"] = "application/json" }, idle_timeout = 60 }
  if resp.status ~= 200 then
    local text = resp:read() or ""
    resp:close()
    error(api.error { op = "sandbox:exec", code = "exec_refused", status = resp.status, sandbox_id = sb.id,
      exec_id = tok.executionId, message = "the run was refused: " .. text:sub(1, 300) }, 0)
  end
  p.reader = task.spawn(function()
    local ok, err = pcall(api.traced, "sandbox:exec.stream", "POST", "/sandboxes/" .. sb.id .. "/runs/stream",
      { sandbox_id = sb.id }, pump, p, resp, opts)
    resp:close()
    if not ok and not p.failure then p.failure = err end
    p.done = true
    p.cond:broadcast()
  end)
  return p
end

--- p:wait() -> the result {code, stdout, stderr, truncated, exec_id} with :check(). If the
-- waiting task is cancelled (or its deadline passes), the command's process group is killed
-- before the cancellation goes on. [yields]
function Process:wait()
  local ok, err = pcall(function()
    while not self.done do self.cond:wait() end
  end)
  if not ok then
    -- We stop waiting: the command must not outlive its caller.
    pcall(send_kill, self.sb, self.id, 15)
    local t0 = core.now()
    while not self.done and core.now() - t0 < 2 do pcall(task.sleep, 0.05) end
    if not self.done then pcall(send_kill, self.sb, self.id, 9, true) end
    task.cancel(self.reader)
    error(err, 0)
  end
  if self.failure then error(self.failure, 0) end
  local res = setmetatable({ code = self.code, stdout = table.concat(self.out.stdout),
    stderr = table.concat(self.out.stderr), truncated = self.truncated, exec_id = self.exec_id,
    sandbox_id = self.sb.id, command_summary = self.summary }, render.Result)
  return res
end

--- p:lines() -> iterator over the lines of stdout as they arrive (the last partial line
-- included); ends at the command's end. Only for processes started with sb:spawn. [yields]
function Process:lines()
  local carry = ""
  return function()
    while true do
      local nl = carry:find("\n", 1, true)
      if nl then
        local line = carry:sub(1, nl - 1)
        carry = carry:sub(nl + 1)
        return line
      end
      if #self.lines_buf > 0 then
        carry = carry .. table.concat(self.lines_buf)
        self.lines_buf = {}
      elseif self.done then
        if carry ~= "" then
          local line = carry
          carry = ""
          return line
        end
        return nil
      else
        self.cond:wait()
      end
    end
  end
end

--- sb:exec(cmd, opts) -> {code, stdout, stderr, truncated, exec_id} with :check(). cmd: a bash
-- string or an argv table (quoted so each element arrives literally). opts: env (never in
-- command text; names bash cannot export are refused), cwd, timeout (seconds; the process
-- group is killed when it expires, then code "timeout" is raised), on_output(stream, chunk),
-- max_output (bytes per stream, default 8 MiB). Cancelling the calling task kills the group.
-- Raises "unknown_outcome" for a stream without an exit event. [yields]
function methods.exec(sb, cmd, opts)
  opts = opts or {}
  local function run()
    local p = start(sb, cmd, opts)
    return p:wait()
  end
  if opts.timeout then return task.timeout(opts.timeout, run) end
  return run()
end

--- sb:spawn(cmd, opts) -> Process with p:lines(), p:wait(), p:kill(sig), p.exec_id. The same
-- options as sb:exec (lines() reads stdout). [yields] until the command has started.
function methods.spawn(sb, cmd, opts)
  opts = opts or {}
  opts.lines = "stdout"
  return start(sb, cmd, opts)
end

--- sb:run_sync(cmd) -> {code, stdout, stderr}: one command through the `sync` run operation
-- (buffered by the server; no streaming, no kill). [yields]
function methods.run_sync(sb, cmd)
  local command = command_of(cmd)
  local c = rawget(sb, "_conn")
  local tok = api.call(c, "sandbox:run_sync", "POST", "/sandboxes/" .. sb.id .. "/runs/sync/token",
    { body = { command = command }, idempotent = true, sandbox_id = sb.id })
  local r = api.traced("sandbox:run_sync.run", "POST", "/sandboxes/" .. sb.id .. "/runs/sync",
    { sandbox_id = sb.id }, http.request,
    { method = "POST", url = tok.uri, body = json.encode({ command = command }),
    headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/json" } })
  local d = json.decode(r.body)
  if r.status ~= 200 or type(d) ~= "table" then
    error(api.error { op = "sandbox:run_sync", code = "exec_refused", status = r.status, sandbox_id = sb.id,
      message = "the sync run failed: " .. tostring(r.body):sub(1, 300) }, 0)
  end
  return setmetatable({ code = math.tointeger(d.exit_code) or d.exit_code, stdout = d.stdout or "",
    stderr = d.stderr or "", exec_id = tok.executionId, sandbox_id = sb.id, truncated = false,
    command_summary = command:sub(1, 80) }, render.Result)
end

M.wrapper = wrapper
M.env_file = env_file
return M
