-- The attacker's spec of moonbox local's HTTP framing (issue 23, item 2): raw bytes on loopback
-- (spec/support/raw_http.lua), as a hostile client or a confused proxy sends them. A request
-- whose end is ambiguous (Content-Length and Transfer-Encoding, two Content-Lengths), that
-- names a transfer coding the server does not implement, or that holds a NUL or a control byte
-- in a header or in its path (raw or %00) is refused at the door, before any handler: one
-- answer with Render's error shape and a code, Connection: close, the connection closed, and
-- nothing after it on the connection answered. Then the differential part: the same hostile
-- corpus through the nginx TLS edge (spec/support/edge.lua) and directly; the two never
-- disagree on where a request ends (a pipelined request after it is answered by both or by
-- neither, and a request hidden in a body by neither).
local T = require "moonbox.testing"
local json = require "moonbox.json"
local backend = require "spec.support.local_backend"
local raw = require "spec.support.raw_http"

local B -- one backend with an nginx edge in front; B.direct_url is the backend itself

local function port_of(url) return tonumber(url:match(":(%d+)$")) end

setup(T.async(function()
  B = backend.start { edge = true }
end))

teardown(T.async(function()
  if B then B:destroy() end
end))

local KEY = backend.KEY

-- A request that reads its body and answers 400 (no sandbox group is made of it): the hostile
-- requests use it, so that a body, when read at all, is read to its end and the connection kept.
local function hostile(head, body)
  return "POST /v1/sandbox-groups HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " .. KEY .. "\r\n" ..
    head .. "\r\n" .. (body or "")
end

-- What must never be answered: a request that only exists inside another's body (its answer is
-- the only one saying invalid_limit).
local SMUGGLED = "GET /v1/sandboxes?limit=smuggled HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " .. KEY ..
  "\r\n\r\n"
-- A pipelined request after the hostile one, ending the connection (its answer is the only one
-- saying "workspace not found").
local MARKER = "GET /v1/sandboxes?ownerId=tea-marker HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " .. KEY ..
  "\r\nConnection: close\r\n\r\n"
local function smuggled_answered(res) return res.bytes:find("invalid_limit", 1, true) ~= nil end
local function marker_answered(res) return res.bytes:find("workspace not found", 1, true) ~= nil end

local function direct(bytes) return raw.send(port_of(B.direct_url), bytes) end

local function status_lines(res) return select(2, res.bytes:gsub("HTTP/1%.%d %d%d%d ", "")) end

-- The one clean refusal: exactly one status line, the status, Render's error shape with a code,
-- Connection: close, and the connection closed by the server.
local function refused(res, status, what)
  local a = res.answers[1]
  assert(a, what .. ": no answer at all (raw bytes: " .. ("%q"):format(res.bytes) .. ")")
  assert.are.equal(status, a.status, what .. ": " .. res.bytes)
  assert.are.equal(1, status_lines(res), what .. ": more than one status line on the wire: " .. res.bytes)
  assert.is_truthy(a.head:lower():find("\r\nconnection: close", 1, true), what .. ": no Connection: close: " .. a.head)
  local body = json.decode(a.body)
  assert.is_string(body.message, what)
  assert.is_string(body.code, what .. ": no error code in " .. a.body)
  assert.is_true(res.closed, what .. ": the connection was left open")
end

