--- spec/support/isolation_host.lua — host-side fixtures of spec/local_isolation_spec.lua: the
-- things an attacker inside a sandbox aims at, set up on the host by the spec itself.
--
--   listener(addr, secret)  a TCP listener on the host that logs every connection it accepts
--                           (and sends secret to it), so a spec can prove that nothing reached it
--   test_host()             a network namespace of the spec's own (a veth pair in a private range,
--                           a tiny HTTP server inside): a machine "outside" that allow-all may
--                           reach; never an address outside this machine
--   processes_in_range(base) / mounts_naming(text)   what a terminated sandbox may have left
--
-- Every fixture is removed by its close(); the spec calls them in teardown. Host programs come
-- from Debian (python3, iproute2); a missing one raises a sentence naming the package, because
-- the spec must fail loudly in CI rather than skip.
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local files = require "spec.support.files"

local M = {}

M.PYTHON = "/usr/bin/python3"
M.IP = "/usr/sbin/ip"

local exists = files.exists
local read = files.read
M.read = read

--- M.require_host_tools(): raises unless python3 and ip (Debian python3, iproute2) are there.
function M.require_host_tools()
  assert(exists(M.PYTHON), "the isolation spec needs " .. M.PYTHON .. " on the host (Debian package " ..
    "python3) for its listeners and its test host")
  assert(exists(M.IP), "the isolation spec needs " .. M.IP .. " on the host (Debian package iproute2) " ..
    "to make its test network namespace")
end

--- M.run(argv[, what]) -> stdout of a host command that must succeed; raises naming what (or
-- the command line), its exit status and its output otherwise. [yields]
local function run(argv, what)
  local r = proc.run(argv)
  assert(r.code == 0, (what or table.concat(argv, " ")) .. " failed (exit " .. tostring(r.code) .. "): " ..
    r.stderr .. r.stdout)
  return r.stdout
end
M.run = run

local Link = {}
Link.__index = Link

--- M.netns(t) -> link {ns, veth, peer, net, host_addr, addrs}: a network namespace of the spec's
-- own making, named t.ns .. "-" .. tag, joined to the host by a veth pair (t.ifname .. tag ..
-- "h" on the host, ... "n" inside) in a /t.bits of the private range t.range ("10.213") that no
-- interface of this machine uses yet: host side .1 (host_addr), and inside the namespace the
-- addresses ending in each of t.inside ({ 2 } by default; addrs, in that order), lo up.
-- link:close() removes it; link.tag is the random tag in its names. [yields]
function M.netns(t)
  local tag = string.format("%06x", math.random(0, 0xffffff))
  local link = setmetatable({ tag = tag, ns = t.ns .. "-" .. tag, veth = t.ifname .. tag .. "h",
    peer = t.ifname .. tag .. "n", addrs = {} }, Link)
  local used = run({ M.IP, "-4", "-o", "addr", "show" }, "listing the host's addresses")
  for _ = 1, 50 do
    local n = math.random(0, 255)
    if not used:find(t.range:gsub("%.", "%%.") .. "%." .. n .. "%.") then
      link.net = t.range .. "." .. n
      break
    end
  end
  assert(link.net, "no free " .. t.range .. ".N.0/" .. t.bits .. " on this machine")
  link.host_addr = link.net .. ".1"
  local mask = "/" .. t.bits
  run { M.IP, "netns", "add", link.ns }
  link.made = true
  local ok, err = pcall(function()
    run { M.IP, "link", "add", link.veth, "type", "veth", "peer", "name", link.peer }
    run { M.IP, "link", "set", link.peer, "netns", link.ns }
    run { M.IP, "addr", "add", link.host_addr .. mask, "dev", link.veth }
    run { M.IP, "link", "set", link.veth, "up" }
    for i, last in ipairs(t.inside or { 2 }) do
      link.addrs[i] = link.net .. "." .. last
      run { M.IP, "-n", link.ns, "addr", "add", link.addrs[i] .. mask, "dev", link.peer }
    end
    run { M.IP, "-n", link.ns, "link", "set", link.peer, "up" }
    run { M.IP, "-n", link.ns, "link", "set", "lo", "up" }
  end)
  if not ok then
    link:close()
    error(err, 0)
  end
  return link
end

--- link:close(): removes the veth pair and the namespace (what runs in it should be gone). [yields]
function Link:close()
  if not self.made then return end
  self.made = false
  proc.run { M.IP, "link", "del", self.veth }
  proc.run { M.IP, "netns", "del", self.ns }
end

--- M.until_ready(what, check[, seconds]): polls check() until it returns true, for at most
-- seconds (20 by default): a server starting up gives no event to wait for. [yields]
function M.until_ready(what, check, seconds)
  require("spec.support.poll").wait(seconds or 20, check, what .. " to come up")
end

-- Accepts connections forever; prints "conn <peer port>" for each, sends the secret and closes.
local LISTENER = [[
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0))
s.listen(128)
print("port", s.getsockname()[1], flush=True)
while True:
    c, a = s.accept()
    print("conn", a[1], flush=True)
    try:
        c.sendall(sys.argv[2].encode())
    except OSError:
        pass
    c.close()
]]

