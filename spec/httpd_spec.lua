-- Pins moonbox.httpd: routing, request parsing, bounded bodies, answers (whole, file, stream),
-- failures of handlers and clients, concurrency, and closing with work in flight.
-- Clients are moonbox.http (same loop) and, where a separate process matters, the curl command
-- run in the background and polled for, so the loop keeps serving while it waits.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local httpd = require "moonbox.httpd"
local http = require "moonbox.http"
local json = require "moonbox.json"
local strings = require "moonbox.strings"
local files = require "spec.support.files"

local tmp -- a private directory for this spec file
local seq = 0

local sh = files.sh

local exists = files.exists
local read_file = files.must_read
local write_file = files.write

-- Waits (yielding to the loop) until pred() is true; fails the test after `secs`.
local function wait_until(pred, secs, what)
  local deadline = task.now() + (secs or 10)
  while not pred() do
    if task.now() > deadline then error("timed out waiting for " .. (what or "a condition"), 2) end
    task.sleep(0.01)
  end
end

-- Runs a shell command in the background; returns a function that waits for it to finish.
local function background(cmd)
  seq = seq + 1
  local done = string.format("%s/done-%d", tmp, seq)
  os.execute(string.format("( %s ; touch %s ) >/dev/null 2>&1 &", cmd, done))
  return function(secs) wait_until(function() return exists(done) end, secs or 30, cmd) end
end

-- Starts a server for one test; `<close>` it.
local function server(opts)
  return httpd.listen(opts or {})
end

files.temp_dir(setup, teardown, "httpd", function(dir) tmp = dir end)

describe("httpd routing", function()
  it("captures :name segments and the rest of the path, decoded", T.async(function()
    local srv <close> = server()
    local seen
    srv:route("GET", "/v1/sandboxes/:id/files/*", function(req)
      seen = req
      return 200, "ok"
    end)
    local r = http.request { url = srv.url .. "/v1/sandboxes/sbx%2D1/files/a%20dir/b.txt" }
    assert.are.equal(200, r.status)
    assert.are.equal("sbx-1", seen.captures.id)
    assert.are.equal("a dir/b.txt", seen.captures.rest)
    assert.are.equal("/v1/sandboxes/sbx-1/files/a dir/b.txt", seen.path)
    assert.are.equal("/v1/sandboxes/sbx%2D1/files/a%20dir/b.txt", seen.target)
    r = http.request { url = srv.url .. "/v1/sandboxes/x/files" }
    assert.are.equal(200, r.status)
    assert.are.equal("", seen.captures.rest)
  end))

  it("answers 404 with a JSON message when no pattern matches", T.async(function()
    local srv <close> = server()
    srv:route("GET", "/a/:x", function() return 200 end)
    local r = http.request { url = srv.url .. "/a" }
    assert.are.equal(404, r.status)
    assert.are.equal("application/json", r.headers["content-type"])
    assert.matches('"message":"no route for GET /a"', r.body, 1, true)
    r = http.request { url = srv.url .. "/a/1/2" }
    assert.are.equal(404, r.status)
  end))

  it("answers 405 with Allow when the path matches but the method does not", T.async(function()
    local srv <close> = server()
    srv:route("GET", "/items/:id", function() return 200, "got" end)
    srv:route("delete", "/items/:id", function() return 204 end)
    local r = http.request { method = "PUT", url = srv.url .. "/items/7", body = "x" }
    assert.are.equal(405, r.status)
    assert.are.equal("GET, HEAD, DELETE", r.headers["allow"])
    r = http.request { method = "DELETE", url = srv.url .. "/items/7" }
    assert.are.equal(204, r.status)
  end))

  it("serves HEAD from the GET route without a body", T.async(function()
    local srv <close> = server()
    local method
    srv:route("GET", "/doc", function(req)
      method = req.method
      return 200, "twelve bytes"
    end)
    local r = http.request { method = "HEAD", url = srv.url .. "/doc" }
    assert.are.equal(200, r.status)
    assert.are.equal("HEAD", method)
    assert.are.equal("", r.body)
    assert.are.equal("12", r.headers["content-length"])
  end))

  it("tries routes in the order they were added, '*' matching any method", T.async(function()
    local srv <close> = server()
    srv:route("GET", "/x/special", function() return 200, "special" end)
    srv:route("*", "/x/*", function(req) return 200, "any " .. req.method end)
    assert.are.equal("special", http.request { url = srv.url .. "/x/special" }.body)
    assert.are.equal("any PATCH", http.request { method = "PATCH", url = srv.url .. "/x/y" }.body)
  end))

  it("rejects malformed patterns and options when the route is added", T.async(function()
    local srv <close> = server()
    local h = function() end
    assert.has_error(function() srv:route("GET", "no-slash", h) end)
    assert.has_error(function() srv:route("GET", "/a/*/b", h) end)
    assert.has_error(function() srv:route("GET", "/a/:", h) end)
    assert.has_error(function() srv:route("GET", "/a", h, { body = "disk" }) end)
    assert.has_error(function() srv:route("GET", "/a", h, { max_body = 0 }) end)
    assert.has_error(function() srv:route("GET", "/a", "not a function") end)
  end))
end)

