-- The seeded fault harness (spec/support/harness.lua) against a real `moonbox local`: random mixes
-- of create, restore, exec, upload, download, capture, snapshot delete and terminate, a few at a
-- time, with the server SIGKILLed and restarted on the same state dir between rounds and while
-- operations are in flight; every invariant (a snapshot `available` restores to exactly the tree
-- it captured; a terminated sandbox has no directory, cgroup, keeper or mount; nothing spooled
-- survives a restart; no sandbox of the killed server is served as running; the records match the
-- disk, layers included) is checked after every round and every restart. Fixed seeds, and
-- MOONBOX_HARNESS_SEED=N (with MOONBOX_HARNESS_OPS, MOONBOX_HARNESS_KILLS) to replay one: a
-- failure prints its seed and the whole operation log. Each run ends with `moonbox local --check`
-- on the stopped server's state dir. Needs root; CI has it.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local harness = require "spec.support.harness"

local OPS = tonumber(os.getenv("MOONBOX_HARNESS_OPS") or "") or 220
local KILLS = tonumber(os.getenv("MOONBOX_HARNESS_KILLS") or "") or 6
-- MOONBOX_HARNESS_SEED=N runs that seed alone (a replay), instead of the fixed ones.
local env_seed = math.tointeger(tonumber(os.getenv("MOONBOX_HARNESS_SEED") or ""))
local SEEDS = env_seed and { env_seed } or { 11, 42 } -- between them: kills at every crash point

describe("the fault harness", function()
  setup(T.async(function()
    assert(proc.run({ "id", "-u" }).stdout == "0\n", "this spec needs root")
  end))

  for _, seed in ipairs(SEEDS) do
    it(string.format("seed %d: %d operations, %d kills, 0 invariant violations", seed, OPS, KILLS), T.async(function()
      io.stderr:write(string.format("\nharness: seed %d, %d operations, %d kills (replay: MOONBOX_HARNESS_SEED=%d" ..
        " MOONBOX_HARNESS_OPS=%d MOONBOX_HARNESS_KILLS=%d)\n", seed, OPS, KILLS, seed, OPS, KILLS))
      local h = harness.new { seed = seed, ops = OPS, kills = KILLS, concurrency = 3 }
      local ok, rep = pcall(h.run, h)
      if not ok then
        io.stderr:write(h:dump(), "\n")
        h:close(true)
        error(rep, 0)
      end
      print("\n" .. harness.summary(rep))
      local violated = #rep.violations > 0
      if violated then io.stderr:write(h:dump(), "\n") end
      h:close(violated)
      assert.is_true(rep.kills >= KILLS, "only " .. rep.kills .. " kills")
      assert.is_true(rep.ops >= OPS, "only " .. rep.ops .. " operations")
      assert.are.equal(0, #rep.violations, harness.summary(rep))
    end))
  end
end)
