-- bench/waits.lua [N] — how long the recipe's waits take against what the backend needed, in
-- one run against a `moonbox local` process, alternating so both see the same machine:
--   create:   render.sandboxes.create{} (returns once running) vs the backend's own create →
--             running: a raw POST /v1/sandboxes followed by a run-token mint, which the backend
--             answers only once the boot is done (the earliest a client can know);
--   snapshot: sb:snapshot{} of a sandbox with 150 MB written (returns once available) vs the
--             capture itself: a raw POST .../snapshots polled every 2 ms until available.
-- Prints p50 of each and the ratios. Run: build/moonbox run bench/waits.lua [30] (root).
local core = require "moonbox.core"
local task = require "moonbox.task"
local render = require "moonbox.render"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"

local n = tonumber(arg and arg[1]) or 30
local B = L.start()
B:connect_render()

local p50 = measure.median

local raw_create, mb_create = {}, {}
for i = 1, n do
  local t0 = core.now()
  local s, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace } })
  assert(s == 201, "create: " .. s)
  local ms = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/stream/token", { body = { command = "true" } })
  assert(ms == 201, "mint: " .. ms)
  raw_create[i] = core.now() - t0
  B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  t0 = core.now()
  local rsb = render.sandboxes.create {}
  mb_create[i] = core.now() - t0
  rsb:terminate()
end

local sb = render.sandboxes.create {}
sb:exec("head -c 150000000 /dev/zero > /root/fill"):check()
local raw_snap, mb_snap = {}, {}
local m = math.max(5, n // 4)
for i = 1, m do
  local t0 = core.now()
  local s, snap = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots", { body = { kind = "filesystem" } })
  assert(s == 202 or s == 201, "snapshot: " .. s)
  local path = "/v1/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id
  while snap.status == "creating" do
    task.sleep(0.002)
    local _
    _, snap = B:req("GET", path)
  end
  assert(snap.status == "available", "capture " .. tostring(snap.status))
  raw_snap[i] = core.now() - t0
  B:req("DELETE", path)
  t0 = core.now()
  local rs = sb:snapshot {}
  mb_snap[i] = core.now() - t0
  rs:delete()
end
sb:terminate()
B:destroy()

local rc, mc, rs, ms = p50(raw_create), p50(mb_create), p50(raw_snap), p50(mb_snap)
print(string.format("| create → running (%d) | %.1f ms | %.1f ms | %.2f× |", n, rc * 1000, mc * 1000, mc / rc))
print(string.format("| snapshot of 150 MB (%d) | %.0f ms | %.0f ms | %.2f× |", m, rs * 1000, ms * 1000, ms / rs))
