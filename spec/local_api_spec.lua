-- `moonbox local` over real HTTP: every endpoint of docs/wire.md ("Endpoints") with its status codes,
-- bodies and error codes ("Errors", "Restore"), against a real backend process running real sandboxes.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local http = require "moonbox.http"
local json = require "moonbox.json"
local proc = require "moonbox.proc"
local L = require "spec.support.local_backend"

local B -- the backend shared by most specs

local run = T.async

setup(run(function() B = L.start() end))
teardown(run(function() if B then B:destroy() end end))

local function q(extra)
  local t = { ownerId = B.workspace }
  for k, v in pairs(extra or {}) do t[k] = v end
  return t
end

describe("authentication", function()
  it("answers 401 with a JSON message without a key or with a wrong one", T.async(function()
    local s1, b1 = B:req("GET", "/v1/sandboxes", { auth = false })
    assert.are.equal(401, s1)
    assert.matches("Bearer", b1.message)
    local s2 = B:req("GET", "/v1/sandboxes", { auth = "rnd_wrong" })
    assert.are.equal(401, s2)
  end))

  it("stores a generated key 0600 in the state dir when none is given", T.async(function()
    local other = L.start { args = {} }
    local st = proc.run { "stat", "-c", "%a", other.state .. "/api-key" }
    assert.are.equal("600", st.stdout:match("%d+"))
    other:destroy()
  end))
end)

describe("POST /sandboxes", function()
  it("creates a sandbox in creating with Render's fields, then it runs", T.async(function()
    local status, sb, h = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace } })
    assert.are.equal(201, status)
    assert.matches("^sbx%-[0-9a-v]+$", sb.id)
    assert.are.equal(29, #sb.id)
    assert.are.equal("creating", sb.status)
    assert.are.equal("1c-2g", sb.plan)
    assert.are.same({ default = "allow-all" }, sb.networkPolicy)
    assert.are.equal("oregon", sb.region)
    assert.are.equal(86400, sb.timeoutSeconds)
    assert.matches("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%dZ$", sb.createdAt)
    assert.are.equal(json.null, sb.terminatedAt)
    assert.matches("^sbg%-", sb.sandboxGroupId)
    assert.matches("^req%-", h["render-request-id"])
    local running = B:wait_status(sb.id, "running")
    assert.are.equal(sb.id, running.id)
    assert.are.equal(204, (B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")))
  end))

  it("requires ownerId in the body and knows only its workspace", T.async(function()
    local s1, b1 = B:req("POST", "/v1/sandboxes", { body = {} })
    assert.are.equal(400, s1)
    assert.are.equal("invalid_owner_id", b1.code)
    local s2, b2 = B:req("POST", "/v1/sandboxes", { body = { ownerId = "tea-0000000000000000000a" } })
    assert.are.equal(404, s2)
    assert.are.equal("workspace not found", b2.message)
  end))

  it("refuses malformed JSON and fields of the wrong type with a clear 400", T.async(function()
    local s, b = B:req("POST", "/v1/sandboxes", { body = "{not json",
      headers = { ["Content-Type"] = "application/json" } })
    assert.are.equal(400, s)
    assert.matches("not valid JSON", b.message)
    for field, value in pairs({ plan = 5, timeoutSeconds = "long", env = { "a" }, region = "mars",
      networkPolicy = { default = "sometimes" }, idleTimeoutSeconds = 10 }) do
      local st, body = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, [field] = value } })
      assert.are.equal(400, st, field)
      assert.is_string(body.message, field)
    end
    local st, body = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, timeoutSeconds = -1 } })
    assert.are.equal(400, st)
    assert.matches("timeoutSeconds", body.message)
  end))

  it("accepts an allow-list network policy and keeps it as sent (spec/local_allowlist_spec.lua " ..
    "enforces it)", T.async(function()
    local policy = { default = "allow-list", allowedDomains = { "api.example.com", "*.example.org" } }
    local s, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, networkPolicy = policy } })
    assert.are.equal(201, s)
    assert.are.same(policy, sb.networkPolicy)
    local _, got = B:req("GET", "/v1/sandboxes/" .. sb.id)
    assert.are.same(policy, got.networkPolicy)
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))

  it("ignores unknown fields (wire compatibility)", T.async(function()
    local s, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace,
      futureField = { x = 1 } } })
    assert.are.equal(201, s)
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))
end)

