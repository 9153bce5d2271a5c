-- bench/isolation.lua — what the sandbox hardening costs, end to end over HTTP: create →
-- running p50 (a run-token mint waits for the boot, so this is what a client sees) and the
-- round trip of `exec true` (mint + SSE run to exit), against the `moonbox local` binary named
-- by MOONBOX_BIN. bench/isolation.sh runs it for the hardened backend and for the one before
-- the hardening, alternately, and prints the ratios.
-- Run: MOONBOX_BIN=... build/moonbox run bench/isolation.lua LABEL [N]   (needs root)
local core = require "moonbox.core"
local L = require "spec.support.local_backend"
local measure = require "bench.support.measure"

local label, n = arg[1] or "?", tonumber(arg[2] or "30")
local B = L.start { stderr = "null" }

local pct = measure.pct
local function exec(id, command) return measure.exec(B, id, command) end

local function create(network) return measure.create(B, { networkPolicy = { default = network } }) end

local out = {}
for _, network in ipairs({ "deny-all", "allow-all" }) do
  local lat = {}
  for i = 1, n do
    local id, t = create(network)
    lat[i] = t
    B:req("POST", "/v1/sandboxes/" .. id .. "/terminate")
  end
  out[#out + 1] = string.format("create_%s_p50_ms=%.2f", network:gsub("-", "_"), pct(lat, 0.5) * 1000)
end
local id = create("deny-all")
local rt = {}
exec(id, "true")
for i = 1, n do
  local t0 = core.now()
  assert(exec(id, "true") == 0)
  rt[i] = core.now() - t0
end
out[#out + 1] = string.format("exec_p50_ms=%.2f", pct(rt, 0.5) * 1000)
B:req("POST", "/v1/sandboxes/" .. id .. "/terminate")
B:destroy()
print(label .. " " .. table.concat(out, " "))