describe("moonbox local refuses ambiguous framing at the door", function()
  it("Content-Length with Transfer-Encoding, in both orders: 400, closed, the smuggled request unanswered",
    T.async(function()
      local body = "0\r\n\r\n" .. SMUGGLED
      for _, head in ipairs {
        "Content-Length: " .. #body .. "\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: chunked\r\nContent-Length: " .. #body .. "\r\n",
        "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n",
      } do
        local res = direct(hostile(head, body) .. MARKER)
        refused(res, 400, head)
        assert.is_false(smuggled_answered(res), "smuggled request answered: " .. res.bytes)
        assert.is_false(marker_answered(res), "request after a refusal answered: " .. res.bytes)
      end
    end))

  it("two Content-Lengths, different or the same: 400 and closed", T.async(function()
    for _, head in ipairs {
      "Content-Length: 5\r\nContent-Length: 6\r\n",
      "Content-Length: 6\r\nContent-Length: 5\r\n",
      "Content-Length: 5\r\nContent-Length: 5\r\n",
    } do
      refused(direct(hostile(head, "hello!") .. MARKER), 400, head)
    end
  end))

  it("a transfer coding it does not implement: 501 at once, not the idle close", T.async(function()
    for _, te in ipairs { "xchunked", "gzip, chunked", "chunked, identity", "identity" } do
      local res = direct(hostile("Transfer-Encoding: " .. te .. "\r\n", "5\r\nhello\r\n0\r\n\r\n") .. MARKER)
      refused(res, 501, te)
    end
    -- chunked twice, or not last: the end cannot be known (RFC 9112 section 6.3)
    refused(direct(hostile("Transfer-Encoding: chunked, chunked\r\n", "0\r\n\r\n")), 400, "chunked, chunked")
    refused(direct(hostile("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", "0\r\n\r\n")), 400,
      "chunked twice")
  end))

  it("a NUL after the API key is not the API key: 400, never 200", T.async(function()
    local res = direct("GET /v1/sandboxes?limit=1 HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " .. KEY ..
      "\0junk\r\n\r\n")
    refused(res, 400, "Bearer KEY\\0junk")
    for _, h in ipairs { "X-A: a\0b", "X-A: a\1b", "X-A: a\127b", "X-A: a\rb" } do
      refused(direct("GET /v1/sandboxes?limit=1 HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " .. KEY ..
        "\r\n" .. h .. "\r\n\r\n"), 400, ("%q"):format(h))
    end
  end))

  it("two Host fields: 400 and closed (RFC 9112 section 3.2)", T.async(function()
    refused(direct(hostile("Host: other\r\nContent-Length: 5\r\n", "hello") .. MARKER), 400, "two Host fields")
  end))

  it("a chunk size that overflows 64 bits: 400 or 413 and closed, the rest never read as a request",
    T.async(function()
      local res = direct(hostile("Transfer-Encoding: chunked\r\n", "10000000000000005\r\nhello\r\n0\r\n\r\n") ..
        SMUGGLED .. MARKER)
      -- libmicrohttpd refuses it itself, as 413 Content Too Large
      local status = res.answers[1] and res.answers[1].status
      assert.is_true(status == 400 or status == 413, res.bytes)
      assert.is_true(res.closed, "the connection was left open")
      assert.is_false(smuggled_answered(res) or marker_answered(res), res.bytes)
    end))

  it("a folded header line (obs-fold): 400", T.async(function()
    refused(direct("GET /v1/sandboxes?limit=1 HTTP/1.1\r\nHost: localhost\r\nX-A: b\r\n c\r\nAuthorization: Bearer " ..
      KEY .. "\r\n\r\n"), 400, "obs-fold")
  end))

  it("a NUL or control byte in the path, raw or percent-encoded: 400, not the sandbox before it",
    T.async(function()
      local sb = B:create()
      for _, target in ipairs {
        "/v1/sandboxes/" .. sb.id .. "%00x", "/v1/sandboxes/" .. sb.id .. "%0Ax", "/v1/sandboxes/" .. sb.id .. "%7F",
        "/v1/sandboxes/" .. sb.id .. "\0x",
      } do
        refused(direct("GET " .. target .. " HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " .. KEY ..
          "\r\n\r\n"), 400, ("%q"):format(target))
      end
      -- and in a file path (the rest of a route): never the file before the NUL
      refused(direct("POST /v1/sandboxes/" .. sb.id .. "/files/download/token?path=/etc/passwd HTTP/1.1\r\n" ..
        "Host: localhost\r\nAuthorization: Bearer " .. KEY .. "\r\nX-A: \0\r\n\r\n"), 400, "NUL header on a mint")
      B:req("DELETE", "/v1/sandboxes/" .. sb.id)
    end))

  it("a Content-Length that is not a number is refused before any handler, and the connection closed",
    T.async(function()
      -- libmicrohttpd refuses these itself (its own 400) before moonbox sees the headers.
      for _, cl in ipairs { "abc", "+5", "-5", "5 5", "5,5", "0x5" } do
        local res = direct(hostile("Content-Length: " .. cl .. "\r\n", "hello") .. MARKER)
        assert.are.equal(400, res.answers[1] and res.answers[1].status, cl .. ": " .. res.bytes)
        assert.is_true(res.closed, cl .. ": the connection was left open")
        assert.is_false(marker_answered(res), cl .. ": request after a refusal answered")
      end
    end))

  it("well-framed requests still pass: leading zeros, bare LF, keep-alive pipelining", T.async(function()
    local res = direct(hostile("Content-Length: 005\r\n", "hello") .. MARKER)
    assert.are.equal("400 404", res.statuses, res.bytes) -- not JSON, then the marker's 404
    assert.is_true(marker_answered(res))
    res = direct((SMUGGLED:gsub("\r\n", "\n")) .. MARKER)
    assert.are.equal("400 404", res.statuses, res.bytes)
    res = direct(hostile("Transfer-Encoding: chunked\r\n", "5\r\nhello\r\n0\r\n\r\n") .. SMUGGLED .. MARKER)
    assert.are.equal("400 400 404", res.statuses, res.bytes)
  end))
end)

