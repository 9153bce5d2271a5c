--- moonbox.schedule.cli — the `moonbox schedule FILE [...]` command.
--
-- Every mode loads FILE the same way (as a task, with schedule.running() true, so a recipe's
-- "run once now" branch stays quiet), which registers its schedules; then either runs the
-- daemon (no mode flag) or answers one question and exits: --list, --next, --trigger, --pause,
-- --resume, --stop (asks the daemons on a shared database to stop, and waits for them). State
-- lives in the state dir's moonbox.db or a shared database (moonbox.schedule.store).
local core = require "moonbox.core"
local schedule = require "moonbox.schedule"
local clock_mod = require "moonbox.schedule.clock"
local build = require "moonbox.build"
local db_mod = require "moonbox.db"
local ledger_mod = require "moonbox.ledger"
local render = require "moonbox.render"
local daemon_mod = require "moonbox.schedule.daemon"
local ops_mod = require "moonbox.schedule.ops"
local store_mod = require "moonbox.schedule.store"
local sys = require "moonbox.sys"
local task = require "moonbox.task"
local trace = require "moonbox.trace"

local M = {}

M.command = {
  usage = "moonbox schedule FILE [--drain] [--backend URL|local|render] [--state DB]\n" ..
    "       [--listen [HOST:]PORT] [--webhook URL]... [--trace-dir DIR] [--control-token-file FILE]\n" ..
    "       moonbox schedule FILE --list | --next NAME [N] | --trigger NAME | --pause NAME\n" ..
    "       moonbox schedule FILE --resume NAME\n" ..
    "       moonbox schedule FILE --stop [--drain] [--timeout S]",
  detail = [[Loads FILE, a recipe that registers schedules with schedule.cron / schedule.every
(moonbox.schedule), and fires them until SIGTERM or SIGINT: each fire runs as a task with its
own ledger run; state and history persist in $XDG_STATE_HOME/moonbox/moonbox.db, so a restart
neither repeats nor loses a run (missed slots inside a schedule's catch-up window run once;
older ones are recorded skipped). Runs left running by a killed daemon are recorded
interrupted on start, and the sandboxes they hold are terminated.

On SIGTERM/SIGINT it stops firing, cancels running runs (with --drain: waits for them; a
second signal cancels them), records their outcome and exits 0. The event log goes to stdout.

  --list           the schedules, their next fire, state and last outcome
  --next NAME [N]  the next N (default 5) slots of schedule NAME
  --trigger NAME   run NAME once now in this process (recorded, trigger "manual"); exit 0
                   when it succeeded, 1 when not
  --pause NAME     pause NAME (persisted; a running daemon skips its fires from the next one)
  --resume NAME    resume NAME and clear its failure count
  --drain          on SIGTERM/SIGINT let running runs finish instead of cancelling them
  --stop           stop every daemon (on a shared database: on any machine) that fires one
                   of FILE's schedules and was running when asked: each cancels its runs (as
                   on SIGTERM) and exits; with --drain each stops firing at once and exits
                   when its runs have finished. Waits up to --timeout S (default 60) for
                   them; exit 0 when all stopped, 1 naming those that did not
  --backend B      as for `moonbox run`
  --state DB       where state and history live: a SQLite file, or a postgres:// URL shared
                   by daemons on several machines (default: MOONBOX_DATABASE_URL, else
                   $XDG_STATE_HOME/moonbox/moonbox.db); see docs/schedule.md

Operating it (docs/schedule.md, "Operating a daemon"):
  --listen [HOST:]PORT    serve /healthz, /metrics (Prometheus) and the status page at /;
                          a bare PORT binds 127.0.0.1; another address only when written
                          out as an IP (e.g. 0.0.0.0:9464)
  --webhook URL           POST a JSON alert on a failed run, a pause and a recovery
                          (repeatable; added to each schedule's own `webhooks`)
  --webhook-timeout S     seconds per webhook attempt (default 10)
  --webhook-queue N       messages a webhook may have waiting before new ones are dropped
                          (default 100)
  --trace-dir DIR         write a Chrome trace (Perfetto) per run: DIR/run-ID.json
  --control-token-file F  enable the page's pause/resume/trigger buttons with the token in F
                          (or MOONBOX_CONTROL_TOKEN); without one the page is read-only

`moonbox runs` prints the history. For tests only, MOONBOX_TEST_CLOCK=
"start=2026-03-01T00:00:00Z,scale=600" runs schedule time from that start 600x faster
(docs/schedule.md, "The test clock").]],
}

