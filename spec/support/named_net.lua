--- spec/support/named_net.lua — a small named network for the allow-list spec, made by the spec
-- itself and removed by close(): a network namespace joined to the host by a veth pair in
-- 10.214.N.0/24 (host .1, namespace .2 and .3), and in it
--
--   dnsmasq   on .2:53, the resolver `moonbox local --dns` points the sandboxes' gates at:
--             allowed.test and every name below it, other.test -> .2; far.test -> .3;
--             host.allowed.test -> .1 (the host itself); alias.allowed.test -> 10.0.2.2
--             (slirp4netns's alias of the host's loopback)
--   nginx     on .2 and .3, ports 80 and 443 (TLS with a certificate for all of those names,
--             signed by a CA made here: net.ca is its PEM), answering "served <host>" (and
--             /big: net.big_size bytes), logging "<host> <request>" per request to
--             net.dir .. "/access.log"
--   listener  a TCP listener on .2 that logs every connection (H.listener), for "raw TCP"
--   udp sink  a UDP socket on .2 that logs every datagram, with a sentinel
--
-- Nothing here leaves this machine: every address is in the namespace or on its veth. Host
-- programs come from Debian (nginx-light, dnsmasq-base, openssl, python3, iproute2); a missing
-- one raises a sentence naming its package.
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local H = require "spec.support.isolation_host"
local files = require "spec.support.files"

local M = {}

M.NGINX, M.DNSMASQ, M.OPENSSL = "/usr/sbin/nginx", "/usr/sbin/dnsmasq", "/usr/bin/openssl"

local exists = files.exists

local run = H.run

local write = files.write

local until_ready = H.until_ready

local NGINX_CONF = [[
daemon off;
master_process off;
pid %s/nginx.pid;
events { worker_connections 256; }
http {
  log_format hosts '$host $request';
  access_log %s/access.log hosts;
  client_body_temp_path %s/tmp;
  proxy_temp_path %s/tmp;
  fastcgi_temp_path %s/tmp;
  uwsgi_temp_path %s/tmp;
  scgi_temp_path %s/tmp;
  server {
    listen %s:80;
    listen %s:443 ssl;
    listen %s:80;
    listen %s:443 ssl;
    server_name _;
    ssl_certificate %s/server.crt;
    ssl_certificate_key %s/server.key;
    client_max_body_size 64m;
    location / { default_type text/plain; return 200 "served $host\n"; }
    location = /big { alias %s/big; }
  }
}
]]

