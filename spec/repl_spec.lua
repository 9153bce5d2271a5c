-- Pins `moonbox repl` (docs/repl.md) through a real pseudo-terminal (tmux) and through pipes,
-- against a real `moonbox local`: results, multi-line chunks, completion, Ctrl-C, history,
-- background output, exit status, and the termination of what a session created.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local task = require "moonbox.task"
local L = require "spec.support.local_backend"
local Tmux = require "spec.support.tmux"

local run = T.async
local B, tmp

local sh_quote = require("moonbox.render").shell_quote

local function env(xdg)
  return { RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace, XDG_STATE_HOME = xdg or (tmp .. "/xdg"),
    NO_COLOR = "1" }
end

local function repl_command()
  return sh_quote(L.BIN) .. " repl --backend " .. B.url
end

--- Starts a REPL in a fresh tmux server (its own directory) and waits for the first prompt.
local function start_repl(name, xdg)
  local dir = tmp .. "/" .. name
  proc.run { "mkdir", "-p", dir }
  local term = Tmux.start { dir = dir, command = repl_command(), env = env(xdg) }
  term:wait_for("\n>$")
  return term
end

local function sandbox_status(id)
  local status, sb = B:req("GET", "/v1/sandboxes/" .. id)
  assert(status == 200, "GET sandbox " .. id .. ": " .. tostring(status))
  return sb.status
end

--- Processes in the sandbox whose command line matches `pattern` (a grep -E pattern written so
-- that it does not match itself, e.g. "[s]leep 30").
local function processes(id, pattern)
  local r = B:exec(id, "ps -eo pid,pgid,args | grep -E " .. sh_quote(pattern) .. " || true")
  assert(r.code == 0, "ps in " .. id .. " failed: " .. tostring(r.stderr))
  return r.stdout
end

setup(run(function()
  B = L.start()
  tmp = proc.run({ "mktemp", "-d", "/tmp/moonbox-repl-spec.XXXXXX" }).stdout:gsub("%s+$", "")
end))

teardown(run(function()
  if B then B:destroy() end
  if tmp then proc.run { "rm", "-rf", tmp } end
end))

describe("moonbox repl on a terminal", function()
  local term, sb_id

  setup(run(function() term = start_repl("session") end))
  teardown(run(function()
    if term then term:kill() end
  end))

  it("creates a sandbox and shows an exec's result", run(function()
    term:line("sb = render.sandboxes.create{}")
    term:line("sb.id")
    local screen = term:wait_for('"sbx%-[%w]+"')
    sb_id = screen:match('"(sbx%-[%w]+)"')
    term:line('sb:exec("echo hi")')
    screen = term:wait_for('stdout = "hi\\n"', 30, true)
    assert.matches("code = 0", screen)
    assert.are.equal("running", sandbox_status(sb_id))
  end))

  it("continues an unfinished chunk on a second prompt", run(function()
    -- each line waits for the prompt it leads to: a line typed before its prompt is drawn is
    -- echoed by the terminal ahead of the prompt
    term:line("function double(x)")
    term:wait_for("\n>>$")
    term:line("  return x * 2")
    term:wait_for("return x %* 2\n>>$")
    term:line("end")
    term:wait_for("\n>> end\n>$")
    term:line("double(21)")
    local screen = term:wait_for("\n42\n>$")
    assert.matches("\n> function double%(x%)\n>>   return x %* 2\n>> end\n> double%(21%)\n42\n", screen)
  end))

  it("completes sb:exe to sb:exec with Tab", run(function()
    term:type("sb:exe") -- sb:ex is also sb:exists
    term:key("Tab")
    local screen = term:wait_for("\n> sb:exec$")
    assert.matches("\n> sb:exec$", screen)
    term:key("C-c") -- discards the line
    term:wait_for("\n> sb:exec\n>$")
  end))

  it("cancels sb:exec with Ctrl-C, back at the prompt with its processes gone", run(function()
    term:line('sb:exec("sleep 30")')
    -- wait until the command really runs in the sandbox
    local t0 = task.now()
    while not processes(sb_id, "[s]leep 30"):find("sleep 30", 1, true) do
      assert(task.now() - t0 < 30, "sleep 30 never started in " .. sb_id)
      task.sleep(0.05)
    end
    local before = term:screen()
    term:key("C-c")
    -- Well before `sleep 30` could end on its own (how fast belongs in bench/, not here).
    term:wait_for("interrupted: the chunk's task was cancelled and unwound\n>$", 15)
    assert.are_not.equal(before, term:screen())
    assert.are.equal("", processes(sb_id, "[s]leep 30"))
    assert.are.equal("running", sandbox_status(sb_id))
  end))

  it("shows a background task's output above the prompt without mangling the typed line", run(function()
    term:line('task.spawn(function() task.sleep(0.5) print("from the background") end)')
    term:wait_for("<Task %d+ [%a]+>\n>$")
    term:type("partial = 1")
    local screen = term:wait_for("\nfrom the background\n> partial = 1$")
    assert.matches("\nfrom the background\n> partial = 1$", screen)
    term:key("Enter")
    -- the next prompt first: keys typed while a chunk runs are echoed by the terminal ahead of it
    term:wait_for("> partial = 1\n>$")
    term:line("partial")
    term:wait_for("\n> partial\n1\n>$")
    -- io.write too: a complete line at once, the rest when it is flushed
    term:line('task.spawn(function() task.sleep(0.5) io.write("written ", 2, "\\nhalf") ' ..
      'task.sleep(0.3) io.stdout:write(" line"):flush() end)')
    term:wait_for("<Task %d+ [%a]+>\n>$")
    term:type("typed = 2")
    term:wait_for("\nwritten 2\nhalf line\n> typed = 2$")
    term:key("Enter")
  end))

  it("reports a background task's failure and lists tasks", run(function()
    term:line('task.spawn(function() task.sleep(0.2) error("background boom") end)')
    term:wait_for("%[task %d+ failed%] stdin:1: background boom")
    term:line(":tasks")
    term:wait_for("failed%s+spawned in chunk %d+")
  end))
end)