describe("GET /sandboxes", function()
  it("pages newest first with opaque cursors and hides terminated by default", T.async(function()
    local made = {}
    for i = 1, 5 do
      local _, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, name = "page-" .. i } })
      made[i] = sb.id
    end
    B:req("POST", "/v1/sandboxes/" .. made[5] .. "/terminate")
    local seen, cursor = {}, nil
    repeat
      local s, page = B:req("GET", "/v1/sandboxes", { query = q({ limit = 2, cursor = cursor }) })
      assert.are.equal(200, s)
      assert.is_true(#page <= 2)
      for _, item in ipairs(page) do
        assert.is_string(item.cursor)
        seen[#seen + 1] = item.sandbox.id
        cursor = item.cursor
      end
    until #page < 2
    local pos = {}
    for i, id in ipairs(seen) do pos[id] = i end
    assert.is_nil(pos[made[5]], "a terminated sandbox was listed")
    assert.is_true(pos[made[4]] < pos[made[3]] and pos[made[3]] < pos[made[1]], "not newest first")
    local _, term = B:req("GET", "/v1/sandboxes", { query = q({ status = { "terminated" } }) })
    local found = false
    for _, item in ipairs(term) do if item.sandbox.id == made[5] then found = true end end
    assert.is_true(found)
    for i = 1, 4 do B:req("POST", "/v1/sandboxes/" .. made[i] .. "/terminate") end
  end))

  it("refuses bad limits, cursors and statuses with their codes", T.async(function()
    local s1, b1 = B:req("GET", "/v1/sandboxes", { query = q({ limit = 500 }) })
    assert.are.same({ 400, "invalid_limit" }, { s1, b1.code })
    local s2, b2 = B:req("GET", "/v1/sandboxes", { query = q({ cursor = "garbage!" }) })
    assert.are.same({ 400, "invalid_cursor" }, { s2, b2.code })
    local s3, b3 = B:req("GET", "/v1/sandboxes", { query = q({ status = "sleeping" }) })
    assert.are.same({ 400, "invalid_status" }, { s3, b3.code })
    local s4, _, _, raw = B:req("GET", "/v1/sandboxes", { query = q({ status = "errored" }) })
    assert.are.equal(200, s4)
    assert.are.equal("[]", raw) -- an empty page is an empty JSON array, not an object
  end))

  it("refuses forged cursors: another list's, a sequence past any record's, a malformed one", T.async(function()
    -- The cursor's sequence becomes a bound SQL parameter of the keyset page: what no page
    -- ever handed out must be refused, never turned into a 5xx or a float comparison.
    local function b64url(raw)
      local A = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
      local out = {}
      for i = 1, #raw, 3 do
        local a, b, c = raw:byte(i, i + 2)
        local n = (a << 16) | ((b or 0) << 8) | (c or 0)
        for j = 1, 2 + (b and 1 or 0) + (c and 1 or 0) do
          local v = (n >> (6 * (4 - j))) & 63
          out[#out + 1] = A:sub(v + 1, v + 1)
        end
      end
      return table.concat(out)
    end
    local _, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, name = "cursor" } })
    local first = select(2, B:req("GET", "/v1/sandboxes", { query = q({ limit = 1 }) }))[1]
    assert.is_table(first, "the sandbox just made is listed")
    local accepted = select(1, B:req("GET", "/v1/sandboxes", { query = q({ cursor = first.cursor }) }))
    assert.are.equal(200, accepted, "a cursor the backend handed out is taken")
    for _, raw in ipairs { "snp:1", "sbx:99999999999999999999999999", "sbx:9007199254740993",
      "sbx:", "sbx:1:2", "sbx:0x10", "sbx:" .. ("9"):rep(400) } do
      local st, body = B:req("GET", "/v1/sandboxes", { query = q({ cursor = b64url(raw) }) })
      assert.are.same({ 400, "invalid_cursor" }, { st, body.code }, raw:sub(1, 40))
    end
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))
end)

