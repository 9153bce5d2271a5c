--- moonbox.repl — `moonbox repl`: an interactive Lua session on the live event loop.
--
-- The session is the root task. It reads a chunk (moonbox.lineedit: libedit on a terminal,
-- plain lines from a pipe), compiles it the way lua.c does (`return <line>` first, so an
-- expression prints its values; a chunk that ends early continues on a second prompt), runs it
-- as a task of its own and waits for it, so API calls work at the top level while tasks spawned
-- earlier keep running. Ctrl-C cancels that chunk task (its guards unwind; a running exec's
-- process group is killed) and never the session. On exit, the sandboxes the session created
-- and did not keep are terminated (after a confirmation on a terminal).
--
-- Exit status: 0 when every chunk succeeded, 1 when any chunk failed (piped sessions use it),
-- 2 on usage errors, 130 after Ctrl-C at a piped session's input, 143 after SIGTERM.
local core = require "moonbox.core"
local task = require "moonbox.task"
local build = require "moonbox.build"
local pretty = require "moonbox.pretty"
local complete = require "moonbox.repl.complete"
local trace = require "moonbox.trace"
local sys = require "moonbox.sys"
local render = require "moonbox.render"
local schedule = require "moonbox.schedule"
local ledger = require "moonbox.ledger"

local M = {}

M.command = {
  usage = "moonbox repl [--backend URL|local|render] [--no-history]",
  detail = [[An interactive Lua session on the live event loop: `render`, `task` and `schedule`
are preloaded, each chunk you enter runs as a task (so API calls work at the top level), and
work started with task.spawn keeps running between prompts; its output is printed above the
prompt without mangling what you are typing.

Line editing, history (kept in $XDG_STATE_HOME/moonbox/repl_history) and Tab completion of
globals, fields and methods (`sb:ex<Tab>` gives `sb:exec`). An expression prints its values;
a statement that is not finished continues on a `>>` prompt. Ctrl-C cancels the running chunk
(not the session); Ctrl-D exits. On exit the sandboxes this session created and did not keep
(sb:keep()) are listed and terminated after a confirmation.

Commands: :help, :tasks, :cancel N, :sandboxes, :backend, :trace on [FILE] | off, :quit.

With stdin not a terminal it reads chunks line by line, prints results without prompts, and
terminates what it created without asking. Exit status: 0 when every chunk succeeded, 1 when
one failed, 2 on usage errors, 130 after Ctrl-C while reading piped input, 143 after SIGTERM.
--backend chooses the backend as for `moonbox run`.]],
}

local PROMPT, PROMPT2 = "> ", ">> "

local Session = {}
Session.__index = Session

-- ---- output ----------------------------------------------------------------------------------

--- The API keys in play (the environment's and the connection's): never printed, never kept
-- in the history.
function Session.secrets()
  local out = {}
  local c = render.current_connection()
  for _, k in ipairs { os.getenv("RENDER_API_KEY"), c and c.api_key } do
    if type(k) == "string" and #k >= 8 then out[#out + 1] = k end
  end
  return out
end

--- s with every API key (and, while a trace is on, env value) replaced by "[redacted]": the
-- same filter as the trace's (moonbox.trace registers the keys as secrets).
function Session:redact(s)
  for _, k in ipairs(self:secrets()) do trace.secret(k, true) end
  return trace.redact(s)
end

--- Writes one line of output; on a terminal whose prompt is showing it goes above the prompt.
function Session:out(s)
  s = self:redact(s)
  if self.tty then
    self.le.print(s)
  else
    io.stdout:write(s, "\n")
    io.stdout:flush()
  end
end

--- Writes an error report (stderr when piped, above the prompt on a terminal).
function Session:err(s)
  s = self:redact(s)
  if self.tty then
    io.stdout:flush()
    self.le.print(s)
  else
    io.stderr:write(s, "\n")
    io.stderr:flush()
  end
end