-- Logs every datagram as "udp <text>" (the sentinel's included).
local UDP_SINK = [[
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
print("port", s.getsockname()[1], flush=True)
while True:
    d, a = s.recvfrom(2048)
    print("udp", d.decode("ascii", "replace"), flush=True)
]]

local UDP_SEND = [[
import socket, sys
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(sys.argv[3].encode(), (sys.argv[1], int(sys.argv[2])))
]]

-- One A query; prints the rcode and the addresses of the answer.
M.DNS_QUERY = [[
import random, socket, struct, sys
name, server = sys.argv[1], sys.argv[2]
qid = random.randrange(65536)
q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
for label in name.split("."):
    q += bytes([len(label)]) + label.encode()
q += b"\0" + struct.pack(">HH", int(sys.argv[3]) if len(sys.argv) > 3 else 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(3)
s.sendto(q, (server, 53))
m = s.recv(4096)
rcode, an = m[3] & 15, struct.unpack(">H", m[6:8])[0]
off = len(q)
addrs = []
for _ in range(an):
    while m[off] and m[off] < 192:
        off += m[off] + 1
    off += 2 if m[off] >= 192 else 1
    t, _, _, rdlen = struct.unpack(">HHIH", m[off:off + 10])
    off += 10
    if t == 1:
        addrs.append(socket.inet_ntoa(m[off:off + 4]))
    off += rdlen
print("rcode", rcode, " ".join(addrs))
]]

local Net = {}
Net.__index = Net

--- M.start([opts]) -> net {ns, host_addr, addr, far, ca, dir, listener, udp_port, big_size}.
-- opts.big: the size of /big in bytes (default 3 MiB + 7). [yields]
function M.start(opts)
  opts = opts or {}
  for path, pkg in pairs { [M.NGINX] = "nginx-light", [M.DNSMASQ] = "dnsmasq-base", [M.OPENSSL] = "openssl" } do
    assert(exists(path), "the allow-list spec needs " .. path .. " on the host (Debian package " .. pkg .. ")")
  end
  H.require_host_tools()
  local link = H.netns { ns = "mbal", ifname = "mba", range = "10.214", bits = 24, inside = { 2, 3 } }
  local tag = link.tag
  local self = setmetatable({ link = link, ns = link.ns, net = link.net, host_addr = link.host_addr,
    addr = link.addrs[1], far = link.addrs[2], procs = {} }, Net)
  self.dir = run({ "mktemp", "-d", "/tmp/moonbox-named-net.XXXXXX" }):gsub("%s+$", "")
  sys.mkdir_p(self.dir .. "/tmp", tonumber("755", 8))

  -- a CA and a server certificate for every name the servers answer to
  local d = self.dir
  run({ M.OPENSSL, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
    "-keyout", d .. "/ca.key", "-out", d .. "/ca.crt", "-days", "2", "-subj", "/CN=moonbox spec CA " .. tag },
    "making the test CA")
  run({ M.OPENSSL, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
    "-keyout", d .. "/server.key", "-out", d .. "/server.csr", "-subj", "/CN=allowed.test" },
    "making the server key")
  write(d .. "/san.ext", "subjectAltName=DNS:allowed.test,DNS:*.allowed.test,DNS:other.test,DNS:far.test\n")
  run({ M.OPENSSL, "x509", "-req", "-in", d .. "/server.csr", "-CA", d .. "/ca.crt", "-CAkey", d .. "/ca.key",
    "-CAcreateserial", "-out", d .. "/server.crt", "-days", "2", "-extfile", d .. "/san.ext" },
    "signing the server certificate")
  self.ca = H.read(d .. "/ca.crt")

  write(d .. "/nginx.conf", string.format(NGINX_CONF, d, d, d, d, d, d, d, self.addr, self.addr, self.far,
    self.far, d, d, d))
  self.big_size = opts.big or (3 * 1024 * 1024 + 7)
  run { "sh", "-c", "head -c \"$1\" /dev/urandom > \"$2\"", "sh", tostring(self.big_size), d .. "/big" }
  self.procs[#self.procs + 1] = proc.spawn { H.IP, "netns", "exec", self.ns, M.NGINX, "-c", d .. "/nginx.conf",
    "-p", d, "-e", d .. "/error.log", stdout = "null", stderr = "null" }
  self.procs[#self.procs + 1] = proc.spawn { H.IP, "netns", "exec", self.ns, M.DNSMASQ, "--keep-in-foreground",
    "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--bind-interfaces", "--listen-address=" .. self.addr,
    "--user=root", "--pid-file", "--address=/allowed.test/" .. self.addr,
    "--address=/host.allowed.test/" .. self.host_addr, "--address=/alias.allowed.test/10.0.2.2",
    "--address=/other.test/" .. self.addr, "--address=/far.test/" .. self.far, stdout = "null", stderr = "null" }
  until_ready("nginx in " .. self.ns, function()
    local r = proc.run { "curl", "-s", "--max-time", "2", "--cacert", d .. "/ca.crt", "--resolve",
      "allowed.test:443:" .. self.addr, "https://allowed.test/" }
    return r.stdout == "served allowed.test\n"
  end)
  until_ready("dnsmasq in " .. self.ns, function()
    local r = proc.run { H.PYTHON, "-c", M.DNS_QUERY, "far.test", self.addr }
    return r.stdout:find("rcode 0 " .. self.far, 1, true) ~= nil
  end)
  self.listener = H.listener(self.addr, "raw-tcp-secret-" .. tag, self.ns)
  local sink = proc.spawn { H.IP, "netns", "exec", self.ns, H.PYTHON, "-c", UDP_SINK, self.addr }
  self.procs[#self.procs + 1] = sink
  self.udp_lines = sink:lines("stdout")
  local first = self.udp_lines()
  self.udp_port = assert(first and tonumber(first:match("^port (%d+)")), "the UDP sink did not start")
  self.sentinels = 0
  return self
end

--- net:access_log() -> the servers' log so far: one "<host> <request line>" per request.
function Net:access_log() return H.read(self.dir .. "/access.log") or "" end

--- net:settled_access_log() -> the servers' log with every request answered before this call in
-- it. nginx writes a request's line after its last byte is sent, so a client may have its answer
-- before the line is there; but it runs as one process (master_process off) and logs each
-- request before it takes the next event, so once the line of a request the host sends now (to
-- sentinel-N.test) is there, so is every earlier one. Returns the log before that line. [yields]
function Net:settled_access_log()
  self.sentinels = self.sentinels + 1
  local mark = "sentinel-" .. self.sentinels .. ".test"
  run({ "curl", "-s", "--max-time", "10", "--resolve", mark .. ":80:" .. self.addr, "http://" .. mark .. "/" },
    "the access log's sentinel request")
  local log, at
  require("spec.support.poll").wait(10, function()
    log = self:access_log()
    at = log:sub(1, #mark + 1) == mark .. " " and 1 or log:find("\n" .. mark .. " ", 1, true)
    return at
  end, "the sentinel " .. mark .. " in " .. self.dir .. "/access.log")
  return log:sub(1, at == 1 and 0 or at)
end

--- net:datagrams_before_sentinel() -> array of the texts of datagrams the UDP sink got before
-- one the host sends now. [yields]
function Net:datagrams_before_sentinel()
  self.sentinels = self.sentinels + 1
  local mark = "sentinel-" .. self.sentinels
  run { H.PYTHON, "-c", UDP_SEND, self.addr, tostring(self.udp_port), mark }
  local got = {}
  while true do
    local line = assert(self.udp_lines(), "the UDP sink ended")
    local text = line:match("^udp (.*)$")
    if text == mark then return got end
    got[#got + 1] = text
  end
end

function Net:close()
  if self.listener then self.listener:close() end
  for _, p in ipairs(self.procs) do
    pcall(p.kill, p, "KILL")
    pcall(p.wait, p)
  end
  self.link:close()
  if self.dir then proc.run { "rm", "-rf", "--", self.dir } end
end

return M
