--- moonbox.render.exec — running commands in a sandbox: sb:exec, sb:spawn and sb:run_sync,
-- with the semantics of docs/reference/render.md, "Exec". A part of the Sandbox class
-- (lua/moonbox/render/sandbox.lua lists its methods); it sees a sandbox only through sb.id and
-- sb:connection().
--
-- Render's exec has no stdin, cwd, per-call env or kill, stores the command text on the
-- sandbox's exec timeline, and keeps a process running when the client drops the stream. So
-- every command runs under a small bash wrapper (no secrets in it) that:
--   * refuses to start (exit 143) when a kill marker for it already exists — a kill that
--     arrived before the command started;
--   * records its process group id (it is the group leader), so kill() — and the
--     cancellation of the waiting task, and an expired timeout — can signal the whole group
--     from a second exec;
--   * sources, then deletes, a per-call env file uploaded beforehand as a root-only file in
--     the in-memory /dev area (which filesystem snapshots leave out): env values never appear
--     in command text;
--   * after the command, stops whatever it left running in its group before the exit code is
--     reported.
-- Every request goes through moonbox.render.api (the stream and the kills are data-plane
-- requests with the same retries and typed errors as the rest). Output is capped per stream at
-- max_output bytes (the rest of that stream is dropped, never a gap in the middle); a stream
-- that ends without an exit event is an unknown outcome.
local api = require "moonbox.render.api"
local files = require "moonbox.render.files"
local json = require "moonbox.json"
local task = require "moonbox.task"
local core = require "moonbox.core"
local trace = require "moonbox.trace"
local ids = require "moonbox.ids"
local schema = require "moonbox.schema"
local utf8_cut = require("moonbox.strings").utf8_cut
local durable = require "moonbox.durable"

local M = {}

local MARKERS = "/dev/.moonbox"
local FORBIDDEN_ENV = { UID = true, EUID = true, PPID = true, SHELLOPTS = true, BASHOPTS = true,
  BASH_VERSINFO = true }
local SIGNALS = { HUP = 1, INT = 2, QUIT = 3, KILL = 9, USR1 = 10, USR2 = 12, TERM = 15, CONT = 18,
  STOP = 19 }
local DEFAULT_MAX_OUTPUT = 8 * 1024 * 1024
-- After a TERM sent because the caller stopped waiting, how long the command gets to end before
-- its group gets KILL.
local STOP_GRACE = 2

--- render.shell_quote(s) -> s quoted for bash so that it arrives as one literal word. A word
-- that is not valid UTF-8 is written in bash's $'...' form with \xNN escapes, so the command
-- text stays UTF-8: it travels as a JSON string, which cannot carry other bytes unchanged.
local function shell_quote(s)
  s = tostring(s)
  if s:match("^[%w%-_%./=:,+@%%]+$") then return s end
  if not utf8.len(s) then
    local escaped = s:gsub("[^%w%-_%./=:,+@ ]", function(c) return string.format("\\x%02X", c:byte()) end)
    return "$'" .. escaped .. "'"
  end
  return "'" .. s:gsub("'", "'\\''") .. "'"
end
M.shell_quote = shell_quote

-- ---- results ----------------------------------------------------------------------------------

local Result = { __name = "moonbox.render.Result" }
Result.__index = Result

--- result:check() -> result, or raises code "exit_status" naming the command, the exit code and
-- the stderr tail when the exit code is not 0.
function Result:check()
  if self.code == 0 then return self end
  local tail = self.stderr:sub(-400)
  error(api.error { op = "sandbox:exec", code = "exit_status", sandbox_id = self.sandbox_id,
    exec_id = self.exec_id, exit_code = self.code,
    message = string.format("command exited with %s: %s%s", tostring(self.code), self.command_summary,
      tail ~= "" and ("; stderr: " .. tail) or "") }, 2)
end
M.Result = Result

-- ---- the wrapper --------------------------------------------------------------------------------