-- Keeps the traceback lines that belong to the user's code: the frames below the chunk
-- (moonbox's task entry, xpcall, [C]) say nothing useful at a prompt.
local function trim_traceback(tb)
  if not tb then return nil end
  local lines, keep = {}, 0
  for line in tb:gmatch("[^\n]+") do
    lines[#lines + 1] = line
    if line:find("stdin:", 1, true) or line:find("in main chunk", 1, true) then keep = #lines end
  end
  if keep == 0 then return tb end
  return table.concat(lines, "\n", 1, keep)
end

local function is_code(err, code)
  return type(err) == "table" and core.Error.is(err) and err.code == code
end

--- The report of a failed chunk or task: one line, then the traceback.
local function describe_error(err, tb)
  local s
  if type(err) == "table" and core.Error.is(err) then
    s = tostring(err)
    tb = err.traceback or tb
  elseif type(err) == "string" or type(err) == "number" then
    s = tostring(err)
  else
    local mt = getmetatable(err)
    local ok, str = false, nil
    if type(mt) == "table" and rawget(mt, "__tostring") then ok, str = pcall(tostring, err) end
    s = ok and str or string.format("(error object is a %s value)", type(err))
  end
  tb = trim_traceback(tb)
  if not tb or s:find("stack traceback", 1, true) then return s end
  -- a recorded traceback starts with the message it was recorded for: keep only the frames
  local at = tb:find("stack traceback:", 1, true)
  if at then tb = tb:sub(at) end
  return s .. "\n" .. tb
end

-- ---- background tasks ----------------------------------------------------------------------

--- task.spawn as the session's globals see it: the task is listed by :tasks, and its failure
-- is reported when it happens (it is then not reported again at exit; task.join still
-- re-raises it).
function Session:spawn(fn, ...)
  if type(fn) ~= "function" then error("task.spawn: expected a function, got " .. type(fn), 2) end
  -- where the user's code called it (a `return task.spawn(...)` tail call leaves no frame)
  local site = "in chunk " .. self.nchunks
  local info = debug.getinfo(2, "Sl")
  if info and info.what ~= "C" then
    site = string.format("at %s:%s (chunk %d)", info.short_src, tostring(info.currentline), self.nchunks)
  end
  local rec = { chunk = self.nchunks, site = site }
  local t = task.spawn(function(...)
    local r = table.pack(xpcall(fn, core.msgh, ...))
    if not r[1] then
      local err = r[2]
      core.observe(core.current())
      if is_code(err, "cancelled") then
        -- at the end of the session every task still running is cancelled: no news
        if not self.closing then self:err(string.format("[task %d cancelled]", rec.id)) end
      else
        self:err(string.format("[task %d failed] %s", rec.id, describe_error(err, core.traceback_of(err))))
      end
      error(err, 0)
    end
    return table.unpack(r, 2, r.n)
  end, ...)
  rec.task, rec.id = t, t.id
  self.tasks[#self.tasks + 1] = rec
  return t
end

-- ---- sandboxes ------------------------------------------------------------------------------

function Session:observe_render()
  self.unobserve = render.observe(function(event, subject)
    if event == "created" then
      self.sandboxes[subject.id] = { sb = subject, order = self.nchunks }
      self.sandbox_order[#self.sandbox_order + 1] = subject.id
    elseif event == "kept" and self.sandboxes[subject.id] then
      self.sandboxes[subject.id].kept = true
    elseif event == "terminated" then
      self.sandboxes[subject] = nil
    end
  end)
end

--- The sandboxes this session created and still holds, in creation order.
function Session:held()
  local out = {}
  for _, id in ipairs(self.sandbox_order) do
    local h = self.sandboxes[id]
    if h then out[#out + 1] = h end
  end
  return out
end

-- ---- commands ---------------------------------------------------------------------------------

local HELP = [[
Enter Lua. An expression prints its values; each chunk runs as a task (API calls work here).
  sb = render.sandboxes.create{}     a sandbox (terminated when the session ends, unless sb:keep())
  sb:exec("uname -a")                 run a command; Ctrl-C cancels it and kills its processes
  task.spawn(function() ... end)      background work; its output appears above the prompt
Commands:
  :help              this text
  :tasks             tasks spawned in this session (id, status, where)
  :cancel N          cancel task N
  :sandboxes         sandboxes this session created and still holds
  :backend           the backend, workspace and whether it is embedded
  :trace on [FILE]   write a Chrome trace of what follows (default: in the state dir); :trace off
  :quit              leave (as Ctrl-D)
Keys: Tab completes globals, fields and methods; Up/Down walk the history; Ctrl-C cancels the
running chunk or clears the line; Ctrl-D on an empty line exits.]]

local commands = {}

function commands.help(self) self:out(HELP) end

function commands.tasks(self)
  if #self.tasks == 0 then return self:out("(no tasks spawned in this session)") end
  local keep = {}
  for _, rec in ipairs(self.tasks) do
    local status = core.status(rec.task)
    local data = core.data(rec.task)
    local name = data.name and (" " .. pretty.quote(data.name)) or ""
    self:out(string.format("  %-5d %-8s spawned %s%s", rec.id, status, rec.site, name))
    if status ~= "done" and status ~= "failed" then keep[#keep + 1] = rec end
  end
  -- finished tasks are listed once more, then forgotten
  self.tasks = keep
end

function commands.cancel(self, arg)
  local id = tonumber(arg)
  if not id then return self:err(":cancel needs a task id (see :tasks)") end
  for _, rec in ipairs(self.tasks) do
    if rec.id == id then
      task.cancel(rec.task)
      return self:out(string.format("cancelling task %d", id))
    end
  end
  self:err(string.format(":cancel: no task %d in this session (see :tasks)", id))
end

function commands.sandboxes(self)
  local held = self:held()
  if #held == 0 then return self:out("(no sandboxes held by this session)") end
  for _, h in ipairs(held) do
    self:out("  " .. pretty.summary(h.sb) .. (h.kept and " (kept: survives the session)" or ""))
  end
end

function commands.backend(self)
  local ok, c = pcall(render.connection)
  if not ok then return self:err("no backend: " .. describe_error(c)) end
  self:out(string.format("%s (%s%s), workspace %s", c.base, c.kind,
    c.state_dir and (", embedded, state in " .. c.state_dir) or "", tostring(c.workspace)))
end

function commands.trace(self, arg)
  local what, file = (arg or ""):match("^(%S*)%s*(.-)%s*$")
  if what == "on" then
    if trace.enabled() then return self:err("trace already on (" .. tostring(trace.path()) .. ")") end
    if file == "" then
      local dir = self.cli.state_home()
      local made, merr = pcall(sys.mkdir_p, dir, tonumber("700", 8))
      if not made then return self:err("trace: " .. describe_error(merr)) end
      file = string.format("%s/repl-trace-%s.json", dir, os.date("!%Y%m%dT%H%M%S"))
    end
    local started, err = pcall(trace.start, file)
    if not started then return self:err("trace: " .. describe_error(err)) end
    self:out("tracing to " .. file)
  elseif what == "off" then
    if not trace.enabled() then return self:err("trace is not on") end
    self:out("trace written to " .. tostring(trace.stop()))
  else
    self:err("usage: :trace on [FILE] | :trace off")
  end
end

commands.quit = function(self) self.quit = true end
commands.exit = commands.quit

function Session:command(line)
  local name, arg = line:match("^%s*:(%a*)%s*(.-)%s*$")
  local fn = commands[name]
  if not fn then
    self:err(string.format("unknown command :%s (:help lists them)", tostring(name)))
    return
  end
  local ok, err = pcall(fn, self, arg)
  if not ok then
    self.failures = self.failures + 1
    self:err(":" .. name .. ": " .. describe_error(err))
  end
end

-- ---- reading chunks -------------------------------------------------------------------------

function Session:read_line(prompt)
  if self.tty then return self.le.read(prompt) end
  return self.le.read_raw()
end

--- Reads one chunk: returns src, fn (compiled) | src, nil, syntax error | src, "command" |
-- false (Ctrl-C) | nil (end of input).
function Session:read_chunk()
  local line = self:read_line(PROMPT)
  if line == false or line == nil then return line end
  if line:match("^%s*:%a") then return line, "command" end
  if line:match("^%s*$") then return "", nil end
  local fn = load("return " .. line, "=stdin", "t")
  if fn then return line, fn end
  local src = line
  while true do
    local f, err = load(src, "=stdin", "t")
    if f then return src, f end
    if not err:match("<eof>$") then return src, nil, err end
    local more = self:read_line(PROMPT2)
    if more == false then return false end
    if more == nil then return src, nil, err end
    src = src .. "\n" .. more
  end
end

function Session:remember(src)
  if not self.tty or src:match("^%s*$") then return end
  if src == self.last_history then return end
  for _, k in ipairs(self:secrets()) do
    if src:find(k, 1, true) then return end -- an API key never goes to the history file
  end
  self.last_history = src
  self.le.add_history(src)
  if self.history_path then
    local saved, msg = self.le.save_history(self.history_path)
    if not saved then
      self:err("history is not saved: " .. tostring(msg)) -- said once: saving stops here
      self.history_path = nil
    end
  end
end

-- ---- running chunks ---------------------------------------------------------------------------

function Session:run_chunk(fn)
  self.nchunks = self.nchunks + 1
  local t = core.spawn(fn)
  t.name = "repl chunk " .. self.nchunks
  -- An expression chunk is `return <expr>`, a tail call that leaves no frame of the chunk on
  -- the stack: errors made inside it name the prompt, not moonbox's own files.
  local data = core.data(t)
  data.site, data.site_recipe = "stdin:1", true
  self.current = t
  self.le.interrupt_target(t)
  local r = table.pack(core.join(t))
  self.le.interrupt_target(nil)
  self.current = nil
  if self.flush_stdout then self.flush_stdout() end -- a chunk's unfinished io.write line
  if r[1] then
    if r.n > 1 then
      local parts = {}
      for i = 2, r.n do parts[#parts + 1] = pretty.format(r[i]) end
      self:out(table.concat(parts, "\t"))
    end
    return true
  end
  local err = r[2]
  self.failures = self.failures + 1
  local nl = self.tty and "\n" or "" -- after the terminal's ^C
  if is_code(err, "cancelled") then
    self:err(nl .. "interrupted: the chunk's task was cancelled and unwound")
  elseif is_code(err, "interrupted") then
    self:err(nl .. "interrupted (Ctrl-C) while running Lua")
  else
    self:err(describe_error(err, core.traceback(t)))
  end
  return false
end

-- ---- the session --------------------------------------------------------------------------

function Session:banner()
  if not self.tty then return end
  local c = self.conn
  self:out(string.format("moonbox %s repl (%s) — backend %s (%s%s), workspace %s", build.version, _VERSION,
    c.base, c.kind, c.state_dir and ", embedded" or "", tostring(c.workspace)))
  self:out("render, task and schedule are loaded; :help for commands; Ctrl-D exits")
end

function Session:preload()
  _G.render = render
  _G.task = setmetatable({ spawn = function(fn, ...) return self:spawn(fn, ...) end }, { __index = task })
  _G.schedule = schedule
  _G.pretty = pretty
  _G.print = function(...)
    local n = select("#", ...)
    local parts = {}
    for i = 1, n do parts[i] = tostring((select(i, ...))) end
    self:out(table.concat(parts, "\t"))
  end
  if self.tty then self:route_stdout() end
  self.le.set_completer(function(text) return complete.complete(text, _G) end)
end

--- On a terminal, io.write and io.stdout:write go above the prompt too: complete lines at
-- once, a partial line when it is flushed (io.stdout:flush, or the chunk ending). io.stdout
-- becomes a stand-in whose other methods (seek, setvbuf, lines, ...) act on the real one;
-- session:restore_stdout() puts everything back.
function Session:route_stdout()
  local real, real_write = io.stdout, io.write
  local pending = {}
  local session = self
  local proxy = {}
  local function emit_lines(flush_partial)
    local text = table.concat(pending)
    pending = {}
    for line, nl in text:gmatch("([^\n]*)(\n?)") do
      if nl == "\n" then
        session:out(line)
      elseif line ~= "" then
        if flush_partial then session:out(line) else pending[1] = line end
      end
    end
  end
  function proxy.write(_, ...)
    for i = 1, select("#", ...) do
      local v = select(i, ...)
      if type(v) ~= "string" and type(v) ~= "number" then
        error("bad argument #" .. i .. " to 'write' (string expected, got " .. type(v) .. ")", 2)
      end
      pending[#pending + 1] = tostring(v)
    end
    emit_lines(false)
    return proxy
  end
  function proxy.flush() emit_lines(true) return proxy end
  setmetatable(proxy, {
    __index = function(_, k)
      local m = real[k]
      if type(m) == "function" then return function(_, ...) return m(real, ...) end end
      return m
    end,
    __name = "FILE*", __tostring = function() return tostring(real) end,
  })
  io.stdout = proxy -- luacheck: ignore 122
  io.write = function(...) return proxy:write(...) end -- luacheck: ignore 122
  self.flush_stdout = proxy.flush
  self.restore_stdout = function()
    emit_lines(true)
    io.stdout, io.write = real, real_write -- luacheck: ignore 122
  end
end

--- Terminates what the session created and did not keep; asks first on a terminal.
function Session:cleanup(ask)
  local held = {}
  for _, h in ipairs(self:held()) do
    if not h.kept then held[#held + 1] = h end
  end
  if #held == 0 then return end
  self:err(string.format("%d sandbox%s created in this session and not kept:", #held,
    #held == 1 and "" or "es"))
  for _, h in ipairs(held) do self:err("  " .. pretty.summary(h.sb)) end
  if ask then
    local answer = self.le.read("terminate them? [Y/n] ")
    if answer and answer:match("^%s*[nN]") then
      self:err("left running; terminate them with render.sandboxes.terminate(id), or `moonbox reap` " ..
        "will once this session has ended")
      return
    end
  end
  for _, h in ipairs(held) do
    local ok, err = pcall(h.sb.terminate, h.sb)
    if ok then
      self:err("  terminated " .. h.sb.id)
    else
      self.failures = self.failures + 1
      self.cleanup_failed = true
      self:err("  could not terminate " .. h.sb.id .. ": " .. describe_error(err))
    end
  end
end

function Session:loop()
  while not self.quit do
    local src, fn, err = self:read_chunk()
    if src == nil then
      if self.tty then io.stdout:write("\n") end
      break
    end
    if src == false then
      if not self.tty then
        self.interrupted = true
        break
      end
    elseif fn == "command" then
      self:remember(src)
      self:command(src)
    elseif fn then
      self:remember(src)
      self:run_chunk(fn)
    elseif err then
      self:remember(src)
      self.failures = self.failures + 1
      self:err(err)
    end
  end
end

function Session:run()
  self:observe_render()
  -- A terminal session connects now, for its banner; a piped one at its first API call (a
  -- script that never calls the API starts no embedded backend).
  local connected, cerr = pcall(function()
    if self.backend then render.connect { backend = self.backend } end
    if self.tty then self.conn = render.connection() end
  end)
  if not connected then
    if self.unobserve then self.unobserve() end
    io.stderr:write("moonbox repl: cannot connect to the backend: ", describe_error(cerr), "\n")
    return 1
  end
  self:preload()
  self:banner()
  local ok, err = pcall(self.loop, self)
  local terminated = not ok and is_code(err, "cancelled")
  if not ok and not terminated then
    self.failures = self.failures + 1
    self:err("moonbox repl: " .. describe_error(err))
  end
  if self.current then
    core.cancel(self.current)
    pcall(core.join, self.current)
  end
  -- After SIGTERM there is nobody to ask: terminate what the session holds.
  local cleaned, clean_err = pcall(self.cleanup, self, self.tty and not terminated)
  if not cleaned then self:err("moonbox repl: cleanup: " .. describe_error(clean_err)) end
  if trace.enabled() then pcall(trace.stop) end
  if self.unobserve then self.unobserve() end
  self.cli.finish_run()
  self.closing = true
  if terminated then return 143 end
  if self.interrupted then return 130 end
  if self.tty then return self.cleanup_failed and 1 or 0 end
  return self.failures > 0 and 1 or 0
end

--- repl.main(args, cli) -> exit status: the `moonbox repl` command. Parses --backend and
-- --no-history (a usage error is status 2), opens the line editor with its history, runs the
-- session (session:run: chunks until end of input or :quit, then the cleanup of what it made)
-- on the event loop, puts stdout and print back and records the process's end in the ledger.
-- Called outside any task: it runs the loop itself (core.run). The statuses are those of the
-- file header; an error the session did not handle is printed and gives 1.
function M.main(args, cli)
  local opts, rest = cli.parse_flags(args, { backend = "value", ["no-history"] = "flag" })
  if not opts then return cli.usage_error("repl: %s", rest) end
  if #rest > 0 then return cli.usage_error("repl: unexpected argument '%s'", rest[1]) end
  local backend = opts.backend
  local bad = cli.bad_backend("repl", backend)
  if bad then return bad end
  -- lazy: moonbox.lineedit loads libedit, which only a session needs (`moonbox help repl` loads
  -- this module too)
  local le = require "moonbox.lineedit"
  local tty = core.isatty(0)
  local history
  if tty and not opts["no-history"] then
    local dir = cli.state_home()
    local made, merr = pcall(sys.mkdir_p, dir, tonumber("700", 8))
    if made then
      history = dir .. "/repl_history"
    else
      cli.eprintf("moonbox repl: no history this time: %s\n", cli.format_error(merr))
    end
  end
  local session = setmetatable({ le = le, tty = tty, cli = cli, backend = backend, history_path = history,
    tasks = {}, sandboxes = {}, sandbox_order = {}, nchunks = 0, failures = 0 }, Session)
  cli.set_arg("repl", {})
  build.ledger = true -- like moonbox run: what the session creates is in the ledger (ps / reap)
  le.open { tty = tty, history = history }
  local real_print = print
  local sigs = core.signal_cancel({ "TERM" })
  local ok, code = pcall(core.run, function() return session:run() end)
  core.signal_restore(sigs)
  if session.restore_stdout then session.restore_stdout() end
  le.close()
  _G.print = real_print
  core.shutdown()
  core.report_unobserved()
  ledger.close_process(not ok and "failed" or code == 0 and "ok"
    or (code == 130 or code == 143) and "interrupted" or "failed")
  if not ok then
    cli.eprintf("moonbox repl: %s\n", cli.format_error(code))
    return cli.EXIT_FAIL
  end
  return code
end

M.Session = Session
return M