describe("get and terminate", function()
  it("404s unknown ids and terminates idempotently", T.async(function()
    assert.are.equal(404, (B:req("GET", "/v1/sandboxes/sbx-0000000000000000000000000")))
    assert.are.equal(404, (B:req("POST", "/v1/sandboxes/sbx-0000000000000000000000000/terminate")))
    local sb = B:create()
    assert.are.equal(204, (B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate", { query = q() })))
    assert.are.equal(204, (B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")))
    local s, got = B:req("GET", "/v1/sandboxes/" .. sb.id)
    assert.are.equal(200, s)
    assert.are.equal("terminated", got.status)
    assert.is_string(got.terminatedAt)
  end))

  it("answers 404 for another workspace's ownerId", T.async(function()
    local s, b = B:req("GET", "/v1/sandboxes", { query = { ownerId = "tea-0000000000000000000a" } })
    assert.are.equal(404, s)
    assert.are.equal("workspace not found", b.message)
  end))
end)

describe("exec", function()
  local sb
  setup(run(function() sb = B:create { env = { GREETING = "hello from create" } } end))
  teardown(run(function() B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate") end))

  it("streams output and the exit code over SSE, in the home directory as root", T.async(function()
    local r = B:exec(sb.id, 'echo "$GREETING"; pwd; id -u; echo oops >&2; exit 7')
    assert.are.equal(7, r.code)
    assert.are.equal("hello from create\n/root\n0\n", r.stdout)
    assert.are.equal("oops\n", r.stderr)
    assert.are.equal("exit", r.events[#r.events].event)
  end))

  it("keeps a process started by one exec for the next", T.async(function()
    B:exec(sb.id, "setsid sleep 300 > /dev/null 2>&1 < /dev/null &")
    local r = B:exec(sb.id, "pgrep -x sleep")
    assert.are.equal(0, r.code)
  end))

  it("answers the sync operation with stdout, stderr and exit_code", T.async(function()
    local s, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/sync/token",
      { body = { command = "printf hi; exit 3" } })
    assert.are.equal(201, s)
    assert.matches("/runs/sync$", tok.uri)
    local r = http.request { method = "POST", url = tok.uri, body = json.encode(
      { command = "printf hi; exit 3" }),
      headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/json" } }
    assert.are.equal(200, r.status)
    assert.are.same({ stdout = "hi", stderr = "", exit_code = 3 }, json.decode(r.body))
  end))

  it("records executions newest first, truncating commands to 4096 bytes", T.async(function()
    local long = "true # " .. string.rep("x", 5000)
    local r = B:exec(sb.id, long)
    local s, page = B:req("GET", "/v1/sandboxes/" .. sb.id .. "/execs", { query = { limit = 1 } })
    assert.are.equal(200, s)
    local e = page[1].execution
    assert.are.equal(r.exec_id, e.id)
    assert.are.equal("runs", e.type)
    assert.are.equal("stream", e.operation)
    assert.are.equal(4096, #e.command)
    assert.is_nil(e.exitCode) -- the platform does not learn exit codes by itself
    local s2, st = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/execs/" .. e.id .. "/status",
      { body = { exitCode = 0 } })
    assert.are.equal(200, s2)
    assert.are.equal(e.id, st.execId)
    assert.are.equal(0, st.exitCode)
    local _, one = B:req("GET", "/v1/sandboxes/" .. sb.id .. "/execs/" .. e.id)
    assert.are.equal(0, one.exitCode)
  end))

  it("refuses wrong tokens and tokens for another sandbox", T.async(function()
    local other = B:create()
    local _, tok = B:req("POST", "/v1/sandboxes/" .. other.id .. "/runs/stream/token",
      { body = { command = "true" } })
    local i, j = tok.uri:find(other.id, 1, true)
    local elsewhere = tok.uri:sub(1, i - 1) .. sb.id .. tok.uri:sub(j + 1)
    local bad = http.request { method = "POST", url = elsewhere, body = "{}",
      headers = { Authorization = "Bearer " .. tok.token } }
    assert.are.equal(403, bad.status)
    local none = http.request { method = "POST", url = tok.uri, body = "{}",
      headers = { Authorization = "Bearer nope" } }
    assert.are.equal(401, none.status)
    B:req("POST", "/v1/sandboxes/" .. other.id .. "/terminate")
  end))

  it("delivers large output completely", T.async(function()
    local r = B:exec(sb.id, "head -c 3000000 /dev/zero | tr '\\0' 'a'")
    assert.are.equal(0, r.code)
    assert.are.equal(3000000, #r.stdout)
  end))
end)

describe("files", function()
  local sb
  setup(run(function() sb = B:create() end))
  teardown(run(function() B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate") end))

  local function token(op, path)
    return B:req("POST", "/v1/sandboxes/" .. sb.id .. "/files/" .. op .. "/token",
      { query = { path = path } })
  end

  it("uploads a file (0600) and downloads it with Content-Disposition", T.async(function()
    local data = "binary\0data\255" .. string.rep("z", 70000)
    local s, tok = token("upload", "app/hello.bin")
    assert.are.equal(201, s)
    assert.are.equal("PUT", tok.method)
    local up = http.request { method = "PUT", url = tok.uri, body = data,
      headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/octet-stream" } }
    assert.are.equal(204, up.status)
    local r = B:exec(sb.id, "stat -c %a /root/app/hello.bin")
    assert.are.equal("600\n", r.stdout)
    local _, dt = token("download", "/root/app/hello.bin")
    assert.are.equal("GET", dt.method)
    local down = http.request { url = dt.uri, headers = { Authorization = "Bearer " .. dt.token } }
    assert.are.equal(200, down.status)
    assert.are.equal("application/octet-stream", down.headers["content-type"])
    assert.are.equal('attachment; filename="hello.bin"', down.headers["content-disposition"])
    assert.is_true(down.body == data)
  end))

  it("answers 404 file_not_found for a missing path", T.async(function()
    local _, dt = token("download", "/nope/missing.txt")
    local down = http.request { url = dt.uri, headers = { Authorization = "Bearer " .. dt.token } }
    assert.are.equal(404, down.status)
    local b = json.decode(down.body)
    assert.are.same({ "file_not_found", "no file or directory at path" }, { b.code, b.message })
  end))

  it("refuses paths that are not clean, before minting", T.async(function()
    for _, p in ipairs({ "/app/data/", "workspace//x", "/app/./x", "a/../b", "" }) do
      local s, b = token("upload", p)
      assert.are.equal(400, s, p)
      assert.is_string(b.message)
    end
  end))

  it("lists a directory", T.async(function()
    B:exec(sb.id, "mkdir -p /root/ls/sub && printf 12345 > /root/ls/f && ln -s sub /root/ls/link")
    local s, body = B:req("GET", "/v1/sandboxes/" .. sb.id .. "/files/list", { query = { path = "/root/ls",
      depth = 1 } })
    assert.are.equal(200, s)
    assert.are.equal("/root/ls", body.path)
    local by = {}
    for _, e in ipairs(body.entries) do by[e.name] = e end
    assert.are.equal("file", by.f.type)
    assert.are.equal(5, by.f.size)
    assert.are.equal("directory", by.sub.type)
    assert.are.equal("symlink", by.link.type)
    assert.are.equal("sub", by.link.target)
    assert.matches("Z$", by.f.modifiedAt)
  end))
end)

describe("snapshots and restore", function()
  local sb
  setup(run(function()
    sb = B:create()
    B:exec(sb.id, "echo layer-one > /root/marker; echo in-dev > /dev/devfile")
  end))
  teardown(run(function() B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate") end))

  local function wait_snapshot(snap)
    for _ = 1, 600 do
      local _, s = B:req("GET", "/v1/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id)
      if s.status ~= "creating" then return s end
      task.sleep(0.05)
    end
    error("snapshot did not finish")
  end

  it("captures a filesystem snapshot (202 creating → available) and restores it", T.async(function()
    local s, snap = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots",
      { query = q(), body = { kind = "filesystem", name = "golden" } })
    assert.are.equal(202, s)
    assert.are.equal("creating", snap.status)
    assert.matches("^snp%-[0-9a-v]+$", snap.id)
    assert.are.equal(json.null, snap.capturedAt)
    local done = wait_snapshot(snap)
    assert.are.equal("available", done.status)
    assert.is_string(done.capturedAt)
    assert.is_number(done.sizeBytes)
    local restored = B:create { snapshotId = snap.id }
    local r = B:exec(restored.id, "cat /root/marker; cat /dev/devfile 2>/dev/null || echo no-dev")
    assert.are.equal("layer-one\nno-dev\n", r.stdout)
    local byname = B:create { snapshotName = "golden" }
    assert.are.equal("layer-one\n", B:exec(byname.id, "cat /root/marker").stdout)
    B:req("POST", "/v1/sandboxes/" .. restored.id .. "/terminate")
    B:req("POST", "/v1/sandboxes/" .. byname.id .. "/terminate")
  end))

  it("checks restores in Render's order", T.async(function()
    local _, snap = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots", { body = { kind = "runtime" } })
    snap = wait_snapshot(snap)
    local function create(body)
      body.ownerId = B.workspace
      return B:req("POST", "/v1/sandboxes", { body = body })
    end
    local s1, b1 = create { snapshotId = snap.id, snapshotName = "golden" }
    assert.are.same({ 400 }, { s1 })
    assert.matches("mutually exclusive", b1.message)
    local s2, b2 = create { snapshotName = "snp-looks-like-an-id" }
    assert.are.same({ 400, "invalid_snapshot_name" }, { s2, b2.code })
    local s3, b3 = create { snapshotId = "snp-0000000000000000000v" }
    assert.are.same({ 404, "snapshot_not_found" }, { s3, b3.code })
    local s4, b4 = create { snapshotName = "no-such-name" }
    assert.are.same({ 404, "snapshot_not_found" }, { s4, b4.code })
    local s5, b5 = create { snapshotId = snap.id, plan = "8c-16g" }
    assert.are.same({ 409, "snapshot_plan_mismatch" }, { s5, b5.code })
  end))

  it("validates names, lists newest first, deletes idempotently", T.async(function()
    local s1, b1 = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots", { body = { name = "snp-bad" } })
    assert.are.same({ 400, "invalid_snapshot_name" }, { s1, b1.code })
    local s2, b2 = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots", { body = { name = string.rep(
      "n", 65) } })
    assert.are.same({ 400, "invalid_snapshot_name" }, { s2, b2.code })
    local _, a = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots", { body = { name = "listed" } })
    a = wait_snapshot(a)
    local _, b = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots", { body = { name = "listed" } })
    b = wait_snapshot(b)
    local gid = a.sandboxGroupId
    local s, page = B:req("GET", "/v1/sandbox-groups/" .. gid .. "/snapshots", { query = q(
      { status = "available" }) })
    assert.are.equal(200, s)
    assert.are.equal(b.id, page[1].snapshot.id)
    assert.are.equal(a.id, page[2].snapshot.id)
    local s3, b3 = B:req("GET", "/v1/sandbox-groups/" .. gid .. "/snapshots")
    assert.are.same({ 400, "invalid_owner_id" }, { s3, b3.code })
    local s4, b4 = B:req("GET", "/v1/sandbox-groups/" .. gid .. "/snapshots",
      { query = { ownerId = { B.workspace, B.workspace } } })
    assert.are.same({ 400, "invalid_owner_id" }, { s4, b4.code })
    assert.are.equal(204, (B:req("DELETE", "/v1/sandbox-groups/" .. gid .. "/snapshots/" .. a.id)))
    assert.are.equal(204, (B:req("DELETE", "/v1/sandbox-groups/" .. gid .. "/snapshots/" .. a.id)))
    assert.are.equal(404, (B:req("GET", "/v1/sandbox-groups/" .. gid .. "/snapshots/" .. a.id)))
    local s5, b5 = B:req("GET", "/v1/sandbox-groups/sbg-bad/snapshots/" .. a.id)
    assert.are.same({ 400, "invalid_sandbox_group_id" }, { s5, b5.code })
    local s6, b6 = B:req("GET", "/v1/sandbox-groups/" .. gid .. "/snapshots/snp-bad")
    assert.are.same({ 400, "invalid_snapshot_id" }, { s6, b6.code })
  end))

  it("answers snapshot_not_available for a snapshot of another group or still capturing, " ..
    "and snapshot_creating when deleting one that is capturing", T.async(function()
    local big = B:create()
    assert.are.equal(0, B:exec(big.id, "head -c 300000000 /dev/zero > /root/big").code)
    local _, snap = B:req("POST", "/v1/sandboxes/" .. big.id .. "/snapshots",
      { body = { kind = "filesystem" } })
    local s1, b1 = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, snapshotId = snap.id } })
    local s2, b2 = B:req("DELETE", "/v1/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id)
    local _, now = B:req("GET", "/v1/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id)
    if now.status == "creating" or b1.code then -- only meaningful while the capture still runs
      assert.are.same({ 409, "snapshot_not_available" }, { s1, b1.code })
      assert.are.same({ 409, "snapshot_creating" }, { s2, b2.code })
    end
    wait_snapshot(snap)
    local _, g2 = B:req("POST", "/v1/sandbox-groups", { body = { ownerId = B.workspace,
      name = "elsewhere" } })
    local s3, b3 = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, snapshotId = snap.id,
      sandboxGroupId = g2.id } })
    assert.are.same({ 409, "snapshot_not_available" }, { s3, b3.code })
    B:req("POST", "/v1/sandboxes/" .. big.id .. "/terminate")
  end))

  it("refuses to snapshot a sandbox that is not running", T.async(function()
    local other = B:create()
    B:req("POST", "/v1/sandboxes/" .. other.id .. "/terminate")
    local s, b = B:req("POST", "/v1/sandboxes/" .. other.id .. "/snapshots", { body = {} })
    assert.are.same({ 409, "sandbox_not_running" }, { s, b.code })
  end))
end)

describe("sandbox groups", function()
  it("lists the default group and needs exactly one ownerId", T.async(function()
    local s, page = B:req("GET", "/v1/sandbox-groups", { query = q() })
    assert.are.equal(200, s)
    local g = page[#page].sandboxGroup
    assert.are.equal("Default", g.name)
    assert.is_true(g.isDefault)
    assert.are.equal(1000, g.concurrencyLimit)
    assert.are.equal(B.workspace, g.ownerId)
    local s2, b2 = B:req("GET", "/v1/sandbox-groups")
    assert.are.same({ 400, "invalid_owner_id" }, { s2, b2.code })
  end))

  it("answers 429 with Retry-After at the group's concurrency limit", T.async(function()
    local _, g = B:req("POST", "/v1/sandbox-groups", { body = { ownerId = B.workspace, name = "tiny",
      concurrencyLimit = 1 } })
    local s1, a = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, sandboxGroupId = g.id } })
    assert.are.equal(201, s1)
    local s2, b2, h2 = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace,
      sandboxGroupId = g.id } })
    assert.are.equal(429, s2)
    assert.is_string(b2.message)
    assert.are.equal("1", h2["retry-after"])
    B:req("POST", "/v1/sandboxes/" .. a.id .. "/terminate")
    local s3, c = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, sandboxGroupId = g.id } })
    assert.are.equal(201, s3)
    B:req("POST", "/v1/sandboxes/" .. c.id .. "/terminate")
  end))
