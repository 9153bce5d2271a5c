-- Soak: many fan-out runs against `moonbox local` under randomized faults — 500/503 and lost
-- answers on creates, 503s on sandbox reads, 429 bursts, cut exec streams. Each run must end as
-- the faults that fired in it allow — it succeeds exactly when no fault fired that no client
-- can get past (a create answered 500 or 503, which all_or_nothing turns into the run's failure,
-- or an exec stream cut before its exit, whose outcome is unknown); the rest (lost create
-- answers, 503s on reads, 429s) the client must absorb. After every run the backend lists 0
-- sandboxes before any reap, and `moonbox reap` finds nothing to do. Bounded: MOONBOX_SOAK_RUNS
-- runs (default 200) or 240 s, whichever comes first; the counts are printed.
local T = require "moonbox.testing"
local core = require "moonbox.core"
local runs = require "spec.support.runs"

local B, home

runs.fixture(setup, teardown, function(b, h) B, home = b, h end, { args = { "--seed", "42" } })

-- The rules, in order; `fatal` marks those whose firing must fail the run; `per_run` is about
-- how often each fires in a run (its rate times the matching requests a run makes: 4 creates,
-- ~8 sandbox reads, up to 4 execs, a listing only after a lost create answer).
local RULES = {
  { "POST /v1/sandboxes=500@0.025", fatal = true, per_run = 0.1 },
  { "POST /v1/sandboxes=503@0.025", fatal = true, per_run = 0.1 },
  { "POST /v1/sandboxes=drop@0.05", per_run = 0.2 },
  { "* /v1/sandboxes/*=503@0.05", per_run = 0.3 },
  { "GET /v1/sandboxes=429:1@0.02", per_run = 0.004 },
  { "POST /v1/sandboxes/*/runs/stream/token=429:1@0.02", per_run = 0.05 },
  { "POST /proxy/*/runs/stream=cut@0.05", fatal = true, per_run = 0.1 },
}
local SPEC = {}
for i, r in ipairs(RULES) do SPEC[i] = r[1] end
SPEC = table.concat(SPEC, ";")

local COUNT = 4

describe("soak", function()
  it("ends every faulty fan-out run as its faults allow, with 0 sandboxes left and no reap needed",
    T.async(function()
      local recipe = home:recipe(string.format([[
local render = require "moonbox.render"
local task = require "moonbox.task"
local fleet <close> = render.restore(nil, { count = %d, concurrency = %d, policy = "all_or_nothing" })
task.map(fleet, function(sb) return sb:exec("echo soak"):check().stdout end, { concurrency = %d })
]], COUNT, COUNT, COUNT))
      local limit = tonumber(os.getenv("MOONBOX_SOAK_RUNS") or "200")
      local started = core.now()
      local counts = { runs = 0, ok = 0, failed = 0, fired = {} }
      for i = 1, #RULES do counts.fired[i] = 0 end
      for _ = 1, limit do
        if core.now() - started > 240 then break end
        assert.are.equal(200, (B:req("PUT", "/_moonbox/faults", { body = SPEC }))) -- fired counts start at 0
        local r = home:moonbox("run", recipe)
        local _, f = B:req("GET", "/_moonbox/faults")
        B:req("DELETE", "/_moonbox/faults") -- a fault-free look at what is left
        counts.runs = counts.runs + 1
        local fatal = {}
        for i, rule in ipairs(f.rules) do
          counts.fired[i] = counts.fired[i] + rule.fired
          if RULES[i].fatal and rule.fired > 0 then fatal[#fatal + 1] = RULES[i][1] end
        end
        local what = string.format("run %d (fatal faults fired: %s): %s", counts.runs,
          #fatal > 0 and table.concat(fatal, ", ") or "none", r.stderr)
        if #fatal == 0 then
          assert.are.equal(0, r.code, what)
          counts.ok = counts.ok + 1
        else
          assert.are.equal(1, r.code, what)
          counts.failed = counts.failed + 1
        end
        local left = B:live()
        assert.are.equal(0, left, what .. ": " .. left .. " sandboxes left")
        local rp = home:moonbox("reap")
        assert.are.equal(0, rp.code, rp.stdout .. rp.stderr)
        assert.matches("reap: 0 terminated, 0 already gone, 0 never made, 0 failed", rp.stdout)
      end
      -- What the rates allow on average, for the record: each of the COUNT creates survives the
      -- two fatal create faults, then each exec survives the cut.
      local create_ok = (1 - 0.025) * (1 - 0.025)
      local expected = create_ok ^ COUNT * (1 - 0.05) ^ COUNT
      local fired = {}
      for i, n in ipairs(counts.fired) do fired[i] = string.format("%s x%d", RULES[i][1], n) end
      print(string.format("\nsoak: %d runs in %.0f s: %d succeeded (%.0f%%; the fault rates allow %.0f%% on " ..
        "average), %d failed exactly where a fatal fault fired, 0 left running, 0 reaped\nfaults fired: %s",
        counts.runs, core.now() - started, counts.ok, 100 * counts.ok / counts.runs, 100 * expected,
        counts.failed, table.concat(fired, "; ")))
      assert.is_true(counts.runs >= 20)
      -- Runs did succeed (about two in three should), so the rules above were met by real
      -- fan-outs that completed, not only by runs that failed early.
      assert.is_true(counts.ok > 0, "none of " .. counts.runs .. " runs succeeded")
      -- Every rule that these runs should have fired ten times or more did fire (the chance that
      -- one did not is below e^-10), so the client met it and ended its runs as asserted above.
      for i, rule in ipairs(RULES) do
        if counts.runs * rule.per_run >= 10 then
          assert.is_true(counts.fired[i] > 0, "never fired in " .. counts.runs .. " runs: " .. rule[1])
        end
      end
    end))
end)
