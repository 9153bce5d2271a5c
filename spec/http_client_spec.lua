-- The HTTP client (moonbox.http) against real servers on loopback: moonbox's own server in the
-- same process and loop, and a misbehaving peer (tests/c/misbehaving_server.c) for the
-- failures a correct server cannot produce.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local http = require "moonbox.http"
local with_server = require("spec.support.http_server").with
local proc = require "moonbox.proc"
local build = require "moonbox.build"

local PEER = os.getenv("MOONBOX_TEST_PEER") or
  (os.getenv("MOONBOX_BUILD_DIR") or (build.exe:match("(.*)/") or ".")) .. "/tests/c/misbehaving_server"

-- Starts the misbehaving peer; returns its base URL and the process handle.
local function start_peer()
  local p = proc.spawn { PEER }
  local port = p:lines("stdout")()
  assert(tonumber(port), "misbehaving_server did not print a port")
  return "http://127.0.0.1:" .. port, p
end

local function rss_kb()
  for line in io.lines("/proc/self/status") do
    local kb = line:match("^VmRSS:%s+(%d+)")
    if kb then return tonumber(kb) end
  end
end

-- A test body: fn(base) against a fresh misbehaving peer, killed afterwards even if fn fails.
local function with_peer(fn)
  return T.async(function()
    local base, peer = start_peer()
    local ok, err = pcall(fn, base)
    peer:kill("KILL")
    if not ok then error(err, 0) end
  end)
end

-- The error http.request raises for opts, which must fail.
local function request_error(opts)
  local ok, err = pcall(http.request, opts)
  assert.is_false(ok, "the request succeeded")
  return err
end

