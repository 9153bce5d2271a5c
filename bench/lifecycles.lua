-- bench/lifecycles.lua — the host CPU one sandbox life costs: N lifecycles (create, exec `true`,
-- terminate) one at a time against a fresh `moonbox local`, against the floor of one bare
-- `bwrap --unshare-all ... true` spawn measured in the same run, by three measures (every one
-- from the kernel's precise per-task runtime, none from tick samples; bench/README.md says why):
--   per process  the backend's utime + stime and its reaped children's (cutime + cstime:
--                keepers, inits, exec helpers, slirp4netns, the sandbox's own processes); for
--                the floor, bwrap's (the bench's own children);
--   + kernel     that plus what the kernel's own threads (kworkers, RCU, ksoftirqd: the
--                children of kthreadd, from /proc/PID/schedstat) ran over the phase and a settle
--                of SETTLE seconds, less their idle rate: the namespaces, mounts and cgroups a
--                life leaves are torn down there, after its processes are gone;
--   machine      every task of the machine (the root cpuacct cgroup's usage, cgroup v1) over the
--                phase and the settle, less this process's own CPU and the idle machine's
--                background; meaningful only on an otherwise quiet machine (the background is
--                printed).
-- The last column is the machine measure from /proc/stat instead, for comparison: tick-sampled
-- (4 ms ticks here) and with steal time, it is what the first version of this bench used.
-- Run: build/moonbox run bench/lifecycles.lua [N] [NETWORK]   (root; NETWORK: allow-all (the
-- default, with slirp4netns) or deny-all). MOONBOX_BIN=other/build/moonbox measures another
-- build's backend with this same bench; BASELINE=other/build/moonbox first compares the two
-- builds, lives interleaved (below). bench/lifecycle_cost.sh runs it under perf.
local path = require "moonbox.path"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local task = require "moonbox.task"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"

local n = tonumber(arg and arg[1]) or 200
local network = arg and arg[2] or "allow-all"
local SETTLE = tonumber(os.getenv("SETTLE")) or 3
local FLOOR_N = 100

local read = path.read_file

-- utime + stime and cutime + cstime of process pid, in seconds (precise totals: the kernel
-- scales the tick-sampled split to the task's measured runtime).
local function stat(pid)
  local st = measure.proc_stat(pid)
  return st.self, st.children
end

-- Seconds the kernel's own threads (kthreadd and its children) have run.
local function kernel_threads()
  local ns = 0
  for _, name in ipairs(sys.listdir("/proc")) do
    if name:match("^%d+$") then
      local s = read("/proc/" .. name .. "/stat")
      local ppid = s and s:match("%) %S+ (%d+)")
      if name == "2" or ppid == "2" then
        ns = ns + (tonumber((read("/proc/" .. name .. "/schedstat") or ""):match("^%d+")) or 0)
      end
    end
  end
  return ns / 1e9
end

local CPUACCT = measure.CPUACCT
local function machine() return CPUACCT and measure.machine_cpu() or 0 end
local ticks = measure.ticks

-- pid: whose CPU and reaped children's the per-process measure counts; "self": only our reaped
-- children's (the floor's bwraps, not our spawning of them).
local function sample(pid)
  local own = stat("self")
  local p, c = stat(pid)
  return { wall = task.now(), own = own, proc = (pid == "self" and 0 or p) + c, kernel = kernel_threads(),
    machine = machine(), ticks = ticks() }
end
local function diff(a, b)
  local d = {}
  for k, v in pairs(a) do d[k] = b[k] - v end
  return d
end
local function settle() proc.run { "sleep", tostring(SETTLE) } end

-- The background: how fast each counter moves while nothing of ours runs.
local idle = diff(sample("self"), (function() proc.run { "sleep", "5" } return sample("self") end)())
local function rate(k) return idle[k] / idle.wall end

-- Per-unit CPU of fn() (count units) by each measure, its settle included (pid as for sample).
local function per_unit(pid, count, fn)
  local a = sample(pid)
  fn()
  settle()
  local d = diff(a, sample(pid))
  local function less_bg(k) return d[k] - rate(k) * d.wall end
  return { proc = d.proc / count,
    kernel = (d.proc + less_bg("kernel")) / count,
    machine = (less_bg("machine") - d.own) / count,
    ticks = (less_bg("ticks") - d.own) / count }
end

-- One life (create, exec `true` over the stream, terminate) on backend b.
local function life(b) measure.life(b, { networkPolicy = { default = network } }) end

-- BASELINE=other/build/moonbox: before the measures below, the per-process CPU of a life on
-- that build's backend and on this one's, their lives interleaved one by one in the same run
-- (so both see the same load), printed as one more table row.
local baseline = os.getenv("BASELINE")
if baseline then
  local default = L.BIN
  L.BIN = baseline
  local A = L.start()
  L.BIN = default
  local B = L.start()
  for _ = 1, 10 do life(A) life(B) end
  local a0, b0 = { stat(A.p.pid) }, { stat(B.p.pid) }
  for _ = 1, n do life(A) life(B) end
  local a1, b1 = { stat(A.p.pid) }, { stat(B.p.pid) }
  A:destroy()
  B:destroy()
  local function per(x0, x1) return ((x1[1] - x0[1]) + (x1[2] - x0[2])) * 1000 / n end
  print(string.format("| interleaved, %s | %d + %d | baseline %.2f ms (backend %.2f, children %.2f) | this " ..
    "build %.2f ms (backend %.2f, children %.2f) | this / baseline %.3f |", network, n, n, per(a0, a1),
    (a1[1] - a0[1]) * 1000 / n, (a1[2] - a0[2]) * 1000 / n, per(b0, b1), (b1[1] - b0[1]) * 1000 / n,
    (b1[2] - b0[2]) * 1000 / n, per(b0, b1) / per(a0, a1)))
end

local B = L.start()
io.stderr:write("backend pid ", B.p.pid, "\n") -- for strace/perf on this backend alone
for _ = 1, 10 do life(B) end -- warm-up
settle()
local p0 = { stat(B.p.pid) }
local lives = per_unit(B.p.pid, n, function() for _ = 1, n do life(B) end end)
local p1 = { stat(B.p.pid) }
B:destroy()
settle()
local floor = per_unit("self", FLOOR_N, function()
  for _ = 1, FLOOR_N do
    proc.run { "bwrap", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true" }
  end
end)

local function ms(x) return string.format("%.1f ms", x * 1000) end
local function cell(k) return string.format("%s / %s = %.1f×", ms(lives[k]), ms(floor[k]), lives[k] / floor[k]) end
print("| network | lives | per process: life / floor | backend | children | + kernel threads | machine" ..
  (CPUACCT and "" or " (none: no cpuacct)") .. " | /proc/stat (ticks) | background |")
print(string.format("| %s | %d | %s | %s | %s | %s | %s | %s | %.0f ms/s (kernel %.0f) |", network, n,
  cell("proc"), ms((p1[1] - p0[1]) / n), ms((p1[2] - p0[2]) / n), cell("kernel"),
  CPUACCT and cell("machine") or "—", cell("ticks"), rate("machine") * 1000, rate("kernel") * 1000))