--- exec.env_file(env, level) -> the env file's text: one `export NAME='value'` per variable,
-- sorted by name. Raises at `level` (the recipe's call) for names bash cannot export or that
-- are not identifiers, and for values that are not strings or numbers.
local function env_file(env, level)
  level = (level or 1) + 1
  local names = {}
  for k, v in pairs(env) do
    if type(k) ~= "string" or not k:match("^[A-Za-z_][A-Za-z0-9_]*$") then
      error("sb:exec: env name " .. tostring(k) .. " is not a valid variable name", level)
    end
    if FORBIDDEN_ENV[k] then
      error("sb:exec: env name " .. k .. " cannot be set: bash makes it read-only", level)
    end
    if type(v) ~= "string" and type(v) ~= "number" then
      error("sb:exec: env value of " .. k .. " must be a string", level)
    end
    names[#names + 1] = k
  end
  table.sort(names)
  local lines = {}
  for _, k in ipairs(names) do
    local v = tostring(env[k])
    trace.secret(v)
    lines[#lines + 1] = "export " .. k .. "='" .. v:gsub("'", "'\\''") .. "'"
  end
  return table.concat(lines, "\n") .. "\n"
end
M.env_file = env_file

--- exec.wrapper(id, command, cwd, has_env) -> the bash script that runs command (see the file's
-- header); id names its marker files under /dev/.moonbox.
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
M.wrapper = wrapper

--- exec.intent(cmd, opts, kind) -> the structured command the client built, carried beside the
-- wire body as the request's opts.intent (the real transport, moonbox.http, sends only the
-- body; a dry run's engine reads this instead of the wrapper's text, moonbox.local.engine.sim):
-- {kind = "stream" | "sync", exec = {command = the recipe's text | nil, argv = its argv table
-- (a copy) | nil, cwd, timeout, env_names (sorted; never the values), env_file (the path of the
-- env file the wrapper sources and removes), id (the marker name kills address)}}. Does not
-- yield.
local function intent_of(cmd, opts, kind, id)
  local ex = { cwd = opts and opts.cwd, timeout = opts and opts.timeout, id = id }
  if type(cmd) == "table" then
    ex.argv = {}
    for i, a in ipairs(cmd) do ex.argv[i] = tostring(a) end
  else
    ex.command = cmd
  end
  if opts and type(opts.env) == "table" and next(opts.env) ~= nil then
    ex.env_names = {}
    for k in pairs(opts.env) do ex.env_names[#ex.env_names + 1] = tostring(k) end
    table.sort(ex.env_names)
    if id then ex.env_file = MARKERS .. "/" .. id .. ".env" end
  end
  return { kind = kind, exec = ex }
end
M.intent = intent_of

local function command_of(cmd)
  if type(cmd) == "table" then
    local parts = {}
    for i, a in ipairs(cmd) do parts[i] = shell_quote(a) end
    return table.concat(parts, " ")
  elseif type(cmd) == "string" then
    return cmd
  end
  error("sb:exec: cmd must be a string or an argv table, got " .. type(cmd), 3) -- the recipe's call
end

-- The command for messages: at most 80 characters.
local function summary(command)
  return #command > 80 and (command:sub(1, 77) .. "...") or command
end

--- exec.first_words(command) -> the command's first words for an error message (at most four,
-- at most 60 characters, registered secrets redacted).
local function first_words(command)
  local words = {}
  for w in command:gmatch("%S+") do
    if #words == 4 then
      words[#words + 1] = "..."
      break
    end
    words[#words + 1] = w
  end
  local s = table.concat(words, " ")
  if #s > 60 then s = s:sub(1, 57) .. "..." end
  return trace.redact(s)
end
M.first_words = first_words

local function signal_number(sig)
  if sig == nil then return 15 end
  if type(sig) == "number" then return sig end
  local n = SIGNALS[tostring(sig):upper():gsub("^SIG", "")]
  if not n then error("kill: unknown signal " .. tostring(sig), 3) end
  return n
end

-- ---- kills --------------------------------------------------------------------------------------

--- Sends sig to the command's process group from a second exec (a sync run); if the command
-- has not started yet, leaves a kill marker so it exits 143 without running (no_marker: not
-- even that). Returns "signalled", "marked" or "gone". [yields]
local function send_kill(sb, id, sig, no_marker)
  local m = MARKERS .. "/" .. id
  local after = sig == 9 and ("; rm -f " .. m .. ".pgid") or ""
  local otherwise = no_marker and "echo gone" or ("touch " .. m .. ".kill; echo marked")
  local script = "mkdir -p " .. MARKERS .. "; if [ -s " .. m .. ".pgid ]; then kill -" .. sig ..
    " -- -$(cat " .. m .. ".pgid) 2>/dev/null" .. after .. "; echo signalled; else " .. otherwise .. "; fi"
  local r = api.data(sb:connection(), "sandbox:kill",
    { path = "/sandboxes/" .. sb.id .. "/runs/sync/token", body = { command = script } },
    { method = "POST", body = json.encode({ command = script }), timeout = 30,
      headers = { ["Content-Type"] = "application/json" },
      intent = { kind = "sync", kill = { id = id, signal = sig, mark = not no_marker } } },
    { name = "sandbox:kill.run", span_path = "/sandboxes/" .. sb.id .. "/runs/sync", sandbox_id = sb.id,
      repeatable = true })
  local d = json.decode(r.body)
  return type(d) == "table" and tostring(d.stdout or ""):match("%a+") or nil
end

-- ---- processes ------------------------------------------------------------------------------------

local Process = { __name = "moonbox.render.Process" }
Process.__index = Process
Process.__tostring = function(p) return "Process " .. tostring(p.exec_id) .. " in " .. p.sb.id end
M.Process = Process

--- p:kill(sig [, {grace}]) -> "signalled" | "marked": signals the whole process group (TERM by
-- default; names like "KILL" or numbers); "marked" when the command had not started (it then
-- exits 143 without running). TERM escalates to KILL after opts.grace seconds (default 5) if
-- the command is still running. [yields]
function Process:kill(sig, opts)
  local n = signal_number(sig)
  local how = send_kill(self.sb, self.id, n)
  if n == 15 and how == "signalled" then
    -- The command may ignore TERM, and its children may outlive it even when the wrapper
    -- itself died of the TERM: after the grace period the whole group gets KILL regardless.
    local grace = schema.seconds(opts and opts.grace) or 5
    task.spawn(function()
      task.sleep(grace)
      pcall(send_kill, self.sb, self.id, 9, true)
    end)
  end
  return how
end

--- Reads the run's SSE stream into p's outputs and line queue until the exit event. Output
-- events come decoded from C (resp:read_output: the bytes, no JSON value per event; output of
-- one stream that arrived together as one chunk); every other event's data is JSON-decoded
-- here, and so is an output event of an unusual shape.
local function relay_output(p, resp, opts)
  local max = opts.max_output or DEFAULT_MAX_OUTPUT
  local kept = { stdout = 0, stderr = 0 }
  local on_output = opts.on_output
  while true do
    local event, stream, data = resp:read_output()
    if not event then break end
    local d
    if stream == nil then
      d = json.decode(data)
      if event == "output" and type(d) == "table" and p.out[d.stream] then
        stream, data = d.stream, d.data or ""
      end
    end
    if stream then
      if on_output then on_output(stream, data) end
      if p.line_stream == stream then
        p.lines_buf[#p.lines_buf + 1] = data
        p.cond:broadcast()
      end
      local room = max - kept[stream]
      if room > 0 then
        if #data > room then
          -- cut at a character boundary: never half a UTF-8 sequence
          data = data:sub(1, utf8_cut(data, room))
          p.truncated = true
        end
        local t = p.out[stream]
        t[#t + 1] = data
        kept[stream] = kept[stream] + #data
      elseif #data > 0 then
        p.truncated = true
      end
    elseif event == "exit" and type(d) == "table" then
      p.code = math.tointeger(d.exit_code) or d.exit_code
    elseif event == "error" and type(d) == "table" then
      p.failure = api.error { op = "sandbox:exec", code = "exec_error", status = d.status,
        sandbox_id = p.sb.id, exec_id = p.exec_id, message = tostring(d.message) }
      break
    end
  end
  if p.code == nil and not p.failure then
    p.failure = api.error { op = "sandbox:exec", code = "unknown_outcome", sandbox_id = p.sb.id,
      exec_id = p.exec_id, message = "the output stream of `" .. first_words(p.command) .. "` ended " ..
        "without an exit event: the command's outcome is unknown (it may still be running)" }
  end
end

-- The options of sb:exec (sb:spawn takes them but timeout); moonbox.schema checks them at the
-- recipe's call (M.SCHEMA below).
local EXEC_OPTS = {
  env = { type = "table",
    doc = "per-call variables, never in command text (a root-only file, sourced and deleted)" },
  cwd = { type = "string", doc = "the directory to run in (default the home directory)" },
  timeout = { type = "seconds", kind = "deadline",
    doc = "the longest the whole call takes; then the process group is killed and `timeout` raised" },
  on_output = { type = "function", doc = "on_output(stream, chunk), called as output arrives" },
  max_output = { type = "bytes", default = DEFAULT_MAX_OUTPUT,
    doc = "bytes kept per stream; the rest is dropped and `truncated` set" },
  idempotent = { type = "boolean", default = false,
    doc = "a durable run resuming may run it again when a crash left it running (else `unknown_outcome`)" },
}
local SPAWN_OPTS = {}
for k, v in pairs(EXEC_OPTS) do
  if k ~= "timeout" then SPAWN_OPTS[k] = v end
end

-- Returns the env file's text of checked options (nil without env).
local function check_opts(opts)
  if opts.env == nil or next(opts.env) == nil then return nil end
  return env_file(opts.env, 3)
end

--- Starts a command (cmd as the recipe gave it, command its text) and returns its Process; the
-- stream is read by a task of its own. [yields]
local function start(sb, cmd, command, env_text, opts, line_stream)
  -- a private marker name, not an API id (the journal's own on resume: it is in the body)
  local id = durable.fresh(function() return ids.new("exe"):sub(5) end)
  -- Uploads land root-owned 0600, in the in-memory /dev area.
  if env_text then files.write(sb, MARKERS .. "/" .. id .. ".env", env_text) end
  local script = wrapper(id, command, opts.cwd, env_text ~= nil)
  local started, resp, tok, span = pcall(api.data, sb:connection(), "sandbox:exec",
    { path = "/sandboxes/" .. sb.id .. "/runs/stream/token", body = { command = script } },
    { method = "POST", body = json.encode({ command = script }), stream = true, idle_timeout = 60,
      headers = { Accept = "text/event-stream", ["Content-Type"] = "application/json" },
      intent = intent_of(cmd, opts, "stream", id) },
    { name = "sandbox:exec.stream", span_path = "/sandboxes/" .. sb.id .. "/runs/stream",
      sandbox_id = sb.id, idempotent_run = opts.idempotent == true })
  if not started then
    -- Cancelled or out of time before the stream's headers came (an HTTP/2 edge may hold them
    -- until the command's first output): the command may be running with nobody to stop it.
    -- Kill its group, or leave the marker that keeps it from ever starting.
    if api.is_interruption(resp) then api.shielded(send_kill, sb, id, 9) end
    error(resp, 0)
  end
  local p = setmetatable({ sb = sb, id = id, exec_id = tok.executionId, out = { stdout = {}, stderr = {} },
    truncated = false, cond = core.cond(), lines_buf = {}, line_stream = line_stream, command = command,
    summary = summary(command) }, Process)
  p.reader = task.spawn(function()
    local ok, err = pcall(relay_output, p, resp, opts)
    resp:close()
    if not ok and not p.failure then p.failure = err end
    if span then span:close_with(p.failure) end
    p.done = true
    p.cond:broadcast()
  end)
  return p
end

-- Stops a command whose caller stopped waiting: TERM to its group, STOP_GRACE seconds for its
-- stream to end, then KILL. Runs shielded: a second cancellation cannot cut it short.
local function stop_group(p)
  pcall(send_kill, p.sb, p.id, 15)
  pcall(task.timeout, STOP_GRACE, function()
    while not p.done do p.cond:wait() end
  end)
  if not p.done then pcall(send_kill, p.sb, p.id, 9, true) end
end

--- p:wait() -> the result {code, stdout, stderr, truncated, exec_id} with :check(). If the
-- waiting task is cancelled (or its deadline passes), the command's process group is killed
-- before the cancellation goes on. Raises "unknown_outcome" for a stream without an exit
-- event, "exec_error" when the backend reports one. [yields]
function Process:wait()
  local ok, err = pcall(function()
    while not self.done do self.cond:wait() end
  end)
  if not ok then
    -- The command must not outlive its caller.
    api.shielded(stop_group, self)
    task.cancel(self.reader)
    error(err, 0)
  end
  if self.failure then error(self.failure, 0) end
  return setmetatable({ code = self.code, stdout = table.concat(self.out.stdout),
    stderr = table.concat(self.out.stderr), truncated = self.truncated, exec_id = self.exec_id,
    sandbox_id = self.sb.id, command_summary = self.summary }, Result)
end

--- p:lines() -> iterator over the lines of stdout as they arrive (the last partial line
-- included); ends at the command's end. [yields]
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

-- ---- the methods --------------------------------------------------------------------------------

--- sb:exec(cmd, opts) -> {code, stdout, stderr, truncated, exec_id} with :check(). cmd: a bash
-- string or an argv table (quoted so each element arrives literally). opts: env (never in
-- command text; names bash cannot export are refused), cwd, timeout (seconds for the whole
-- call), on_output(stream, chunk), max_output (bytes per stream, default 8 MiB). When the
-- timeout expires the command's process group is killed and an error with code "timeout" (so
-- task.is_timeout holds) is raised naming the sandbox, the exec id and the command's first
-- words. Cancelling the calling task kills the group too. Raises "unknown_outcome" for a
-- stream without an exit event, and the API's structured errors. [yields]
function M.exec(sb, cmd, opts)
  opts = opts or {}
  local env_text = check_opts(opts)
  local command = command_of(cmd)
  local limit = schema.seconds(opts.timeout)
  if not limit then return start(sb, cmd, command, env_text, opts):wait() end
  local p
  local ok, res = pcall(task.timeout, limit, function()
    p = start(sb, cmd, command, env_text, opts)
    return p:wait()
  end)
  if ok then return res end
  if type(res) == "table" and res.op == "task.timeout" and res.code == "timeout" then
    error(api.error { op = "sandbox:exec", code = "timeout", retryable = true, seconds = limit,
      sandbox_id = sb.id, exec_id = p and p.exec_id, command = first_words(command),
      message = string.format("`%s` did not finish within %g s; its process group was killed",
        first_words(command), limit) }, 0)
  end
  error(res, 0)
end

--- sb:spawn(cmd, opts) -> Process with p:lines(), p:wait(), p:kill(sig), p.exec_id. The same
-- options as sb:exec but timeout (lines() reads stdout). [yields] until the command has
-- started.
function M.spawn(sb, cmd, opts)
  opts = opts or {}
  local env_text = check_opts(opts)
  return start(sb, cmd, command_of(cmd), env_text, opts, "stdout")
end

--- sb:run_sync(cmd) -> {code, stdout, stderr, truncated, exec_id} with :check(): one command
-- through the `sync` run operation (buffered by the server; no streaming, no kill). truncated is
-- the server's word: true when it cut a stream (moonbox local keeps 1 MiB of each). [yields]
function M.run_sync(sb, cmd)
  local command = command_of(cmd)
  local r, tok = api.data(sb:connection(), "sandbox:run_sync",
    { path = "/sandboxes/" .. sb.id .. "/runs/sync/token", body = { command = command } },
    { method = "POST", body = json.encode({ command = command }),
      headers = { ["Content-Type"] = "application/json" }, intent = intent_of(cmd, nil, "sync") },
    { name = "sandbox:run_sync.run", span_path = "/sandboxes/" .. sb.id .. "/runs/sync", sandbox_id = sb.id })
  local d = json.decode(r.body)
  if type(d) ~= "table" then
    error(api.error { op = "sandbox:run_sync", code = "malformed_response", status = r.status,
      sandbox_id = sb.id, exec_id = tok.executionId, message = "the sync run's answer is not JSON" }, 0)
  end
  return setmetatable({ code = math.tointeger(d.exit_code) or d.exit_code, stdout = d.stdout or "",
    stderr = d.stderr or "", exec_id = tok.executionId, sandbox_id = sb.id,
    truncated = d.truncated == true, command_summary = summary(command) }, Result)
end

-- ---- the declared calls (moonbox.schema) -------------------------------------------------------

local CMD = { name = "cmd", type = { "string", "table" } }
local OPTS = { name = "opts", type = "table", optional = true }

M.SCHEMA = {
  ["sb:exec"] = { summary = "runs a command and waits for its result", args = { CMD, OPTS },
    options = EXEC_OPTS, returns = "Result", yields = true },
  ["sb:spawn"] = { summary = "starts a command and returns its process", args = { CMD, OPTS },
    options = SPAWN_OPTS, returns = "Process", yields = true },
  ["sb:run_sync"] = { summary = "runs a command through the buffered sync operation", args = { CMD },
    returns = "Result", yields = true },
  ["proc:wait"] = { summary = "waits for the command's end and returns its result", returns = "Result",
    yields = true },
  ["proc:lines"] = { summary = "an iterator over stdout's lines as they arrive", returns = "fun(): string?",
    yields = true },
  ["proc:kill"] = { summary = "signals the command's process group", args = {
    { name = "sig", type = { "string", "integer" }, optional = true }, OPTS },
    options = { grace = { type = "seconds", default = 5,
      doc = "after TERM, how long the command gets before its group gets KILL" } },
    returns = "string", yields = true },
  ["result:check"] = { summary = "the result, or raises exit_status when the exit code is not 0",
    returns = "Result" },
  ["render.shell_quote"] = { summary = "s quoted for bash so that it arrives as one literal word",
    args = { { name = "s", type = { "string", "number" } } }, returns = "string" },
}
schema.declare(M.SCHEMA)

M.exec = schema.wrap("sb:exec", M.exec)
M.spawn = schema.wrap("sb:spawn", M.spawn)
M.run_sync = schema.wrap("sb:run_sync", M.run_sync)
M.shell_quote = schema.wrap("render.shell_quote", shell_quote)
Process.wait = schema.wrap("proc:wait", Process.wait)
Process.lines = schema.wrap("proc:lines", Process.lines)
Process.kill = schema.wrap("proc:kill", Process.kill)
Result.check = schema.wrap("result:check", Result.check)

return M
