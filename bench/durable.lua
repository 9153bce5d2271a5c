-- bench/durable.lua [CALLS] [ROUNDS] — what a durable run's journal costs, and what a resume and
-- a replay save (docs/reference/durable.md). Run as root: `build/moonbox run bench/durable.lua`.
--
-- Against a `moonbox local` of its own (spec/support/local_backend.lua), every figure the
-- median of ROUNDS (default 5) rounds of whole `moonbox run` processes, in one run:
--
--   1. resume: a durable run creates a sandbox, makes CALLS (default 100) calls (sb:refresh),
--      then is SIGKILLed; `moonbox run --resume` answers those from the journal (all but the
--      reads whose `done` had not been written yet: sent again) and makes CALLS more live.
--      Against the sum of its parts, measured apart in the same round: a process that only
--      reads that run's journal (the same rows, decoded), plus a durable run that makes as many
--      live calls as the resume did on an adopted sandbox, less one process start (both
--      baselines pay one, the resume one only). The issue's bound is 1.2x.
--   2. replay: 1000 calls (sb:refresh) live without a journal, recorded (--record), journaled
--      (--durable, in SQLite), replayed (--replay).
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"
local proc = require "moonbox.proc"
local core = require "moonbox.core"

local CALLS = math.tointeger(tonumber(arg[1] or "")) or 100
local ROUNDS = math.tointeger(tonumber(arg[2] or "")) or 5
local REPLAY_CALLS = 1000

local B = L.start()
local tmp = proc.run({ "mktemp", "-d", "/tmp/moonbox-bench-durable.XXXXXX" }).stdout:gsub("%s+$", "")
local env = { RENDER_LOCAL_DEV_URL = B.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
  XDG_STATE_HOME = tmp .. "/state", PATH = os.getenv("PATH"), HOME = os.getenv("HOME") }

local function write(name, text)
  local f = assert(io.open(tmp .. "/" .. name, "w"))
  f:write(text)
  f:close()
  return tmp .. "/" .. name
end

-- The run that dies: create, n1 calls, then (BENCH_CRASH set) SIGKILL itself; n2 calls more.
local crashing = write("crashing.lua", [[
local render = require "moonbox.render"
local sys = require "moonbox.sys"
local n1, n2 = tonumber(arg[1]), tonumber(arg[2])
local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
for _ = 1, n1 do sb:refresh() end
if os.getenv("BENCH_CRASH") == "1" then
  local f = io.open("/proc/self/stat")
  local pid = math.tointeger(tonumber(f:read("a"):match("^(%d+)")))
  f:close()
  sys.kill(pid, 9)
end
for _ = 1, n2 do sb:refresh() end
]])
-- The live remainder alone: the same n2 calls on a sandbox made beforehand, adopted.
local remainder = write("remainder.lua", [[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.get(arg[1]):adopt()
for _ = 1, tonumber(arg[2]) do sb:refresh() end
]])
-- Reading a run's journal, as a resume does (the rows, decoded).
local reader = write("reader.lua", [[
local ledger = require "moonbox.ledger"
local dstore = require "moonbox.durable.store"
local L = ledger.open()
local n = #dstore.db(L.db, math.tointeger(tonumber(arg[1]))):load()
L:close()
assert(n > 0, "no journal")
]])
local empty = write("empty.lua", "")
local maker = write("maker.lua", [[
local render = require "moonbox.render"
print(render.sandboxes.create({ network = "deny-all", lifetime = 600 }):keep().id)
]])
local calls = write("calls.lua", [[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
for _ = 1, tonumber(arg[1]) do sb:refresh() end
]])