-- Every line passes moonbox.trace.redact: a run's error may quote the API key or an env value.
local function line_out(s)
  io.stdout:write(trace.redact(s), "\n")
  io.stdout:flush()
end

local function state_text(st, shared)
  if not st then return "new" end
  local parts = {}
  if st.paused == 1 then
    parts[#parts + 1] = "paused" .. (st.paused_reason and (" (" .. st.paused_reason .. ")") or "")
  else
    parts[#parts + 1] = "active"
  end
  if (st.failures or 0) > 0 then parts[#parts + 1] = st.failures .. " consecutive failure(s)" end
  if shared then
    parts[#parts + 1] = "shared database"
  elseif st.owner_pid and ledger_mod.alive(st.owner_pid, st.owner_pid_start) then
    parts[#parts + 1] = "daemon pid " .. st.owner_pid
  else
    parts[#parts + 1] = "no daemon"
  end
  return table.concat(parts, ", ")
end

local function list(store, clock)
  local now = clock:now()
  line_out(string.format("%-20s %-26s %-25s %-8s %s", "NAME", "SPEC", "NEXT FIRE", "LAST", "STATE"))
  for _, s in ipairs(schedule.list()) do
    local st = store:state(s.name)
    local nxt
    if st and st.paused == 1 then
      nxt = "- (paused)"
    elseif st and st.next_fire and st.owner_pid and ledger_mod.alive(st.owner_pid,
      st.owner_pid_start) then
      nxt = clock_mod.format(st.next_fire)
    else
      local t = schedule.next_after(s, math.max(now, st and st.last_slot or now))
      nxt = t and schedule.format_slot(s, t) or "never"
    end
    local last = store:last_run(s.name)
    line_out(string.format("%-20s %-26s %-25s %-8s %s", s.name, s.spec, nxt,
      last and last.outcome or "-", state_text(st, store.shared)))
  end
end

--- The ledger (and with it the schedule store). The daemon (wait) waits for a database that is
-- not there yet, saying so once, with a backoff up to 5 s; the one-shot modes report it. [yields]
local function open_ledger(wait)
  local delay, told = 0.2, false
  while true do
    local ok, L = pcall(ledger_mod.open)
    if ok then return L end
    local down = daemon_mod.db_down(L)
    if not down then error(L, 0) end
    if not wait then
      error(core.Error.new { op = "moonbox schedule", code = L.code, message = L.message, where = false,
        traceback = false }, 0)
    end
    if not told then
      line_out(string.format("%s %s: not starting until it answers", clock_mod.format(core.time()),
        tostring(L.message)))
      told = true
    end
    task.sleep(delay)
    delay = math.min(5, delay * 2)
  end
end

--- Asks every live daemon firing one of the schedules all to stop (command 'stop' or 'drain')
-- and waits up to timeout seconds until each has stopped (or its lease has run out: it is
-- gone). Prints who was asked, who acknowledged and who stopped. -> exit status. [yields]
local function stop_fleet(store, all, command, timeout, cli)
  local names = {}
  for i, s in ipairs(all) do names[i] = s.name end
  local token, owners = store:request_stop(names, command)
  if #owners == 0 then
    line_out("no live daemon fires " .. table.concat(names, ", ") .. " on " .. store:describe())
    return cli.EXIT_OK
  end
  line_out(string.format("asked %d daemon(s) to stop%s: %s", #owners,
    command == "drain" and " after their runs in progress" or "", table.concat(owners, ", ")))
  if not store.shared then
    -- SQLite: the daemon is on this machine and reads no lease: SIGTERM tells it to look now
    for _, o in ipairs(owners) do
      local pid = tonumber(o:match("/(%d+)/[^/]*$"))
      local ok, err = pcall(sys.kill, pid, 15)
      if not ok then line_out(string.format("%s: could not signal pid %d: %s", o, pid, tostring(err))) end
    end
  end
  local told_ack, told_end = {}, {}
  local deadline = core.time() + timeout
  local acked, gone = 0, 0
  while true do
    local st = store:stop_status(token)
    for _, o in ipairs(owners) do
      local x = st[o] or {}
      if x.acked and not told_ack[o] then
        told_ack[o] = true
        acked = acked + 1
        line_out(o .. ": acknowledged")
      end
      if not told_end[o] and (x.stopped or not x.alive) then
        told_end[o] = true
        gone = gone + 1
        line_out(o .. (x.stopped and ": stopped" or ": gone (its lease ran out before it said it stopped)"))
      end
    end
    if gone == #owners then break end
    if core.time() >= deadline then break end
    task.sleep(math.min(0.25, math.max(0.01, deadline - core.time())))
  end
  local left = {}
  for _, o in ipairs(owners) do if not told_end[o] then left[#left + 1] = o end end
  line_out(string.format("%d of %d daemon(s) acknowledged, %d stopped", acked, #owners, gone))
  if #left > 0 then
    cli.eprintf("moonbox schedule: --stop: %d daemon(s) had not stopped after %gs: %s\n", #left, timeout,
      table.concat(left, ", "))
    return cli.EXIT_FAIL
  end
  return cli.EXIT_OK
end

--- M.ops_options(opts, modes) -> the options of moonbox.schedule.ops.attach (any = true when
-- one was given), or nil and a usage message. Reads the control token file.
function M.ops_options(opts, modes)
  local o = { webhooks = opts.webhook or {} }
  local given = opts.listen or opts.webhook or opts["trace-dir"] or opts["control-token-file"]
    or opts["webhook-timeout"] or opts["webhook-queue"]
  if given and #modes > 0 then
    return nil, "--listen, --webhook, --trace-dir and --control-token-file apply to the daemon, not to " ..
      table.concat(modes, " ")
  end
  if opts.listen then
    local host, port = ops_mod.parse_listen(opts.listen)
    if not host then return nil, "--listen: " .. port end
    o.host, o.port = host, port
  end
  for i, u in ipairs(o.webhooks) do
    local ok, why = schedule.check_webhook(u)
    if not ok then return nil, string.format("--webhook (the %d. one): %s", i, why) end
  end
  if opts["webhook-timeout"] then
    local v = tonumber(opts["webhook-timeout"])
    if not v or v <= 0 then return nil, "--webhook-timeout: expected a number of seconds > 0" end
    o.webhook_timeout = v
  end
  if opts["webhook-queue"] then
    local v = math.tointeger(tonumber(opts["webhook-queue"]))
    if not v or v < 1 then return nil, "--webhook-queue: expected an integer >= 1" end
    o.webhook_queue = v
  end
  if opts["trace-dir"] then
    local dir = opts["trace-dir"]
    if dir:sub(1, 1) ~= "/" then dir = sys.getcwd() .. "/" .. dir end
    o.trace_dir = dir
  end
  local tok_file = opts["control-token-file"]
  if tok_file then
    local tok, err = ops_mod.read_token(tok_file)
    if not tok then return nil, "--control-token-file: " .. err end
    o.control_token = tok
  elseif opts.listen and (os.getenv("MOONBOX_CONTROL_TOKEN") or "") ~= "" then
    o.control_token = os.getenv("MOONBOX_CONTROL_TOKEN")
    if #o.control_token < 16 then return nil, "MOONBOX_CONTROL_TOKEN must have at least 16 characters" end
  end
  if o.control_token and not o.host then return nil, "a control token needs --listen (the page's buttons)" end
  local hf = io.open("/etc/hostname")
  if hf then
    o.hostname = hf:read("l")
    hf:close()
  end
  o.any = given and true or false
  return o
end

--- main(args, cli) -> exit status: `moonbox schedule FILE [--list | --next NAME [N] | --trigger NAME |
-- --pause NAME | --resume NAME | --stop [--drain] [--timeout S]] [daemon options]`. args are the
-- words after `schedule`; cli is moonbox.cli (flag parsing, usage errors, exit codes). Checks the
-- flags first (a usage error -> cli.usage_error's status, nothing opened), registers the API key
-- and run env values as secrets, opens the ledger (waiting for it only in daemon mode) and the
-- schedule store, runs the recipe (which must register at least one schedule) and then does the
-- one mode asked for; without one it builds the daemon, attaches the ops server when any of
-- --listen/--webhook/--trace-dir/--control-token-file was given, and runs until stopped. A
-- failure of the recipe, the store or the daemon is printed to stderr (prefixed
-- "moonbox schedule: ") and gives EXIT_FAIL; a --trigger run that is not ok and a --stop that
-- leaves daemons running also give EXIT_FAIL; a SIGINT/SIGTERM that stops the daemon is a clean
-- end (the status above, not 130/143).
-- Never raises; closes the ledger on every path. Runs the loop itself (cli.run_root_opts): call
-- it from outside any task.
function M.main(args, cli)
  local opts, rest = cli.parse_flags(args, { list = "flag", next = "value", trigger = "value",
    pause = "value", resume = "value", drain = "flag", backend = "value", listen = "value",
    webhook = "list", ["webhook-timeout"] = "value", ["webhook-queue"] = "value", ["trace-dir"] = "value",
    ["control-token-file"] = "value", state = "value", stop = "flag", timeout = "value" })
  if not opts then return cli.usage_error("schedule: %s", rest) end
  local file = rest[1]
  if not file then return cli.usage_error("schedule: missing the recipe FILE") end
  local modes = {}
  for _, k in ipairs { "list", "next", "trigger", "pause", "resume", "stop" } do
    if opts[k] then modes[#modes + 1] = "--" .. k end
  end
  if #modes > 1 then return cli.usage_error("schedule: %s cannot be combined", table.concat(modes,
      " and ")) end
  local stop_timeout = 60
  if opts.timeout then
    stop_timeout = tonumber(opts.timeout)
    if not opts.stop then return cli.usage_error("schedule: --timeout applies to --stop") end
    if not stop_timeout or stop_timeout <= 0 then
      return cli.usage_error("schedule: --timeout: expected a number of seconds > 0, got '%s'", opts.timeout)
    end
  end
  if opts.drain and #modes > 0 and not opts.stop then
    return cli.usage_error("schedule: --drain applies to the daemon or to --stop, not to %s", modes[1])
  end
  local n_next = 5
  if opts.next then
    n_next = tonumber(rest[2] or "5")
    if not n_next or n_next < 1 or n_next % 1 ~= 0 then
      return cli.usage_error("schedule: --next NAME N: N must be a positive integer, got '%s'",
          tostring(rest[2]))
    end
    if rest[3] then return cli.usage_error("schedule: unexpected argument '%s'", rest[3]) end
  elseif rest[2] then
    return cli.usage_error("schedule: unexpected argument '%s'", rest[2])
  end
  local bad = cli.bad_backend("schedule", opts.backend)
  if bad then return bad end
  local ops_opts, operr = M.ops_options(opts, modes)
  if not ops_opts then return cli.usage_error("schedule: %s", operr) end
  local cok, clock = pcall(clock_mod.from_env)
  if not cok then return cli.usage_error("schedule: %s", tostring(clock)) end
  local chunk, lerr = loadfile(file)
  if not chunk then
    cli.eprintf("moonbox schedule: cannot load recipe: %s\n", lerr)
    return cli.EXIT_FAIL
  end
  cli.set_arg(file, {})
  -- Never in a log line, the history, an alert or the page: the API key, and every env value a
  -- run gives moonbox.render (kept for the life of the process, trace or not).
  trace.secret(os.getenv("RENDER_API_KEY"), true)
  trace.keep_secrets()
  schedule._set_running(true)
  build.ledger = true
  if opts.state then db_mod.set_target(opts.state) end
  local tok, terr = pcall(db_mod.target)
  if not tok then return cli.usage_error("schedule: --state: %s", tostring(terr)) end
  local ledger, store
  local status = cli.EXIT_OK
  local code, err = cli.run_root_opts({ quiet_signals = true }, function()
    ledger = open_ledger(#modes == 0)
    store = store_mod.open(ledger)
    ledger_mod.set_process(ledger) -- creates outside any run go to this process's own run
    if opts.backend then render.connect { backend = opts.backend } end
    local ok, e = xpcall(chunk, core.msgh)
    if not ok then error(e, 0) end
    local all = schedule.list()
    if #all == 0 then
      error(string.format("moonbox schedule: %s registered no schedules " ..
        "(call schedule.cron or schedule.every)", file), 0)
    end
    local name = opts.next or opts.trigger or opts.pause or opts.resume
    local s = name and schedule.get(name)
    if name and not s then
      local names = {}
      for i, x in ipairs(all) do names[i] = x.name end
      error(string.format("moonbox schedule: %s has no schedule named '%s' (it has: %s)", file, name,
        table.concat(names, ", ")), 0)
    end
    local now = clock:now()
    if opts.stop then
      status = stop_fleet(store, all, opts.drain and "drain" or "stop", stop_timeout, cli)
    elseif opts.list then
      list(store, clock) -- reads only: a schedule with no row yet is listed "new"
    elseif opts.next then
      local t = now
      for _ = 1, n_next do
        t = schedule.next_after(s, t)
        if not t then break end
        line_out(schedule.format_slot(s, t))
      end
    elseif opts.pause or opts.resume then
      store:ensure(s, file, now)
      if opts.pause then
        store:set_paused(name, true, "paused by --pause at " .. clock_mod.format(now), now)
        line_out(string.format("%s: paused (a running daemon skips its fires from the next one)", name))
      else
        store:set_paused(name, false, nil, now)
        line_out(string.format("%s: resumed (failure count cleared)", name))
      end
    else
      local d = daemon_mod.new { recipe = file, schedules = all, clock = clock,
        store = store, out = line_out, drain = opts.drain, format_error = cli.format_error,
        errout = function(text) io.stderr:write(trace.redact(text)) end }
      if opts.trigger then
        local run = d:trigger(s)
        if run.outcome ~= "ok" then status = cli.EXIT_FAIL end
      else
        local ops
        if ops_opts.any then
          ops_opts.recipe, ops_opts.schedules, ops_opts.clock, ops_opts.store = file, all, clock, store
          ops_opts.log = function(text) line_out(clock_mod.format(clock:now()) .. " " .. text) end
          local aok, aerr = pcall(ops_mod.attach, d, ops_opts)
          if not aok then
            error(string.format("moonbox schedule: --listen %s: %s", tostring(opts.listen),
              type(aerr) == "table" and tostring(aerr.message or aerr) or tostring(aerr)), 0)
          end
          ops = aerr
          if ops.srv and not ops_mod.is_loopback(ops.srv.host) then
            io.stderr:write(string.format("moonbox schedule: warning: the status page and /metrics listen " ..
              "on %s, not a loopback address: whoever can reach it reads run errors and history%s\n",
              ops.srv.url, ops_opts.control_token and " and may try control tokens" or ""))
          end
          if ops.srv then
            line_out(string.format("%s listening on %s (/healthz, /metrics, status page at /%s)",
              clock_mod.format(clock:now()), ops.srv.url, ops_opts.control_token and "; control enabled" or
              "; read-only"))
          end
        end
        local rok, rerr = pcall(d.run, d)
        if ops then ops:close() end
        if not rok then error(rerr, 0) end
      end
    end
    if ledger.run_id then ledger:end_run("ok") end
    pcall(render.close)
  end)
  if ledger and ledger_mod.process() == ledger then ledger_mod.set_process(nil) end
  if ledger then ledger:close() end
  if err ~= nil then
    local msg = cli.format_error(err)
    if not msg:match("^moonbox schedule: ") then
      msg = "moonbox schedule: recipe " .. file .. " failed: " .. msg
    end
    cli.eprintf("%s\n", msg)
    return cli.EXIT_FAIL
  end
  if code == 130 or code == 143 then return status end
  if code ~= cli.EXIT_OK then return code end
  return status
end

return M
