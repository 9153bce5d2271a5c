--- moonbox.cli — the `moonbox` command: argument parsing, help, and exit codes.
--
-- Exit codes: 0 success; 1 the recipe (or a test) failed; 2 usage error; 3 the registry-ref
-- leak check failed (tests); 130 interrupted by SIGINT, 143 by SIGTERM (after the recipe's
-- task was cancelled and its guards unwound).
local core = require "moonbox.core"
local build = require "moonbox.build"
local duration = require "moonbox.duration"
local path = require "moonbox.path"
local sys = require "moonbox.sys"

-- What a command uses, loaded when that command runs: lazy.reap is the module moonbox.reap,
-- lazy["local.service"] moonbox.local.service.
local lazy = setmetatable({}, { __index = function(t, name)
  -- lazy: at the top these would load for every command, `moonbox --version` and an empty
  -- `moonbox run` included: the Render client, the local backend, the ledger with libcurl,
  -- libmicrohttpd and SQLite (about 40 ms and 10 MB more at each start), and what only
  -- `moonbox run` needs (the budget, the trace, JSON) for every other command.
  local m = require("moonbox." .. name)
  t[name] = m
  return m
end })
require("moonbox.http_schema").install() -- moonbox.http's calls checked against their schema

local M = {}

local EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
local EXIT_SIGNAL = { INT = 130, TERM = 143 }

local commands = {}
local order = {}