describe("httpd requests", function()
  it("parses the query: first values, repeated keys, percent and plus decoding", T.async(function()
    local srv <close> = server()
    local seen
    srv:route("GET", "/q", function(req)
      seen = {
        query = req.query, params = req.params,
        status = req:query_all("status"), first = req:query_param("status"),
        name = req:query_param("na me"), none = req:query_all("missing"),
      }
      return 200
    end)
    http.request { url = srv.url .. "/q?status=a&status=b%26c&na+me=J%C3%BCrg+X&flag&empty=" }
    assert.are.equal("status=a&status=b%26c&na+me=J%C3%BCrg+X&flag&empty=", seen.query)
    assert.are.same({ "a", "b&c" }, seen.status)
    assert.are.equal("a", seen.first)
    assert.are.equal("Jürg X", seen.name)
    assert.are.equal("", seen.params.flag)
    assert.are.equal("", seen.params.empty)
    assert.are.same({}, seen.none)
  end))

  it("gives lower-cased request headers, and sends the handler's headers", T.async(function()
    local srv <close> = server()
    local seen
    srv:route("GET", "/h", function(req)
      seen = { all = req.headers, custom = req:header("X-CUSTOM-Thing"), remote = req.remote }
      return 201, "made", { ["X-Reply"] = "yes", ["Set-Cookie"] = { "a=1", "b=2" }, ["X-N"] = 5 }
    end)
    local r = http.request { url = srv.url .. "/h", headers = { ["X-Custom-Thing"] = "Value 1" } }
    assert.are.equal(201, r.status)
    assert.are.equal("made", r.body)
    assert.are.equal("Value 1", seen.all["x-custom-thing"])
    assert.are.equal("Value 1", seen.custom)
    assert.are.equal("127.0.0.1", seen.remote)
    assert.are.equal("yes", r.headers["x-reply"])
    assert.are.equal("a=1, b=2", r.headers["set-cookie"])
    assert.are.equal("5", r.headers["x-n"])
    assert.are.equal("text/plain; charset=utf-8", r.headers["content-type"])
  end))

  it("binds to 127.0.0.1 on an ephemeral port by default", T.async(function()
    local srv <close> = server()
    assert.are.equal("127.0.0.1", srv.host)
    assert.is_true(srv.port > 0)
    assert.are.equal("http://127.0.0.1:" .. srv.port, srv.url)
    -- The kernel's own table: a LISTEN socket (state 0A) on 127.0.0.1 (0100007F) at our port.
    local want = string.format("0100007F:%04X", srv.port)
    local found
    for line in io.lines("/proc/net/tcp") do
      local addr, state = line:match("^%s*%d+:%s+(%x+:%x+)%s+%x+:%x+%s+(%x+)")
      if addr and addr:upper() == want and state == "0A" then found = true end
    end
    assert.is_true(found)
  end))

  it("raises listen_failed for a port already in use", T.async(function()
    local srv <close> = server()
    local ok, err = pcall(httpd.listen, { port = srv.port })
    assert.is_false(ok)
    assert.are.equal("listen_failed", err.code)
  end))
end)

