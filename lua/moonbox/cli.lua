--- moonbox.cli — the `moonbox` command: argument parsing, help, and exit codes.
--
-- Exit codes: 0 success; 1 the recipe (or a test) failed; 2 usage error; 3 the registry-ref
-- leak check failed (tests); 130 interrupted by SIGINT, 143 by SIGTERM (after the recipe's
-- task was cancelled and its guards unwound).
local core = require "moonbox.core"
local build = require "moonbox.build"

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

--- Runs fn(...) as the root task with SIGINT/SIGTERM cancelling it; returns exit code, plus
-- the error when it failed.
local function run_root(fn, ...)
  local sigs = core.signal_cancel({ "INT", "TERM" })
  local ok, err = pcall(core.run, fn, ...)
  local sig = core.signal_received()
  core.signal_restore(sigs)
  -- Background tasks still running are cancelled and allowed to unwind.
  core.shutdown()
  local unobserved = core.report_unobserved()
  if sig then
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

command("run", "run a recipe as a task", "moonbox run FILE [ARGS...]",
  [[Loads FILE as a Lua chunk and runs it as the root task on the event loop, so its top
level can call any moonbox function that waits. ARGS are in the global `arg` table (arg[0] is
FILE), as with `lua`. When the chunk returns, tasks it left running are cancelled and unwound.

Exit status: 0 on success; 1 when the recipe raised (message and traceback on stderr) or a task
failed with nobody joining it; 2 on usage errors; 130 after SIGINT and 143 after SIGTERM, once
the recipe's task was cancelled and its guards unwound.]],
  function(args)
    local file = args[1]
    if not file then return usage_error("run: missing the recipe FILE") end
    local rest = table.move(args, 2, #args, 1, {})
    local chunk, lerr = loadfile(file)
    if not chunk then
      eprintf("moonbox: cannot load recipe: %s\n", lerr)
      return EXIT_FAIL
    end
    set_arg(file, rest)
    local code, err = run_root(chunk, table.unpack(rest))
    if err ~= nil then
      eprintf("moonbox: recipe %s failed: %s\n", file, M.format_error(err))
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
    local ok, err = pcall(require("busted.runner"), { standalone = false })
    os.exit = real_exit -- luacheck: ignore 122
    if ok then return EXIT_OK end
    if getmetatable(err) == exit_mt then return err.code end
    eprintf("moonbox test: %s\n", M.format_error(err))
    return EXIT_FAIL
  end)

command("version", "print the version", "moonbox version",
  "Prints moonbox's version, and the versions of Lua and of the libraries it runs on.",
  function()
    local http = require "moonbox.http"
    print(string.format("moonbox %s (%s; libcurl %s; libev %s; libmicrohttpd %s)",
      build.version, _VERSION, http.curl_version(), core.libev_version(),
      require("moonbox.httpd").mhd_version()))
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
return M
