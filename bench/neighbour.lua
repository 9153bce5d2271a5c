-- bench/neighbour.lua — one sandbox's load on another (issue 23 item 5): p50/p99 of an exec
-- `true` in a quiet sandbox (mint + POST + SSE exit) and of a list call (GET /v1/sandboxes),
-- idle and while a second 1c-2g sandbox of the same backend is hostile: a fork storm held at
-- its process limit (children that take memory and ask to be the OOM killer's first victims),
-- a 1.9 GiB hog re-touching its pages (the storm's children fill the rest of the memory limit), and two CPU burners.
-- BEFORE and AFTER in the same run: two backends, one started with MOONBOX_LOCAL_FAIRNESS=off
-- (no caps on the sandboxes' parent cgroup, the server and the helpers not weighted, the exec
-- helper inside the sandbox's cgroups: the old tree's placement), one with the fairness of
-- engine/cgroup.lua. Rounds alternate the two (ABBA...), and only one hostile sandbox runs at a
-- time. Prints the table (pooled over the rounds, with the per-round spread) and the ratios.
-- Run: build/moonbox run bench/neighbour.lua [OUT.md]   (root; ROUNDS=4 N=60 HOSTILE_WARMUP=5)
local task = require "moonbox.task"
local core = require "moonbox.core"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"
local host = require "moonbox.local.engine.host"
local read_file = require("moonbox.path").read_file

local out_file = arg and arg[1]
local ROUNDS = tonumber(os.getenv("ROUNDS") or "") or 4
local N = tonumber(os.getenv("N") or "") or 60
local WARMUP = tonumber(os.getenv("HOSTILE_WARMUP") or "") or 5
local pct = measure.pct

local HOSTILE = [=[
cat > /root/h.py <<'EOF'
import os, sys, time
kind = sys.argv[1]
if kind == "burn":
    while True:
        pass
if kind == "hog":  # 1.9 GiB of the plan's 2, touched again and again (the storm takes the rest)
    b = bytearray(1900 << 20)
    while True:
        for i in range(0, len(b), 4096):
            b[i] = (b[i] + 1) & 255
if kind == "storm":  # forks until the process limit, then keeps asking
    while True:
        try:
            pid = os.fork()
        except OSError:
            continue
        if pid == 0:
            try:
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")  # the OOM killer's first victims: the storm refills
                os.execv("/bin/sleep", ["sleep", "3600"])
            finally:
                os._exit(0)
EOF
cd /root
for k in hog burn burn; do setsid python3 h.py $k </dev/null >/dev/null 2>&1 & done
sleep 3
for i in 1 2 3 4; do setsid python3 h.py storm </dev/null >/dev/null 2>&1 & done
]=]

local modes = {}
for _, name in ipairs({ "before", "after" }) do
  local env = name == "before" and { MOONBOX_LOCAL_FAIRNESS = "off" } or nil
  local B = L.start { env = env }
  local quiet = measure.create(B, { plan = "1c-2g" })
  modes[name] = { name = name, B = B, quiet = quiet, tag = host.hash(B.state),
    samples = { idle = { exec = {}, list = {} }, hostile = { exec = {}, list = {} } }, rounds = {} }
end

-- The hostile sandbox's state as its cgroups tell it (host side).
local function hostile_state(m, id)
  local function rd(ctrl, file)
    return tonumber((read_file("/sys/fs/cgroup/" .. ctrl .. "/moonbox/" .. m.tag .. "/" .. id .. "/" .. file)
      or ""):match("%d+"))
  end
  local oom = read_file("/sys/fs/cgroup/memory/moonbox/" .. m.tag .. "/" .. id .. "/memory.oom_control") or ""
  return string.format("pids %s/%s, memory %.2f GiB (failcnt %s), OOM kills %s", rd("pids", "pids.current"),
    rd("pids", "pids.max"), (rd("memory", "memory.usage_in_bytes") or 0) / 2 ^ 30, rd("memory", "memory.failcnt"),
    oom:match("oom_kill (%d+)") or "?")
end

-- N exec `true` in the quiet sandbox and N list calls, alternating; seconds into into.exec/list.
local function phase(m, into)
  local r = { exec = {}, list = {} }
  for _ = 1, N do
    local t0 = core.now()
    assert(measure.exec(m.B, m.quiet, "true") == 0, "exec `true` failed in " .. m.quiet)
    r.exec[#r.exec + 1] = core.now() - t0
    t0 = core.now()
    local s = m.B:req("GET", "/v1/sandboxes", { query = { limit = 20 } })
    assert(s == 200, "list failed: " .. tostring(s))
    r.list[#r.list + 1] = core.now() - t0
  end
  for k, list in pairs(r) do
    for _, v in ipairs(list) do into[k][#into[k] + 1] = v end
  end
  return r
end

local function ms(x) return string.format("%.1f", x * 1000) end

local function round(m, i)
  local idle = phase(m, m.samples.idle)
  local hid = measure.create(m.B, { plan = "1c-2g" })
  local tok = measure.token(m.B, hid, "true") -- the hostile sandbox is up
  assert(tok)
  assert(measure.exec(m.B, hid, HOSTILE) == 0, "starting the hostile workload failed")
  task.sleep(WARMUP)
  local before_state = hostile_state(m, hid)
  local hostile = phase(m, m.samples.hostile)
  local after_state = hostile_state(m, hid)
  local t0 = core.now()
  measure.terminate(m.B, hid)
  local rec = { idle = idle, hostile = hostile }
  m.rounds[#m.rounds + 1] = rec
  io.stderr:write(string.format("round %d %-6s exec p50/p99 idle %s/%s hostile %s/%s; list idle %s/%s hostile %s/%s; " ..
    "terminate %.2f s\n  hostile at start: %s\n  hostile at end:   %s\n", i, m.name,
    ms(pct(idle.exec, 0.5)), ms(pct(idle.exec, 0.99)), ms(pct(hostile.exec, 0.5)), ms(pct(hostile.exec, 0.99)),
    ms(pct(idle.list, 0.5)), ms(pct(idle.list, 0.99)), ms(pct(hostile.list, 0.5)), ms(pct(hostile.list, 0.99)),
    core.now() - t0, before_state, after_state))
end

local load0 = read_file("/proc/loadavg")
for i = 1, ROUNDS do
  local order = (i % 2 == 1) and { "before", "after" } or { "after", "before" }
  for _, name in ipairs(order) do round(modes[name], i) end
end
local load1 = read_file("/proc/loadavg")

-- The table: per mode, pooled p50/p99 and the spread of the per-round values.
local function spread(m, phase_, what, p)
  local lo, hi
  for _, r in ipairs(m.rounds) do
    local v = pct(r[phase_][what], p)
    lo, hi = math.min(lo or v, v), math.max(hi or v, v)
  end
  return ms(lo) .. "–" .. ms(hi)
end

local lines = { "| tree | call | idle p50 | idle p99 | hostile p50 | hostile p99 | p99 hostile / idle |",
  "|---|---|---:|---:|---:|---:|---:|" }
for _, name in ipairs({ "before", "after" }) do
  local m = modes[name]
  for _, what in ipairs({ "exec", "list" }) do
    local i50, i99 = pct(m.samples.idle[what], 0.5), pct(m.samples.idle[what], 0.99)
    local h50, h99 = pct(m.samples.hostile[what], 0.5), pct(m.samples.hostile[what], 0.99)
    lines[#lines + 1] = string.format("| %s | %s | %s ms (%s) | %s ms (%s) | %s ms (%s) | %s ms (%s) | %.1f× |",
      name, what == "exec" and "exec `true`" or "list", ms(i50), spread(m, "idle", what, 0.5), ms(i99),
      spread(m, "idle", what, 0.99), ms(h50), spread(m, "hostile", what, 0.5), ms(h99),
      spread(m, "hostile", what, 0.99), h99 / i99)
  end
end
local text = table.concat(lines, "\n") .. "\n\n" .. string.format(
  "%d rounds × %d exec + %d list per phase, alternating before/after; pooled percentiles, per-round range in " ..
  "parentheses. Load average before: %s; after: %s", ROUNDS, N, N, (load0 or ""):match("^(%S+ %S+ %S+)"),
  (load1 or ""):match("^(%S+ %S+ %S+)")) .. "\n"
io.stdout:write(text)
if out_file then
  local f = assert(io.open(out_file, "w"))
  f:write(text)
  f:close()
end
for _, m in pairs(modes) do
  pcall(measure.terminate, m.B, m.quiet)
  m.B:destroy()
end
