-- The render client on the path to Render's cloud: HTTPS through an nginx TLS + HTTP/2 edge
-- (spec/support/edge.lua) in front of a real `moonbox local`, a CA of the spec's own making,
-- and an HTTP CONNECT proxy (tinyproxy). What differs from plain HTTP/1.1 to 127.0.0.1: one
-- multiplexed connection for a fan-out, SSE and large uploads as HTTP/2 streams, connect URIs
-- that point at the edge, the CA bundle and proxy from the environment, and no silent re-send
-- of a create on a reused HTTP/2 connection.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local http = require "moonbox.http"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local render = require "moonbox.render"
local L = require "spec.support.local_backend"
local E = require "spec.support.edge"
local runs = require "spec.support.runs"

local B, edge

local run = T.async

L.fixture(setup, teardown, function(b) B, edge = b, b.edge end, { edge = true })

local function journal_posts(since, path) return #runs.requests(B, since, "POST", path) end
local function journal_mark() return runs.last_seq(B) end

describe("through a TLS + HTTP/2 edge", function()
  it("a 100-sandbox fan-out shares one TCP connection, every request an HTTP/2 stream", T.async(function()
    local from = #edge:entries()
    local items = {}
    for i = 1, 100 do items[i] = i end
    local ids = task.map(items, function()
      local sb <close> = render.sandboxes.create {}
      return sb.id
    end, { concurrency = 100 })
    assert.are.equal(100, #ids)
    local conns, list = edge:connections(from)
    local creates, protos = 0, {}
    for _, e in ipairs(list) do
      protos[e.proto] = (protos[e.proto] or 0) + 1
      if e.method == "POST" and e.uri == "/v1/sandboxes" and e.status == 201 then creates = creates + 1 end
    end
    assert.are.equal(100, creates)
    assert.are.same({ ["HTTP/2.0"] = #list }, protos)
    assert.are.equal(1, conns, "the fan-out used " .. conns .. " connections")
    assert.are.equal(0, B:live())
  end))

  it("SSE exec and a 50 MB upload work as HTTP/2 streams, with connect URIs on the edge", T.async(function()
    local sb <close> = render.sandboxes.create {}
    local from = #edge:entries()
    local r = sb:exec("echo out; echo err >&2; exit 3")
    assert.are.same({ 3, "out\n", "err\n" }, { r.code, r.stdout, r.stderr })
    local dir = E.tempdir("edge-upload")
    local file = dir .. "/big.bin"
    assert.are.equal(0, proc.run({ "sh", "-c", 'head -c 52428800 /dev/urandom > "$1"', "x", file }).code)
    local sum = proc.run({ "sha256sum", file }).stdout:match("^(%x+)")
    sb:copy_in("/tmp/big.bin", file, { timeout = 300 })
    proc.run { "rm", "-rf", dir }
    local check = sb:exec("stat -c %s /tmp/big.bin; sha256sum /tmp/big.bin"):check()
    assert.are.equal("52428800\n" .. sum .. "  /tmp/big.bin\n", check.stdout)
    local stream, upload
    for _, e in ipairs(select(2, edge:connections(from))) do
      if e.method == "POST" and e.uri == "/proxy/" .. sb.id .. "/runs/stream" then stream = e end
      if e.method == "PUT" and e.uri == "/proxy/" .. sb.id .. "/files/upload" then upload = e end
    end
    assert.is_table(stream, "the exec stream did not cross the edge")
    assert.is_table(upload, "the upload did not cross the edge")
    assert.are.same({ "HTTP/2.0", 200 }, { stream.proto, stream.status })
    assert.are.equal("HTTP/2.0", upload.proto)
    assert.is_true(upload.status >= 200 and upload.status < 300, "upload answered " .. upload.status)
  end))

  it("an exec stream opens before its command says anything (the edge holds headers until a byte)", T.async(function()
    local sb <close> = render.sandboxes.create {}
    -- the command waits for a file only a second exec makes: spawn must return first
    local p = sb:spawn("while [ ! -e /tmp/go ]; do sleep 0.05; done; echo done")
    sb:exec("touch /tmp/go"):check()
    local r = p:wait()
    assert.are.same({ 0, "done\n" }, { r.code, r.stdout })
  end))

  it("a command whose start runs out of time before its stream opened never runs on", T.async(function()
    local sb <close> = render.sandboxes.create {}
    local mark = journal_mark()
    local stream = "/proxy/" .. sb.id .. "/runs/stream"
    B:faults("POST " .. stream .. "=latency:1500#1") -- the stream's answer is held past the timeout
    local ok, err = pcall(sb.exec, sb, "touch /tmp/ran; sleep 3100", { timeout = 0.5 })
    assert.is_false(ok)
    assert.is_true(task.is_timeout(err))
    -- the held start runs once its latency is over; killed (or marked) it ends, and its stream
    -- with it, which the journal shows as the entry's status
    local ended
    for _ = 1, 800 do
      local _, entries = B:req("GET", "/_moonbox/journal", { query = { since = mark } })
      for _, e in ipairs(entries) do
        if e.method == "POST" and e.path == stream and e.status then ended = e end
      end
      if ended then break end
      task.sleep(0.025)
    end
    B:req("DELETE", "/_moonbox/faults")
    assert.is_table(ended, "the command whose caller gave up is still running")
    assert.are.equal("no\n", sb:exec("[ -e /tmp/ran ] && echo ran || echo no"):check().stdout)
  end))

  it("a create whose HTTP/2 connection breaks while it is held is unknown_outcome, sent once", T.async(function()
    -- warm the one connection, then hold a create at the backend and break the client's
    -- connection under it by killing the edge's worker (its master starts a new one at once)
    assert.are.equal(200, (B:req("GET", "/v1/sandboxes", { query = { limit = 1 } })))
    local mark = journal_mark()
    B:faults("POST /v1/sandboxes=latency:3000#1")
    local creating = task.spawn(function() return pcall(render.sandboxes.create, { name = "edge-once" }) end)
    for _ = 1, 400 do
      if journal_posts(mark, "/v1/sandboxes") == 1 then break end
      task.sleep(0.025)
    end
    assert.are.equal(1, journal_posts(mark, "/v1/sandboxes"), "the create never reached the backend")
    local workers = proc.run({ "pgrep", "-P", tostring(edge.p.pid) }).stdout
    assert.matches("%d", workers)
    for pid in workers:gmatch("%d+") do sys.kill(tonumber(pid), 9) end
    local ok, err = task.join(creating)
    assert.is_false(ok)
    assert.are.equal("unknown_outcome", err.code, tostring(err.message))
    -- the held create runs out its latency and is carried out once; a re-send would have gone
    -- out at once, long before
    local made
    for _ = 1, 600 do
      for sb in render.sandboxes.list {} do if sb.name == "edge-once" then made = sb end end
      if made then break end
      task.sleep(0.025)
    end
    assert.is_table(made, "the held create was never carried out")
    assert.are.equal(1, journal_posts(mark, "/v1/sandboxes"), "libcurl sent the create again")
    B:req("DELETE", "/_moonbox/faults")
    made:terminate()
  end))

  it("trusts the CA named by SSL_CERT_FILE alone, or CURL_CA_BUNDLE, and no other", T.async(function()
    local url = edge.url .. "/v1/sandboxes?limit=1"
    local auth = { Authorization = "Bearer " .. B.key }
    local saved = { os.getenv("CURL_CA_BUNDLE"), os.getenv("SSL_CERT_FILE") }
    local function try()
      local ok, r = pcall(http.request, { url = url, headers = auth, timeout = 30 })
      return ok and r.status or r.code
    end
    local ok, err = pcall(function()
      sys.setenv("CURL_CA_BUNDLE", nil)
      sys.setenv("SSL_CERT_FILE", edge.ca)
      assert.are.equal(200, try())
      sys.setenv("SSL_CERT_FILE", nil)
      sys.setenv("CURL_CA_BUNDLE", edge.ca)
      assert.are.equal(200, try())
      sys.setenv("CURL_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
      sys.setenv("SSL_CERT_FILE", edge.ca) -- CURL_CA_BUNDLE wins, as with the curl tool
      assert.are.equal("tls_failed", try())
    end)
    sys.setenv("CURL_CA_BUNDLE", saved[1])
    sys.setenv("SSL_CERT_FILE", saved[2])
    edge:trust()
    assert(ok, err)
  end))
end)

describe("libcurl's silent re-send over HTTP/2", function()
  -- libcurl 7.88 sends a transfer again on a new connection when its reused connection fails
  -- before any answer byte (Curl_retry_request), HTTP/2 streams included. An upload racing a
  -- broken connection shows it: without no_resend it is quietly sent again and answered on a
  -- new connection about half the time. With no_resend it must fail every time, and the server
  -- must see every request at most once.
  it("never happens to a no_resend request: a broken connection is connection_reset", T.async(function()
    local httpd = require "moonbox.httpd"
    local srv <close> = httpd.listen { host = "127.0.0.1", port = 0 }
    local held, finished, sinks = 0, 0, 0
    srv:route("POST", "/held", function()
      held = held + 1
      task.sleep(1)
      finished = finished + 1
      return 201, "made"
    end)
    srv:route("PUT", "/sink", function() sinks = sinks + 1 return 204, "" end,
      { body = "file", max_body = 1024 * 1024 * 1024, upload_dir = "/tmp" })
    srv:route("GET", "/warm", function() return 200, "ok" end)
    local e = E.start { upstream = srv.url }
    local ok, err = pcall(function()
      local body = string.rep("x", 64 * 1024 * 1024)
      for round = 1, 4 do
        held, finished, sinks = 0, 0, 0
        assert.are.equal("2", http.request { url = e.url .. "/warm", timeout = 30 }.http_version)
        local up = task.spawn(pcall, http.request, { method = "PUT", url = e.url .. "/sink", body = body,
          no_resend = true, timeout = 60 })
        task.sleep(0.1) -- the upload under way first: the broken connection then finds it mid-body
        local post = task.spawn(pcall, http.request, { method = "POST", url = e.url .. "/held", body = "{}",
          no_resend = true, timeout = 30 })
        for _ = 1, 400 do
          if held > 0 then break end
          task.sleep(0.01)
        end
        assert.are.equal(1, held, "round " .. round .. ": the POST never reached the server")
        for pid in proc.run({ "pgrep", "-P", tostring(e.p.pid) }).stdout:gmatch("%d+") do
          sys.kill(tonumber(pid), 9)
        end
        local pok, perr = task.join(post)
        local uok, uerr = task.join(up)
        assert.is_false(pok, "round " .. round .. ": the held POST was answered")
        assert.are.equal("connection_reset", perr.code)
        assert.is_false(uok, "round " .. round .. ": the upload was sent again and answered")
        assert.are.equal("connection_reset", uerr.code)
        for _ = 1, 400 do -- until the held POST's handler has ended
          if finished == held then break end
          task.sleep(0.01)
        end
        assert.are.same({ 1, 1, 0 }, { held, finished, sinks }, "round " .. round)
      end
    end)
    e:stop()
    assert(ok, err)
  end))
end)

describe("through an HTTP CONNECT proxy", function()
  local proxy, home
  setup(run(function()
    proxy = E.proxy()
    home = runs.home(B)
  end))
  teardown(run(function()
    if proxy then proxy:stop() end
    if home then proc.run { "rm", "-rf", home.dir } end
  end))

  -- argv of `moonbox run recipe` in home with extra environment assignments.
  local function moonbox_run(recipe, env)
    local argv = home:argv({ "run", recipe })
    for i, a in ipairs(argv) do
      if a == L.BIN then
        for j, kv in ipairs(env) do table.insert(argv, i + j - 1, kv) end
        break
      end
    end
    return proc.run(argv)
  end

  local RECIPE = [[
local render = require "moonbox.render"
local sb <close> = render.sandboxes.create {}
io.write(sb:exec("echo through"):check().stdout)
]]

  it("a run with HTTPS_PROXY goes through it; NO_PROXY bypasses it", T.async(function()
    local recipe = home:recipe(RECIPE)
    local target = "localhost:" .. edge.port
    local before = proxy:connects(target)
    local r = moonbox_run(recipe, { "HTTPS_PROXY=" .. proxy.url, "NO_PROXY=", "no_proxy=" })
    assert.are.equal(0, r.code, r.stderr)
    assert.are.equal("through\n", r.stdout)
    local via = proxy:connects(target) - before
    assert.is_true(via >= 1, "no CONNECT " .. target .. " in the proxy's log")
    local r2 = moonbox_run(recipe, { "HTTPS_PROXY=" .. proxy.url, "NO_PROXY=localhost" })
    assert.are.equal(0, r2.code, r2.stderr)
    assert.are.equal(via, proxy:connects(target) - before, "NO_PROXY=localhost still went through the proxy")
  end))

  it("a proxy that cannot be reached fails the run without showing its credentials", T.async(function()
    local recipe = home:recipe(RECIPE)
    local closed = E.free_port()
    local r = moonbox_run(recipe, { "HTTPS_PROXY=http://someone:s3cr3tpass@127.0.0.1:" .. closed, "NO_PROXY=" })
    assert.are_not.equal(0, r.code)
    assert.matches("connect", r.stderr)
    assert.is_nil(r.stderr:find("s3cr3tpass", 1, true), r.stderr)
    assert.is_nil(r.stdout:find("s3cr3tpass", 1, true))
  end))
end)