-- Runs `moonbox run ARGS...` with env (+ extra), returns its wall seconds and stdout; raises on
-- an exit status other than want_code (default 0; "killed": it must die of a signal).
local function timed(args, extra, want_code)
  local argv = { L.BIN, "run" }
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  local e = {}
  for k, v in pairs(env) do e[k] = v end
  for k, v in pairs(extra or {}) do e[k] = v end
  argv.env = e
  local t0 = core.now()
  local r = proc.run(argv)
  local dt = core.now() - t0
  local killed = want_code == "killed" and r.signal ~= nil
  if not killed and r.code ~= (want_code or 0) then
    error(string.format("bench: %s exited %s (wanted %s): %s", table.concat(args, " "), tostring(r.code),
      tostring(want_code or 0), r.stderr), 0)
  end
  return dt, r.stdout, r.stderr
end

local function last_run_id()
  local _, out = timed({ write("last.lua", [[
local ledger = require "moonbox.ledger"
local L = ledger.open()
print(L.db:value("SELECT max(id) AS id FROM runs"))
L:close()
]]) })
  return math.tointeger(tonumber(out:match("%d+")))
end

-- The live remainder is what the resume sent to the backend: the CALLS after the crash, the
-- reads whose `done` was still waiting for the next write when the run was killed (sent again),
-- the lost_sandbox check and the terminate. Its baseline makes as many calls: the adopt's GET,
-- live - 2 reads and the terminate.
local resume_t, read_t, live_t, start_t, answered_n, live_n = {}, {}, {}, {}, {}, {}
for round = 1, ROUNDS do
  timed({ "--durable", crashing, tostring(CALLS), tostring(CALLS) }, { BENCH_CRASH = "1" }, "killed")
  local id = last_run_id()
  local dt, _, err = timed({ "--resume", tostring(id) })
  resume_t[round] = dt
  local answered, live = err:match("(%d+) call%(s%) answered from its journal.-(%d+) live")
  answered_n[round], live_n[round] = assert(tonumber(answered), err), assert(tonumber(live), err)
  read_t[round] = timed({ reader, tostring(id) })
  local _, sid = timed({ maker })
  live_t[round] = timed({ "--durable", remainder, sid:match("%S+"), tostring(live_n[round] - 2) })
  start_t[round] = timed({ empty })
end

local live_plain, recorded, replayed, journaled = {}, {}, {}, {}
local cassette = tmp .. "/calls.cassette"
for round = 1, ROUNDS do
  live_plain[round] = timed({ calls, tostring(REPLAY_CALLS) })
  recorded[round] = timed({ "--record", cassette, calls, tostring(REPLAY_CALLS) })
  journaled[round] = timed({ "--durable", calls, tostring(REPLAY_CALLS) })
  replayed[round] = timed({ "--replay", cassette })
end

local med = measure.median
local r, rd, lv, st = med(resume_t), med(read_t), med(live_t), med(start_t)
local lp, rc, rp, jn = med(live_plain), med(recorded), med(replayed), med(journaled)
local an, ln = med(answered_n), med(live_n)
print(string.format("| resume after %d calls, then %d more | %.0f ms (%d answered from the journal, %d live) |",
  CALLS, CALLS, r * 1000, an, ln))
print(string.format("| journal read (the run's entries) | %.0f ms |", rd * 1000))
print(string.format("| live remainder (%d calls, adopted sandbox) | %.0f ms |", ln, lv * 1000))
print(string.format("| process start (empty recipe) | %.0f ms |", st * 1000))
print(string.format("| resume / (read + live - start) | %.2fx |", r / (rd + lv - st)))
print(string.format("| %d calls live, no journal | %.0f ms |", REPLAY_CALLS, lp * 1000))
print(string.format("| %d calls recorded (--record) | %.0f ms (%.2fx live) |", REPLAY_CALLS, rc * 1000, rc / lp))
print(string.format("| %d calls journaled (--durable, SQLite) | %.0f ms (%.2fx live) |", REPLAY_CALLS, jn * 1000,
  jn / lp))
print(string.format("| %d calls replayed (--replay) | %.0f ms (%.3fx live) |", REPLAY_CALLS, rp * 1000, rp / lp))

B:stop()
L.remove_tree(tmp)