end)

describe("fault injection and the journal", function()
  it("injects statuses with Retry-After, counted", T.async(function()
    local s = B:req("PUT", "/_moonbox/faults", { body = { rules = {
      { match = "GET /v1/sandbox-groups", fault = "status", status = 429, retry_after = 2, count = 1 },
    } } })
    assert.are.equal(200, s)
    local s1, b1, h1 = B:req("GET", "/v1/sandbox-groups", { query = q() })
    assert.are.equal(429, s1)
    assert.are.equal("rate limit exceeded", b1.message)
    assert.are.equal("2", h1["retry-after"])
    assert.are.equal(200, (B:req("GET", "/v1/sandbox-groups", { query = q() })))
    B:req("DELETE", "/_moonbox/faults")
  end))

  it("drops a create's response after creating the sandbox", T.async(function()
    B:req("PUT", "/_moonbox/faults", { body = "POST /v1/sandboxes=drop#1" })
    local ok, err = pcall(B.req, B, "POST", "/v1/sandboxes",
      { body = { ownerId = B.workspace, name = "lost" }, fresh_connect = true })
    assert.is_false(ok)
    assert.are.equal("connection_reset", err.code)
    local _, page = B:req("GET", "/v1/sandboxes", { query = { name = "lost" } })
    assert.are.equal(1, #page)
    B:req("POST", "/v1/sandboxes/" .. page[1].sandbox.id .. "/terminate")
    B:req("DELETE", "/_moonbox/faults")
  end))

  it("cuts an exec stream before its terminal event", T.async(function()
    local sb = B:create()
    B:req("PUT", "/_moonbox/faults", { body = "POST /proxy/*/runs/stream=cut#1" })
    local r = B:exec(sb.id, "echo before-cut")
    assert.is_nil(r.code)
    assert.are.equal("before-cut\n", r.stdout)
    assert.are.equal(0, B:exec(sb.id, "true").code)
    B:req("DELETE", "/_moonbox/faults")
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))

  it("journals requests with env values and keys redacted", T.async(function()
    local _, before = B:req("GET", "/_moonbox/journal")
    local since = before[#before].seq
    local _, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace,
      env = { SECRET = "hunter2" } } })
    local _, entries = B:req("GET", "/_moonbox/journal", { query = { since = since } })
    local create
    for _, e in ipairs(entries) do
      if e.method == "POST" and e.path == "/v1/sandboxes" then create = e end
    end
    assert.is_table(create)
    assert.are.equal("<redacted>", create.body.env.SECRET)
    assert.are.equal("Bearer <redacted>", create.headers.authorization)
    assert.is_nil(json.encode(entries):find("hunter2", 1, true))
    assert.is_nil(json.encode(entries):find(B.key, 1, true))
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))
end)

