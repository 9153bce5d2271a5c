-- bench/allowlist.lua — what the allow-list gate costs against allow-all, in one run on one
-- `moonbox local` (needs root; the servers run in a network namespace the bench makes, as in
-- spec/local_allowlist_spec.lua):
--   create_to_exec   create → the first `exec true` answered (an exec waits for the network:
--                    slirp4netns, and for allow-list the gate's namespace, veth and rules)
--   http_request     one HTTP request on a new connection, from Python inside the sandbox
--                    (200 in a row; allow-list: through the gate; allow-all: slirp4netns only)
--   download_MBps    a 64 MiB download over HTTPS with curl
-- Creates alternate between the two policies so that noise hits both alike. Prints one line
-- per policy and the ratios; bench/README.md keeps the numbers.
-- Run: build/moonbox run bench/allowlist.lua [N]
local core = require "moonbox.core"
local N = require "spec.support.named_net"
local L = require "spec.support.local_backend"

local n = tonumber(arg[1] or "20")
local net = N.start { big = 64 * 1024 * 1024 }
local B = L.start { stderr = "null", args = { "--dns", net.addr } }

local POLICY = {
  ["allow-all"] = { default = "allow-all" },
  ["allow-list"] = { default = "allow-list", allowedDomains = { "allowed.test" } },
}

local function p50(list)
  table.sort(list)
  return list[math.max(1, math.ceil(#list * 0.5))]
end

local function create(name)
  local t0 = core.now()
  local s, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, networkPolicy = POLICY[name] } })
  assert(s == 201, "create failed: " .. s)
  local r = B:exec(sb.id, "true")
  assert(r.code == 0, "exec failed")
  return sb.id, core.now() - t0
end

local REQUESTS = [[
import socket, sys, time
host, addr = sys.argv[1], sys.argv[2]
if addr == "-":
    addr = socket.gethostbyname(host)
times = []
for _ in range(200):
    t0 = time.perf_counter()
    s = socket.create_connection((addr, 80))
    s.sendall(b"GET / HTTP/1.1\r\nHost: " + host.encode() + b"\r\nConnection: close\r\n\r\n")
    while s.recv(65536):
        pass
    s.close()
    times.append(time.perf_counter() - t0)
times.sort()
print("%.3f" % (times[len(times) // 2] * 1000))
]]

local results = { ["allow-all"] = { create = {} }, ["allow-list"] = { create = {} } }
for _ = 1, n do
  for _, name in ipairs({ "allow-all", "allow-list" }) do
    local id, t = create(name)
    results[name].create[#results[name].create + 1] = t
    B:req("POST", "/v1/sandboxes/" .. id .. "/terminate")
  end
end
for _, name in ipairs({ "allow-all", "allow-list" }) do
  local id = create(name)
  local ca = B:exec(id, "cat > /root/ca.crt <<'EOF'\n" .. net.ca .. "EOF")
  assert(ca.code == 0)
  local target = name == "allow-list" and "-" or net.addr
  local r = B:exec(id, "python3 - allowed.test " .. target .. " <<'PY'\n" .. REQUESTS .. "PY")
  assert(r.code == 0, r.stderr)
  results[name].http = tonumber(r.stdout)
  local resolve = name == "allow-all" and ("--resolve allowed.test:443:" .. net.addr .. " ") or ""
  local d = B:exec(id, "curl -sS --cacert /root/ca.crt " .. resolve .. "-o /dev/null -w '%{time_total}' " ..
    "https://allowed.test/big")
  assert(d.code == 0, d.stderr)
  results[name].mbps = net.big_size / 1e6 / tonumber(d.stdout)
  B:req("POST", "/v1/sandboxes/" .. id .. "/terminate")
end
B:destroy()
net:close()
local all, list = results["allow-all"], results["allow-list"]
for _, name in ipairs({ "allow-all", "allow-list" }) do
  local r = results[name]
  print(string.format("%-10s create_to_exec_p50_ms=%.1f http_request_p50_ms=%.3f download_MBps=%.0f", name,
    p50(r.create) * 1000, r.http, r.mbps))
end
print(string.format("ratio      create_to_exec=%.2f http_request=%.2f download=%.2f",
  p50(list.create) / p50(all.create), list.http / all.http, list.mbps / all.mbps))
