-- bench/shared_schedule.lua — what sharing the schedule state in PostgreSQL costs, against the
-- embedded SQLite store in the same run:
--   1. slot-claim latency: the claim of a slot (store:record, one INSERT ... ON CONFLICT DO
--      NOTHING in a transaction): one claimer on SQLite, against three claimers (three
--      connections, as three daemons) racing for the same slots on PostgreSQL; wall time per
--      claim attempt, p50 and p99.
--   2. fire lateness: `moonbox schedule` daemons on the test clock (an every-second schedule at
--      scale 10: a slot every 100 ms real) — one on SQLite, three on one PostgreSQL database;
--      lateness = when the run body starts (after the claim) minus the slot, in real ms.
-- PostgreSQL is started from Debian's package in a temp dir (spec/support/postgres.lua).
-- Run from the repository root: build/moonbox run bench/shared_schedule.lua [CLAIMS] [SLOTS]
local proc = require "moonbox.proc"
local core = require "moonbox.core"
local task = require "moonbox.task"
local PG = require "spec.support.postgres"

local CLAIMS = tonumber(arg and arg[1]) or 300
local SLOTS = tonumber(arg and arg[2]) or 100
local SCALE = 10
local BIN = require("moonbox.build").exe

local function pct(list, p)
  table.sort(list)
  return list[math.max(1, math.ceil(#list * p))]
end

local function open_store(where)
  local ledger = require("moonbox.ledger").open(where)
  local store = require("moonbox.schedule.store").open(ledger)
  store:ensure({ name = "b", spec = "every 1s" }, "bench", core.time())
  return store
end

-- Every claimer claims slots 1..CLAIMS of schedule "b"; returns the latencies (ms).
local function claims(stores)
  local lat, winners = {}, 0
  local base = math.floor(core.time())
  for slot = 1, CLAIMS do
    local ts = {}
    for i, st in ipairs(stores) do
      ts[i] = task.spawn(function()
        local t0 = core.time() -- the wall clock: core.now() is the loop's cached time
        local id = st:record({ schedule = "b", slot = base + slot, trigger = "cron", fired_at = base + slot,
          started_at = base + slot, ended_at = base + slot, outcome = "ok" }, base + slot)
        lat[#lat + 1] = (core.time() - t0) * 1000
        if id then winners = winners + 1 end
      end)
    end
    for _, t in ipairs(ts) do task.join(t) end
  end
  assert(winners == CLAIMS, "claims won: " .. winners .. " of " .. CLAIMS)
  return lat
end

local RECIPE = [[
local clock = require("moonbox.schedule.clock").from_env()
require("moonbox.schedule").every("b", "1s", function(run)
  local f = assert(io.open("DIR/late", "a"))
  f:write(string.format("%.6f\n", (clock:now() - run.slot) / SCALE))
  f:close()
end)
]]

-- n daemons on database env `db` (an env entry or nil) for SLOTS slots; lateness list (ms).
local function lateness(dir, n, db)
  local recipe = dir .. "/recipe.lua"
  local f = assert(io.open(recipe, "w"))
  f:write((RECIPE:gsub("DIR", dir):gsub("SCALE", tostring(SCALE))))
  f:close()
  local clock = string.format("start=2026-03-01T00:00:00Z,scale=%d,at=%.6f", SCALE, core.time() + 1)
  local ps = {}
  for i = 1, n do
    local argv = { "env", "HOME=" .. dir, "XDG_STATE_HOME=" .. dir .. "/state", "MOONBOX_TEST_CLOCK=" .. clock,
      "RENDER_LOCAL_DEV_URL=http://127.0.0.1:9", "RENDER_API_KEY=unused" }
    if db then argv[#argv + 1] = db end
    for _, a in ipairs { BIN, "schedule", recipe } do argv[#argv + 1] = a end
    argv.stdout, argv.stderr = "null", "inherit"
    ps[i] = proc.spawn(argv)
  end
  -- wait (real time: this is a measurement on the clock) until SLOTS slots have passed
  task.sleep(1 + SLOTS / SCALE + 0.5)
  for _, p in ipairs(ps) do p:kill("TERM") end
  for _, p in ipairs(ps) do p:wait() end
  local out = {}
  for l in io.lines(dir .. "/late") do out[#out + 1] = tonumber(l) * 1000 end
  return out
end

local server = PG.start()
local dir = proc.run({ "mktemp", "-d", "/tmp/moonbox-bench-shared.XXXXXX" }).stdout:gsub("%s+$", "")
local ok, err = pcall(function()
  local sq = claims { open_store(dir .. "/claims.db") }
  local url = server:create_database("claims")
  local pg = claims { open_store(url), open_store(url), open_store(url) }
  proc.run { "mkdir", dir .. "/one", dir .. "/three" }
  local l1 = lateness(dir .. "/one", 1, nil)
  local l3 = lateness(dir .. "/three", 3, "MOONBOX_DATABASE_URL=" .. server:create_database("fires"))
  print(string.format("| measure | 1 daemon, SQLite | 3 daemons, PostgreSQL | ratio |"))
  print("|---|---:|---:|---:|")
  for _, row in ipairs {
    { "slot claim p50 (ms)", pct(sq, 0.5), pct(pg, 0.5) },
    { "slot claim p99 (ms)", pct(sq, 0.99), pct(pg, 0.99) },
    { "fire lateness p50 (ms)", pct(l1, 0.5), pct(l3, 0.5) },
    { "fire lateness p99 (ms)", pct(l1, 0.99), pct(l3, 0.99) },
  } do
    print(string.format("| %s | %.3f | %.3f | %.1fx |", row[1], row[2], row[3], row[3] / row[2]))
  end
  print(string.format("(%d claims per store; %d + %d fires run)", CLAIMS, #l1, #l3))
end)
server:destroy()
proc.run { "rm", "-rf", dir }
if not ok then error(err, 0) end
