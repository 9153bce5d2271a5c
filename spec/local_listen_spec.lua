-- Where `moonbox local` listens and which address the connect URIs it hands out point at: both
-- loopback addresses on one port, and exec/file URIs built from the address the client used
-- (Host; a loopback proxy's X-Forwarded-Host/-Proto; --public-url first), with the headers
-- checked before they go into a URL.
local T = require "moonbox.testing"
local http = require "moonbox.http"
local json = require "moonbox.json"
local proc = require "moonbox.proc"
local L = require "spec.support.local_backend"

local B, SB, port

local run = T.async

setup(run(function()
  B = L.start { edge = false }
  port = assert(B.direct_url:match(":(%d+)$"))
  SB = B:create()
end))
teardown(run(function() if B then B:destroy() end end))

-- POSTs a run token request to base with extra headers; returns status, decoded body, response.
local function token(base, headers)
  local h = { Authorization = "Bearer " .. B.key, ["Content-Type"] = "application/json" }
  for k, v in pairs(headers or {}) do h[k] = v end
  local r = http.request { method = "POST", url = base .. "/v1/sandboxes/" .. SB.id .. "/runs/stream/token",
    body = json.encode { command = "echo hi" }, headers = h, timeout = 30 }
  local body = r.body
  if (r.headers["content-type"] or ""):find("json") then body = json.decode(r.body) end
  return r.status, body, r
end

describe("moonbox local listens", function()
  it("on 127.0.0.1 and ::1 at the one port it prints (RENDER_LOCAL_DEV_URL is 127.0.0.1's)", T.async(function()
    assert.are.equal("http://127.0.0.1:" .. port, B.direct_url)
    for _, base in ipairs { "http://127.0.0.1:" .. port, "http://[::1]:" .. port } do
      local r = http.request { url = base .. "/v1/sandboxes?limit=1", headers = { Authorization = "Bearer " .. B.key } }
      assert.are.equal(200, r.status, base)
      assert.are.equal(base:match("//%[?([^%]]-)%]?:%d+$"), r.remote_ip)
    end
  end))

  it("and localhost that resolves to ::1 reaches it, connect URIs included", T.async(function()
    local base = "http://localhost:" .. port
    -- pin localhost to ::1 for this request (and, through libcurl's DNS cache, later ones)
    local r6 = http.request { url = base .. "/v1/sandboxes?limit=1", headers = { Authorization = "Bearer " .. B.key },
      resolve = { "localhost:" .. port .. ":[::1]" } }
    assert.are.same({ 200, "::1" }, { r6.status, r6.remote_ip })
    local s, tok, r = token(base, nil)
    assert.are.equal(201, s)
    assert.are.equal("::1", r.remote_ip)
    assert.are.equal(base .. "/proxy/" .. SB.id .. "/runs/stream", tok.uri)
    local resp <close> = http.stream { method = "POST", url = tok.uri, body = json.encode { command = "echo hi" },
      headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream",
        ["Content-Type"] = "application/json" }, timeout = 60 }
    assert.are.equal(200, resp.status)
    local out = {}
    while true do
      local ev = resp:read_event()
      if not ev then break end
      if ev.event == "output" then out[#out + 1] = json.decode(ev.data).data end
    end
    assert.are.equal("hi\n", table.concat(out))
  end))
end)

describe("moonbox local on a port another program holds on ::1", function()
  it("refuses to start, naming ::1 (its localhost clients would reach the other program)", T.async(function()
    local httpd = require "moonbox.httpd"
    local other <close> = httpd.listen { host = "::1", port = 0 }
    local state = proc.run({ "mktemp", "-d", "/tmp/moonbox-listen-spec.XXXXXX" }).stdout:gsub("%s+$", "")
    local r = proc.run { L.BIN, "local", "--port", tostring(other.port), "--state", state, "--quiet",
      timeout = 120 }
    L.remove_tree(state)
    assert.are_not.equal(0, r.code)
    assert.matches("::1 port " .. other.port .. ".*in use", r.stderr)
  end))
end)

describe("connect URIs", function()
  it("follow the Host the client used, on either address", T.async(function()
    for _, base in ipairs { "http://127.0.0.1:" .. port, "http://[::1]:" .. port } do
      local s, tok = token(base)
      assert.are.equal(201, s)
      assert.are.equal(base .. "/proxy/" .. SB.id .. "/runs/stream", tok.uri)
    end
    local s, tok = token(B.direct_url, { Host = "sandbox.example.test:9443" })
    assert.are.equal(201, s)
    assert.are.equal("http://sandbox.example.test:9443/proxy/" .. SB.id .. "/runs/stream", tok.uri)
    local _, ft = B:req("POST", "/v1/sandboxes/" .. SB.id .. "/files/upload/token", { query = { path = "/tmp/x" },
      headers = { Host = "[::1]:" .. port } })
    assert.are.equal("http://[::1]:" .. port .. "/proxy/" .. SB.id .. "/files/upload", ft.uri)
  end))

  it("follow a loopback proxy's X-Forwarded-Host and -Proto (first of a list)", T.async(function()
    local s, tok = token(B.direct_url, { ["X-Forwarded-Host"] = "edge.example.test, inner.test",
      ["X-Forwarded-Proto"] = "https, http" })
    assert.are.equal(201, s)
    assert.are.equal("https://edge.example.test/proxy/" .. SB.id .. "/runs/stream", tok.uri)
  end))

  it("refuse a Host or X-Forwarded-* that is not exactly host[:port] with 400", T.async(function()
    local HOST, FHOST = "the Host header is not host[:port]", "the X-Forwarded-Host header is not host[:port]"
    local bad = {
      { { Host = "evil.test/path?x=" }, HOST }, { { Host = "user@evil.test" }, HOST },
      { { Host = "evil.test:99999" }, HOST }, { { Host = "evil.test:80:81" }, HOST },
      { { Host = "-evil.test" }, HOST }, { { Host = "[not-ipv6]" }, HOST },
      { { ["X-Forwarded-Host"] = "evil.test/x" }, FHOST }, { { ["X-Forwarded-Host"] = "a b" }, FHOST },
      { { ["X-Forwarded-Host"] = "ok.test", ["X-Forwarded-Proto"] = "javascript" },
        "the X-Forwarded-Proto header must be http or https" },
    }
    for _, case in ipairs(bad) do
      local s, body = token(B.direct_url, case[1])
      assert.are.same({ 400, case[2] }, { s, type(body) == "table" and body.message or body }, json.encode(case[1]))
    end
  end))
end)

describe("moonbox local --public-url", function()
  it("is the base of every connect URI, whatever the request's Host", T.async(function()
    local P = L.start { edge = false, args = { "--public-url", "https://sandboxes.example.test/render/" } }
    local ok, err = pcall(function()
      local sb = P:create()
      local s, tok = P:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/sync/token", { body = { command = "true" },
        headers = { ["X-Forwarded-Host"] = "other.test" } })
      assert.are.equal(201, s)
      assert.are.equal("https://sandboxes.example.test/render/proxy/" .. sb.id .. "/runs/sync", tok.uri)
    end)
    P:destroy()
    assert(ok, err)
  end))

  it("refuses a URL that is not http(s)://host[:port][/path] at startup, naming it", T.async(function()
    local r = proc.run { L.BIN, "local", "--port", "0", "--state", "/nonexistent-moonbox-spec-state",
      "--public-url", "https://ex ample.test/" }
    assert.are_not.equal(0, r.code)
    assert.matches("%-%-public%-url https://ex ample.test/: ", r.stderr)
  end))
end)