describe("httpd request bodies", function()
  it("gives memory-mode bodies as req.body", T.async(function()
    local srv <close> = server()
    local got
    srv:route("POST", "/m", function(req) got = req.body return 200, #req.body .. "" end)
    local body = string.rep("0123456789", 50000)
    local r = http.request { method = "POST", url = srv.url .. "/m", body = body }
    assert.are.equal(200, r.status)
    assert.are.equal(body, got)
  end))

  it("answers 413 above max_body and buffers nothing beyond the limit", T.async(function()
    local srv <close> = server { max_body = 4096 }
    local called = false
    srv:route("POST", "/m", function() called = true return 200 end)
    srv:route("POST", "/small", function() called = true return 200 end, { max_body = 1000 })
    -- Declared length over the limit: refused before the body is read (Expect: 100-continue).
    local r = http.request { method = "POST", url = srv.url .. "/m", body = string.rep("x", 5000),
                             headers = { Expect = "100-continue" } }
    assert.are.equal(413, r.status)
    assert.matches("exceeds the limit of 4096 bytes", r.body, 1, true)
    r = http.request { method = "POST", url = srv.url .. "/small", body = string.rep("x", 1001),
                       headers = { Expect = "100-continue" } }
    assert.are.equal(413, r.status)
    -- No declared length (chunked): the excess is read and dropped, then 413.
    r = http.request { method = "POST", url = srv.url .. "/small", body = string.rep("y", 20000),
                       headers = { ["Transfer-Encoding"] = "chunked" } }
    assert.are.equal(413, r.status)
    assert.is_false(called)
    local st = srv:stats()
    assert.are.equal(3, st.rejected_large)
    assert.is_true(st.peak_body_bytes <= 1001, "buffered " .. st.peak_body_bytes .. " bytes")
    -- Within the limit, chunked or not, the handler runs.
    r = http.request { method = "POST", url = srv.url .. "/small", body = string.rep("z", 1000),
                       headers = { ["Transfer-Encoding"] = "chunked" } }
    assert.are.equal(200, r.status)
    assert.is_true(called)
  end))

  it("streams file-mode bodies to a 0600 temporary file it removes afterwards", T.async(function()
    local dir = tmp .. "/uploads"
    os.execute("mkdir -p " .. dir)
    local srv <close> = server()
    local seen
    srv:route("PUT", "/f", function(req)
      seen = { path = req.body_file, size = req.body_size, body = req.body,
               data = read_file(req.body_file),
               mode = sh("stat -c %a " .. req.body_file):gsub("%s+$", "") }
      return 200
    end, { body = "file", upload_dir = dir, max_body = 300000 })
    local payload = {}
    for i = 1, 20000 do payload[i] = string.format("%07d\n", i) end
    payload = table.concat(payload)
    local r = http.request { method = "PUT", url = srv.url .. "/f", body = payload }
    assert.are.equal(200, r.status)
    assert.are.equal(dir, seen.path:match("^(.*)/moonbox%-upload%-"))
    assert.are.equal("600", seen.mode)
    assert.are.equal(#payload, seen.size)
    assert.are.equal(payload, seen.data)
    assert.is_nil(seen.body)
    assert.is_false(exists(seen.path))
    assert.are.equal(0, srv:stats().peak_body_bytes)
  end))

  it("answers 413 above a file-mode limit and leaves no file behind", T.async(function()
    local dir = tmp .. "/uploads413"
    os.execute("mkdir -p " .. dir)
    local srv <close> = server()
    local called = false
    srv:route("PUT", "/f", function() called = true return 200 end,
      { body = "file", upload_dir = dir, max_body = 10000 })
    local r = http.request { method = "PUT", url = srv.url .. "/f", body = string.rep("q", 10001),
                             headers = { Expect = "100-continue" } }
    assert.are.equal(413, r.status)
    r = http.request { method = "PUT", url = srv.url .. "/f", body = string.rep("q", 50000),
                       headers = { ["Transfer-Encoding"] = "chunked" } }
    assert.are.equal(413, r.status)
    assert.is_false(called)
    assert.are.equal("", sh("ls -A " .. dir))
  end))

  it("keeps a body file the handler moved away", T.async(function()
    local srv <close> = server()
    local kept = tmp .. "/kept.bin"
    srv:route("POST", "/keep", function(req)
      assert(os.rename(req.body_file, kept))
      return 204
    end, { body = "file", upload_dir = tmp })
    local r = http.request { method = "POST", url = srv.url .. "/keep", body = "precious" }
    assert.are.equal(204, r.status)
    assert.are.equal("precious", read_file(kept))
  end))

  it("drops bodies of body = \"none\" routes", T.async(function()
    local srv <close> = server()
    local seen
    srv:route("POST", "/n", function(req) seen = req return 200 end, { body = "none" })
    local r = http.request { method = "POST", url = srv.url .. "/n", body = string.rep("n", 5000) }
    assert.are.equal(200, r.status)
    assert.is_nil(seen.body)
    assert.is_nil(seen.body_file)
    assert.are.equal(0, srv:stats().peak_body_bytes)
  end))
end)

describe("httpd answers", function()
  it("sends a file with res:send_file, and raises not_found for a missing one", T.async(function()
    local srv <close> = server()
    local path = tmp .. "/served.txt"
    local content = string.rep("file line\n", 3000)
    write_file(path, content)
    srv:route("GET", "/file/:name", function(req, res)
      local ok, err = pcall(res.send_file, res, 200, tmp .. "/" .. req.captures.name,
        { ["Content-Type"] = "text/x-test" })
      if not ok then return 404, err.code end
    end)
    local r = http.request { url = srv.url .. "/file/served.txt" }
    assert.are.equal(200, r.status)
    assert.are.equal(content, r.body)
    assert.are.equal("text/x-test", r.headers["content-type"])
    r = http.request { url = srv.url .. "/file/missing.txt" }
    assert.are.equal(404, r.status)
    assert.are.equal("not_found", r.body)
  end))

  it("streams with SSE framing: events, multi-line data, comments", T.async(function()
    local srv <close> = server()
    srv:route("GET", "/events", function(_, res)
      local w = res:stream(200, { ["Content-Type"] = "text/event-stream" })
      w:sse("greeting", "hello\nworld")
      task.sleep(0.02)
      w:comment("keep-alive")
      w:sse(nil, "plain", "7")
      w:sse("crlf", "a\r\nb")
      w:close()
    end)
    local r = http.request { url = srv.url .. "/events" }
    assert.are.equal(200, r.status)
    assert.are.equal("text/event-stream", r.headers["content-type"])
    assert.are.equal("event: greeting\ndata: hello\ndata: world\n\n: keep-alive\n" ..
                     "id: 7\ndata: plain\n\nevent: crlf\ndata: a\ndata: b\n\n", r.body)
  end))

  it("writes an exec output event with w:sse_output exactly as w:sse of its JSON", T.async(function()
    local srv <close> = server()
    local chunks = { "", "plain", "a\nb\r\n\"q\" \\ \t\0\31", "é€😀", "bad \255\237\160\128\192\175 \226\130",
      ("0123456789abcdefghijklmnopqrstuvwxyz\n"):rep(3000) }
    srv:route("GET", "/both", function(req, res)
      local w = res:stream(200, { ["Content-Type"] = "text/event-stream" })
      local fast = req:query_param("fast") == "1"
      for i, c in ipairs(chunks) do
        local stream = i % 2 == 0 and "stderr" or "stdout"
        if fast then w:sse_output(stream, c) else w:sse("output", json.encode({ stream = stream, data = c })) end
      end
      w:close()
    end)
    local slow = http.request { url = srv.url .. "/both" }
    local fast = http.request { url = srv.url .. "/both?fast=1" }
    assert.are.equal(200, fast.status)
    assert.is_true(#slow.body > 100000)
    assert.are.equal(slow.body, fast.body)
  end))

  it("parses as SSE for moonbox.http's stream reader", T.async(function()
    local srv <close> = server()
    srv:route("GET", "/events", function(_, res)
      local w = res:stream(200, { ["Content-Type"] = "text/event-stream" })
      for i = 1, 3 do w:sse("n", tostring(i)) end
    end)
    local resp <close> = http.stream { url = srv.url .. "/events" }
    local got = {}
    while true do
      local ev = resp:read_event()
      if not ev then break end
      got[#got + 1] = ev.event .. "=" .. ev.data
    end
    assert.are.same({ "n=1", "n=2", "n=3" }, got)
  end))

  it("makes the writer wait for a slow client instead of queueing without bound", T.async(function()
    local srv <close> = server()
    local chunk = string.rep("b", 64 * 1024)
    local n_chunks = 256 -- 16 MiB: more than loopback socket buffers can absorb
    local written, max_pending, wrote_all = 0, 0, false
    local writer, in_write
    srv:route("GET", "/big", function(_, res)
      local w = res:stream(200, nil, { buffer = 64 * 1024 })
      writer = w
      for _ = 1, n_chunks do
        in_write = true
        w:write(chunk)
        in_write = false
        written = written + #chunk
        if w:pending() > max_pending then max_pending = w:pending() end
      end
      wrote_all = true
    end)
    local resp <close> = http.stream { url = srv.url .. "/big", buffer = 16 * 1024 }
    -- The client reads nothing: await the writer parked in a write with more than its buffer
    -- queued (a writer that queued without bound would finish instead).
    local deadline = task.now() + 30
    while not wrote_all and not (in_write and writer:pending() > 64 * 1024) do
      assert(task.now() < deadline, "the writer neither parked nor finished")
      task.sleep(0.01)
    end
    assert.is_false(wrote_all)
    assert.is_true(written < n_chunks * #chunk)
    local total = 0
    while true do
      local c = resp:read()
      if not c then break end
      total = total + #c
    end
    assert.are.equal(n_chunks * #chunk, total)
    assert.is_true(wrote_all)
    assert.is_true(max_pending <= 64 * 1024, "pending reached " .. max_pending)
  end))

  for _, writer in ipairs({ "sse", "sse_output" }) do
    it("raises client_gone in w:" .. writer .. " when the client disconnects mid-stream", T.async(function()
      local srv <close> = server()
      local base = httpd.live_requests()
      local err, finished
      srv:route("GET", "/ticks", function(_, res)
        local w = res:stream(200, { ["Content-Type"] = "text/event-stream" })
        local ok, e
        repeat
          if writer == "sse" then
            ok, e = pcall(w.sse, w, "tick", string.rep("t", 200))
          else
            ok, e = pcall(w.sse_output, w, "stdout", string.rep("t\n", 100))
          end
          task.sleep(0.005)
        until not ok
        err = e
        finished = true
      end)
      local resp = http.stream { url = srv.url .. "/ticks" }
      assert.are.equal(writer == "sse" and "tick" or "output", resp:read_event().event)
      resp:close()
      wait_until(function() return finished end, 10, "the writer to notice")
      assert.are.equal("client_gone", err.code)
      assert.are.equal("w:" .. writer, err.op)
      assert.are.equal("/ticks", err.path)
      wait_until(function() return httpd.live_requests() == base end, 5, "the request to be freed")
      assert.are.equal(0, srv:stats().handlers)
    end))
  end

  it("refuses a second answer and answers after the handler returns", T.async(function()
    local srv <close> = server()
    local second
    srv:route("GET", "/twice", function(_, res)
      assert.is_true(res:send(200, "first"))
      second = { pcall(res.send, res, 200, "second") }
      task.sleep(0.01)
    end)
    local r = http.request { url = srv.url .. "/twice" }
    assert.are.equal("first", r.body)
    assert.is_false(second[1])
    assert.matches("already sent", second[2])
  end))
end)

describe("httpd handler failures", function()
  it("answers 500 with a JSON message and logs the error with its traceback", T.async(function()
    local srv <close> = server()
    srv:route("GET", "/boom", function() error("kaboom in handler") end)
    local lines = {}
    local real = io.stderr
    io.stderr = { write = function(_, s) lines[#lines + 1] = s end } -- luacheck: ignore 122
    local ok, r = pcall(http.request, { url = srv.url .. "/boom" })
    io.stderr = real -- luacheck: ignore 122
    assert.is_true(ok, tostring(r))
    assert.are.equal(500, r.status)
    assert.are.equal("application/json", r.headers["content-type"])
    assert.matches('^{"message":".*kaboom in handler"}$', r.body)
    local log = table.concat(lines)
    assert.matches("handler for GET /boom failed: .*kaboom in handler", log)
    assert.matches("stack traceback:", log, 1, true)
    assert.matches("httpd_spec.lua", log, 1, true)
  end))

  it("answers a failure whose message is not UTF-8 with valid JSON, U+FFFD for each bad byte",
    T.async(function()
      local srv <close> = server { log = function() end }
      srv:route("GET", "/bytes", function() error({ code = "custom", message = 'a"\255\226\130b' }) end)
      local r = http.request { url = srv.url .. "/bytes" }
      assert.are.equal(500, r.status)
      assert.is_true(strings.utf8_valid(r.body), r.body)
      assert.are.equal('{"message":"a\\"\239\191\189\239\191\189\239\191\189b"}', r.body)
    end))

  it("sends handler failures to the log function when one is given", T.async(function()
    local lines = {}
    local srv <close> = server { log = function(line) lines[#lines + 1] = line end }
    srv:route("GET", "/bad", function() error({ code = "custom" }) end)
    local r = http.request { url = srv.url .. "/bad" }
    assert.are.equal(500, r.status)
    assert.are.equal(1, #lines)
    assert.matches("handler for GET /bad failed", lines[1], 1, true)
  end))

  it("answers 500 'handler did not respond' when the handler returns nothing", T.async(function()
    local lines = {}
    local srv <close> = server { log = function(line) lines[#lines + 1] = line end }
    srv:route("GET", "/silent", function() task.sleep(0.001) end)
    local r = http.request { url = srv.url .. "/silent" }
    assert.are.equal(500, r.status)
    assert.are.equal('{"message":"handler did not respond"}', r.body)
    assert.matches("returned without responding", lines[1], 1, true)
  end))

  it("breaks off a stream whose handler raises midway", T.async(function()
    local lines = {}
    local srv <close> = server { log = function(line) lines[#lines + 1] = line end }
    srv:route("GET", "/half", function(_, res)
      local w = res:stream(200)
      w:write("partial")
      task.sleep(0.01)
      error("midway")
    end)
    local ok, err = pcall(http.request, { url = srv.url .. "/half" })
    assert.is_false(ok)
    assert.are.equal("connection_reset", err.code)
    assert.matches("midway", lines[1], 1, true)
  end))
end)

describe("httpd under load", function()
  it("holds and answers 1,000 concurrent requests from separate processes", T.async(function()
    local srv <close> = server()
    local N, procs = 1000, 4
    local arrived = 0
    local all_in = require("moonbox.core").cond()
    srv:route("GET", "/c/:n", function(req)
      arrived = arrived + 1
      if arrived == N then all_in:broadcast() end
      while arrived < N do all_in:wait() end
      return 200, req.captures.n
    end)
    local waits = {}
    for p = 1, procs do
      local cfg = string.format("%s/urls-%d.cfg", tmp, p)
      local lines = {}
      for i = 1, N // procs do
        lines[#lines + 1] = string.format('url = "%s/c/%d"\noutput = "/dev/null"', srv.url,
          (p - 1) * (N // procs) + i)
      end
      write_file(cfg, table.concat(lines, "\n") .. "\n")
      waits[p] = background(string.format(
        "curl -s --parallel --parallel-immediate --parallel-max %d --max-time 120 " ..
        "-w '%%{http_code}\\n' -K %s > %s/codes-%d", N // procs, cfg, tmp, p))
    end
    wait_until(function() return arrived == N end, 90, "1,000 requests to arrive together")
    for p = 1, procs do waits[p](90) end
    local ok = 0
    for p = 1, procs do
      for code in io.lines(string.format("%s/codes-%d", tmp, p)) do
        if code == "200" then ok = ok + 1 end
      end
    end
    assert.are.equal(N, ok)
    assert.is_true(srv:stats().max_concurrent >= N)
  end))
end)

describe("httpd close", function()
  it("closes with requests in flight without crashing or leaking", T.async(function()
    local srv = server()
    local base = httpd.live_requests()
    local started, writer_err = 0, nil
    srv:route("GET", "/slow", function()
      started = started + 1
      task.sleep(30)
      return 200, "too late"
    end)
    srv:route("GET", "/stream", function(_, res)
      started = started + 1
      local w = res:stream(200)
      local _, e = pcall(function()
        while true do
          w:write("x")
          task.sleep(0.01)
        end
      end)
      writer_err = e
    end)
    srv:route("POST", "/upload", function() return 200 end, { body = "file", upload_dir = tmp })
    local clients = {}
    for i = 1, 10 do
      clients[i] = task.spawn(function() return pcall(http.request, { url = srv.url .. "/slow" }) end)
    end
    local streamer = task.spawn(function()
      local resp <close> = http.stream { url = srv.url .. "/stream" }
      pcall(function() while resp:read() do end end)
    end)
    -- A body still arriving when the server closes: its second half comes a second later.
    local slow_upload = background(string.format(
      "(head -c 1000 /dev/zero; sleep 1; head -c 1000 /dev/zero) | curl -s -X POST -T - %s/upload",
      srv.url))
    wait_until(function() return started == 11 and srv:stats().active == 12 end, 10,
      "the handlers to start and the upload to arrive")
    srv:close()
    assert.is_true(srv.closed)
    srv:close() -- idempotent
    for i = 1, 10 do
      local ok, r = task.join(clients[i])
      assert.is_true(ok == false or r.status ~= 200)
    end
    task.join(streamer)
    -- close cancels the handlers: the streaming one unwinds where it waits.
    wait_until(function() return writer_err ~= nil end, 5, "the streaming handler to unwind")
    assert.is_true(task.is_cancelled(writer_err) or writer_err.code == "client_gone")
    slow_upload(10)
    wait_until(function() return srv:stats().handlers == 0 end, 5, "the handlers to unwind")
    collectgarbage()
    wait_until(function() return httpd.live_requests() == base end, 5, "the requests to be freed")
    assert.are.equal("", sh("ls -A " .. tmp .. " | grep moonbox-upload || true"))
    assert.has_error(function() srv:route("GET", "/x", function() end) end)
  end))

  it("shuts down gracefully: refuses new connections, finishes those in flight", T.async(function()
    local srv = server()
    local started = 0
    srv:route("GET", "/slow", function()
      started = started + 1
      task.sleep(0.2)
      return 200, "finished"
    end)
    local clients = {}
    for i = 1, 3 do
      clients[i] = task.spawn(function() return http.request { url = srv.url .. "/slow" } end)
    end
    wait_until(function() return started == 3 end, 5, "the handlers to start")
    local url = srv.url
    local done = task.spawn(function() srv:shutdown(5) end)
    task.sleep(0.01)
    local ok, err = pcall(http.request, { url = url .. "/slow", connect_timeout = 2 })
    assert.is_false(ok)
    assert.are.equal("connect_failed", err.code)
    assert.is_false(srv.closed)
    for i = 1, 3 do assert.are.equal("finished", task.join(clients[i]).body) end
    task.join(done)
    assert.is_true(srv.closed)
  end))

  it("lets a handler shut its own server down after answering", T.async(function()
    local srv = server()
    local closer
    srv:route("POST", "/shutdown", function(_, res)
      res:send(202, "bye")
      closer = task.spawn(function() srv:shutdown(5) end)
    end)
    local r = http.request { method = "POST", url = srv.url .. "/shutdown", body = "" }
    assert.are.equal(202, r.status)
    assert.are.equal("bye", r.body)
    task.join(closer)
    assert.is_true(srv.closed)
    assert.are.equal(0, srv:stats().handlers)
  end))
end)
