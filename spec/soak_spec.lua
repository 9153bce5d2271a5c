-- Soak (issue 5): many fan-out runs against `moonbox local` under randomized faults — 5% 500/503,
-- 429 bursts, 5% lost create responses, 5% cut exec streams — and after each run plus
-- `moonbox reap`, not one sandbox may be left running. Bounded: MOONBOX_SOAK_RUNS runs (default
-- 200) or 240 s, whichever comes first; the counts are printed.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local core = require "moonbox.core"
local L = require "spec.support.local_backend"

local B, home

local run = T.async

setup(run(function()
  B = L.start { args = { "--seed", "42" } }
  B:connect_render()
  home = proc.run({ "mktemp", "-d" }).stdout:gsub("%s+$", "")
end))
teardown(run(function()
  if B then B:destroy() end
  proc.run { "rm", "-rf", home }
end))

local function live() return B:live() end

describe("soak", function()
  it("leaves 0 sandboxes running after every faulty fan-out run plus reap", T.async(function()
    B:req("PUT", "/_moonbox/faults", { body =
      "POST /v1/sandboxes=500@0.025;POST /v1/sandboxes=503@0.025;POST /v1/sandboxes=drop@0.05;" ..
      "* /v1/sandboxes/*=503@0.05;GET /v1/sandboxes=429:1@0.02;" ..
      "POST /v1/sandboxes/*/runs/stream/token=429:1@0.02;POST /proxy/*/runs/stream=cut@0.05" })
    local recipe = home .. "/soak.lua"
    local f = assert(io.open(recipe, "w"))
    f:write([[
local render = require "moonbox.render"
local task = require "moonbox.task"
local fleet <close> = render.restore(nil, { count = 4, concurrency = 4, policy = "best_effort" })
task.map(fleet, function(sb) return sb:exec("echo soak"):check().stdout end, { concurrency = 4 })
]])
    f:close()
    local env = { "env", "HOME=" .. home, "XDG_STATE_HOME=", "RENDER_API_KEY=" .. B.key,
      "RENDER_WORKSPACE_ID=" .. B.workspace, "RENDER_LOCAL_DEV_URL=" .. B.url, L.BIN }
    local function moonbox(...)
      local argv = table.move(env, 1, #env, 1, {})
      for _, a in ipairs({ ... }) do argv[#argv + 1] = a end
      return proc.run(argv)
    end
    local runs = tonumber(os.getenv("MOONBOX_SOAK_RUNS") or "200")
    local started = core.now()
    local counts = { runs = 0, ok = 0, failed = 0, reaped = 0 }
    for _ = 1, runs do
      if core.now() - started > 240 then break end
      local r = moonbox("run", recipe)
      counts.runs = counts.runs + 1
      if r.code == 0 then counts.ok = counts.ok + 1 else counts.failed = counts.failed + 1 end
      local rp = moonbox("reap")
      assert.are.equal(0, rp.code, rp.stdout .. rp.stderr)
      counts.reaped = counts.reaped + tonumber(rp.stdout:match("(%d+) terminated") or "0")
      B:req("DELETE", "/_moonbox/faults", {}) -- a fault-free look at what is left
      local left = live()
      assert.are.equal(0, left, "run " .. counts.runs .. " left " .. left .. " sandboxes: " .. r.stderr)
      B:req("PUT", "/_moonbox/faults", { body =
        "POST /v1/sandboxes=500@0.025;POST /v1/sandboxes=503@0.025;POST /v1/sandboxes=drop@0.05;" ..
        "* /v1/sandboxes/*=503@0.05;GET /v1/sandboxes=429:1@0.02;" ..
        "POST /v1/sandboxes/*/runs/stream/token=429:1@0.02;POST /proxy/*/runs/stream=cut@0.05" })
    end
    B:req("DELETE", "/_moonbox/faults")
    print(string.format("\nsoak: %d runs in %.0f s: %d succeeded, %d failed under faults, %d sandboxes reaped, " ..
      "0 left running", counts.runs, core.now() - started, counts.ok, counts.failed, counts.reaped))
    assert.is_true(counts.runs >= 20)
  end))
end)
