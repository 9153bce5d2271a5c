-- The request/response test vectors listed in docs/wire.md (Render's TypeScript SDK, Python SDK
-- and CLI tests), replayed against `moonbox local` with plain HTTP requests shaped exactly as
-- those clients send them. Ids and times differ; shapes, statuses and codes must hold.
--
-- Every vector runs twice: against `moonbox local` (a real backend over real HTTP) and against a
-- dry run (moonbox.dryrun: the same service and routes on the simulated engine, over the
-- in-memory transport), which must answer each one as moonbox local does. Where a vector reads
-- what a command printed, the dry run's answer is what its render.dry_run.on_exec hook says
-- (B.runs_commands is false): the wire's shape is checked, not a shell.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local http = require "moonbox.http"
local json = require "moonbox.json"
local proc = require "moonbox.proc"
local L = require "spec.support.local_backend"
local D = require "spec.support.dryrun_backend"

local run = T.async

-- moonbox local with the fields a dry run's backend has too.
local function real_backend()
  local b = L.start()
  b.http, b.runs_commands = http, true
  b.hold = function(_, fn, ...) return fn(...) end
  return b
end

local BACKENDS = {
  { "moonbox local", real_backend },
  { "a dry run", function()
    local b = D.start()
    -- What the commands below print, which a dry run's engine does not run.
    require("moonbox.render").dry_run.on_exec("^echo hi$", { stdout = "hi\n" })
    return b
  end },
}

for _, backend in ipairs(BACKENDS) do
local B, SB

