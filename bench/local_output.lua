-- bench/local_output.lua — the backend's side of exec output: `yes … | head -c SIZE` through an
-- exec's SSE stream, with the backend's CPU (utime + stime of the `moonbox local` process, from
-- /proc/PID/stat) per GiB of output, and the wall throughput. The client only frames the
-- events (no JSON decoding), so the figures describe the server's quoting and copying.
-- Run: build/moonbox run bench/local_output.lua [MiB]   (root, like moonbox local)
local http = require "moonbox.http"
local json = require "moonbox.json"
local core = require "moonbox.core"
local L = require "spec.support.local_backend"

local mib = tonumber(arg and arg[1]) or 512
local total = mib * 1024 * 1024
local function cpu(pid)
  local f = assert(io.open("/proc/" .. pid .. "/stat"))
  local s = f:read("a")
  f:close()
  local fields = {}
  for x in s:match("%) (.*)$"):gmatch("%S+") do fields[#fields + 1] = x end
  return (tonumber(fields[12]) + tonumber(fields[13])) / 100
end

local B = L.start()
local sb = B:create {}
local best
for _ = 1, 3 do
  local cmd = "yes 0123456789abcdefghijklmnopqrstuvwxyz | head -c " .. total
  local _, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/stream/token", { body = { command = cmd } })
  local c0, t0 = cpu(B.p.pid), core.now()
  local resp <close> = http.stream { method = "POST", url = tok.uri, body = json.encode({ command = cmd }),
    headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream" }, buffer = 1024 * 1024 }
  local bytes = 0
  while true do
    local ev = resp:read_event()
    if not ev or ev.event == "exit" then break end
    bytes = bytes + #ev.data
  end
  local secs, used = core.now() - t0, cpu(B.p.pid) - c0
  assert(bytes > total, "short output: " .. bytes)
  if not best or used < best.cpu then best = { cpu = used, secs = secs } end
end
B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
B:destroy()
print(string.format("| %d MiB of `yes` output | %.0f MB/s | %.2f s backend CPU per GiB |", mib,
  total / best.secs / 1e6, best.cpu * 1024 / mib))
