-- bench/fanout.lua — 100 restores + exec + terminate against a `moonbox local`, at concurrency
-- 1, 4 and 16 (issue 5's goal: 16 in at most 0.25x the wall time of 1). Client CPU and peak RSS
-- of this process are printed with each row (its children, the backend, are not counted).
-- Run: build/moonbox run bench/fanout.lua [COUNT]   (root, like moonbox local)
-- LATENCY_MS=200: every API call the fan-out makes waits that long in the backend (its latency
-- fault, set after the snapshot is taken) and only concurrency 1 and 16 run: the client's
-- concurrency measured apart from this machine's two cores (issue 13: 16 vs 1 <= 0.1x wall).
local render = require "moonbox.render"
local task = require "moonbox.task"
local core = require "moonbox.core"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"

local count = tonumber(arg and arg[1]) or 100
local B = L.start()
B:connect_render()
local base <close> = render.sandboxes.create {}
base:exec("echo ready > /root/marker"):check()
local snap = base:snapshot { name = "fanout-bench" }
local latency = tonumber(os.getenv("LATENCY_MS"))
local levels = { 1, 4, 16 }
if latency then
  B:faults("*=latency:" .. latency)
  levels = { 1, 16 }
end

-- This process's CPU (utime + stime, seconds) and peak RSS (VmHWM, KiB).
local function rusage()
  local st = measure.proc_stat("self")
  return st.self, st.hwm
end

-- Machine-wide busy time (all processes: the backend, its sandboxes, this client) from
-- /proc/stat, in cores: how close a row came to saturating the machine.
local function machine_busy()
  local f = io.open("/proc/stat")
  local line = f:read("l")
  f:close()
  local total, idle, i = 0, 0, 0
  for x in line:gmatch("%d+") do
    i = i + 1
    total = total + tonumber(x)
    if i == 4 or i == 5 then idle = idle + tonumber(x) end -- idle, iowait
  end
  return total, idle
end
local ncores = 0
for line in io.lines("/proc/cpuinfo") do
  if line:match("^processor%s*:") then ncores = ncores + 1 end
end

local rows, base_wall = {}, nil
for _, c in ipairs(levels) do
  local cpu0 = rusage()
  local mt0, mi0 = machine_busy()
  local t0 = core.now()
  local fleet <close> = render.restore(snap, { count = count, concurrency = c })
  task.map(fleet, function(sb) return sb:exec("cat /root/marker"):check().stdout end, { concurrency = c })
  fleet:terminate()
  local wall = core.now() - t0
  local cpu1, rss = rusage()
  local mt1, mi1 = machine_busy()
  local busy = ((mt1 - mt0) - (mi1 - mi0)) / math.max(mt1 - mt0, 1) * ncores
  base_wall = base_wall or wall
  rows[#rows + 1] = string.format("| %d | %d | %.2f | %.2f× | %.0f | %.1f | %.2f of %d |", count, c, wall,
    wall / base_wall, (cpu1 - cpu0) * 1e6 / count, rss / 1024, busy, ncores)
  io.stderr:write(rows[#rows], "\n")
end
if latency then B:req("DELETE", "/_moonbox/faults") end
snap:delete()
print("| restores (+ exec + terminate) | concurrency | wall s | wall vs concurrency 1 | client CPU µs per sandbox " ..
  "| client peak RSS MB | machine busy (cores) |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for _, r in ipairs(rows) do print(r) end
-- What a connect token's lifetime must cover: the longest any of this run's tokens waited from
-- its mint to its use, with 16 sandboxes booting and exec'ing at once on this machine.
local _, health = B:req("GET", "/_moonbox/health")
local tk = type(health) == "table" and health.tokens
if tk then
  print(string.format("connect tokens: %d spent, the slowest used %.3f s after its mint (lifetime %d s)",
    tk.spent, tk.slowestUseSeconds, tk.lifetimeSeconds))
end
base:terminate()
B:destroy()