local function command(name, summary, usage, detail, fn)
  commands[name] = { summary = summary, usage = usage, detail = detail, fn = fn }
  order[#order + 1] = name
end

local function eprintf(fmt, ...)
  io.stderr:write(string.format(fmt, ...))
end

local function usage_error(fmt, ...)
  eprintf("moonbox: " .. fmt .. "\n", ...)
  eprintf("Run `moonbox help` for the commands.\n")
  return EXIT_USAGE
end

--- Formats an error for a person: one line, then the traceback where one is known.
function M.format_error(err)
  if type(err) == "table" and core.Error.is(err) then
    local s = tostring(err)
    if err.traceback then s = s .. "\n" .. err.traceback end
    return s
  end
  if type(err) == "string" then return err end
  local ok, s = pcall(tostring, err)
  return ok and s or ("(" .. type(err) .. " error object)")
end

-- Sets the global `arg` as the standalone interpreter does: script at 0, its arguments at 1..n.
local function set_arg(script, args)
  local a = { [-1] = build.exe, [0] = script }
  for i, v in ipairs(args) do a[i] = v end
  _G.arg = a
end

--- cli.finish_run(): what `moonbox run` and `moonbox repl` do when the recipe (or session) has
-- ended, whatever happened: creates of this process whose answer never came are settled by
-- their labels, and the embedded local backend it used is left (stopped when no other run uses
-- it). Failures are reported on stderr; `moonbox reap` finishes what is left. [yields]
function M.finish_run()
  local render = package.loaded["moonbox.render"]
  if not render then return end
  local L = lazy.ledger.process()
  local c = render.current_connection()
  if L and L.run_id and c then
    local ok, err = pcall(lazy.reap.settle_unknown, L, L.run_id, c, function(line)
      io.stderr:write("moonbox: ", line, "\n")
    end)
    if not ok then io.stderr:write("moonbox: settling lost creates failed: ", M.format_error(err), "\n") end
  end
  local ok, err = pcall(render.close)
  if not ok then io.stderr:write("moonbox: leaving the backend failed: ", M.format_error(err), "\n") end
end

--- cli.print_dry_run(report, file, want_json, summary_fields): what `moonbox run --dry-run`
-- prints on stdout once the recipe ended: the report as text (moonbox.dryrun.text), or
-- as one JSON line with --json: the dry run's own keys, and the facts `moonbox run --json` has
-- under its keys (summary_fields: run_summary's s:fields, which win over the report's).
function M.print_dry_run(rep, file, want_json, summary_fields)
  local dryrun = lazy.dryrun
  if want_json then
    io.stdout:write(lazy.trace.redact(dryrun.json(rep, summary_fields)), "\n")
  else
    io.stdout:write(dryrun.text(rep, file), "\n")
  end
  io.stdout:flush()
end

--- Runs fn(...) as the root task with SIGINT/SIGTERM cancelling it; returns exit code, plus
-- the error when it failed.
local function run_root(fn, ...)
  return M.run_root_opts({}, fn, ...)
end

--- Like run_root; opts.quiet_signals: a signal is a normal way to stop (no message).
function M.run_root_opts(opts, fn, ...)
  local sigs = core.signal_cancel({ "INT", "TERM" })
  local ok, err = pcall(core.run, fn, ...)
  local sig = core.signal_received()
  core.signal_restore(sigs)
  -- Background tasks still running are cancelled and allowed to unwind.
  core.shutdown()
  local unobserved = core.report_unobserved()
  if sig then
    local cancelled = type(err) == "table" and core.Error.is(err) and err.code == "cancelled"
    if opts.quiet_signals and (ok or cancelled) then
      return EXIT_SIGNAL[sig] or EXIT_FAIL
    end
    if not ok and not (type(err) == "table" and core.Error.is(err) and err.code == "cancelled") then
      eprintf("moonbox: interrupted by SIG%s; while unwinding: %s\n", sig, M.format_error(err))
    else
      eprintf("moonbox: interrupted by SIG%s; the recipe was cancelled and unwound\n", sig)
    end
    return EXIT_SIGNAL[sig] or EXIT_FAIL
  end
  if not ok then return EXIT_FAIL, err end
  if unobserved > 0 then
    eprintf("moonbox: %d task(s) failed without being joined (see above)\n", unobserved)
    return EXIT_FAIL
  end
  return EXIT_OK
end

--- Checks a --backend value: nil when fine (or absent), else the usage error's exit status
-- (the message names the command).
local function bad_backend(cmd, b)
  if b == nil or b == "local" or b == "render" or b:match("^https?://") then return nil end
  return usage_error("%s: --backend must be a URL, local or render, got '%s'", cmd, b)
end
M.bad_backend = bad_backend

command("run", "run a recipe as a task",
  "moonbox run [--backend URL|local|render] [--trace FILE] [--json] [--progress] [--dry-run]\n" ..
  "                   [--max-sandboxes N] [--max-sandbox-seconds S]\n" ..
  "                   [--durable [--run-id NAME] | --record CASSETTE | --replay CASSETTE] FILE [ARGS...]\n" ..
  "       moonbox run --resume RUN [FILE [ARGS...]]",
  [[Loads FILE as a Lua chunk and runs it as the root task on the event loop, so its top
level can call any moonbox function that waits. ARGS are in the global `arg` table (arg[0] is
FILE), as with `lua`. When the chunk returns, tasks it left running are cancelled and unwound.

Exit status: 0 on success; 1 when the recipe raised (message and traceback on stderr) or a task
failed with nobody joining it; 2 on usage errors; 130 after SIGINT and 143 after SIGTERM, once
the recipe's task was cancelled and its guards unwound. A second SIGINT while unwinding exits
at once (130) and leaves what is still running to `moonbox reap`.

--backend chooses where moonbox.render calls go: a URL (a `moonbox local` or another
compatible server), `local` (the embedded local backend, started for the recipe when none is
running), or `render` (Render's cloud; needs RENDER_API_KEY). Without it: RENDER_LOCAL_DEV_URL,
then RENDER_API_KEY, then the embedded local backend.

--trace FILE writes Chrome trace event JSON (open it in Perfetto): one span per API call, per
task and per sandbox's life, and the adaptive concurrency windows. Never a secret.
--json prints a machine-readable summary as the last line of stdout: outcome, exit status,
duration, the sandbox ids created, terminated, kept and leaked, API calls, errors.
--progress shows the progress line (created/running/failed/terminated, elapsed) on stderr even
when stderr is not a terminal; on a terminal it is always shown.

--max-sandboxes N and --max-sandbox-seconds S are the run's budget (docs/reference/render.md,
"Budgets"): a create beyond N raises budget_exceeded before anything is sent; when the run's
sandboxes have existed S seconds in total, those still running are terminated and the run
fails with budget_exceeded. A recipe's render.budget{...} can lower them, never raise them.

--dry-run runs the recipe against moonbox local's own service with a simulated engine, over an
in-memory transport, on a simulated clock: no process, no network, no sandbox, and every call
refused as moonbox local refuses it. Execs exit 0 with empty output unless the recipe's
render.dry_run hooks say otherwise. Then it prints what the run would do: each step in
simulated time, creates by plan, snapshots, restores, execs, peak live sandboxes and
sandbox-seconds (with --json: one JSON object instead). Budgets apply. See
docs/reference/render.md, "Dry runs", for what a dry run can and cannot tell.

--durable journals the run in the run store (the ledger's database): every Render call with its
answer, every task.step's results, the clock and the randomness it reads. If the run dies
(SIGKILL, a lost machine), `moonbox run --resume RUN` runs the recipe again from the top with the
same arguments and backend: journaled calls get their recorded answers without touching the
backend, the sandboxes it had are adopted as they are, and from the first call past the journal
it runs live. A call that differs from the journal raises nondeterminism; a sandbox the journal
holds that is gone raises lost_sandbox. --run-id NAME names the run: the same command again
resumes it when it died (and refuses when it runs or has ended). `moonbox reap` leaves a durable
run that died to its resume (`moonbox reap --abandon RUN` gives it up). A durable schedule's run
(docs/schedule.md) is refused: the `moonbox schedule` daemons resume it.
--record CASSETTE writes the same journal to a file, with the recipe's own moonbox.http requests;
--replay CASSETTE runs the recipe with no backend at all, every call answered from the cassette
(FILE defaults to the one recorded). Secrets never enter a journal or a cassette. See
docs/reference/durable.md.]],
  -- The command: parses the flags above (a bad one is a usage error, status 2), loads the
  -- recipe (a load error is status 1), then runs its chunk as the root task (run_root: the
  -- loop runs here, outside any task) under the run's budget, with the dry-run simulation,
  -- the progress line and the trace when asked. Afterwards it closes the ledger's record of
  -- this process, the budget and the trace, and prints the dry-run report or the --json
  -- summary. Returns the exit status run_root gives (e.g. 0, 1, 130/143 after a signal); the
  -- recipe's error is printed (M.format_error), never raised.
  function(args)
    local backend, trace_file, want_json, want_progress, dry_run
    local limits = {}
    local jopts = {} -- a journal (moonbox.durable.run): durable, run_key, resume, record, replay
    local VALUED = { backend = true, trace = true, ["max-sandboxes"] = true, ["max-sandbox-seconds"] = true,
      ["run-id"] = true, resume = true, record = true, replay = true }
    while args[1] and args[1]:match("^%-%-") do
      local a = table.remove(args, 1)
      local name, v = a:match("^%-%-([%w%-]+)=(.*)$")
      name = name or a:sub(3)
      if VALUED[name] then
        if not v then
          v = table.remove(args, 1)
          if not v then return usage_error("run: --%s needs a value", name) end
        end
        if name == "run-id" then
          if not v:match("^[%w][%w._:-]*$") or #v > 128 or math.tointeger(tonumber(v)) then
            return usage_error("run: --run-id wants a name of letters, digits and ._:- (not a number, " ..
              "at most 128), got '%s'", v)
          end
          jopts.run_key = v
        elseif name == "resume" then
          jopts.resume = v
        elseif name == "record" then
          jopts.record = v
        elseif name == "replay" then
          jopts.replay = v
        elseif name == "backend" then
          backend = v
        elseif name == "trace" then
          trace_file = v
        elseif name == "max-sandboxes" then
          limits.sandboxes = math.tointeger(tonumber(v))
          if not limits.sandboxes or limits.sandboxes < 0 then
            return usage_error("run: --max-sandboxes wants a whole number >= 0, got '%s'", v)
          end
        else
          limits.sandbox_seconds = duration.parse(v) or tonumber(v)
          if not limits.sandbox_seconds or limits.sandbox_seconds < 0 then
            return usage_error("run: --max-sandbox-seconds wants seconds or a duration like 2h, got '%s'", v)
          end
        end
      elseif name == "json" and not v then
        want_json = true
      elseif name == "progress" and not v then
        want_progress = true
      elseif name == "dry-run" and not v then
        dry_run = true
      elseif name == "durable" and not v then
        jopts.durable = true
      elseif a == "--" then
        break
      else
        return usage_error("run: unknown option '%s'", a)
      end
    end
    local bad = bad_backend("run", backend)
    if bad then return bad end
    if dry_run and backend then
      return usage_error("run: --dry-run simulates the backend; it takes no --backend")
    end
    -- which journal, if any (docs/reference/durable.md)
    local jmode
    local modes = {}
    if jopts.durable or jopts.run_key then modes[#modes + 1] = jopts.durable and "--durable" or "--run-id" end
    if jopts.resume then modes[#modes + 1] = "--resume" end
    if jopts.record then modes[#modes + 1] = "--record" end
    if jopts.replay then modes[#modes + 1] = "--replay" end
    if dry_run then modes[#modes + 1] = "--dry-run" end
    if jopts.run_key and not jopts.durable then
      return usage_error("run: --run-id names a durable run: give --durable too")
    end
    if #modes > 1 then
      return usage_error("run: %s and %s cannot be combined", modes[1], modes[2])
    end
    if jopts.durable or jopts.resume then jmode = "durable"
    elseif jopts.record then jmode = "record"
    elseif jopts.replay then jmode = "replay" end
    if (jopts.resume or jopts.replay) and backend then
      return usage_error("run: %s takes the backend from %s; it takes no --backend",
        jopts.resume and "--resume" or "--replay",
        jopts.resume and "the run it resumes" or "the cassette (none)")
    end
    local file = args[1]
    if not file and not (jopts.resume or jopts.replay) then
      return usage_error("run: missing the recipe FILE")
    end
    local rest = table.move(args, 2, #args, 1, {})
    local chunk
    local function load_recipe(f, a)
      local ch, lerr = loadfile(f)
      if not ch then return nil, lerr end
      set_arg(f, a)
      file, rest, chunk = f, a, ch
      return ch
    end
    -- A resume runs the recipe its run recorded (a replay, its cassette's when none is given):
    -- it is loaded once the journal is open, in the root task.
    if file and not (jopts.resume or (jopts.replay and not file)) then
      local ok, lerr = load_recipe(file, rest)
      if not ok then
        eprintf("moonbox: cannot load recipe: %s\n", lerr)
        return EXIT_FAIL
      end
    end
    -- moonbox.render records this run's creates (moonbox ps / reap); a dry run creates nothing,
    -- nor does a replay.
    build.ledger = not dry_run and jmode ~= "replay"
    local trace = lazy.trace
    if trace_file then
      local ok, terr = pcall(trace.start, trace_file,
        { name = "moonbox run " .. tostring(file or jopts.resume) })
      if not ok then
        eprintf("moonbox: %s\n", M.format_error(terr))
        return EXIT_FAIL
      end
    end
    local summary = want_json and lazy.run_summary.start() or nil
    local dry_report
    local t_start = core.now()
    local budget_mod = lazy["render.budget"]
    local budget = budget_mod.new(limits)
    local jctx, jstats, setup_failed
    local code, err = run_root(function()
      if jmode then
        -- A journal that cannot be set up (a run that cannot be resumed, a cassette that is not
        -- one) is a one-line message, not a recipe's failure.
        local ok, c = pcall(lazy["durable.run"].begin, { mode = jmode, file = file, args = rest,
          args_given = #rest > 0, backend = backend, run_key = jopts.run_key, resume = jopts.resume,
          cassette = jopts.record or jopts.replay })
        if not ok then
          setup_failed = type(c) == "table" and M.format_error(c) or tostring(c)
          M.finish_run()
          return
        end
        jctx = c
        jctx.cassette_path = jopts.record or jopts.replay
        if not chunk then
          local lok, lerr = load_recipe(jctx.file, jctx.args)
          if not lok then
            -- the run stays resumable (with the recipe put back, or another FILE given)
            setup_failed = "moonbox: cannot load recipe: " .. tostring(lerr)
            lazy["durable.run"].finish(jctx)
            jctx = nil
            M.finish_run()
            return
          end
        end
      end
      -- Errors made where no recipe frame is on the stack (a tail call of the chunk) name the
      -- recipe file rather than moonbox's own.
      local data = core.data(core.current())
      data.site, data.site_recipe = file, true
      if dry_run then lazy.dryrun.start() end
      budget_mod.attach(core.current(), budget)
      local progress
      if not dry_run and (want_progress or core.isatty(2)) then
        progress = lazy.progress.start { tty = core.isatty(2) }
      end
      if backend and not jmode then lazy.render.connect { backend = backend } end
      local r = table.pack(xpcall(chunk, core.msgh, table.unpack(rest)))
      -- a dry run past its simulated-time limit cancelled the recipe: that limit is the error
      if dry_run and not r[1] and lazy.dryrun.over() then r = table.pack(false, lazy.dryrun.over()) end
      if progress then progress:stop() end
      if jctx then jstats = lazy["durable.run"].finish(jctx) end
      M.finish_run()
      if dry_run then dry_report = lazy.dryrun.stop() end
      return budget_mod.settle(budget, r)
    end)
    if setup_failed then
      eprintf("%s\n", setup_failed)
      -- nothing ran: a claimed run is left as it was (dead, so resumable again)
      local ledger = package.loaded["moonbox.ledger"]
      local L = ledger and ledger.process()
      if L then
        L:stop_keeping()
        L:close()
        ledger.set_process(nil)
      end
      budget:close()
      return EXIT_FAIL
    end
    if jctx then
      local line = lazy["durable.run"].describe(jctx, jstats)
      if line then eprintf("%s\n", line) end
    end
    if err ~= nil then
      if file then
        eprintf("moonbox: recipe %s failed: %s\n", file, M.format_error(err))
      else
        eprintf("%s\n", M.format_error(err))
      end
    end
    local outcome = code == 0 and "ok" or (code == 130 or code == 143) and "interrupted" or "failed"
    -- A run that never loaded the ledger has none to close (and need not load SQLite for it).
    local ledger = package.loaded["moonbox.ledger"]
    if ledger then ledger.close_process(outcome) end
    budget:close()
    if trace_file then trace.stop() end
    local run_info = { recipe = file, exit_code = code, error = err, duration_s = core.now() - t_start,
      budget = budget, dry_run = dry_report ~= nil }
    if dry_report then
      M.print_dry_run(dry_report, file, want_json, summary and summary:fields(run_info))
    elseif summary then
      io.stdout:write(summary:finish(run_info), "\n")
      io.stdout:flush()
    end
    return code
  end)

command("test", "run busted specs inside moonbox", "moonbox test [BUSTED ARGS...]",
  [[Runs busted (Debian's lua-busted) inside this binary, so specs have the real event loop.
Specs use require("moonbox.testing").async(fn) to run a test body as a task. All busted
arguments work (e.g. `moonbox test spec/task_spec.lua --filter=timeout`). The registry-ref leak
check runs at exit: a run that leaves any Lua registry reference held fails with status 3.]],
  function(args)
    core.leakcheck(true)
    local bargs = { [0] = "busted" }
    for i, v in ipairs(args) do bargs[i] = v end
    _G.arg = bargs
    local real_exit = os.exit
    local exit_mt = {}
    os.exit = function(code) -- luacheck: ignore 122
      if code == true or code == nil then code = 0 elseif code == false then code = 1 end
      error(setmetatable({ code = code }, exit_mt), 0)
    end
    -- lazy: busted (Debian's lua-busted) is for `moonbox test` alone
    local ok, err = pcall(require("busted.runner"), { standalone = false })
    os.exit = real_exit -- luacheck: ignore 122
    if ok then return EXIT_OK end
    if getmetatable(err) == exit_mt then return err.code end
    eprintf("moonbox test: %s\n", M.format_error(err))
    return EXIT_FAIL
  end)

--- Parses --flag VALUE / --flag=VALUE options against a spec {name = "value"|"flag"}; returns
-- options, positional arguments, or nil and a message.
local function parse_flags(args, spec)
  local opts, rest = {}, {}
  local i = 1
  while i <= #args do
    local a = args[i]
    local name, value = a:match("^%-%-([%w%-]+)=(.*)$")
    if not name then name = a:match("^%-%-([%w%-]+)$") end
    if name then
      local kind = spec[name]
      if not kind then return nil, "unknown option --" .. name end
      if kind == "flag" then
        opts[name] = true
      else
        if value == nil then
          i = i + 1
          value = args[i]
          if value == nil then return nil, "option --" .. name .. " needs a value" end
        end
        if kind == "list" then -- repeatable: every value, in order
          opts[name] = opts[name] or {}
          table.insert(opts[name], value)
        else
          opts[name] = value
        end
      end
    else
      rest[#rest + 1] = a
    end
    i = i + 1
  end
  return opts, rest
end
M.parse_flags = parse_flags

M.state_home = path.state_home

--- cli.parse_size(text) -> bytes, or nil: "512", "64K", "512M", "40G", "1T" (powers of 1024; a
-- trailing "iB" or "B" allowed).
function M.parse_size(text)
  local n, unit = tostring(text):match("^(%d+)%s*([KkMmGgTt]?)i?[Bb]?$")
  n = n and math.tointeger(tonumber(n))
  if not n then return nil end
  local shift = ({ [""] = 0, k = 10, m = 20, g = 30, t = 40 })[unit:lower()]
  if n >= (1 << (62 - shift)) then return nil end
  return n << shift
end

--- A path given on the command line, made absolute against the working directory (nil stays nil).
local function absolute(p)
  if p == nil or p:sub(1, 1) == "/" then return p end
  return path.clean(sys.getcwd() .. "/" .. p)
end

command("local", "serve Render's sandbox API on this machine",
  "moonbox local [--port N] [--state DIR] [--image DIR | --host-root] [--faults SPEC]\n" ..
  "                     [--api-key KEY | --api-key-file FILE] [--workspace tea-...]\n" ..
  "                     [--concurrency-limit N] [--seed N] [--dns IPV4] [--rate-limit N]\n" ..
  "                     [--public-url URL] [--disk PLAN=SIZE]... [--disk-size SIZE]\n" ..
  "       moonbox local --check [--state DIR]",
  [[Serves Render's sandbox API (under /v1) on 127.0.0.1 and ::1 and runs real, isolated sandboxes on
this machine: each in its own user namespace (root inside is an unprivileged id on the host),
with a seccomp filter, its plan's cgroup limits, and an overlay root over a Debian 12 image
(built once per machine with mmdebstrap; --image DIR for your own root filesystem; --host-root
for the host's own /, discouraged). Snapshots are layers. Prints the lines that point a client
at it:

  RENDER_LOCAL_DEV_URL=http://127.0.0.1:8120
  RENDER_API_KEY=...            (generated at first start, kept 0600 in the state dir)
  RENDER_WORKSPACE_ID=tea-...

--port 0 picks a free port (the same on both addresses).
--api-key-file FILE (its first word), or MOONBOX_LOCAL_API_KEY in the environment, fixes the API key
instead of the generated one; --api-key KEY does too, but every user of the host can read a
process's argv: moonbox wipes the value from its own at start, a moment after it was visible.
--state DIR defaults to $XDG_STATE_HOME/moonbox/local.
--dns IPV4 is the resolver that allow-list sandboxes' gates ask for the allowed names (default:
the host's, through slirp4netns; see docs/local-isolation.md).
--rate-limit N answers /v1 requests beyond N a minute with 429 and Retry-After (default 100000;
every /v1 answer carries RateLimit-Limit, -Remaining and -Reset; a low N rehearses throttling).
--public-url URL (e.g. https://sandbox.example.test): the base of the exec and file URIs it
hands out; without it they follow the request's Host, or a loopback proxy's X-Forwarded-Host and
X-Forwarded-Proto (docs/local.md: "Behind a TLS proxy").
--disk PLAN=SIZE (repeatable) bounds each sandbox of PLAN to SIZE bytes of writes (K, M, G, T:
powers of 1024; default 40G, Render's figure, every plan); --disk-size SIZE is the size of the
sandbox disk when it is first made (default: the state directory's free space less its
reserve). See docs/local.md: "Disk".
--faults injects errors (see docs/local.md: "Fault injection"); the control endpoint
/_moonbox/faults changes them at run time and /_moonbox/journal lists the requests received.
Stops cleanly on SIGINT/SIGTERM (exit status 0). --embedded is how moonbox starts its embedded
backend (docs/reference/render.md): it also stops when no moonbox process uses it any more.
--check serves nothing: it reads every layer of every available snapshot in the state dir in
full and compares it with the manifest written at capture, one line per snapshot and a summary;
exit status 1 when any does not match. It needs the state dir's lock: it refuses while a backend
serves that dir (docs/local.md: "Snapshots").]],
  -- The command: checks every flag before anything starts (usage errors, status 2: a port out
  -- of range, a host that is not loopback, a bad --public-url, --dns or --rate-limit, an
  -- unreadable @faults file), then in the root task starts the backend (moonbox.local.start),
  -- prints its RENDER_* variables on stdout and serves until SIGINT/SIGTERM (or, --embedded,
  -- until no moonbox process uses it), closing it on the way out. Returns 0 after a signal,
  -- 1 (the error printed) when it cannot start.
  function(args)
    local opts, rest = parse_flags(args, { port = "value", state = "value", image = "value",
      ["host-root"] = "flag", faults = "value", ["api-key"] = "value", ["api-key-file"] = "value",
      workspace = "value",
      ["concurrency-limit"] = "value", seed = "value", host = "value", quiet = "flag", embedded = "flag",
      dns = "value", ["rate-limit"] = "value", ["public-url"] = "value", disk = "list",
      ["disk-size"] = "value", check = "flag" })
    if not opts then return usage_error("local: %s", rest) end
    if opts.check then
      for k in pairs(opts) do
        if k ~= "check" and k ~= "state" then
          return usage_error("local: --check takes only --state DIR, not --%s", k)
        end
      end
      if #rest > 0 then return usage_error("local: unexpected argument '%s'", rest[1]) end
      local status
      local code, err = M.run_root_opts({ quiet_signals = true }, function()
        local state_dir = absolute(opts.state) or (M.state_home() .. "/local")
        status = lazy["local.check"].run(state_dir, function(line)
          io.stdout:write(line, "\n")
          io.stdout:flush()
        end)
      end)
      if err ~= nil then
        eprintf("moonbox local --check: %s\n", M.format_error(err))
        return EXIT_FAIL
      end
      return status or code
    end
    local disk, disk_size
    for _, d in ipairs(opts.disk or {}) do
      local plan, size = d:match("^([^=]+)=(.*)$")
      local bytes = size and M.parse_size(size)
      local service = lazy["local.service"]
      if not (plan and service.PLANS[plan] and bytes and bytes > 0) then
        return usage_error(
          "local: --disk wants PLAN=SIZE (PLAN one of %s; SIZE such as 512M or 40G), got '%s'",
          service.PLAN_NAMES, d)
      end
      disk = disk or {}
      disk[service.PLAN_ALIASES[plan] or plan] = bytes
    end
    if opts["disk-size"] then
      disk_size = M.parse_size(opts["disk-size"])
      if not (disk_size and disk_size > 0) then
        return usage_error("local: --disk-size wants a size such as 100G, got '%s'", opts["disk-size"])
      end
    end
    local rate_limit = opts["rate-limit"] and math.tointeger(tonumber(opts["rate-limit"]))
    if opts["rate-limit"] and not (rate_limit and rate_limit >= 1) then
      return usage_error("local: --rate-limit wants a whole number of requests per minute >= 1, got '%s'",
        opts["rate-limit"])
    end
    if #rest > 0 then return usage_error("local: unexpected argument '%s'", rest[1]) end
    if opts.image and opts["host-root"] then return usage_error(
      "local: --image and --host-root exclude each other") end
    local port = tonumber(opts.port or "8120")
    if not port or port < 0 or port > 65535 or port % 1 ~= 0 then
      return usage_error("local: --port must be 0..65535")
    end
    local loopback = { ["127.0.0.1"] = true, localhost = true, ["::1"] = true }
    if opts.host and not loopback[opts.host] then
      return usage_error("local: --host must be a loopback address; moonbox local never listens elsewhere")
    end
    if opts["public-url"] then
      local ok_url, why = lazy["local.http.public"].valid_url(opts["public-url"])
      if not ok_url then return usage_error("local: --public-url %s: %s", opts["public-url"], why) end
    end
    if opts.dns and not opts.dns:match("^%d+%.%d+%.%d+%.%d+$") then
      return usage_error("local: --dns must be an IPv4 address (the resolver allow-list sandboxes ask)")
    end
    -- The key: --api-key (wiped from argv by main.c), else --api-key-file's first word, else
    -- $MOONBOX_LOCAL_API_KEY (unset once read, so no child inherits it).
    local api_key = opts["api-key"]
    if api_key and opts["api-key-file"] then
      return usage_error("local: --api-key and --api-key-file exclude each other")
    end
    if opts["api-key-file"] then
      local f = io.open(opts["api-key-file"])
      api_key = f and f:read("a"):match("^%s*(%S+)")
      if f then f:close() end
      if not api_key then
        return usage_error("local: --api-key-file %s: cannot read a key from it (one word, e.g. rnd_...)",
          opts["api-key-file"])
      end
    end
    local env_key = os.getenv("MOONBOX_LOCAL_API_KEY")
    if env_key then
      sys.setenv("MOONBOX_LOCAL_API_KEY", nil)
      api_key = api_key or env_key:match("^%s*(%S+)")
    end
    if api_key == "" then return usage_error("local: --api-key wants a key, got an empty one") end
    local faults = opts.faults
    if faults and faults:sub(1, 1) == "@" then
      local f = io.open(faults:sub(2))
      if not f then return usage_error("local: cannot read the faults file %s", faults:sub(2)) end
      faults = f:read("a")
      f:close()
    end
    -- A long-running server: the collector starts a cycle when the heap is 1.5x what the last
    -- one left (Lua's default, 2x, let the backend's RSS run 9.5 MB higher after 1,000
    -- sandbox lives than after 100; 6.6 MB at 1.5x, for no CPU cost bench/lifecycles.lua can
    -- see: bench/README.md).
    collectgarbage("incremental", 150, 100)
    local code, err = M.run_root_opts({ quiet_signals = true }, function()
      local state_dir = absolute(opts.state) or (M.state_home() .. "/local")
      local backend = lazy["local"].start {
        host = opts.host, port = port, state_dir = state_dir,
        image = absolute(opts.image), host_root = opts["host-root"], faults = faults,
        on_image_build = not opts.quiet and function(line) io.stderr:write("  ", line, "\n") end or nil,
        api_key = api_key, workspace = opts.workspace,
        concurrency_limit = tonumber(opts["concurrency-limit"]), seed = tonumber(opts.seed),
        dns = opts.dns, rate_limit = rate_limit, public_url = opts["public-url"],
        disk = disk, disk_size = disk_size,
      }
      local _close <close> = setmetatable({}, { __close = function()
        backend:close()
        if opts.embedded then M.embedded_gone(state_dir) end
      end })
      local stop = core.cond()
      if opts.embedded then M.embedded_watch(state_dir, stop) end
      io.stdout:write(string.format(
        "RENDER_LOCAL_DEV_URL=%s\nRENDER_API_KEY=%s\nRENDER_WORKSPACE_ID=%s\n",
        backend.url, backend.api_key, backend.workspace))
      io.stdout:flush()
      if not opts.quiet then
        io.stderr:write(string.format("moonbox local: serving on %s (state in %s); Ctrl-C stops\n",
          backend.url, backend.state_dir))
      end
      stop:wait()
    end)
    if err ~= nil then
      eprintf("moonbox local: %s\n", M.format_error(err))
      return EXIT_FAIL
    end
    if code == 130 or code == 143 then return EXIT_OK end
    return code
  end)

command("image", "build, list and remove the base images of local sandboxes",
  "moonbox image build [NAME] | moonbox image list | moonbox image rm NAME",
  [[Local sandboxes (moonbox local) start from a base image: a Debian root filesystem built once
per machine with mmdebstrap from this machine's own apt sources, and cached in
$MOONBOX_IMAGES, else $XDG_CACHE_HOME/moonbox/images (~/.cache/moonbox/images).

  build [NAME]   builds NAME (default debian-12: Debian with bash, coreutils, procps, git,
                 python3, nodejs, npm, curl, ca-certificates, tar, gzip); a few minutes; a no-op
                 when it exists. moonbox local builds the default image on first use.
  list           the built images.
  rm NAME        removes an image; snapshots made on it can no longer be restored.]],
  function(args)
    local image = lazy["local.image"]
    local sub, name = args[1], args[2]
    if sub == "list" then
      for _, im in ipairs(image.list()) do print(im.name, im.path, (im.info:gsub("\n", " "))) end
      return EXIT_OK
    end
    if sub ~= "build" and sub ~= "rm" then return usage_error("image: expected build, list or rm") end
    if sub == "rm" and not name then return usage_error("image rm: which image?") end
    local code, err = M.run_root_opts({}, function()
      if sub == "rm" then
        if not image.remove(name) then error("image " .. name .. " does not exist", 0) end
        return
      end
      name = name or image.DEFAULT
      if image.exists(name) then
        io.stderr:write("moonbox image: " .. name .. " is built (" .. image.path(name) .. ")\n")
        return
      end
      io.stderr:write("moonbox image: building " .. name .. " with mmdebstrap (a few minutes)\n")
      image.build(name, { log = function(line) io.stderr:write("  ", line, "\n") end })
      io.stderr:write("moonbox image: built " .. image.path(name) .. "\n")
    end)
    if err ~= nil then
      eprintf("moonbox image: %s\n", M.format_error(err))
      return EXIT_FAIL
    end
    return code
  end)

local embedded_locks -- luacheck: ignore 231 (assigned only so that the locks live on)

--- cli.embedded_watch(dir, stop): the watcher of `moonbox local --embedded` (the protocol is in
-- lua/moonbox/render/embedded.lua): records this process in dir/embedded.pid, then every 0.2 s
-- takes the start lock and, when embedded.users can be taken exclusively too — no process uses
-- the backend any more — keeps both locks until this process ends and signals `stop`. Polling:
-- the end of another process's lock has no event to wait on, and 0.2 s is what a run whose last
-- user was SIGKILLed waits at most for its backend to go.
function M.embedded_watch(dir, stop)
  local embedded = lazy["render.embedded"]
  local ledger = lazy.ledger
  local pid_file = dir .. "/" .. embedded.PID_FILE
  local tmp = pid_file .. ".tmp"
  local f = assert(io.open(tmp, "w"))
  f:write(ledger.self_pid(), " ", ledger.self_start(), "\n")
  f:close()
  assert(os.rename(tmp, pid_file))
  lazy.task.spawn(function()
    while true do
      core.sleep(0.2)
      local start = sys.try_lock(dir .. "/" .. embedded.START_LOCK, "exclusive")
      if start then
        local idle = sys.try_lock(dir .. "/" .. embedded.USERS_LOCK, "exclusive")
        if idle then
          embedded_locks = { start, idle } -- held until the process ends, never collected
          stop:signal()
          return
        end
        start:unlock()
      end
    end
  end)
end

--- cli.embedded_gone(dir): removes dir/embedded.pid if it names this process (the backend has
-- closed).
function M.embedded_gone(dir)
  local embedded = lazy["render.embedded"]
  local ledger = lazy.ledger
  local pid = embedded.backend_pid(dir)
  if pid == ledger.self_pid() then os.remove(dir .. "/" .. embedded.PID_FILE) end
end

-- --state DB of ps and reap: the database to read (moonbox.db.set_target); nil, or the usage
-- error's exit status.
local function state_flag(name, opts)
  if not opts.state then return nil end
  lazy.db.set_target(opts.state)
  local ok, err = pcall(lazy.db.target)
  if not ok then return usage_error("%s: --state: %s", name, tostring(err)) end
end

command("ps", "list the sandboxes moonbox runs hold", "moonbox ps [--state DB]",
  [[Lists every run recorded in the ledger ($XDG_STATE_HOME/moonbox/moonbox.db) that is still
alive or still holds sandboxes: its id, pid, whether it is alive, the recipe and the backend
(a URL, or the state dir of an embedded backend), and each sandbox it created and did not
terminate, or each create whose answer was lost ("unknown create mb-..."). For a dead run it
asks the backend what became of each (running, gone, or which sandbox a lost create's label
names) when that backend can be reached; it never starts a backend. --state DB reads another
ledger: a SQLite file, or a postgres:// URL (default: MOONBOX_DATABASE_URL, else the state
dir's moonbox.db); on PostgreSQL it shows every machine's runs, alive meaning its lease has not
expired. See docs/reference/ledger.md.]],
  function(args)
    local opts, rest = parse_flags(args, { state = "value" })
    if not opts then return usage_error("ps: %s", rest) end
    if #rest > 0 then return usage_error("ps: unexpected argument '%s'", rest[1]) end
    local bad = state_flag("ps", opts)
    if bad then return bad end
    local code, err = run_root(function() lazy.reap.ps(print) end)
    if err ~= nil then eprintf("moonbox ps: %s\n", M.format_error(err)) end
    return code
  end)

command("reap", "terminate what dead runs left behind",
  "moonbox reap [--dry-run] [--forget RUN] [--abandon RUN] [--state DB]",
  [[Goes through every run that is no longer alive (killed, crashed, or ended) and still holds
sandboxes, and settles each with its backend: terminates what still runs, releases what the
backend no longer knows, and reconciles a create whose answer was lost by the label moonbox puts
in every sandbox's name (a sandbox carrying it is terminated; none means the create was never
made). An embedded backend is brought up again on the state dir the run recorded. A run whose
backend cannot be reached, or a terminate that keeps failing after its retries, is reported and
left for the next reap; every other run is still settled. Prints what it did per run.

A durable run (`moonbox run --durable`) that died before it ended is left alone: its sandboxes
wait for `moonbox run --resume RUN` (a durable schedule's run: for a daemon of the schedule to
resume it). --abandon RUN gives such a run up (it is recorded
"abandoned" and can no longer be resumed) and settles what it holds.

--dry-run only says what it would do. --forget RUN drops what run RUN (a dead one) holds from
the ledger without asking its backend — for entries you know are gone; combine it with
--dry-run to see them first. --state DB as for `moonbox ps`: on a PostgreSQL ledger shared by
several machines, reap acts on any machine's runs whose lease has expired, never on a run
another machine is still renewing.

Exit status: 0 when nothing is left held by a dead run, 1 when something is (see the lines
above), 2 on usage errors. The backend's key comes from RENDER_API_KEY, or from the local
backend's state dir for a local one.]],
  function(args)
    local opts, rest = parse_flags(args, { ["dry-run"] = "flag", forget = "value", state = "value",
      abandon = "value" })
    if not opts then return usage_error("reap: %s", rest) end
    if #rest > 0 then return usage_error("reap: unexpected argument '%s'", rest[1]) end
    local bad = state_flag("reap", opts)
    if bad then return bad end
    local forget = opts.forget and math.tointeger(tonumber(opts.forget))
    if opts.forget and not forget then
      return usage_error("reap: --forget needs a run id, got '%s'", opts.forget)
    end
    local abandon = opts.abandon and math.tointeger(tonumber(opts.abandon))
    if opts.abandon and not abandon then
      return usage_error("reap: --abandon needs a run id, got '%s'", opts.abandon)
    end
    if abandon and forget then
      return usage_error("reap: --abandon and --forget are two different things; give one")
    end
    local reap = lazy.reap
    local left = false
    local code, err = run_root(function()
      if abandon then
        local r = reap.abandon(abandon, { dry_run = opts["dry-run"] }, print)
        print(string.format("reap: %d terminated, %d already gone, %d never made, %d failed",
          r.terminated, r.gone, r.never_made, r.failed))
        left = r.failed > 0
        return
      end
      if forget then
        local n = reap.forget(forget, { dry_run = opts["dry-run"] }, print)
        print(string.format("reap: run %d: %d %s", forget, n,
          opts["dry-run"] and "would be forgotten" or "forgotten"))
        return
      end
      local r = reap.reap({ dry_run = opts["dry-run"] }, print)
      if opts["dry-run"] then
        print(string.format("reap: %d would be settled in %d run(s)", r.would, r.runs))
      else
        print(string.format("reap: %d terminated, %d already gone, %d never made, %d failed in %d run(s)",
          r.terminated, r.gone, r.never_made, r.failed, r.runs))
      end
      left = r.failed > 0
    end)
    if err ~= nil then eprintf("moonbox reap: %s\n", M.format_error(err)) end
    if code == EXIT_OK and left then return EXIT_FAIL end
    return code
  end)

-- Commands that live in their own module: `mod.command` holds {usage, detail} and
-- `mod.main(args, cli)` runs it. The module loads only when the command (or its help) is used.
local function external(name, summary, modname)
  commands[name] = setmetatable({ summary = summary, fn = function(args)
    return require(modname).main(args, M) -- lazy: the command's own module, loaded when it is used
  end }, { __index = function(_, k) return require(modname).command[k] end }) -- lazy: its help, as well
  order[#order + 1] = name
end

external("schedule", "run a recipe's schedules (cron) as a long-lived process", "moonbox.schedule.cli")
external("runs", "print the history of scheduled runs", "moonbox.schedule.runs")
external("repl", "an interactive Lua session on the live event loop", "moonbox.repl")

command("version", "print the version", "moonbox version",
  "Prints moonbox's version, and the versions of Lua and of the libraries it runs on.",
  function()
    local http = lazy.http
    print(string.format("moonbox %s (%s; libcurl %s; libev %s; libmicrohttpd %s)",
      build.version, _VERSION, http.curl_version(), core.libev_version(),
      lazy.httpd.mhd_version()))
    return EXIT_OK
  end)

command("help", "show the commands, or one command's help", "moonbox help [COMMAND]",
  "Without COMMAND lists the commands; with one, prints its usage and description.",
  function(args)
    local name = args[1]
    if name then
      local c = commands[name]
      if not c then return usage_error("help: no command named '%s'", name) end
      print("usage: " .. c.usage .. "\n\n" .. c.detail)
      return EXIT_OK
    end
    print("moonbox " .. build.version .. " — orchestrate Render sandboxes from Lua recipes\n")
    print("usage: moonbox COMMAND [ARGS...]\n\ncommands:")
    for _, n in ipairs(order) do
      print(string.format("  %-10s %s", n, commands[n].summary))
    end
    print("\n`moonbox help COMMAND` tells more; the manual is in docs/ (start at docs/README.md).")
    return EXIT_OK
  end)

--- main(argv) -> exit status. argv[0] is the program, argv[1] the command.
function M.main(argv)
  local name = argv[1]
  if name == nil then
    commands.help.fn({})
    return EXIT_USAGE
  end
  if name == "--help" or name == "-h" then name = "help" end
  if name == "--version" or name == "-V" then name = "version" end
  local c = commands[name]
  if not c then return usage_error("unknown command '%s'", name) end
  local args = {}
  for i = 2, #argv do args[#args + 1] = argv[i] end
  if name ~= "run" and name ~= "test" and (args[1] == "--help" or args[1] == "-h") then
    return commands.help.fn({ name })
  end
  if name == "run" and (args[1] == "--help" or args[1] == "-h") then
    return commands.help.fn({ name })
  end
  return c.fn(args)
end

M.commands = commands
M.usage_error, M.eprintf, M.run_root, M.set_arg = usage_error, eprintf, run_root, set_arg
M.EXIT_OK, M.EXIT_FAIL, M.EXIT_USAGE = EXIT_OK, EXIT_FAIL, EXIT_USAGE
return M
