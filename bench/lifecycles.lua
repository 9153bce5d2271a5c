-- bench/lifecycles.lua — the host CPU one sandbox life costs: N lifecycles (create, exec `true`,
-- terminate) one at a time against a fresh `moonbox local`, then the backend's utime + stime and
-- its reaped children's (cutime + cstime: keepers, inits, exec helpers, slirp4netns, the
-- sandbox's own processes) per lifecycle, against the floor of one bare
-- `bwrap --unshare-all ... true` spawn measured in the same run. It also measures both the
-- machine-wide way: the busy time of every CPU (/proc/stat) over the phase plus a settle of
-- SETTLE seconds, less this process's own CPU and the idle machine's background over the same
-- time. That counts what per-process accounting misses (the kernel tears namespaces, mounts and
-- cgroups down in its own workers, after the processes are gone), for the lives and the floor
-- alike; it is only meaningful on an otherwise quiet machine, so the idle background is printed.
-- Run: build/moonbox run bench/lifecycles.lua [N] [NETWORK]   (root; NETWORK: allow-all (the
-- default, with slirp4netns) or deny-all). bench/lifecycle_cost.sh runs it under perf.
local proc = require "moonbox.proc"
local task = require "moonbox.task"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"

local n = tonumber(arg and arg[1]) or 200
local network = arg and arg[2] or "allow-all"

local SETTLE = tonumber(os.getenv("SETTLE")) or 3

-- All CPUs' busy time so far, in seconds (user nice system irq softirq steal; not idle/iowait).
local function busy()
  local f = assert(io.open("/proc/stat"))
  local line = f:read("l")
  f:close()
  local v = {}
  for x in line:gmatch("%d+") do v[#v + 1] = tonumber(x) end
  return (v[1] + v[2] + v[3] + v[6] + v[7] + (v[8] or 0)) / 100
end

-- utime + stime and cutime + cstime of process pid, in seconds.
local function stat(pid)
  local st = measure.proc_stat(pid)
  return st.self, st.children
end

local B = L.start()
io.stderr:write("backend pid ", B.p.pid, "\n") -- for strace/perf on this backend alone
local function life() measure.life(B, { networkPolicy = { default = network } }) end
local function settle() proc.run { "sleep", tostring(SETTLE) } end
local function own() return stat("self") end

-- The machine's background: busy seconds per second while nothing of ours runs.
local i0 = busy()
proc.run { "sleep", "5" }
local idle_rate = (busy() - i0) / 5

-- Machine-wide busy seconds of fn() and the settle after it, less our own CPU and the idle
-- background over the same wall time.
local function machine(fn)
  local b0, o0, w0 = busy(), own(), task.now()
  fn()
  settle()
  local b1, o1, w1 = busy(), own(), task.now()
  return (b1 - b0) - (o1 - o0) - idle_rate * (w1 - w0)
end

for _ = 1, 10 do life() end -- warm-up
settle()
local s0, c0 = stat(B.p.pid)
local lives_machine = machine(function() for _ = 1, n do life() end end)
local s1, c1 = stat(B.p.pid)
B:destroy()
settle()
local FLOOR_N = 100
local _, f0 = stat("self")
local floor_machine = machine(function()
  for _ = 1, FLOOR_N do
    proc.run { "bwrap", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true" }
  end
end)
local _, f1 = stat("self")
local per = ((s1 - s0) + (c1 - c0)) * 1000 / n
local floor = (f1 - f0) * 1000 / FLOOR_N
print("| network | lives | host CPU per life | backend | children | bwrap floor | vs floor |" ..
  " machine-wide per life | machine-wide floor | vs floor | idle background |")
print(string.format("| %s | %d | %.1f ms | %.1f ms | %.1f ms | %.1f ms | %.1f× | %.1f ms | %.1f ms | %.1f× | %.0f ms/s |",
  network, n, per, (s1 - s0) * 1000 / n, (c1 - c0) * 1000 / n, floor, per / floor,
  lives_machine * 1000 / n, floor_machine * 1000 / FLOOR_N, (lives_machine / n) / (floor_machine / FLOOR_N),
  idle_rate * 1000))