describe("against " .. backend[1] .. ":", function()
setup(run(function()
  B = backend[2]()
  SB = B:create()
end))
teardown(run(function() if B then B:destroy() end end))

-- A raw request as an SDK sends it: path under /v1 with the query given literally.
local function raw(method, path_and_query, body, headers)
  local h = { Authorization = "Bearer " .. B.key }
  if body ~= nil then h["Content-Type"] = "application/json" end
  for k, v in pairs(headers or {}) do h[k] = v end
  local r = B.http.request { method = method, url = B.url .. "/v1" .. path_and_query, body = body, headers = h }
  local decoded = r.body
  if (r.headers["content-type"] or ""):find("json") then decoded = json.decode(r.body) end
  return r.status, decoded, r.headers
end

local function wait_snapshot(gid, sid)
  for _ = 1, 600 do
    local _, s = raw("GET", "/sandbox-groups/" .. gid .. "/snapshots/" .. sid)
    if s.status ~= "creating" then return s end
    task.sleep(0.05)
  end
end

describe("TypeScript SDK vectors", function()
  it("1-2: list with ownerId, cursor, limit and status; list with only the default owner", T.async(function()
    local s, page = raw("GET", "/sandboxes?ownerId=" .. B.workspace .. "&limit=25&status=running")
    assert.are.equal(200, s)
    assert.is_true(#page >= 1)
    local c = page[1].cursor
    local s2 = raw("GET", "/sandboxes?ownerId=" .. B.workspace .. "&cursor=" .. c .. "&limit=25&status=running")
    assert.are.equal(200, s2)
    -- a cursor this server never issued is refused, as Render does
    local s3, b3 = raw("GET", "/sandboxes?ownerId=" .. B.workspace .. "&cursor=cursor-before&limit=25&status=running")
    assert.are.same({ 400, "invalid_cursor" }, { s3, b3.code })
    assert.are.equal(200, (raw("GET", "/sandboxes?ownerId=" .. B.workspace)))
  end))

  it("3: listGroups by owner; an unknown workspace is 404 'workspace not found'", T.async(function()
    local s, page = raw("GET", "/sandbox-groups?ownerId=" .. B.workspace)
    assert.are.equal(200, s)
    assert.is_string(page[1].sandboxGroup.id)
    local s2, b2 = raw("GET", "/sandbox-groups?ownerId=tea-test0000000000000000")
    assert.are.equal(404, s2)
    assert.are.equal("workspace not found", b2.message)
  end))

  it("4: create with exactly {ownerId}; with a snapshotId that does not exist", T.async(function()
    local s, sb = raw("POST", "/sandboxes", json.encode({ ownerId = B.workspace }))
    assert.are.equal(201, s)
    assert.are.equal("creating", sb.status)
    raw("POST", "/sandboxes/" .. sb.id .. "/terminate")
    local s2, b2 = raw("POST", "/sandboxes", '{"ownerId":"' .. B.workspace .. '","snapshotId":"snp-cph1rs3idesc73a2b2mg"}')
    assert.are.same({ 404, "snapshot_not_found" }, { s2, b2.code })
  end))

  it("4: the full create body of the TS vector is accepted", T.async(function()
    local body = '{"ownerId":"' .. B.workspace .. '","plan":"pro","timeoutSeconds":600,"region":"oregon",' ..
      '"networkPolicy":{"default":"deny-all"},"env":{"NODE_ENV":"test"}}'
    local s, sb = raw("POST", "/sandboxes", body)
    assert.are.equal(201, s)
    assert.are.same({ "pro", 600, "deny-all" }, { sb.plan, sb.timeoutSeconds, sb.networkPolicy.default })
    raw("POST", "/sandboxes/" .. sb.id .. "/terminate")
  end))

  it("6-7: snapshot create without and with a body; get and delete without ownerId", T.async(function()
    local s, snap = raw("POST", "/sandboxes/" .. SB.id .. "/snapshots")
    assert.are.equal(202, s)
    assert.are.equal("filesystem", snap.kind)
    local s2, snap2 = raw("POST", "/sandboxes/" .. SB.id .. "/snapshots?ownerId=" .. B.workspace,
      '{"kind":"runtime"}')
    assert.are.same({ 202, "runtime" }, { s2, snap2.kind })
    local s3, snap3 = raw("POST", "/sandboxes/" .. SB.id .. "/snapshots", '{"expiresAt":"2099-09-08T00:00:00Z"}')
    assert.are.same({ 202, "2099-09-08T00:00:00Z" }, { s3, snap3.expiresAt })
    for _, f in ipairs({ "id", "sandboxGroupId", "sourceSandboxId", "kind", "status", "plan", "requestedAt",
      "capturedAt", "expiresAt", "sizeBytes", "error" }) do
      assert.is_not_nil(snap[f], f)
    end
    local done = wait_snapshot(snap.sandboxGroupId, snap.id)
    assert.are.equal("available", done.status)
    wait_snapshot(snap2.sandboxGroupId, snap2.id)
    wait_snapshot(snap3.sandboxGroupId, snap3.id)
    assert.are.equal(204, (raw("DELETE", "/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id)))
  end))

  it("8: 409 sandbox_not_running for a snapshot of a suspended sandbox", T.async(function()
    local sb = B:create()
    assert.are.equal(202, (raw("POST", "/sandboxes/" .. sb.id .. "/suspend")))
    B:wait_status(sb.id, "suspended")
    local s, b = raw("POST", "/sandboxes/" .. sb.id .. "/snapshots", '{"kind":"filesystem"}')
    assert.are.same({ 409, "sandbox_not_running" }, { s, b.code })
    raw("POST", "/sandboxes/" .. sb.id .. "/terminate")
  end))

  it("9: snapshots.list with status, limit and ownerId; without owner it is refused", T.async(function()
    local gid = SB.sandboxGroupId
    local s, page = raw("GET", "/sandbox-groups/" .. gid .. "/snapshots?ownerId=" .. B.workspace ..
      "&status=available&limit=10")
    assert.are.equal(200, s)
    assert.is_table(page)
    local s2, b2 = raw("GET", "/sandbox-groups/" .. gid .. "/snapshots")
    assert.are.same({ 400, "invalid_owner_id" }, { s2, b2.code })
  end))

  it("10-11: upload token (no body), PUT octet-stream, download token, GET", T.async(function()
    local s, tok = raw("POST", "/sandboxes/" .. SB.id .. "/files/upload/token?ownerId=" .. B.workspace ..
      "&path=/app/hello.txt")
    assert.are.same({ 201, "PUT" }, { s, tok.method })
    assert.is_string(tok.executionId)
    local up = B.http.request { method = "PUT", url = tok.uri, body = "hello",
      headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/octet-stream" } }
    assert.are.equal(204, up.status)
    local s2, dt = raw("POST", "/sandboxes/" .. SB.id .. "/files/download/token?ownerId=" .. B.workspace ..
      "&path=/app/hello.txt")
    assert.are.same({ 201, "GET" }, { s2, dt.method })
    local down = B.http.request { url = dt.uri, headers = { Authorization = "Bearer " .. dt.token } }
    assert.are.same({ 200, "hello", "application/octet-stream" },
      { down.status, down.body, down.headers["content-type"] })
  end))

  it("12-13: exec mint with {command}, without a body; SSE output and exit", T.async(function()
    local s, tok = raw("POST", "/sandboxes/" .. SB.id .. "/runs/stream/token?ownerId=" .. B.workspace,
      '{"command":"echo hi"}')
    assert.are.equal(201, s)
    for _, f in ipairs({ "executionId", "token", "uri", "method", "expiresAt" }) do assert.is_string(tok[f], f) end
    assert.are.equal("POST", tok.method)
    local resp <close> = B.http.stream { method = "POST", url = tok.uri, body = '{"command":"echo hi"}',
      headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream",
        ["Content-Type"] = "application/json" } }
    assert.are.equal(200, resp.status)
    assert.matches("^text/event%-stream", resp.headers["content-type"])
    local e1 = resp:read_event()
    assert.are.same({ "output", { stream = "stdout", data = "hi\n" } }, { e1.event, json.decode(e1.data) })
    local e2 = resp:read_event()
    assert.are.same({ "exit", { exit_code = 0 } }, { e2.event, json.decode(e2.data) })
    assert.is_nil(resp:read_event())
    local s2 = raw("POST", "/sandboxes/" .. SB.id .. "/runs/stream/token")
    assert.are.equal(201, s2)
  end))

  it("18: minting for an unknown sandbox is 404 with a message", T.async(function()
    local s, b = raw("POST", "/sandboxes/sbx-0000000000000000000000000/runs/stream/token", '{"command":"x"}')
    assert.are.equal(404, s)
    assert.is_string(b.message)
  end))
end)

describe("Python SDK vectors", function()
  it("1: create with plan and timeoutSeconds, env sent verbatim", T.async(function()
    local s, sb = raw("POST", "/sandboxes", json.encode({ ownerId = B.workspace, plan = "starter", timeoutSeconds = 3600,
      env = { FOO = "bar", BAZ = "qux" } }))
    assert.are.equal(201, s)
    B:wait_status(sb.id, "running")
    local r = B:exec(sb.id, 'echo "$FOO $BAZ"')
    assert.are.equal(0, r.code)
    if B.runs_commands then assert.are.equal("bar qux\n", r.stdout) end
    assert.are.equal(204, (raw("POST", "/sandboxes/" .. sb.id .. "/terminate?ownerId=" .. B.workspace)))
  end))

  it("2-4: from_id of an unknown sandbox; repeated status params; terminate", T.async(function()
    assert.are.equal(404, (raw("GET", "/sandboxes/sbx-abc?ownerId=" .. B.workspace)))
    local s, page = raw("GET", "/sandboxes?ownerId=" .. B.workspace .. "&status=running&status=creating&limit=50")
    assert.are.equal(200, s)
    for _, item in ipairs(page) do
      assert.is_true(item.sandbox.status == "running" or item.sandbox.status == "creating")
    end
  end))

  it("5, 7: mint run token with a body; file tokens carry the path in the query", T.async(function()
    assert.are.equal(201, (raw("POST", "/sandboxes/" .. SB.id .. "/runs/stream/token?ownerId=" .. B.workspace,
      '{"command":"ls -la"}')))
    assert.are.equal(201, (raw("POST", "/sandboxes/" .. SB.id .. "/files/upload/token?ownerId=" .. B.workspace ..
      "&path=/app/data")))
    assert.are.equal(201, (raw("POST", "/sandboxes/" .. SB.id .. "/files/download/token?ownerId=" .. B.workspace ..
      "&path=/app/data")))
  end))

  it("8-9: a directory travels as gzip'd tar both ways, symlinks preserved", T.async(function()
    local dir = proc.run({ "mktemp", "-d" }).stdout:gsub("%s+$", "")
    proc.run { "sh", "-c", 'cd "$1" && mkdir src && cd src && echo A > a.txt && mkdir sub && ' ..
      'echo B > sub/b.txt && ln -s a.txt link.txt && tar -czf ../up.tgz a.txt sub sub/b.txt link.txt', "sh", dir }
    local data = assert(io.open(dir .. "/up.tgz", "rb")):read("a")
    local _, tok = raw("POST", "/sandboxes/" .. SB.id .. "/files/upload/token?path=workspace/data")
    local up = B.http.request { method = "PUT", url = tok.uri, body = data, headers = {
      Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/x-tar", ["Content-Encoding"] = "gzip" } }
    assert.are.equal(204, up.status)
    local r = B:exec(SB.id, "cd /root/workspace/data && cat a.txt sub/b.txt && readlink link.txt")
    if B.runs_commands then assert.are.equal("A\nB\na.txt\n", r.stdout) end
    local _, dt = raw("POST", "/sandboxes/" .. SB.id .. "/files/download/token?path=workspace/data")
    local down = B.http.request { url = dt.uri, output_file = dir .. "/down.tgz",
      headers = { Authorization = "Bearer " .. dt.token, ["Accept-Encoding"] = "gzip" } }
    assert.are.equal(200, down.status)
    assert.matches("^application/x%-tar", down.headers["content-type"])
    assert.are.equal("gzip", down.headers["content-encoding"])
    local list = proc.run { "tar", "-tzvf", dir .. "/down.tgz" }
    assert.are.equal(0, list.code)
    assert.matches("link.txt %-> a.txt", list.stdout)
    assert.matches("sub/b.txt", list.stdout)
    proc.run { "rm", "-rf", dir }
  end))

  it("9: download of a missing path is 404 with code file_not_found", T.async(function()
    local _, dt = raw("POST", "/sandboxes/" .. SB.id .. "/files/download/token?path=/nope")
    local down = B.http.request { url = dt.uri, headers = { Authorization = "Bearer " .. dt.token } }
    assert.are.equal(404, down.status)
    assert.are.equal("file_not_found", json.decode(down.body).code)
  end))

  it("10-11: snapshot create with kind, get, list with repeated status, delete", T.async(function()
    local s, snap = raw("POST", "/sandboxes/" .. SB.id .. "/snapshots?ownerId=" .. B.workspace, '{"kind":"filesystem"}')
    assert.are.equal(202, s)
    local gid = snap.sandboxGroupId
    wait_snapshot(gid, snap.id)
    assert.are.equal(200, (raw("GET", "/sandbox-groups/" .. gid .. "/snapshots/" .. snap.id .. "?ownerId=" .. B.workspace)))
    local s2 = raw("GET", "/sandbox-groups/" .. gid .. "/snapshots?ownerId=" .. B.workspace ..
      "&status=available&status=creating&limit=50")
    assert.are.equal(200, s2)
    assert.are.equal(204, (raw("DELETE", "/sandbox-groups/" .. gid .. "/snapshots/" .. snap.id .. "?ownerId=" .. B.workspace)))
  end))
end)

describe("CLI vectors", function()
  it("2: snapshotName \"\" is 400 invalid_snapshot_name; names that look like ids are names", T.async(function()
    local s, b = raw("POST", "/sandboxes", json.encode({ ownerId = B.workspace, snapshotName = "" }))
    assert.are.same({ 400, "invalid_snapshot_name" }, { s, b.code })
    local s2, b2 = raw("POST", "/sandboxes", json.encode({ ownerId = B.workspace, snapshotName = "snp-abc123w" }))
    assert.are.same({ 400, "invalid_snapshot_name" }, { s2, b2.code })
  end))

  it("4: timeouts 0, 1 and 86400 are accepted, negative refused", T.async(function()
    for _, t in ipairs({ 0, 1, 86400 }) do
      local s, sb = raw("POST", "/sandboxes", json.encode({ ownerId = B.workspace, timeoutSeconds = t }))
      assert.are.equal(201, s, tostring(t))
      raw("POST", "/sandboxes/" .. sb.id .. "/terminate")
    end
    assert.are.equal(400, (raw("POST", "/sandboxes", json.encode({ ownerId = B.workspace, timeoutSeconds = -5 }))))
  end))
end)
end)
end
