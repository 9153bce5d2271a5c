-- bench/local.lua — the local backend's costs, measured end to end over HTTP from a client
-- process (this one) against a `moonbox local` process, as a user sees them:
--   create → running latency (p50/p95), exec `true` round trip (p50), restore of a 1 GiB
--   snapshot against a 1 MiB one (ratio), capture throughput of a 1 GiB upper layer, and
--   exec output throughput through SSE.
-- Run: build/moonbox run bench/local.lua [OUT.md]   (needs root, like moonbox local itself)
local task = require "moonbox.task"
local json = require "moonbox.json"
local core = require "moonbox.core"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"

local out_file = arg and arg[1]
local B = L.start()
local report = measure.report()
local function row(...) report:row(...) end

local pct = measure.pct

-- Creates a sandbox and returns its id and the seconds until it could run a command.
local function create_timed(body) return measure.create(B, body) end

local function terminate(id) measure.terminate(B, id) end

local function exec(id, command, on_event)
  return measure.exec(B, id, command, { on_event = on_event, buffer = 1024 * 1024 })
end

local function wait_snapshot(snap)
  while true do
    local _, s = B:req("GET", "/v1/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id)
    if s.status ~= "creating" then
      assert(s.status == "available", "snapshot failed: " .. tostring(s.error))
      return s
    end
    task.sleep(0.01)
  end
end

-- 1. create → running
local lat = {}
for i = 1, 30 do
  local id, t = create_timed()
  lat[i] = t
  terminate(id)
end
row("create → running, p50", string.format("%.1f ms", pct(lat, 0.5) * 1000), "30 creates, one at a time")
row("create → running, p95", string.format("%.1f ms", pct(lat, 0.95) * 1000), "")

-- 2. exec round trip
local sb = create_timed()
local rt = {}
for i = 1, 50 do
  local t0 = core.now()
  assert(exec(sb, "true") == 0)
  rt[i] = core.now() - t0
end
row("exec `true` round trip, p50", string.format("%.1f ms", pct(rt, 0.5) * 1000), "mint + POST + SSE exit, 50 runs")

-- 3. exec output throughput
local bytes = 0
local total = 512 * 1024 * 1024
local t0 = core.now()
assert(exec(sb, "yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c " .. total, function(ev)
  if ev.event == "output" then bytes = bytes + #json.decode(ev.data).data end
end) == 0)
local secs = core.now() - t0
assert(bytes == total, "got " .. bytes)
row("exec output throughput", string.format("%.0f MB/s", total / secs / 1e6),
  "512 MiB through SSE, decoded by a moonbox client")

-- 4. capture of a 1 GiB upper layer, and restore cost against a 1 MiB snapshot
local function snapshot_of(size_expr)
  local id = create_timed()
  assert(exec(id, "head -c " .. size_expr .. " /dev/urandom > /root/blob && sync") == 0)
  local c0 = core.now()
  local _, snap = B:req("POST", "/v1/sandboxes/" .. id .. "/snapshots", { body = { kind = "filesystem" } })
  snap = wait_snapshot(snap)
  local ctime = core.now() - c0
  terminate(id)
  return snap, ctime
end
local small = snapshot_of("1M")
local big, big_capture = snapshot_of("1G")
row("capture throughput, 1 GiB upper layer", string.format("%.0f MB/s", big.sizeBytes / big_capture / 1e6),
  string.format("%.2f s for %d bytes", big_capture, big.sizeBytes))
local function restore_times(snap)
  local t = {}
  for i = 1, 10 do
    local id, secs_ = create_timed { snapshotId = snap.id }
    t[i] = secs_
    terminate(id)
  end
  return pct(t, 0.5)
end
local rs, rb = restore_times(small), restore_times(big)
row("restore of a 1 MiB snapshot, p50", string.format("%.1f ms", rs * 1000), "create → running, 10 restores")
row("restore of a 1 GiB snapshot, p50", string.format("%.1f ms", rb * 1000), "")
row("restore 1 GiB / 1 MiB", string.format("%.2f×", rb / rs), "goal ≤ 1.2×: a restore stacks the layer, copies nothing")

terminate(sb)
B:destroy()

report:finish(out_file)