-- Connects once and prints its own port: the sentinel that orders a listener's log.
local SENTINEL = [[
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
print(c.getsockname()[1], flush=True)
c.recv(100)
]]

local Listener = {}
Listener.__index = Listener

--- M.listener(addr, secret[, ns]) -> listener {addr, port, secret}: a TCP listener on addr
-- (127.0.0.1, or an address of the host; of network namespace ns if given) that logs every
-- accepted connection. [yields]
function M.listener(addr, secret, ns)
  local argv = { M.PYTHON, "-c", LISTENER, addr, secret }
  if ns then argv = { M.IP, "netns", "exec", ns, table.unpack(argv) } end
  local p = proc.spawn(argv)
  local lines = p:lines("stdout")
  local first = lines()
  local port = first and tonumber(first:match("^port (%d+)"))
  assert(port, "the host listener on " .. addr .. " did not start: " .. tostring(first))
  return setmetatable({ p = p, lines = lines, addr = addr, port = port, secret = secret }, Listener)
end

--- listener:connections_before_sentinel() -> array of peer ports the listener accepted before
-- a connection the spec makes now. Anything a sandbox did earlier that reached the listener is
-- in the accept queue ahead of this sentinel (the kernel accepts in order), so an empty array
-- proves that nothing reached it, without a sleep. [yields]
function Listener:connections_before_sentinel()
  local r = proc.run { M.PYTHON, "-c", SENTINEL, self.addr, tostring(self.port) }
  assert(r.code == 0, "the sentinel could not reach the host listener: " .. r.stderr)
  local mine = r.stdout:match("(%d+)")
  local others = {}
  while true do
    local line = self.lines()
    assert(line, "the host listener on " .. self.addr .. " ended")
    local peer = line:match("^conn (%d+)")
    if peer == mine then return others end
    others[#others + 1] = peer
  end
end

function Listener:close()
  self.p:kill("KILL")
  pcall(self.p.wait, self.p)
end

local TestHost = {}
TestHost.__index = TestHost

--- M.test_host() -> host {ns, addr, host_addr, port, marker}: a network namespace made by the
-- spec, joined to the host by a veth pair in 10.213.N.0/30 (host side .1, namespace side .2),
-- with an HTTP server at http://addr:port/ that serves /marker (the text marker). [yields]
function M.test_host()
  local link = M.netns { ns = "mbiso", ifname = "mbi", range = "10.213", bits = 30 }
  local tag = link.tag
  local self = setmetatable({ link = link, ns = link.ns, net = link.net, host_addr = link.host_addr,
    addr = link.addrs[1], marker = "test-host-" .. tag .. "-" .. math.random(1e9),
    port = 18000 + math.random(0, 999) }, TestHost)
  self.dir = os.tmpname()
  os.remove(self.dir)
  sys.mkdir_p(self.dir, tonumber("755", 8))
  files.write(self.dir .. "/marker", self.marker)
  self.server = proc.spawn { M.IP, "netns", "exec", self.ns, M.PYTHON, "-m", "http.server", "--bind",
    self.addr, "--directory", self.dir, tostring(self.port), stdout = "null", stderr = "null" }
  -- ready once the host can fetch the marker through the veth
  M.until_ready("the test host in namespace " .. self.ns .. " at " .. self.addr .. ":" .. self.port, function()
    local r = proc.run { "curl", "-s", "--max-time", "2", "http://" .. self.addr .. ":" .. self.port .. "/marker" }
    return r.stdout == self.marker
  end)
  return self
end

function TestHost:close()
  if self.server then
    self.server:kill("KILL")
    pcall(self.server.wait, self.server)
  end
  self.link:close()
  if self.dir then proc.run { "rm", "-rf", "--", self.dir } end
end

--- M.processes_in_range(base) -> array of "pid uid comm" of host processes whose real uid is in
-- [base, base + 65536): a sandbox's id range (all its processes, its slirp4netns and helpers).
function M.processes_in_range(base)
  local out = {}
  for _, name in ipairs(sys.listdir("/proc")) do
    if name:match("^%d+$") then
      local st = read("/proc/" .. name .. "/status")
      local uid = st and tonumber(st:match("\nUid:%s+(%d+)"))
      if uid and uid >= base and uid < base + 65536 then
        out[#out + 1] = name .. " " .. uid .. " " .. (st:match("^Name:%s+([^\n]*)") or "?")
      end
    end
  end
  return out
end

--- M.mounts_naming(text) -> array of "pid: mountinfo line" for every mount, in any process's
-- mount namespace on the host, whose line contains text.
function M.mounts_naming(text)
  local out = {}
  for _, name in ipairs(sys.listdir("/proc")) do
    if name:match("^%d+$") then
      for line in (read("/proc/" .. name .. "/mountinfo") or ""):gmatch("[^\n]+") do
        if line:find(text, 1, true) then out[#out + 1] = name .. ": " .. line end
      end
    end
  end
  return out
end

return M