describe("lifecycle", function()
  it("suspends on request, is not woken by GET, and is woken by an exec", T.async(function()
    local sb = B:create()
    assert.are.equal(0, B:exec(sb.id, "echo kept > /tmp/state-in-tmp").code)
    local s = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/suspend")
    assert.are.equal(202, s)
    B:wait_status(sb.id, "suspended")
    task.sleep(0.2)
    local _, got = B:req("GET", "/v1/sandboxes/" .. sb.id)
    assert.are.equal("suspended", got.status)
    local r = B:exec(sb.id, "cat /tmp/state-in-tmp")
    assert.are.equal("kept\n", r.stdout)
    local _, after = B:req("GET", "/v1/sandboxes/" .. sb.id)
    assert.are.equal("running", after.status)
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))

  it("terminates a sandbox when its timeoutSeconds is reached", T.async(function()
    local sb = B:create { timeoutSeconds = 1 }
    local got = B:wait_status(sb.id, "terminated")
    assert.is_string(got.terminatedAt)
  end))

  it("adds injected latency, never to the control endpoint", T.async(function()
    B:req("PUT", "/_moonbox/faults", { body = "GET /v1/sandbox-groups=latency:300#1;*=latency:5000" })
    local t0 = task.now()
    assert.are.equal(200, (B:req("GET", "/v1/sandbox-groups", { query = q() })))
    assert.is_true(task.now() - t0 >= 0.25, "the injected latency was not applied")
    -- a `*` rule that would stall every request does not stall the endpoint that removes it
    assert.are.equal(200, (B:req("GET", "/_moonbox/health", { timeout = 2 })))
    assert.are.equal(204, (B:req("DELETE", "/_moonbox/faults", { timeout = 2 })))
  end))
end)

