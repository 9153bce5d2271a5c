-- bench/isolation.lua — what the sandbox hardening costs, end to end over HTTP: create →
-- running p50 (a run-token mint waits for the boot, so this is what a client sees) and the
-- round trip of `exec true` (mint + SSE run to exit), against the `moonbox local` binary named
-- by MOONBOX_BIN. bench/isolation.sh runs it for the hardened backend and for the one before
-- the hardening, alternately, and prints the ratios.
-- Run: MOONBOX_BIN=... build/moonbox run bench/isolation.lua LABEL [N]   (needs root)
local http = require "moonbox.http"
local json = require "moonbox.json"
local core = require "moonbox.core"
local L = require "spec.support.local_backend"

local label, n = arg[1] or "?", tonumber(arg[2] or "30")
local B = L.start { stderr = "null" }

local function pct(list, p)
  table.sort(list)
  return list[math.max(1, math.ceil(#list * p))]
end

local function token(id, command)
  local s, tok = B:req("POST", "/v1/sandboxes/" .. id .. "/runs/stream/token", { body = { command = command } })
  assert(s == 201, "mint failed " .. s)
  return tok
end

local function exec(id, command)
  local tok = token(id, command)
  local resp <close> = http.stream { method = "POST", url = tok.uri, body = json.encode({ command = command }),
    headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream" } }
  local code
  for ev in function() return resp:read_event() end do
    if ev.event == "exit" then code = json.decode(ev.data).exit_code end
  end
  return code
end

local function create(network)
  local t0 = core.now()
  local s, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, networkPolicy = { default = network } } })
  assert(s == 201, "create failed: " .. s .. " " .. json.encode(sb))
  token(sb.id, "true")
  return sb.id, core.now() - t0
end

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
