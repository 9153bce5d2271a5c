-- bench/integrity.lua — the long run of the seeded fault harness (spec/support/harness.lua)
-- against a real `moonbox local` (issue 22): OPS random operations (create, restore, exec,
-- upload, download, capture, snapshot delete, terminate), CONCURRENCY at most per round, with
-- KILLS SIGKILLs of the server (between rounds and while operations are in flight) and a
-- restart on the same state dir after each; every invariant checked after every round and every
-- restart, every available snapshot restored and compared at the end. Prints the figures: the
-- operations per kind, kills, restores verified, violations per invariant, wall time, and on a
-- violation the seed, how to replay it and the whole operation log (into LOG, default
-- /tmp/moonbox-integrity-SEED.log, when there is one). Exits 1 on a violation.
-- Run: build/moonbox run bench/integrity.lua   (root, like moonbox local)
-- Environment: OPS (10000), KILLS (50), SEED (20261207), CONCURRENCY (3), LOG, STOP_AFTER (an
-- operation number: run the same plan only that far, to replay the start of a long run).
local harness = require "spec.support.harness"

local OPS = tonumber(os.getenv("OPS")) or 10000
local KILLS = tonumber(os.getenv("KILLS")) or 50
local SEED = math.tointeger(tonumber(os.getenv("SEED") or "")) or 20261207
local CONCURRENCY = tonumber(os.getenv("CONCURRENCY")) or 3
local LOG = os.getenv("LOG") or string.format("/tmp/moonbox-integrity-%d.log", SEED)

print(string.format("integrity: seed %d, %d operations, %d kills, concurrency %d (replay: SEED=%d OPS=%d " ..
  "KILLS=%d CONCURRENCY=%d build/moonbox run bench/integrity.lua)", SEED, OPS, KILLS, CONCURRENCY, SEED, OPS,
  KILLS, CONCURRENCY))
local h = harness.new { seed = SEED, ops = OPS, kills = KILLS, concurrency = CONCURRENCY,
  stop_after = tonumber(os.getenv("STOP_AFTER") or ""), progress = function(line) print(line) end }
local ok, rep = pcall(h.run, h)
local function write_log()
  local f = assert(io.open(LOG, "w"))
  f:write(h:dump(), "\n")
  f:close()
end
if not ok then
  write_log()
  h:close(true)
  io.stderr:write("integrity: the harness stopped: ", tostring(rep), "\n(the log: ", LOG, ")\n")
  os.exit(2)
end
print(harness.summary(rep))
print(string.format("integrity: %.2f operations per second", rep.ops / rep.wall))
local by = {}
for _, v in ipairs(rep.violations) do
  if not by[v.name] then
    by[v.name] = true
    print(string.format("  first %s (round %d, server %d): %s", v.name, v.round, v.epoch, v.detail:sub(1, 400)))
  end
end
if #rep.violations > 0 then
  write_log()
  print("integrity: the seed, the violations and the whole operation log: " .. LOG)
end
h:close(#rep.violations > 0)
if #rep.violations > 0 then os.exit(1) end
