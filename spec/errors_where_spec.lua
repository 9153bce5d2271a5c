-- Errors keep their place (issue 12): an exec timeout is a `timeout` error carrying the sandbox
-- id, the exec id and the command's first words; `where` is the nearest recipe line for errors
-- raised in spawned tasks (tail calls included), on cancellation and in the REPL — never a file
-- of moonbox's own library.
local T = require "moonbox.testing"
local L = require "spec.support.local_backend"
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local render = require "moonbox.render"

local B, sb

local SPEC = debug.getinfo(1, "S").short_src

L.fixture(setup, teardown, function(b)
  B, sb = b, render.sandboxes.create {}:keep()
  return function() sb:terminate() end
end)

-- "spec/errors_where_spec.lua:N" for the line of the caller.
local function here()
  return SPEC .. ":" .. debug.getinfo(2, "l").currentline
end

local function assert_recipe_where(err, where)
  assert.are.equal(where, err.where)
  assert.are.equal(where .. ": ", tostring(err):sub(1, #where + 2))
  assert.is_nil(err.where:find("lua/moonbox/", 1, true))
end

describe("an exec timeout", function()
  it("is a timeout error with the sandbox, the exec and the command's first words, at the recipe's line",
    T.async(function()
      local ok, err = pcall(sb.exec, sb, "sleep 30 && echo never printed", { timeout = 1 }); local where = here()
      assert.is_false(ok)
      assert.is_true(task.is_timeout(err))
      assert.are.same({ "sandbox:exec", "timeout", 1, sb.id }, { err.op, err.code, err.seconds, err.sandbox_id })
      assert.matches("^exe%-", err.exec_id)
      assert.are.equal("sleep 30 && echo ...", err.command)
      assert.matches("`sleep 30 && echo ...` did not finish within 1 s; its process group was killed", err.message,
        1, true)
      local line = tostring(err)
      assert.matches("sandbox " .. sb.id, line, 1, true)
      assert.matches("exec " .. err.exec_id, line, 1, true)
      assert_recipe_where(err, where)
      -- and the command is gone
      assert.are.equal("0\n", sb:exec("pgrep -c -f '[s]leep 30' || true").stdout)
    end))
end)

describe("an error raised in a spawned task", function()
  -- Joins task t, which must fail with an error of that code; -> the error.
  local function join_error(t, code)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.are.equal(code, err.code)
    return err
  end

  it("names the spawning line when the task's frame is gone (a tail call)", T.async(function()
    local t = task.spawn(function() return render.sandboxes.get("sbx-0000000000000000000000000") end); local where = here()
    assert_recipe_where(join_error(t, "not_found"), where)
  end))

  it("names the line in the task's function otherwise", T.async(function()
    local where
    local t = task.spawn(function()
      where = here(); sb:exec("echo failing >&2; exit 3"):check()
    end)
    local err = join_error(t, "exit_status") -- the task ran, and set where, by now
    assert_recipe_where(err, where)
  end))

  it("names the task.map call for an error in a worker that tail-calls", T.async(function()
    local ok, err = pcall(task.map, { 1, 2 }, function() return sb:exec("sleep 20", { timeout = 0.5 }) end); local where = here()
    assert.is_false(ok)
    assert.are.equal("timeout", err.code)
    assert.are.equal(sb.id, err.sandbox_id)
    assert_recipe_where(err, where)
  end))
end)

describe("a cancellation", function()
  -- Cancels task t and joins it, which must fail as cancelled; -> the error.
  local function cancelled_error(t)
    task.cancel(t)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err))
    return err
  end

  it("names the recipe line the cancelled task was waiting at", T.async(function()
    local where
    local started = false
    local t = task.spawn(function()
      started = true
      where = here(); sb:exec("sleep 100")
    end)
    while not started do task.yield() end -- it ran up to its first wait, inside sb:exec
    local err = cancelled_error(t)
    assert_recipe_where(err, where)
  end))

  it("of a task whose function tail-called names the spawning line", T.async(function()
    local t = task.spawn(function() return task.sleep(100) end); local where = here()
    task.yield()
    assert_recipe_where(cancelled_error(t), where)
  end))
end)

describe("in the REPL", function()
  it("an exec timeout and a spawned task's error name stdin, with the ids", T.async(function()
    local r = proc.run { L.BIN, "repl", input = [[
sb = render.sandboxes.create {}
sb:exec("sleep 30", { timeout = 1 })
t = task.spawn(function() return render.sandboxes.get("sbx-0000000000000000000000000") end)
pcall(task.join, t)
]], env = { RENDER_LOCAL_DEV_URL = B.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
      XDG_STATE_HOME = os.tmpname() .. ".d" } }
    assert.are.equal(1, r.code, r.stderr)
    local line = r.stderr:match("[^\n]*did not finish[^\n]*")
    assert.is_string(line, r.stderr)
    assert.matches("^stdin:1: sandbox:exec: `sleep 30` did not finish within 1 s", line)
    assert.matches("code timeout, sandbox sbx%-%w+, exec exe%-%w+", line)
    assert.matches("%[task %d+ failed%] stdin:1: sandboxes.get: ", r.stderr)
    -- (tracebacks show moonbox's frames; no error is placed in them)
    assert.is_nil(r.stderr:find("lua/moonbox/[%w/_]+%.lua:%d+: [%w_]+[.:][%w_]+: ", 1))
  end))
end)
