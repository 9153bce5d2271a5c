--- spec/support/edge.lua — a cloud-shaped edge for specs: nginx (Debian's) terminating TLS with
-- HTTP/2 in front of a `moonbox local`, with a CA and a server certificate this module makes
-- (openssl) in a temp dir of its own, on its own loopback port; and an HTTP CONNECT proxy
-- (tinyproxy) for the proxy specs.
--
-- edge.start{upstream = "http://127.0.0.1:PORT"} -> Edge. The edge listens on 127.0.0.1 and
-- ::1, answers https://localhost:PORT (the certificate names localhost, 127.0.0.1 and ::1),
-- passes every request to the upstream over HTTP/1.1 keep-alive connections with
-- X-Forwarded-Host/-Proto, and buffers neither requests nor answers (uploads and SSE stream
-- through). Its access log has one line per request: "$connection $server_protocol $method
-- $uri $status", so a spec can count TCP connections and see the protocol a client negotiated.
-- The CA is trusted by this process (CURL_CA_BUNDLE and SSL_CERT_FILE, which moonbox's HTTP
-- client reads, and so do the moonbox processes a spec starts) until edge:stop().
local proc = require "moonbox.proc"
local task = require "moonbox.task"
local http = require "moonbox.http"
local httpd = require "moonbox.httpd"
local sys = require "moonbox.sys"
local files = require "spec.support.files"

local M = {}
local Edge = {}
Edge.__index = Edge

local function sh(script, ...)
  local r = proc.run { "sh", "-ec", script, "edge", ... }
  if r.code ~= 0 then error("edge: " .. script:match("^%s*(%S+)") .. " failed: " .. r.stderr, 0) end
  return r.stdout
end

local write = files.write
local read = function(path) return files.read(path) or "" end

--- edge.free_port() -> a TCP port free on both 127.0.0.1 and ::1 a moment ago. [yields]
function M.free_port()
  local s = httpd.listen { host = "127.0.0.1", also_host = "::1", port = 0 }
  local port = s.port
  s:close()
  return port
end

--- edge.tempdir(tag) -> a new directory under /tmp, 0711 (nginx's workers run as nobody and
-- must reach their temp paths in it). [yields]
function M.tempdir(tag)
  local dir = proc.run({ "mktemp", "-d", "/tmp/moonbox-" .. tag .. ".XXXXXX" }).stdout:gsub("%s+$", "")
  sh('chmod 711 "$1"', dir)
  return dir
end

--- edge.make_ca(dir) -> ca, cert, key: paths of a fresh CA and of a server certificate it signed
-- for localhost, 127.0.0.1 and ::1 (EC P-256, valid two days). [yields]
function M.make_ca(dir)
  write(dir .. "/server.ext", "subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\n" ..
    "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
  sh([[
cd "$1"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key \
  -out ca.pem -days 2 -subj "/CN=moonbox spec CA" \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key \
  -out server.csr -subj "/CN=localhost" 2>/dev/null
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem \
  -days 2 -extfile server.ext 2>/dev/null
]], dir)
  return dir .. "/ca.pem", dir .. "/server.pem", dir .. "/server.key"
end

-- Starts argv as a process with a task that reaps it: returns the process and its waiter.
local function spawn(argv)
  local p = proc.spawn(argv)
  return p, task.spawn(function() return p:wait() end)
end

-- Waits until url answers (any status) or the process exits; raises after `seconds`.
local function wait_ready(what, url, p, waiter, log, seconds)
  local deadline = task.now() + seconds
  while true do
    local ok, err = pcall(http.request, { url = url, timeout = 2, connect_timeout = 2 })
    if ok then return end
    if task.result(waiter) ~= nil or task.now() > deadline then
      p:kill("KILL")
      error(what .. " did not start: " .. read(log) .. " (last try: " .. tostring(err.message or err) .. ")", 0)
    end
    task.sleep(0.05)
  end
end

-- Waits (wait_ready) until server self (an edge or a proxy: p, waiter, stop) answers url;
-- -> self, or stops it and raises when it does not. [yields]
local function started(self, what, url, log, seconds)
  local ok, err = pcall(wait_ready, what, url, self.p, self.waiter, log, seconds)
  if not ok then
    self:stop()
    error(err, 0)
  end
  return self
end

-- Stops a process started with spawn: TERM, then waits for its waiter.
local function stop(p, waiter)
  if task.result(waiter) == nil then p:kill("TERM") end
  pcall(task.join, waiter)
  p:close()
end

local CONF = [[
daemon off;
master_process on;
worker_processes 1;
pid %DIR%/nginx.pid;
error_log %DIR%/error.log warn;
%USER%
events { worker_connections 4096; }
http {
  log_format edge '$connection $server_protocol $request_method $uri $status';
  access_log %DIR%/access.log edge;
  client_body_temp_path %DIR%/tmp-body;
  proxy_temp_path %DIR%/tmp-proxy;
  fastcgi_temp_path %DIR%/tmp-fastcgi;
  uwsgi_temp_path %DIR%/tmp-uwsgi;
  scgi_temp_path %DIR%/tmp-scgi;
  client_max_body_size 0;
  keepalive_requests 1000000;
  keepalive_timeout 600s;
  http2_max_concurrent_streams 512;
  upstream moonbox {
    server %UPSTREAM%;
    keepalive 128;
  }
  server {
    listen 127.0.0.1:%PORT% ssl %HTTP2%;
    listen [::1]:%PORT% ssl %HTTP2%;
    server_name localhost;
    ssl_certificate %DIR%/server.pem;
    ssl_certificate_key %DIR%/server.key;
    location = /_edge/health { access_log off; return 204; }
    location / {
      proxy_pass http://moonbox;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header X-Forwarded-Host $host:$server_port;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
      proxy_send_timeout 600s;
    }
  }
}
]]

--- edge.start(opts) -> Edge {url, port, dir, ca, access_log}. opts: upstream (required:
-- "http://HOST:PORT" of the backend), http2 (default true; false: HTTP/1.1 only), trust
-- (default true: edge:trust() at once). Raises when nginx does not
-- come up. [yields]
function M.start(opts)
  local upstream = assert(opts.upstream, "edge.start: upstream is required"):match("^http://([^/]+)")
  assert(upstream, "edge.start: upstream must be http://HOST:PORT")
  local dir = M.tempdir("edge")
  local ca = M.make_ca(dir)
  local port = M.free_port()
  local conf = CONF:gsub("%%([%u%d]+)%%", {
    DIR = dir, PORT = tostring(port), UPSTREAM = upstream, HTTP2 = opts.http2 == false and "" or "http2",
    USER = proc.run({ "id", "-u" }).stdout:match("^0%s") and "user nobody nogroup;" or "",
  })
  write(dir .. "/nginx.conf", conf)
  local p, waiter = spawn { "nginx", "-p", dir, "-c", dir .. "/nginx.conf", "-e", dir .. "/error.log",
    stdout = "null", stderr = { file = dir .. "/stderr.log" } }
  local self = setmetatable({ p = p, waiter = waiter, dir = dir, ca = ca, port = port, url = "https://localhost:" .. port,
    access_log = dir .. "/access.log" }, Edge)
  if opts.trust ~= false then self:trust() end
  return started(self, "nginx (the TLS edge)", self.url .. "/_edge/health", dir .. "/error.log", 10)
end

local CA_VARS = { "CURL_CA_BUNDLE", "SSL_CERT_FILE" }

--- edge:trust(): makes this process (and the processes it starts) trust the edge's CA alone:
-- CURL_CA_BUNDLE and SSL_CERT_FILE name it (the first wins where both are set, as with the curl
-- tool). edge:untrust() puts back what they were.
function Edge:trust()
  if not self.saved then
    self.saved = {}
    for _, k in ipairs(CA_VARS) do self.saved[k] = os.getenv(k) or false end
  end
  for _, k in ipairs(CA_VARS) do sys.setenv(k, self.ca) end
end

function Edge:untrust()
  if not self.saved then return end
  for _, k in ipairs(CA_VARS) do sys.setenv(k, self.saved[k] or nil) end
  self.saved = nil
end

--- edge:entries() -> the access log so far: {conn = n, proto = "HTTP/2.0", method, uri, status}.
function Edge:entries()
  local out = {}
  for line in read(self.access_log):gmatch("[^\n]+") do
    local conn, proto, method, uri, status = line:match("^(%d+) (%S+) (%S+) (%S+) (%d+)$")
    if conn then
      out[#out + 1] = { conn = tonumber(conn), proto = proto, method = method, uri = uri, status = tonumber(status) }
    end
  end
  return out
end

--- edge:connections(from) -> how many distinct client connections carried the requests logged
-- after the first `from` entries (default 0), and those entries.
function Edge:connections(from)
  local seen, n, list = {}, 0, {}
  for i, e in ipairs(self:entries()) do
    if i > (from or 0) then
      list[#list + 1] = e
      if not seen[e.conn] then
        seen[e.conn] = true
        n = n + 1
      end
    end
  end
  return n, list
end

--- edge:stop(): stops nginx, forgets the CA, removes the temp dir. Idempotent. [yields]
function Edge:stop()
  if self.stopped then return end
  self.stopped = true
  self:untrust()
  stop(self.p, self.waiter)
  proc.run { "rm", "-rf", "--one-file-system", self.dir }
end

-- ---- an HTTP CONNECT proxy ------------------------------------------------------------------

local Proxy = {}
Proxy.__index = Proxy

--- edge.proxy() -> Proxy {url, port, log}: tinyproxy on 127.0.0.1, its own port and temp dir,
-- allowing CONNECT to any port and logging each connection. [yields]
function M.proxy()
  local dir = M.tempdir("proxy")
  local port = M.free_port()
  local log = dir .. "/tinyproxy.log"
  write(dir .. "/tinyproxy.conf", table.concat({
    "Port " .. port, "Listen 127.0.0.1", "Timeout 600", "LogFile \"" .. log .. "\"", "LogLevel Connect",
    "PidFile \"" .. dir .. "/tinyproxy.pid\"", "MaxClients 100", "Allow 127.0.0.1", "DisableViaHeader Yes", "",
  }, "\n"))
  sh('touch "$1" && chmod 666 "$1"', log)
  local p, waiter = spawn { "tinyproxy", "-d", "-c", dir .. "/tinyproxy.conf", stdout = "null",
    stderr = { file = dir .. "/stderr.log" } }
  local self = setmetatable({ p = p, waiter = waiter, dir = dir, port = port, url = "http://127.0.0.1:" .. port, log = log }, Proxy)
  return started(self, "tinyproxy", self.url .. "/", dir .. "/stderr.log", 30)
end

--- proxy:connects(target) -> how many CONNECT requests to target ("host:port") it logged.
function Proxy:connects(target)
  local n = 0
  for line in read(self.log):gmatch("[^\n]+") do
    if line:find("CONNECT " .. target, 1, true) then n = n + 1 end
  end
  return n
end

--- proxy:stop(): stops tinyproxy and removes its temp dir. Idempotent. [yields]
function Proxy:stop()
  if self.stopped then return end
  self.stopped = true
  stop(self.p, self.waiter)
  proc.run { "rm", "-rf", "--one-file-system", self.dir }
end

return M