describe("logs", function()
  it("replays lifecycle events and exec output as SSE, filtered by execId", T.async(function()
    local sb = B:create()
    local r = B:exec(sb.id, "echo logged-line")
    B:exec(sb.id, "echo other-line")
    local resp <close> = http.stream { url = B.url .. "/v1/sandboxes/" .. sb.id
      .. "/logs?follow=false&execId=" .. r.exec_id,
      headers = { Authorization = "Bearer " .. B.key, Accept = "text/event-stream" } }
    assert.are.equal(200, resp.status)
    assert.matches("^text/event%-stream", resp.headers["content-type"])
    local types, lines = {}, {}
    while true do
      local ev = resp:read_event()
      if not ev then break end
      local d = json.decode(ev.data)
      assert.is_string(d.at)
      if ev.event == "lifecycle" then types[#types + 1] = d.type end
      if ev.event == "log" then lines[#lines + 1] = d.data end
    end
    assert.are.same({ "creating", "running" }, types)
    assert.are.same({ "logged-line\n" }, lines)
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))
end)

describe("bad input", function()
  it("answers 413 for a control-plane body over 1 MiB", T.async(function()
    local s = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, name = string.rep("x",
      2 * 1024 * 1024) } })
    assert.are.equal(413, s)
  end))

  it("answers 400 invalid_owner_id for an ownerId that is not a string, on every create", T.async(function()
    for _, owner in ipairs({ 42, true, { B.workspace }, { id = B.workspace }, json.null }) do
      for _, path in ipairs({ "/v1/sandboxes", "/v1/sandbox-groups" }) do
        local s, body = B:req("POST", path, { body = { ownerId = owner, name = "owner-check" } })
        assert.are.same({ 400, "invalid_owner_id" }, { s, body and body.code },
          path .. " with ownerId " .. json.encode(owner))
      end
    end
  end))

  it("refuses an expired connect token", T.async(function()
    local b2 = L.start { env = { MOONBOX_LOCAL_TOKEN_TTL = "0.3" } }
    local sb = b2:create()
    local _, tok = b2:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/stream/token",
      { body = { command = "true" } })
    task.sleep(0.6)
    local r = http.request { method = "POST", url = tok.uri, body = '{"command":"true"}',
      headers = { Authorization = "Bearer " .. tok.token } }
    assert.are.equal(401, r.status)
    assert.matches("expired", json.decode(r.body).message)
    b2:destroy()
  end))

  it("refuses hostile archives with 400 unsafe_archive and writes nothing", T.async(function()
    local sb = B:create()
    local dir = proc.run({ "mktemp", "-d" }).stdout:gsub("%s+$", "")
    local script = [[
      set -e; cd "$1"; mkdir -p src && echo pwned > src/evil
      tar -czf dotdot.tgz --transform 's,^src/evil,../../../../root/escaped,' src/evil
      tar -czPf absolute.tgz --transform 's,^.*src/evil,/root/escaped,' "$1/src/evil"
      mkdir -p l && ln -s /root l/link && tar -czf symlink.tgz -C l link
      mkdir -p s && ln -s ../../../root s/up && tar -czf uplink.tgz -C s up
    ]]
    local made = proc.run { "sh", "-c", script, "sh", dir }
    assert.are.equal(0, made.code, made.stderr)
    for _, name in ipairs({ "dotdot", "absolute", "symlink", "uplink" }) do
      local data = assert(io.open(dir .. "/" .. name .. ".tgz", "rb")):read("a")
      local _, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/files/upload/token",
        { query = { path = "target/" .. name } })
      local up = http.request { method = "PUT", url = tok.uri, body = data, headers = {
        Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/x-tar",
          ["Content-Encoding"] = "gzip" } }
      assert.are.equal(400, up.status, name)
      assert.are.equal("unsafe_archive", json.decode(up.body).code, name)
    end
    local r = B:exec(sb.id, "ls /root/target /root/escaped 2>&1; true")
    assert.matches("No such file", r.stdout)
    assert.not_matches("pwned", B:exec(sb.id, "cat /root/escaped 2>/dev/null; true").stdout)
    proc.run { "rm", "-rf", dir }
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  end))
end)

