-- bench/lifecycles.lua — the host CPU one sandbox life costs: N lifecycles (create, exec `true`,
-- terminate) one at a time against a fresh `moonbox local`, then the backend's utime + stime and
-- its reaped children's (cutime + cstime: keepers, inits, exec helpers, slirp4netns, the
-- sandbox's own processes) per lifecycle, against the floor of one bare
-- `bwrap --unshare-all ... true` spawn measured in the same run.
-- Run: build/moonbox run bench/lifecycles.lua [N] [NETWORK]   (root; NETWORK: allow-all (the
-- default, with slirp4netns) or deny-all). bench/lifecycle_cost.sh runs it under perf.
local json = require "moonbox.json"
local http = require "moonbox.http"
local proc = require "moonbox.proc"
local L = require "spec.support.local_backend"

local n = tonumber(arg and arg[1]) or 200
local network = arg and arg[2] or "allow-all"

local function stat(pid)
  local f = assert(io.open("/proc/" .. pid .. "/stat"))
  local s = f:read("a")
  f:close()
  local fields = {}
  for x in s:match("%) (.*)$"):gmatch("%S+") do fields[#fields + 1] = tonumber(x) or x end
  return (fields[12] + fields[13]) / 100, (fields[14] + fields[15]) / 100
end

local B = L.start()
io.stderr:write("backend pid ", B.p.pid, "\n") -- for strace/perf on this backend alone
local function life()
  local s, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, networkPolicy = { default = network } } })
  assert(s == 201, "create failed: " .. s .. " " .. json.encode(sb))
  local st, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/stream/token", { body = { command = "true" } })
  assert(st == 201, "mint failed " .. st)
  local resp <close> = http.stream { method = "POST", url = tok.uri, body = json.encode({ command = "true" }),
    headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream" } }
  while true do
    local ev = resp:read_event()
    if not ev or ev.event == "exit" then break end
  end
  assert(B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate") == 204)
end
for _ = 1, 10 do life() end -- warm-up
local s0, c0 = stat(B.p.pid)
for _ = 1, n do life() end
local s1, c1 = stat(B.p.pid)
B:destroy()
local _, f0 = stat("self")
for _ = 1, 100 do
  proc.run { "bwrap", "--unshare-all", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "true" }
end
local _, f1 = stat("self")
local per = ((s1 - s0) + (c1 - c0)) * 1000 / n
local floor = (f1 - f0) * 1000 / 100
print(string.format("| %s | %d | %.1f ms | %.1f ms | %.1f ms | %.1f ms | %.1f× |", network, n, per,
  (s1 - s0) * 1000 / n, (c1 - c0) * 1000 / n, floor, per / floor))
