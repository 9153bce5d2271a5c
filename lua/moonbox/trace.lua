--- moonbox.trace — Chrome trace event JSON of a run: every API call, every task, every
-- sandbox's life, as spans that Perfetto (ui.perfetto.dev) and chrome://tracing open.
--
--   moonbox run --trace run.json recipe.lua          -- or, from Lua:
--   trace.start("run.json") ... trace.stop()
--
-- Layout of the file: Chrome's "JSON Array Format", `[` then one event per line, separated by
-- commas, and `]` at trace.stop(). Each event reaches the file with one unbuffered write, so a
-- process killed at any moment (SIGKILL) leaves whole events and loses only the closing `]`,
-- which the array format lets viewers do without (Perfetto and chrome://tracing open such a
-- file; a strict JSON parser needs the `]` appended). The object format was rejected because
-- its closing `]}` cannot be left out, and a buffered file because a kill cuts it mid-event.
-- pid 1 is the moonbox process; each task is a thread (tid = task id, named after the function
-- it runs), so the API calls a task makes nest under its span. Events:
--   ph "X" cat "api"      one per API call (control plane and data plane: exec streams, file
--                         transfers), args: op, method, path, status, attempts, request_id,
--                         sandbox_id, error code. Never headers, bodies, tokens or URLs.
--   ph "X" cat "task"     one per task, from its start to its end.
--   ph "b"/"e" cat "sandbox"  one async span per sandbox, from its create to its termination
--                         (or to the end of the trace, args.open = true).
--   ph "C" name "concurrency <window>"  adaptive windows' sizes (task.window).
--   ph "i"                instants (retries, throttling).
-- Secrets: the API key and every env value given to moonbox.render are registered with
-- trace.secret(); any registered secret found in an event is replaced by "[redacted]" before
-- the line is written, so a trace never holds one even if a message quoted it.
local json = require "moonbox.json"
local core = require "moonbox.core"
local events = require "moonbox.render.events"

local M = { on = false }

local file, path, t_base, unobserve
local secrets = {}
local open_sandboxes = {}
local named_tids = {}
local first = true
local keep = false

local function now_us()
  return math.floor((core.time() - t_base) * 1e6 + 0.5)
end
M.now_us = function() return M.on and now_us() or 0 end

--- trace.redact(s) -> s with every registered secret replaced by "[redacted]" (the trace does
-- it to each event; `moonbox run --json` to its summary).
local function scrub(s)
  for secret in pairs(secrets) do
    if s:find(secret, 1, true) then
      s = s:gsub(secret:gsub("%W", "%%%0"), "[redacted]")
    end
  end
  return s
end

local function tid()
  local t = core.current()
  return t and core.id(t) or 0
end

-- One event, one write(2): the separator and the line go out together, unbuffered.
local function write(ev)
  ev.pid = 1
  local line = scrub(json.encode(ev))
  file:write((first and "\n" or ",\n") .. line)
  first = false
end

local function name_thread(id, name)
  if named_tids[id] then return end
  named_tids[id] = true
  write { name = "thread_name", ph = "M", tid = id, args = { name = name } }
end

--- trace.secret(value[, always]): never write value into the trace (values shorter than 4 bytes
-- are ignored: they would redact ordinary text). Called for the API key (always: a trace may
-- start after the connection) and for env values, which are kept only while a trace is being
-- written, so a long-lived process does not hoard every env value it ever sent.
function M.secret(value, always)
  if type(value) ~= "string" or #value < 4 then return end
  if always then
    secrets[value] = "always"
  elseif keep and not secrets[value] then
    secrets[value] = "always"
  elseif M.on and not secrets[value] then
    secrets[value] = "trace"
  end
end

--- trace.keep_secrets(): from now on every secret registered is kept for the life of the
-- process, trace or not, so trace.redact scrubs env values from any text (`moonbox schedule`
-- does this: its alert messages and status page quote run errors). Costs the memory of every
-- distinct env value sent.
function M.keep_secrets() keep = true end

--- trace.start(path, opts) -> path: starts writing events to path (truncating it). opts.name:
-- the process's name in the viewer. Raises if the file cannot be opened or a trace is on.
function M.start(p, opts)
  if M.on then error("trace.start: a trace is already being written to " .. path, 2) end
  local f, err = io.open(p, "w")
  if not f then error("trace.start: cannot write the trace file: " .. tostring(err), 2) end
  file, path, t_base, first = f, p, core.time(), true
  named_tids, open_sandboxes = {}, {}
  f:setvbuf("no")
  f:write("[")
  M.on = true
  write { name = "process_name", ph = "M", tid = 0,
    args = { name = ((opts and opts.name) or "moonbox") .. " (moonbox " .. core.version .. ")" } }
  do
    unobserve = events.observe(function(event, subject, info)
      if event == "created" then
        open_sandboxes[subject.id] = true
        write { name = subject.id, cat = "sandbox", ph = "b", id = subject.id, ts = now_us(), tid = tid(),
          args = { status = subject.status, snapshot_id = info.snapshot_id } }
      elseif event == "running" then
        write { name = "running", cat = "sandbox", ph = "n", id = subject.id, ts = now_us(), tid = tid() }
      elseif event == "terminated" and open_sandboxes[subject] then
        open_sandboxes[subject] = nil
        write { name = subject, cat = "sandbox", ph = "e", id = subject, ts = now_us(), tid = tid() }
      elseif event == "create_failed" then
        local e = info.error
        write { name = "create failed", cat = "sandbox", ph = "i", s = "t", ts = now_us(), tid = tid(),
          args = { code = type(e) == "table" and e.code or nil, name = info.name } }
      end
    end)
  end
  return p
end

--- trace.stop() -> path|nil: closes the still-open sandbox spans (args.open = true), writes the
-- closing `]` and closes the file.
function M.stop()
  if not M.on then return nil end
  if unobserve then unobserve() end
  unobserve = nil
  local ts = now_us()
  for id in pairs(open_sandboxes) do
    write { name = id, cat = "sandbox", ph = "e", id = id, ts = ts, tid = 0, args = { open = true } }
  end
  file:write("\n]\n")
  file:close()
  M.on = false
  for value, kind in pairs(secrets) do
    if kind == "trace" then secrets[value] = nil end
  end
  local p = path
  file, path = nil, nil
  return p
end

--- trace.enabled() -> boolean.
function M.enabled() return M.on end

--- trace.path() -> the file being written, or nil.
function M.path() return path end

--- trace.complete(name, cat, t0_us, args): a span from t0 (trace.now_us()) to now on the
-- current task's track.
function M.complete(name, cat, t0, args)
  if not M.on then return end
  local t1 = now_us()
  write { name = name, cat = cat, ph = "X", ts = t0, dur = math.max(t1 - t0, 0), tid = tid(), args = args }
end

--- trace.instant(name, cat, args): a point event on the current task's track.
function M.instant(name, cat, args)
  if not M.on then return end
  write { name = name, cat = cat, ph = "i", s = "t", ts = now_us(), tid = tid(), args = args }
end

--- trace.counter(name, values): a counter sample (values: {series = number}).
function M.counter(name, values)
  if not M.on then return end
  write { name = name, ph = "C", ts = now_us(), tid = 0, args = values }
end

--- trace.task_span(id, label, t0): the span of a finished task (moonbox.task calls it).
function M.task_span(id, label, t0, status)
  if not M.on then return end
  name_thread(id, label)
  write { name = label, cat = "task", ph = "X", ts = t0, dur = math.max(now_us() - t0, 0), tid = id,
    args = { status = status } }
end

M.redact = scrub
return M