-- Defects found by driving this backend with Render's own TypeScript and Python SDKs; each is
-- pinned where it was wrong.
describe("wire defects found with Render's SDKs", function()
  local sb
  setup(run(function() sb = B:create() end))
  teardown(run(function() B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate") end))

  local function logs_of(exec_id)
    local resp <close> = http.stream { url = B.url .. "/v1/sandboxes/" .. sb.id
      .. "/logs?follow=false&execId=" ..
      exec_id, headers = { Authorization = "Bearer " .. B.key, Accept = "text/event-stream" } }
    local out = {}
    while true do
      local ev = resp:read_event()
      if not ev then break end
      if ev.event == "log" then out[#out + 1] = json.decode(ev.data) end
    end
    return out
  end

  it("logs a runs/sync exec's stdout and stderr, each with its execId", T.async(function()
    local _, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/runs/sync/token",
      { body = { command = "echo to-out; echo to-err >&2" } })
    local r = http.request { method = "POST", url = tok.uri, body = json.encode(
      { command = "echo to-out; echo to-err >&2" }),
      headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/json" } }
    assert.are.equal(200, r.status)
    local seen = {}
    for _, ev in ipairs(logs_of(tok.executionId)) do
      assert.are.equal(tok.executionId, ev.execId)
      seen[ev.stream] = (seen[ev.stream] or "") .. ev.data
    end
    assert.are.same({ stdout = "to-out\n", stderr = "to-err\n" }, seen)
  end))

  it("takes a plain-file upload sent with Content-Encoding: gzip, and stores it inflated", T.async(function()
    local plain = ("a line of text\n"):rep(1000)
    local gz = proc.run { "gzip", "-c", input = plain }
    assert.are.equal(0, gz.code)
    local _, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/files/upload/token",
      { query = { path = "gz/plain.txt" } })
    local up = http.request { method = "PUT", url = tok.uri, body = gz.stdout, headers = {
      Authorization = "Bearer " .. tok.token, ["Content-Type"] = "text/plain",
        ["Content-Encoding"] = "gzip" } }
    assert.are.equal(204, up.status, up.body)
    assert.are.equal(#plain .. "\n", B:exec(sb.id, "wc -c < /root/gz/plain.txt").stdout)
  end))

  it("downloads /proc/self/status (the reading process's own) as it does /proc/1/cmdline", T.async(function()
    for _, path in ipairs({ "/proc/self/status", "/proc/thread-self/status", "/proc/1/cmdline" }) do
      local _, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/files/download/token",
        { query = { path = path } })
      local d = http.request { url = tok.uri, headers = { Authorization = "Bearer " .. tok.token } }
      assert.are.equal(200, d.status, path .. ": " .. d.body)
      assert.is_true(#d.body > 0, path)
      if path:find("status$") then
        -- the reader's own view: one pid (inside the sandbox's pid namespace, not the host's)
        -- and root of the sandbox's user namespace
        assert.matches("\nNSpid:\t%d+\n", d.body, path)
        assert.matches("\nUid:\t0\t", d.body, path)
      end
    end
  end))

  it("counts /v1 requests honestly in ratelimit-*, logs stream included, and enforces --rate-limit", T.async(function()
    -- A backend of its own: its first request opens the window, so the counts are exact.
    local small = L.start { args = { "--rate-limit", "5" } }
    local ok, err = pcall(function()
      local _, sbx = small:req("POST", "/v1/sandboxes", { body = { ownerId = small.workspace } })
      local _, _, h1 = small:req("GET", "/v1/sandboxes/" .. sbx.id)
      assert.are.same({ "5", "3" }, { h1["ratelimit-limit"], h1["ratelimit-remaining"] })
      local reset = tonumber(h1["ratelimit-reset"])
      assert.is_true(reset >= 1 and reset <= 60, "reset " .. tostring(reset))
      local resp <close> = http.stream { url = small.url .. "/v1/sandboxes/" .. sbx.id .. "/logs?follow=false",
        headers = { Authorization = "Bearer " .. small.key, Accept = "text/event-stream" } }
      assert.are.equal(200, resp.status)
      assert.are.same({ "5", "2" }, { resp.headers["ratelimit-limit"], resp.headers["ratelimit-remaining"] })
      local seen = {}
      for i = 1, 3 do
        local status, body, h = small:req("GET", "/v1/sandboxes", { query = { ownerId = small.workspace } })
        seen[i] = { status = status, left = h["ratelimit-remaining"], retry = h["retry-after"], body = body }
      end
      assert.are.same({ 200, "0" }, { seen[2].status, seen[2].left })
      assert.are.equal(429, seen[3].status)
      assert.are.equal("0", seen[3].left)
      assert.matches("^%d+$", seen[3].retry)
      assert.matches("rate limit exceeded", seen[3].body.message)
    end)
    small:destroy()
    if not ok then error(err, 0) end
  end))

  it("sends ratelimit-* headers on every response, not only on a 429", T.async(function()
    local probes = {
      { "GET", "/v1/sandboxes" }, { "GET", "/v1/sandboxes/" .. sb.id }, { "GET", "/v1/sandboxes/sbx-nope" },
      { "POST", "/v1/sandboxes", { body = { ownerId = B.workspace, plan = "nope" } } },
      { "GET", "/v1/no-such-route" }, { "DELETE", "/v1/sandboxes/" .. sb.id .. "/terminate" },
    }
    for _, p in ipairs(probes) do
      local status, _, h = B:req(p[1], p[2], p[3])
      for _, name in ipairs({ "ratelimit-limit", "ratelimit-remaining", "ratelimit-reset" }) do
        assert.matches("^%d+$", h[name], p[1] .. " " .. p[2] .. " (" .. status .. ") has no " .. name)
      end
    end
    -- a /v1 path no route has, and a route's path with another method, answer as before
    local s404, b404 = B:req("GET", "/v1/no-such-route")
    assert.are.same({ 404, "no route for GET /v1/no-such-route" }, { s404, b404.message })
    local s405, b405, h405 = B:req("DELETE", "/v1/sandboxes/" .. sb.id .. "/terminate")
    assert.are.same({ 405, "POST" }, { s405, h405["allow"] })
    assert.matches("method DELETE is not allowed", b405.message)
  end))

  it("names the old plan names too when a plan is unknown (the SDKs still offer them)", T.async(function()
    local s, body = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, plan = "huge" } })
    assert.are.equal(400, s)
    for _, name in ipairs({ "1c%-2g", "8c%-16g", "starter = 1c%-2g", "standard = 2c%-4g", "pro = 4c%-8g" }) do
      assert.matches(name, body.message)
    end
    local s2, made = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, plan = "standard" } })
    assert.are.equal(201, s2)
    assert.are.equal("standard", made.plan) -- as sent: an older SDK's enum has no "2c-4g"
    B:req("POST", "/v1/sandboxes/" .. made.id .. "/terminate")
  end))
