-- Pins the `moonbox` command line: exit codes, errors on stderr, signals, help.
local build = require "moonbox.build"
local files = require "spec.support.files"

local BIN = os.getenv("MOONBOX_BIN") or build.exe

local function tmpfile(content)
  local path = os.tmpname()
  files.write(path, content)
  return path
end

-- Runs a shell command; returns exit status, stdout, stderr.
local function sh(cmd)
  local out, err = os.tmpname(), os.tmpname()
  local ok, how, code = os.execute(cmd .. " >" .. out .. " 2>" .. err)
  local function slurp(p)
    local s = files.read(p) or ""
    os.remove(p)
    return s
  end
  if how == "signal" then code = 128 + code end
  return ok and 0 or code, slurp(out), slurp(err)
end

local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

-- Runs recipe text with `moonbox run`; -> exit status, stdout, stderr (the recipe file removed).
local function run_recipe(text)
  local f = tmpfile(text)
  local code, out, err = sh(q(BIN) .. " run " .. f)
  os.remove(f)
  return code, out, err
end

describe("moonbox run", function()
  it("exits 0 and passes arguments in arg like lua", function()
    local f = tmpfile([[print(arg[0] ~= nil, ...); print(arg[1], arg[2], #arg)]])
    local code, out = sh(q(BIN) .. " run " .. f .. " one 'two words'")
    assert.are.equal(0, code)
    assert.matches("true\tone\ttwo words", out)
    assert.matches("one\ttwo words\t2", out)
    os.remove(f)
  end)

  it("exits 1 with file:line and a traceback when the recipe raises", function()
    local code, _, err = run_recipe("local function f()\n  error('recipe broke')\nend\nf()\n")
    assert.are.equal(1, code)
    assert.matches(":2: recipe broke", err)
    assert.matches("stack traceback", err)
  end)

  it("reports a structured error on one line plus its traceback", function()
    local code, _, err = run_recipe("local task = require 'moonbox.task'\n" ..
      "task.timeout(0.01, function() task.sleep(1) end)\n")
    assert.are.equal(1, code)
    assert.matches(":2: task.timeout: timed out after 0.01 s %[code timeout%]", err)
    assert.matches("stack traceback", err)
  end)

  it("never lets a child task's error pass silently", function()
    local code, _, err = run_recipe("local task = require 'moonbox.task'\n" ..
      "task.spawn(function() error('lost child') end)\ntask.sleep(0.01)\n")
    assert.are.equal(1, code)
    assert.matches("unhandled error in task", err)
    assert.matches("lost child", err)
  end)

  it("exits 1 with the loader's message for a syntax error", function()
    local code, _, err = run_recipe("local x = = 1\n")
    assert.are.equal(1, code)
    assert.matches("cannot load recipe: .*:1:", err)
  end)

  it("exits 2 on usage errors", function()
    assert.are.equal(2, (sh(q(BIN) .. " run")))
    assert.are.equal(2, (sh(q(BIN) .. " no-such-command")))
    assert.are.equal(2, (sh(q(BIN))))
  end)

  it("exits 130 on SIGINT after cancelling the recipe and unwinding its guards", function()
    local marker = os.tmpname()
    local f = tmpfile(string.format([[
local task = require "moonbox.task"
local g <close> = setmetatable({}, { __close = function()
  task.sleep(0.05) -- a guard may wait while unwinding
  local f = io.open(%q, "w"); f:write("unwound"); f:close()
end })
io.stdout:write("ready\n"); io.stdout:flush()
task.sleep(30)
]], marker))
    local code, out = sh("sh -c " .. q(q(BIN) .. " run " .. f ..
      " & pid=$!; sleep 0.5; kill -INT $pid; wait $pid; exit $?"))
    assert.are.equal(130, code)
    assert.matches("ready", out)
    assert.are.equal("unwound", files.must_read(marker))
    os.remove(f)
    os.remove(marker)
  end)

  it("exits 143 on SIGTERM", function()
    local f = tmpfile("require('moonbox.task').sleep(30)\n")
    local code = sh("sh -c " .. q(q(BIN) .. " run " .. f ..
      " & pid=$!; sleep 0.3; kill -TERM $pid; wait $pid; exit $?"))
    assert.are.equal(143, code)
    os.remove(f)
  end)
end)

describe("moonbox help and version", function()
  it("lists the commands", function()
    local code, out = sh(q(BIN) .. " help")
    assert.are.equal(0, code)
    for _, c in ipairs({ "run", "test", "version", "help" }) do
      assert.matches("\n  " .. c .. " ", out)
    end
  end)

  it("explains one command", function()
    local code, out = sh(q(BIN) .. " help run")
    assert.are.equal(0, code)
    assert.matches("usage: moonbox run %[%-%-backend URL|local|render%] %[%-%-trace FILE%]", out)
    assert.matches("130", out)
  end)

  it("prints the versions of moonbox and its libraries", function()
    local code, out = sh(q(BIN) .. " version")
    assert.are.equal(0, code)
    assert.matches("^moonbox %d+%.%d+%.%d+ %(Lua 5%.4; libcurl [%d.]+; libev [%d.]+", out)
  end)
end)