describe("moonbox repl history", function()
  it("survives a restart", run(function()
    local xdg = tmp .. "/xdg-history"
    local first = start_repl("history1", xdg)
    first:line("history_marker = 4242")
    first:wait_for("\n> history_marker = 4242\n>$")
    first:key("C-d")
    first:wait_for("EXIT=0")
    first:kill()
    local f = assert(io.open(xdg .. "/moonbox/repl_history"))
    assert.matches("history_marker", f:read("a"))
    f:close()

    local second = start_repl("history2", xdg)
    second:key("Up")
    second:wait_for("\n> history_marker = 4242$")
    second:key("Enter")
    second:line("history_marker")
    second:wait_for("\n4242\n>$")
    second:key("C-d")
    second:wait_for("EXIT=0")
    second:kill()
  end))
end)

describe("moonbox repl on exit", function()
  it("terminates, after asking, the sandboxes it created and did not keep", run(function()
    local term = start_repl("exit")
    term:line("a = render.sandboxes.create{}")
    term:line("k = render.sandboxes.create{}:keep()")
    term:line("a.id .. ' ' .. k.id")
    local screen = term:wait_for('"(sbx%-%w+) (sbx%-%w+)"')
    local a, k = screen:match('"(sbx%-%w+) (sbx%-%w+)"')
    term:line(":sandboxes")
    term:wait_for("kept: survives the session")
    term:key("C-d")
    term:wait_for("terminate them? [Y/n]", 30, true)
    assert.are.equal("running", sandbox_status(a))
    term:line("y")
    term:wait_for("EXIT=0")
    term:kill()
    assert.are.equal("terminated", sandbox_status(a))
    assert.are.equal("running", sandbox_status(k))
    B:req("POST", "/v1/sandboxes/" .. k .. "/terminate")
  end))
end)

describe("moonbox repl with piped input", function()
  local function piped(input)
    local r = proc.run { "sh", "-c", "printf '%s' " .. sh_quote(input) .. " | " .. repl_command(),
      env = env() }
    return r.code, r.stdout, r.stderr
  end

  it("prints results, continues chunks and exits 0 when every chunk succeeded", run(function()
    local code, out, err = piped('x = 20\nx + 22\nfunction f(s)\n  return s .. "!"\nend\nf("hi"), {1, a = true}\n')
    assert.are.equal("", err)
    assert.are.equal('42\n"hi!"\t{ 1, a = true }\n', out)
    assert.are.equal(0, code)
  end))

  it("reports a failing chunk with a traceback, goes on, and exits 1", run(function()
    local code, out, err = piped('error("boom")\n"after"\nlocal = 1\n')
    assert.are.equal('"after"\n', out)
    assert.matches("^stdin:1: boom\nstack traceback:\n", err)
    assert.matches("stdin:1: <name> expected near '='", err)
    assert.are.equal(1, code)
  end))

  it("prints the API's whole numbers as integers", run(function()
    local code, out, err = piped('g = render.groups.create{name = "repl-ints"}\ng.concurrency_limit\n' ..
      'math.type(g.concurrency_limit)\ng:delete()\n')
    assert.are.equal(0, code, err)
    assert.matches('^%d+\n"integer"\n', out)
  end))

  it("terminates the sandboxes it created without asking", run(function()
    local code, out, err = piped('sb = render.sandboxes.create{}\nsb.id\nsb:exec("echo piped").stdout\n')
    assert.are.equal(0, code, err)
    local id = out:match('^"(sbx%-%w+)"\n')
    assert.truthy(id, out)
    assert.matches('\n"piped\\n"\n$', out)
    assert.matches("terminated " .. id, err, 1, true)
    assert.are.equal("terminated", sandbox_status(id))
  end))
end)