end)

describe("group deletion", function()
  it("deletes an empty group and refuses one with live sandboxes", T.async(function()
    local _, g = B:req("POST", "/v1/sandbox-groups", { body = { ownerId = B.workspace, name = "temp" } })
    local _, sb = B:req("POST", "/v1/sandboxes", { body = { ownerId = B.workspace, sandboxGroupId = g.id } })
    assert.are.equal(409, (B:req("DELETE", "/v1/sandbox-groups/" .. g.id)))
    B:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
    assert.are.equal(204, (B:req("DELETE", "/v1/sandbox-groups/" .. g.id)))
    assert.are.equal(404, (B:req("DELETE", "/v1/sandbox-groups/" .. g.id)))
  end))
end)

describe("restart", function()
  it("keeps every record; sandboxes whose processes died are reported errored", T.async(function()
    local b2 = L.start()
    local sb = b2:create()
    b2:exec(sb.id, "echo kept > /root/k")
    local _, snap = b2:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots",
      { body = { name = "survivor" } })
    for _ = 1, 200 do
      local _, s = b2:req("GET", "/v1/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id)
      if s.status ~= "creating" then break end
      task.sleep(0.05)
    end
    b2:stop()
    local b3 = L.start { state = b2.state }
    local s, got = b3:req("GET", "/v1/sandboxes/" .. sb.id)
    assert.are.equal(200, s)
    assert.are.equal("errored", got.status)
    local s2, gs = b3:req("GET", "/v1/sandbox-groups/" .. snap.sandboxGroupId .. "/snapshots/" .. snap.id)
    assert.are.equal(200, s2)
    assert.are.equal("available", gs.status)
    local again = b3:create { snapshotId = snap.id }
    assert.are.equal("kept\n", b3:exec(again.id, "cat /root/k").stdout)
    b3:destroy()
  end))
end)