describe("http.request", function()
  it("returns status, lower-cased headers and the body", with_server(function(srv)
    srv:route("GET", "/hello", function()
      return 201, "hi there", { ["X-Thing"] = "yes", ["Content-Type"] = "text/plain" }
    end)
    local r = http.request { url = srv.url .. "/hello" }
    assert.are.equal(201, r.status)
    assert.are.equal("hi there", r.body)
    assert.are.equal("yes", r.headers["x-thing"])
    assert.are.equal("text/plain", r.headers["content-type"])
  end))

  it("joins the values of a repeated response header with a comma", with_server(function(srv)
    srv:route("GET", "/many", function()
      return 200, "", { ["X-Many"] = { "a", "b", "c" }, ["X-One"] = "1" }
    end)
    local r = http.request { url = srv.url .. "/many" }
    assert.are.equal("a, b, c", r.headers["x-many"])
    assert.are.equal("1", r.headers["x-one"])
  end))

  it("sends the method, headers and a binary body as given", with_server(function(srv)
    local seen
    srv:route("*", "/echo", function(req)
      seen = { method = req.method, ctype = req.headers["content-type"], body = req.body }
      return 200, req.body
    end)
    local payload = "a\0b\255\r\n" .. string.rep("z", 100000)
    local r = http.request { method = "PUT", url = srv.url .. "/echo", body = payload,
      headers = { ["Content-Type"] = "application/octet-stream" } }
    assert.are.equal(200, r.status)
    assert.are.equal(payload, r.body)
    assert.are.same({ method = "PUT", ctype = "application/octet-stream", body = payload }, seen)
  end))

  it("treats HTTP error statuses as results, not errors", with_server(function(srv)
    srv:route("GET", "/missing", function() return 404, '{"message":"nope"}' end)
    local r = http.request { url = srv.url .. "/missing" }
    assert.are.equal(404, r.status)
    assert.are.equal('{"message":"nope"}', r.body)
  end))

  it("asks before sending a body in memory over 1 MiB, so a server that refuses it is heard",
    with_server(function(srv)
      local expects = {}
      srv:route("POST", "/small", function(req)
        expects[#expects + 1] = req:header("expect") or "none"
        return 200, tostring(#req.body)
      end, { max_body = 8 * 1024 * 1024 })
      srv:route("POST", "/limited", function() return 200, "never" end) -- the server's 1 MiB limit
      -- a body up to 1 MiB, and one from a file, go at once; a larger one in memory asks first
      assert.are.equal("1048576", http.request { method = "POST", url = srv.url .. "/small",
        body = string.rep("a", 1024 * 1024) }.body)
      assert.are.equal("2097152", http.request { method = "POST", url = srv.url .. "/small",
        body = string.rep("b", 2 * 1024 * 1024) }.body)
      local src = os.tmpname()
      local f = assert(io.open(src, "wb"))
      f:write(string.rep("c", 2 * 1024 * 1024))
      f:close()
      assert.are.equal("2097152", http.request { method = "POST", url = srv.url .. "/small", body_file = src }.body)
      os.remove(src)
      assert.are.same({ "none", "100-continue", "none" }, expects)
      -- refused before a byte of it is read, the body is never sent: the 413 comes back every
      -- time, never a connection reset in the middle of sending
      local big = string.rep("d", 3 * 1024 * 1024)
      for _ = 1, 20 do
        assert.are.equal(413, http.request { method = "POST", url = srv.url .. "/limited", body = big }.status)
      end
    end))

  it("streams request bodies from a file and response bodies to a file", with_server(function(srv)
    srv:route("POST", "/up", function(req) return 200, req.body end, { max_body = 4 * 1024 * 1024 })
    local src, dst = os.tmpname(), os.tmpname()
    local data = string.rep("0123456789", 200000)
    local f = assert(io.open(src, "wb"))
    f:write(data)
    f:close()
    local r = http.request { method = "POST", url = srv.url .. "/up", body_file = src, output_file = dst }
    assert.are.equal(200, r.status)
    assert.are.equal("", r.body)
    local got = assert(io.open(dst, "rb")):read("a")
    assert.are.equal(#data, #got)
    assert.is_true(got == data)
    os.remove(src)
    os.remove(dst)
  end))

  it("refuses header values with line breaks before sending anything", T.async(function()
    local ok, err = pcall(http.request, { url = "http://127.0.0.1:1/", headers = { X = "a\r\nInjected: 1" } })
    assert.is_false(ok)
    assert.matches("line break", err)
  end))

  it("completes 1,000 concurrent requests", with_server(function(srv)
    -- Each answer waits long enough that requests overlap however slowly a loaded (or
    -- sanitized) client gets them all out.
    srv:route("GET", "/n/:i", function(req)
      task.sleep(0.5)
      return 200, req.captures.i
    end)
    local tasks = {}
    for i = 1, 1000 do
      tasks[i] = task.spawn(http.request, { url = srv.url .. "/n/" .. i, timeout = 60 })
    end
    for i = 1, 1000 do
      local r = task.join(tasks[i])
      assert.are.equal(200, r.status)
      assert.are.equal(tostring(i), r.body)
    end
    assert.is_true(srv:stats().max_active >= 100, "requests were not in flight together")
  end))
end)

describe("http.request on a reused handle", function()
  -- Requests one after the other reuse one easy handle and, when it was set up for the same
  -- options, keep its options (runtime/http_client.c, "handle reuse"): nothing of the request
  -- before may carry over.
  it("carries no option of the request before it", with_server(function(srv)
    local seen
    srv:route("*", "/echo", function(req)
      seen = { method = req.method, body = req.body, a = req.headers["x-a"],
        enc = req.headers["accept-encoding"] }
      return 200, "body"
    end)
    srv:route("GET", "/slow", function()
      task.sleep(0.5)
      return 200, "late"
    end)
    local url = srv.url .. "/echo"
    local function get(opts)
      opts.url = opts.url or url
      local r = http.request(opts)
      assert.are.equal(200, r.status)
      return r
    end
    get { headers = { ["X-A"] = "1" } }
    assert.are.equal("1", seen.a)
    get {}
    assert.is_nil(seen.a)
    assert.are.equal("", get { method = "HEAD" }.body)
    assert.are.equal("body", get {}.body)
    assert.are.equal("GET", seen.method)
    get { method = "PUT", body = "put body" }
    assert.are.same({ "PUT", "put body" }, { seen.method, seen.body })
    get {}
    assert.are.same({ "GET", "" }, { seen.method, seen.body })
    get { method = "DELETE" }
    assert.are.equal("DELETE", seen.method)
    get {}
    assert.are.equal("GET", seen.method)
    get { accept_encoding = "gzip" }
    assert.are.equal("gzip", seen.enc)
    get {}
    assert.is_nil(seen.enc)
    -- a timeout of the request before does not cut this one short
    get { timeout = 0.2 }
    assert.are.equal("late", get { url = srv.url .. "/slow" }.body)
  end))
end)

describe("http.request response headers", function()
  it("gives each response its own header values, however alike", with_server(function(srv)
    srv:route("GET", "/n/:i", function(req)
      return 200, "", { ["X-N"] = req.captures.i, ["X-Same"] = "s" }
    end)
    for i = 1, 9 do
      local r = http.request { url = srv.url .. "/n/" .. i }
      assert.are.same({ tostring(i), "s" }, { r.headers["x-n"], r.headers["x-same"] })
    end
  end))
end)

describe("http.request failures", function()
  it("makes connection refused a retryable connect_failed error", T.async(function()
    local err = request_error { url = "http://127.0.0.1:1/x" }
    assert.are.equal("connect_failed", err.code)
    assert.is_true(err.retryable)
    assert.are.equal("GET", err.method)
    assert.matches("http_client_spec.lua:%d+: http.request: GET http://127.0.0.1:1/x: ", tostring(err))
  end))

  it("makes a connection reset mid-body a connection_reset error", with_peer(function(base)
    local err = request_error { url = base .. "/reset" }
    assert.are.equal("connection_reset", err.code)
    assert.is_true(err.retryable)
  end))

  it("makes a closed connection without reply a connection_reset error", with_peer(function(base)
    assert.are.equal("connection_reset", request_error { url = base .. "/close" }.code)
  end))

  it("makes a reply that is not HTTP a malformed_response error", with_peer(function(base)
    local err = request_error { url = base .. "/malformed" }
    assert.are.equal("malformed_response", err.code)
    assert.is_false(err.retryable)
  end))

  it("fires the total timeout", with_peer(function(base)
    -- /hang never answers: only the timeout ends it
    assert.are.equal("timeout", request_error { url = base .. "/hang", timeout = 0.2 }.code)
  end))

  it("fires the idle timeout on a trickling body", with_peer(function(base)
    -- 300 ms between bytes is fine with a 5 s idle timeout...
    local r = http.request { url = base .. "/trickle", idle_timeout = 5 }
    assert.are.equal("tttttttttt", r.body)
    -- ...but a stall longer than the idle timeout is not.
    assert.are.equal("timeout", request_error { url = base .. "/hang", idle_timeout = 1 }.code)
  end))

  it("aborts the transfer when the waiting task's deadline expires", with_peer(function(base)
    local ok, err = pcall(task.timeout, 0.1, http.request, { url = base .. "/hang" })
    assert.is_false(ok)
    assert.is_true(task.is_timeout(err))
  end))

  it("enforces max_body", with_server(function(srv)
    srv:route("GET", "/big", function() return 200, string.rep("x", 100000) end)
    local err = request_error { url = srv.url .. "/big", max_body = 1000 }
    assert.are.equal("body_too_large", err.code)
  end))
end)

describe("http.stream", function()
  it("pauses the transfer for a slow reader, keeping memory bounded", with_server(function(srv)
    local total = 40 * 1024 * 1024
    srv:route("GET", "/firehose", function(_, res)
      local w = res:stream(200, { ["Content-Type"] = "application/octet-stream" })
      local chunk = string.rep("m", 64 * 1024)
      for _ = 1, total // #chunk do w:write(chunk) end
      w:close()
    end)
    collectgarbage()
    local before = rss_kb()
    local resp <close> = http.stream { url = srv.url .. "/firehose", buffer = 64 * 1024 }
    local got, reads = 0, 0
    while true do
      local c = resp:read()
      if not c then break end
      got = got + #c
      reads = reads + 1
      if reads % 8 == 0 then task.sleep(0.001) end -- a slow consumer
      if reads % 256 == 0 then collectgarbage("step") end
    end
    local grew = rss_kb() - before
    local st = resp:stats()
    assert.are.equal(total, got)
    assert.is_true(st.pauses > 0, "the transfer never paused")
    -- the C buffer never holds more than its bound plus one network chunk
    assert.is_true(st.peak_buffered <= 64 * 1024 + 64 * 1024, "peak buffered " .. st.peak_buffered)
    -- and the process did not grow by anything like the 40 MiB body (generous ceiling; ASan
    -- quarantines freed memory, so RSS says nothing about buffering in a sanitized build)
    if not build.sanitized then
      assert.is_true(grew < 24 * 1024, "RSS grew by " .. grew .. " KiB")
    end
  end))

  it("reads Server-Sent Events, including a final event without a blank line",
    with_server(function(srv)
      srv:route("GET", "/events", function(_, res)
        local w = res:stream(200, { ["Content-Type"] = "text/event-stream" })
        w:sse("output", '{"stream":"stdout","data":"hi\\n"}')
        w:comment("keep-alive")
        w:write("event: exit\ndata: {\"exit_code\":\ndata: 3}") -- no trailing blank line
        w:close()
      end)
      local resp <close> = http.stream { url = srv.url .. "/events" }
      assert.are.equal(200, resp.status)
      local e1 = resp:read_event()
      assert.are.same({ event = "output", data = '{"stream":"stdout","data":"hi\\n"}' }, e1)
      local e2 = resp:read_event()
      assert.are.same({ event = "exit", data = '{"exit_code":\n3}' }, e2)
      assert.is_nil(resp:read_event())
    end))

  it("raises the transfer error when the body is cut", with_peer(function(base)
    local resp <close> = http.stream { url = base .. "/reset" }
    local ok, err = pcall(function()
      while resp:read() do end
    end)
    assert.is_false(ok)
    assert.are.equal("connection_reset", err.code)
  end))

  it("stops the transfer when the reading task is cancelled", with_peer(function(base)
    local got = 0
    local reader = task.spawn(function()
      local resp <close> = http.stream { url = base .. "/trickle" }
      while true do
        local chunk = resp:read()
        if not chunk then break end
        got = got + #chunk
      end
    end)
    -- Cancel mid-body: once the first of its ten bytes (one per 300 ms) has arrived.
    local deadline = task.now() + 30
    while got == 0 do
      assert(task.now() < deadline, "no byte of /trickle arrived")
      task.sleep(0.01)
    end
    task.cancel(reader)
    local ok, err = pcall(task.join, reader)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err))
  end))
end)

-- Routes POST /once to a handler that carries the request out and drops the connection before
-- any reply (so libcurl may be tempted to send it again), and warms a keep-alive connection with
-- a GET it could go out on. Returns how many times /once ran (a function) and the GET's response.
local function dropping(srv)
  local calls = 0
  srv:route("POST", "/once", function(_, res)
    calls = calls + 1
    res:drop()
  end)
  srv:route("GET", "/warm", function() return 200, "ok" end)
  local warm = http.request { url = srv.url .. "/warm" }
  assert.are.equal(200, warm.status)
  return function() return calls end, warm
end

describe("http.request fresh_connect", function()
  it("never lets libcurl re-send a request whose reused connection died", with_server(function(srv)
    local calls = dropping(srv)
    local err = request_error { method = "POST", url = srv.url .. "/once", body = "{}",
      fresh_connect = true }
    assert.are.equal("connection_reset", err.code)
    assert.are.equal(1, calls())
  end))
end)

describe("http.request no_resend", function()
  it("on HTTP/1.1 a request that must not run twice is never re-sent by libcurl", with_server(function(srv)
    local calls, warm = dropping(srv)
    -- the origin is now known to speak HTTP/1.1, and a kept-alive connection is there to reuse
    assert.are.equal("1.1", warm.http_version)
    local err = request_error { method = "POST", url = srv.url .. "/once", body = "{}", no_resend = true }
    assert.are.equal("connection_reset", err.code)
    assert.are.equal(1, calls())
  end))

  -- What the option is for: libcurl itself sends a POST again when its reused connection dies
  -- before any answer byte, although the server carried it out.
  it("without it libcurl re-sends a POST whose reused connection died", with_server(function(srv)
    local calls = dropping(srv)
    local err = request_error { method = "POST", url = srv.url .. "/once", body = "{}" }
    assert.are.equal("connection_reset", err.code)
    assert.are.equal(2, calls())
  end))

  it("'reuse' keeps the kept-alive connection and still never re-sends", with_server(function(srv)
    local calls = dropping(srv)
    local err = request_error { method = "POST", url = srv.url .. "/once", body = "{}",
      no_resend = "reuse" }
    assert.are.equal("connection_reset", err.code)
    assert.matches("it was not sent again", err.message)
    assert.are.equal(1, calls())
    assert.has_error(function() http.request { url = srv.url .. "/warm", no_resend = "sometimes" } end)
  end))

  it("resolve pins a name to an address", with_server(function(srv)
    srv:route("GET", "/who", function(req) return 200, req.headers.host end)
    local r = http.request { url = "http://pinned.test:" .. srv.port .. "/who",
      resolve = { "pinned.test:" .. srv.port .. ":127.0.0.1" } }
    assert.are.equal(200, r.status)
    assert.are.equal("pinned.test:" .. srv.port, r.body)
  end))
end)

describe("http proxies", function()
  it("plain http:// to loopback never goes through http_proxy; other URLs would", with_server(function(srv)
    local sys = require "moonbox.sys"
    srv:route("GET", "/x", function() return 200, "direct" end)
    local saved = { os.getenv("http_proxy"), os.getenv("HTTP_PROXY") }
    local dead = "http://127.0.0.1:9" -- the discard port: nothing listens there
    sys.setenv("http_proxy", dead)
    sys.setenv("HTTP_PROXY", dead)
    local ok, err = pcall(function()
      for _, u in ipairs { srv.url, "http://localhost:" .. srv.port, "http://[::1]:" .. srv.port } do
        if u:find("%[::1%]") then
          -- srv listens on 127.0.0.1 only: a direct attempt is refused, a proxied one would be too
          local okr, e = pcall(http.request, { url = u .. "/x", timeout = 10 })
          assert.is_false(okr)
          assert.matches("::1", e.message)
        else
          assert.are.equal("direct", http.request { url = u .. "/x", timeout = 10 }.body)
        end
      end
      -- a name that is not loopback is sent to the proxy (which is not there)
      local okp, e = pcall(http.request, { url = "http://proxied.test:" .. srv.port .. "/x", timeout = 10,
        resolve = { "proxied.test:" .. srv.port .. ":127.0.0.1" } })
      assert.is_false(okp)
      assert.are.equal("connect_failed", e.code)
      assert.matches("port 9", e.message)
    end)
    sys.setenv("http_proxy", saved[1])
    sys.setenv("HTTP_PROXY", saved[2])
    assert(ok, err)
  end))
end)
