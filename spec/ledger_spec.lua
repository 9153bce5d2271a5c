-- The ledger, `moonbox ps` and `moonbox reap` (issue 5): a run SIGKILLed in the middle of a
-- 20-sandbox fan-out leaves its sandboxes recorded; ps shows them; reap terminates every one.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local L = require "spec.support.local_backend"
local S = require "spec.support.store_env"

local B, home, store

local run = T.async

setup(run(function()
  B = L.start()
  B:connect_render()
  home = proc.run({ "mktemp", "-d" }).stdout:gsub("%s+$", "")
  store = S.vars() -- on PostgreSQL: one database for the file, as one home holds one ledger
end))
teardown(run(function()
  if B then B:destroy() end
  proc.run { "rm", "-rf", home }
  S.shutdown()
end))

local function live() return B:live() end

-- `env HOME=... (the store) moonbox ARGS...` for this file's home.
local function argv_of(args)
  local argv = { "env", "HOME=" .. home, "XDG_STATE_HOME=", "RENDER_API_KEY=" .. B.key,
    "RENDER_WORKSPACE_ID=" .. B.workspace, "RENDER_LOCAL_DEV_URL=" .. B.url }
  for _, kv in ipairs(store) do argv[#argv + 1] = kv end
  argv[#argv + 1] = L.BIN
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  return argv
end

local function moonbox(args)
  return proc.run(argv_of(args))
end

describe("a run killed in the middle of a fan-out", function()
  it("is shown by moonbox ps and cleaned up by moonbox reap", T.async(function()
    local recipe = home .. "/fanout.lua"
    local f = assert(io.open(recipe, "w"))
    f:write([[
local render = require "moonbox.render"
local fleet <close> = render.restore(nil, { count = 20, concurrency = 8, policy = "best_effort" })
io.stdout:write("made ", #fleet, "\n"); io.stdout:flush()
require("moonbox.task").sleep(120)
]])
    f:close()
    local argv = argv_of { "run", recipe }
    argv.stderr = "inherit"
    local p = proc.spawn(argv)
    local lines = p:lines("stdout")
    local first = lines()
    assert.matches("^made 20", first or "")
    p:kill("KILL") -- no guard runs: the ledger is all that is left
    p:wait()
    S.after_kill()
    assert.are.equal(20, live())
    local ps = moonbox { "ps" }
    assert.are.equal(0, ps.code, ps.stderr)
    assert.matches("dead", ps.stdout)
    local held = 0
    for _ in ps.stdout:gmatch("holds sbx%-") do held = held + 1 end
    assert.are.equal(20, held)
    local dry = moonbox { "reap", "--dry-run" }
    assert.are.equal(0, dry.code, dry.stderr)
    assert.matches("reap: 20 would be settled in 1 run", dry.stdout)
    assert.are.equal(20, live())
    local reap = moonbox { "reap" }
    assert.are.equal(0, reap.code, reap.stderr)
    assert.matches("20 terminated", reap.stdout)
    assert.are.equal(0, live())
    local after = moonbox { "ps" }
    assert.is_nil(after.stdout:find("holds", 1, true))
  end))

  it("reconciles a create whose answer never came by its label", T.async(function()
    -- The create waits in the backend; the run is killed before the answer comes.
    B:req("PUT", "/_moonbox/faults", { body = "POST /v1/sandboxes=latency:1000" })
    local _, before = B:req("GET", "/_moonbox/journal")
    local mark = before[#before].seq
    local recipe = home .. "/lost.lua"
    local f = assert(io.open(recipe, "w"))
    f:write([[
local render = require "moonbox.render"
render.sandboxes.create {}
]])
    f:close()
    local argv = argv_of { "run", recipe }
    argv.stderr = "inherit"
    local p = proc.spawn(argv)
    local function create_entry()
      local _, entries = B:req("GET", "/_moonbox/journal", { query = { since = mark } })
      for _, e in ipairs(entries) do
        if e.method == "POST" and e.path == "/v1/sandboxes" then return e end
      end
    end
    local waited = 0
    while not create_entry() do
      waited = waited + 1
      assert(waited < 3000, "the create never reached the backend")
      require("moonbox.task").sleep(0.01)
    end
    p:kill("KILL")
    p:wait()
    S.after_kill()
    while not create_entry().status do require("moonbox.task").sleep(0.05) end -- the backend made it
    B:req("DELETE", "/_moonbox/faults")
    assert.are.equal(1, live())
    local ps = moonbox { "ps" }
    -- the sandbox may still be booting when ps looks (it says what is true: creating or running)
    local status = ps.stdout:match("unknown create mb%-%d+%-%d+ %(answer lost; intent %d+%)  is sbx%-%w+ (%a+)")
    assert(status == "running" or status == "creating", ps.stdout)
    local reap = moonbox { "reap" }
    assert.are.equal(0, reap.code, reap.stdout .. reap.stderr)
    assert.matches("1 terminated", reap.stdout)
    assert.are.equal(0, live())
  end))
end)
