--- moonbox.testing — helpers for busted specs run by `moonbox test`.
--
--   local T = require "moonbox.testing"
--   it("waits", T.async(function() task.sleep(0.01) end))
--
-- T.async(fn) runs the test body as a task on the real event loop (task.run) and re-raises
-- its failure with the task's traceback, so busted reports the failing spec line.
--
-- T.replay(cassette, recipe[, args[, opts]]) replays a recording (`moonbox run --record FILE`)
-- with no backend, so a recipe can be tested in any CI, without root, sandboxes or network:
--
--   it("quickstart still makes the calls it was recorded making", function()
--     local r = T.replay("spec/cassettes/quickstart.cassette", "recipes/quickstart.lua")
--     assert.is_true(r.ok, r.stderr)
--     assert.matches("restored 3: built at step 1", r.stdout)
--   end)
local core = require "moonbox.core"
local build = require "moonbox.build"
local proc = require "moonbox.proc"

local M = {}

--- T.async(fn) -> function: a busted test body that runs fn(...) as a task.
function M.async(fn)
  return function(...) return core.run(fn, ...) end
end

--- T.run(fn, ...) -> results of fn: runs fn as a task until it finishes.
M.run = core.run

--- T.raises(fn, ...) -> err: calls fn(...), asserts it raised, and returns what it raised.
function M.raises(fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, "expected an error, but the call succeeded")
  return err
end

--- T.errors_with(code, fn, ...) -> err: calls fn(...), asserts it raised a structured error
-- with that code, and returns the error for further checks.
function M.errors_with(code, fn, ...)
  local ok, err = pcall(fn, ...)
  assert(not ok, "expected an error with code " .. code .. ", but the call succeeded")
  assert(type(err) == "table", "expected a structured error with code " .. code .. ", got " .. tostring(err))
  assert(err.code == code,
    "expected error code " .. code .. ", got " .. tostring(err.code) .. ": " .. tostring(err))
  return err
end

--- T.refs() -> registry refs moonbox holds now (0 between tests means nothing leaked).
M.refs = core.refs

-- What a replay's stderr says: the failure (the line after "recipe FILE failed: ", or the
-- first other line of moonbox's own, without the traceback), its code, the calls replayed.
local function outcome_of(stderr)
  local failure = stderr:match("moonbox: recipe .- failed: (.-)\nstack traceback:")
    or stderr:match("moonbox: recipe .- failed: ([^\n]*)")
  local replayed = stderr:match("moonbox: replayed (%d+) call%(s%)")
  if not failure then
    for line in stderr:gmatch("[^\n]+") do
      if line:match("^moonbox: ") and not line:match("^moonbox: replayed %d+ call") then
        failure = line:sub(10)
        break
      end
    end
  end
  local code = failure and failure:match("%[code ([%w_]+)%]")
  return failure, code, math.tointeger(tonumber(replayed or ""))
end

--- T.replay(cassette, recipe[, args[, opts]]) -> result: runs `moonbox run --replay cassette
-- recipe args...` in a child process of this very moonbox binary, with no backend: no
-- RENDER_* variables, XDG_STATE_HOME pointing at a directory that does not exist (a replay
-- needs no state dir and makes none), every call answered from the cassette. recipe: the
-- recipe's path (nil: the one the cassette recorded, relative to the working directory);
-- args: the recipe's arguments (nil: the recorded ones). opts: cwd (the child's working
-- directory), env ({NAME = value} added to the child's), timeout (seconds before the child's
-- group is killed and T.replay raises; default 300).
-- result: ok (the recipe finished: exit status 0), code (the exit status), stdout (everything
-- the recipe printed), stderr, error (when it failed: the error's message, the first line of
-- it a person reads, without the traceback), error_code (the structured error's code, e.g.
-- "nondeterminism" when the recipe made a call the cassette does not have next, or nil),
-- replayed (how many calls the cassette answered, when moonbox said). A cassette that is not one
-- gives ok = false with error naming the file and line. Raises when the child cannot be started
-- or outlives the timeout. [yields] (outside a task it runs one: call it from anywhere).
function M.replay(cassette, recipe, args, opts)
  assert(type(cassette) == "string", "T.replay: cassette must be a file path")
  assert(recipe == nil or type(recipe) == "string", "T.replay: recipe must be a file path or nil")
  opts = opts or {}
  local argv = { build.exe, "run", "--replay", cassette }
  if recipe then argv[#argv + 1] = recipe end
  for _, a in ipairs(args or {}) do argv[#argv + 1] = tostring(a) end
  local env = { RENDER_API_KEY = false, RENDER_LOCAL_DEV_URL = false, RENDER_USE_LOCAL_DEV = false,
    RENDER_WORKSPACE_ID = false, MOONBOX_DATABASE_URL = false,
    XDG_STATE_HOME = "/nonexistent/moonbox-replay-has-no-state-dir" }
  for k, v in pairs(opts.env or {}) do env[k] = v end
  argv.env, argv.cwd, argv.timeout = env, opts.cwd, opts.timeout or 300
  local function run()
    local r = proc.run(argv)
    local failure, code, replayed = outcome_of(r.stderr)
    return { ok = r.code == 0, code = r.code, stdout = r.stdout, stderr = r.stderr,
      error = r.code ~= 0 and (failure or r.stderr) or nil, error_code = r.code ~= 0 and code or nil,
      replayed = replayed }
  end
  if core.current() then return run() end
  return core.run(run)
end

return M
