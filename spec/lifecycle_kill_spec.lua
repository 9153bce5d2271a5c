-- A run SIGKILLed anywhere in a 20-sandbox fan-out (issue 12): no guard runs, so the ledger is
-- all that is left. After each kill `moonbox ps` names exactly the sandboxes still running on
-- the backend — nothing missing, nothing extra — and one `moonbox reap` leaves 0 running. The
-- kill points are random (a fixed seed, printed) and counted in requests the backend received,
-- so they fall on every stage: creates in flight, waits for `running`, execs, terminates.
local T = require "moonbox.testing"
local runs = require "spec.support.runs"

local B, home

local TIMES = runs.TIMES
local SEED = tonumber(os.getenv("MOONBOX_KILL_SEED") or "") or 12

runs.fixture(setup, teardown, function(b, h) B, home = b, h end)

-- The number of requests a whole run of recipe makes (a run that is not killed).
local function requests_of(recipe)
  local mark = runs.last_seq(B)
  local r = home:moonbox("run", recipe)
  assert.are.equal(0, r.code, r.stderr)
  assert.are.same({}, runs.live(B))
  return #runs.journal(B, mark)
end

for _, kind in ipairs { "task.map", "render.restore" } do
  describe("a " .. kind .. " fan-out SIGKILLed at a random point", function()
    it("is listed exactly by moonbox ps and cleaned up by one moonbox reap (" .. TIMES .. " kills)", T.async(function()
      local recipe = home:recipe(runs.fanout(kind, { exec_concurrency = 20 }))
      local whole = requests_of(recipe)
      math.randomseed(SEED)
      local killed_with, unknown = {}, 0
      for i = 1, TIMES do
        -- Every other kill falls among the first requests, where creates are in flight.
        local at = i % 2 == 1 and math.random(1, 30) or math.random(1, whole)
        local mark = runs.last_seq(B)
        local p = home:spawn("run", recipe)
        local running = runs.until_requests(B, mark, at, p)
        p:kill("KILL")
        p:wait()
        runs.settled(B, mark) -- what the backend was doing when the client died, it finishes
        local live = runs.live(B)
        killed_with[#killed_with + 1] = runs.count(live)
        local what = string.format("%s kill %d (after %d of ~%d requests%s, seed %d)", kind, i, at, whole,
          running and "" or "; the run had ended", SEED)
        local ps = home:moonbox("ps")
        assert.are.equal(0, ps.code, ps.stderr)
        local held, unchecked = runs.ps_sandboxes(ps.stdout)
        for _ in ps.stdout:gmatch("unknown create") do unknown = unknown + 1 end
        assert.are.equal(0, unchecked, what .. ":\n" .. ps.stdout)
        assert.are.same(runs.keys(live), runs.keys(held), what .. ":\n" .. ps.stdout)
        local reap = home:moonbox("reap")
        assert.are.equal(0, reap.code, what .. ":\n" .. reap.stdout .. reap.stderr)
        assert.are.same({}, runs.live(B), what .. ":\n" .. reap.stdout)
        local after = home:moonbox("ps")
        assert.is_nil(after.stdout:find("holds", 1, true), what .. ":\n" .. after.stdout)
      end
      print(string.format("\n%s: sandboxes running at each of %d kills (seed %d): %s; %d creates without " ..
        "an answer reconciled by their label", kind, TIMES, SEED, table.concat(killed_with, " "), unknown))
      -- The kills did land while sandboxes ran, not only before or after the fan-out.
      local busy = 0
      for _, n in ipairs(killed_with) do
        if n > 0 then busy = busy + 1 end
      end
      assert.is_true(busy >= TIMES // 2, "too few kills met running sandboxes: " .. table.concat(killed_with, " "))
    end))
  end)
end