-- The differential part: the same bytes through nginx (TLS) and directly.
describe("nginx in front and moonbox local directly agree on where a request ends", function()
  local body = "0\r\n\r\n" .. SMUGGLED
  local CORPUS = {
    { "CL then TE", hostile("Content-Length: " .. #body .. "\r\nTransfer-Encoding: chunked\r\n", body) },
    { "TE then CL", hostile("Transfer-Encoding: chunked\r\nContent-Length: " .. #body .. "\r\n", body) },
    { "CL short of TE", hostile("Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", body) },
    { "TE chunked, identity", hostile("Transfer-Encoding: chunked, identity\r\n", body) },
    { "TE xchunked", hostile("Transfer-Encoding: xchunked\r\nContent-Length: 5\r\n", "hello") },
    { "TE xchunked alone", hostile("Transfer-Encoding: xchunked\r\n", body) },
    { "obs-fold", hostile("X-A: b\r\n c\r\nContent-Length: 5\r\n", "hello") },
    { "obs-fold of TE", hostile("Transfer-Encoding:\r\n chunked\r\nContent-Length: " .. #body .. "\r\n", body) },
    { "two CL, different", hostile("Content-Length: " .. #body .. "\r\nContent-Length: 5\r\n", body) },
    { "two CL, same", hostile("Content-Length: 5\r\nContent-Length: 5\r\n", "hello") },
    { "CL +5", hostile("Content-Length: +5\r\n", "hello") },
    { "CL -5", hostile("Content-Length: -5\r\n", "hello") },
    { "CL 5 5", hostile("Content-Length: 5 5\r\n", "hello") },
    { "CL 005", hostile("Content-Length: 005\r\n", "hello") },
    { "CL with spaces", hostile("Content-Length:  5 \r\n", "hello") },
    { "bare LF", (hostile("Content-Length: 5\r\n", "hello"):gsub("\r\n", "\n")) },
    { "NUL in a header", hostile("X-A: a\0b\r\nContent-Length: 5\r\n", "hello") },
    { "NUL in the key", (hostile("Content-Length: 5\r\n", "hello"):gsub(KEY, KEY .. "\0x")) },
    { "CR in a header", hostile("X-A: a\rb\r\nContent-Length: 5\r\n", "hello") },
    { "chunk size with junk", hostile("Transfer-Encoding: chunked\r\n", "5;\0x\r\nhello\r\n0\r\n\r\n") },
    { "chunk size too long", hostile("Transfer-Encoding: chunked\r\n", "00000000000000000005\r\nhello\r\n0\r\n\r\n") },
    { "chunk size overflows", hostile("Transfer-Encoding: chunked\r\n", "10000000000000005\r\nhello\r\n0\r\n\r\n") },
    { "chunk larger than sent", hostile("Transfer-Encoding: chunked\r\n", "fffffffffffffff\r\nhello\r\n0\r\n\r\n") },
    { "two Host fields", hostile("Host: other\r\nContent-Length: 5\r\n", "hello") },
    { "bare CR line end", hostile("X-A: a\rContent-Length: 5\r\n", "hello") },
    { "space before colon", hostile("Content-Length : 5\r\n", "hello") },
  }

  it("for every case of the hostile corpus", T.async(function()
    local edge_port = B.edge.port
    local disagreements = {}
    for _, case in ipairs(CORPUS) do
      local name, bytes = case[1], case[2] .. MARKER
      local d = direct(bytes)
      local e = raw.send(edge_port, bytes, { ca = B.edge.ca })
      local function saw(res) return { smuggled = smuggled_answered(res), marker = marker_answered(res) } end
      local sd, se = saw(d), saw(e)
      io.stderr:write(("framing: %-22s direct %-12s edge %s\n"):format(name, d.statuses, e.statuses))
      if sd.smuggled or se.smuggled then
        disagreements[#disagreements + 1] = name .. ": a request inside a body was answered (direct " ..
          tostring(sd.smuggled) .. ", edge " .. tostring(se.smuggled) .. ")"
      end
      -- Where nginx passes a request on (re-framed: it sends upstream a Content-Length or chunks
      -- of its own), moonbox may be stricter and refuse it when sent directly (it refused and
      -- closed: nothing after it is read); it must never take a request nginx refuses, nor,
      -- when both take it, end it elsewhere (then the answers after it are the same).
      local direct_refused = d.answers[1] and (d.answers[1].status == 400 or d.answers[1].status == 501) and d.closed
      if sd.marker and not se.marker then
        disagreements[#disagreements + 1] = name .. ": moonbox took a request nginx refuses (direct " ..
          d.statuses .. ", edge " .. e.statuses .. ")"
      elseif se.marker and not sd.marker and not direct_refused then
        disagreements[#disagreements + 1] = name .. ": the request after it was answered through the edge only" ..
          " and moonbox did not refuse it cleanly (direct " .. d.statuses .. ", edge " .. e.statuses .. ")"
      elseif sd.marker and se.marker and d.statuses ~= e.statuses then
        disagreements[#disagreements + 1] = name .. ": both took it but answered differently (direct " ..
          d.statuses .. ", edge " .. e.statuses .. ")"
      end
    end
    assert.are.same({}, disagreements)
  end))
end)
