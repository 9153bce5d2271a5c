-- moonbox.render snapshots and groups against a real `moonbox local`: capture, wait, restore
-- (by object and by name), list order, delete, and each of Render's snapshot error codes.
local T = require "moonbox.testing"
local render = require "moonbox.render"
require "moonbox.render.snapshots"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"

local B

L.fixture(setup, teardown, function(b) B = b end)

local raised = T.raises

local function last_body(path)
  local _, entries = B:req("GET", "/_moonbox/journal")
  for i = #entries, 1, -1 do
    if entries[i].method == "POST" and entries[i].path == path then return entries[i].body_json end
  end
end

describe("render.groups", function()
  it("has no default group before the first sandbox, then one; create adds a non-default group", T.async(
    function()
    assert.is_nil(render.groups.list()())
    assert.is_nil(render.groups.default())
    do
      local _sb <close> = render.sandboxes.create {}
    end
    local d = render.groups.default()
    assert.matches("^sbg%-", d.id)
    assert.is_true(d.is_default)
    assert.matches("moonbox.render.Group: fields are read in snake_case: `is_default`, not `isDefault`",
      raised(function() local v = d.isDefault; return v end), 1, true)
    local g = render.groups.create { name = "second", concurrency_limit = 5, region = "oregon" }
    assert.matches("^sbg%-", g.id)
    assert.are.same({ "second", 5, false }, { g.name, g.concurrency_limit, g.is_default })
    assert.matches("^Group sbg%-%S+ %(second, oregon%)$", tostring(g))
    local ids = {}
    for one in render.groups.list() do ids[one.id] = true end
    assert.is_true(ids[d.id] and ids[g.id])
    assert.are.equal(d.id, render.groups.default().id)
  end))
end)

describe("render.groups.delete and list page sizes", function()
  -- The limit= of each GET of path after journal seq since.
  local function list_queries(since, path)
    local out = {}
    for i, e in ipairs(runs.requests(B, since, "GET", path)) do out[i] = (e.query or ""):match("limit=(%d+)") end
    return out
  end
  local function mark() return runs.last_seq(B) end

  it("deletes an empty group (g:delete() or by id); a second delete raises not_found", T.async(function()
    local g = render.groups.create { name = "to-delete" }
    local h = render.groups.create { name = "by-id" }
    g:delete()
    render.groups.delete(h.id)
    for one in render.groups.list() do
      assert.are_not.equal(g.id, one.id)
      assert.are_not.equal(h.id, one.id)
    end
    local err = raised(render.groups.delete, g)
    assert.are.equal("not_found", err.code)
    assert.is_truthy(tostring(err):find(g.id, 1, true))
  end))

  it("refuses to delete a group with a running sandbox, naming it, and the default group", T.async(function()
    local g = render.groups.create { name = "busy" }
    do
      local sb <close> = render.sandboxes.create { group = g.id }
      local err = raised(render.groups.delete, g)
      assert.are.equal("conflict", err.code)
      assert.matches(g.id .. " still has 1 sandbox that is not terminated: " .. sb.id, err.message, 1, true)
    end
    g:delete()
    local err = raised(render.groups.delete, render.groups.default())
    assert.are.equal("conflict", err.code)
    assert.matches("default group", err.message)
  end))

  it("asks for page_size items per request and stops at limit", T.async(function()
    local made = {}
    for i = 1, 5 do made[i] = render.sandboxes.create {} end
    local since = mark()
    local n = 0
    for _ in render.sandboxes.list { page_size = 2 } do n = n + 1 end
    assert.is_true(n >= 5)
    local qs = list_queries(since, "/v1/sandboxes")
    assert.are.equal(math.ceil((n + 1) / 2), #qs)
    for _, limit in ipairs(qs) do assert.are.equal("2", limit) end
    since = mark()
    local got = {}
    for sb in render.sandboxes.list { limit = 3 } do got[#got + 1] = sb.id end
    assert.are.equal(3, #got)
    assert.are.same({ "3" }, list_queries(since, "/v1/sandboxes"))
    local n_groups = 0
    for _ in render.groups.list { page_size = 1, limit = 1 } do n_groups = n_groups + 1 end
    assert.are.equal(1, n_groups)
    local err = raised(render.sandboxes.list, { limt = 3 })
    assert.matches("render.sandboxes.list: unknown option `limt` (did you mean `limit`?)", tostring(err), 1, true)
    err = raised(render.snapshots.list, { page_size = 101 })
    assert.matches("option `page_size` must be an integer from 1 to 100", tostring(err))
    for _, sb in ipairs(made) do sb:terminate() end
  end))
end)

describe("sb:snapshot", function()
  it("captures, waits until available, and restores into a sandbox that has the file", T.async(function()
    local sb <close> = render.sandboxes.create {}
    sb:exec("echo kept > ~/marker.txt"):check()
    local snap = sb:snapshot { name = "restore-me" }
    assert.are.equal('{"kind":"filesystem","name":"restore-me"}', last_body("/v1/sandboxes/" .. sb.id
      .. "/snapshots"))
    assert.matches("^snp%-", snap.id)
    assert.are.same({ "available", "filesystem", "restore-me", sb.id, sb.sandbox_group_id },
      { snap.status, snap.kind, snap.name, snap.source_sandbox_id, snap.sandbox_group_id })
    assert.is_string(snap.captured_at)
    assert.are.equal(("Snapshot %s (restore-me, available, filesystem)"):format(snap.id), tostring(snap))
    local copy <close> = render.sandboxes.create { snapshot = snap }
    assert.are_not.equal(sb.id, copy.id)
    assert.are.equal("kept\n", copy:exec("cat ~/marker.txt"):check().stdout)
  end))

  it("returns at once with wait = false, sends expires_at as RFC 3339, and wait_available times out",
    T.async(function()
      local sb <close> = render.sandboxes.create {}
      local at = os.time() + 3600
      local snap = sb:snapshot { wait = false, expires_at = at }
      assert.are.equal("creating", snap.status)
      assert.are.equal(os.date("!%Y-%m-%dT%H:%M:%SZ", at), snap.expires_at)
      local err = raised(snap.wait_available, snap, { timeout = 0 })
      assert.are.same({ "timeout", snap.id }, { err.code, err.snapshot_id })
      assert.are.equal(snap, render.snapshots.wait_available(snap, { timeout = 60 }))
      assert.are.equal("available", snap.status)
      assert.are.equal("available", render.snapshots.get(snap.id).status)
    end))

  it("raises invalid_snapshot_name for a bad name, with the sandbox id", T.async(function()
    local sb <close> = render.sandboxes.create {}
    local err = raised(sb.snapshot, sb, { name = "snp-not-a-name" })
    assert.are.same({ "invalid_snapshot_name", 400, sb.id }, { err.code, err.status, err.sandbox_id })
  end))

  it("raises sandbox_not_running for a suspended sandbox", T.async(function()
    local sb <close> = render.sandboxes.create {}
    sb:suspend()
    local err = raised(sb.snapshot, sb, {})
    assert.are.same({ "sandbox_not_running", 409, sb.id }, { err.code, err.status, err.sandbox_id })
  end))

  it("refuses an unknown kind before sending anything", T.async(function()
    local sb <close> = render.sandboxes.create {}
    assert.matches("option `kind` must be one of", tostring(raised(sb.snapshot, sb, { kind = "memory" })))
  end))
end)

describe("render.snapshots", function()
  it("restores by name and latest(name) picks the newest available of two", T.async(function()
    local sb <close> = render.sandboxes.create {}
    sb:exec("echo one > ~/v"):check()
    local first = sb:snapshot { name = "twice" }
    sb:exec("echo two > ~/v"):check()
    local second = sb:snapshot { name = "twice" }
    assert.are.equal(second.id, render.snapshots.latest("twice").id)
    assert.is_nil(render.snapshots.latest("never-made"))
    local copy <close> = render.sandboxes.create { snapshot = "twice" }
    assert.are.equal("two\n", copy:exec("cat ~/v"):check().stdout)
    second:delete()
    assert.are.equal(first.id, render.snapshots.latest("twice").id)
  end))

  it("lists every snapshot of the group newest first, filtered by status", T.async(function()
    local sb <close> = render.sandboxes.create {}
    local made = {}
    for i = 1, 3 do made[i] = sb:snapshot { name = "order-" .. i }.id end
    local seen = {}
    for snap in render.snapshots.list { status = { "available" } } do
      if snap.name and snap.name:match("^order%-") then seen[#seen + 1] = snap.id end
      assert.are.equal("available", snap.status)
    end
    assert.are.same({ made[3], made[2], made[1] }, seen)
    local n = 0
    for _ in render.snapshots.list { status = "failed" } do n = n + 1 end
    assert.are.equal(0, n)
  end))

  it("deletes idempotently; get then raises snapshot_not_found with the snapshot id", T.async(function()
    local sb <close> = render.sandboxes.create {}
    local snap = sb:snapshot {}
    assert.are.equal(snap.id, render.snapshots.get(snap.id).id)
    assert.are.equal(snap.id, render.snapshots.get(snap.id, { group = snap.sandbox_group_id }).id)
    assert.matches("render.snapshots.get(snapshot_id, {group = group_id})",
      raised(render.snapshots.get, snap.sandbox_group_id, snap.id), 1, true)
    assert.matches("render.snapshots.get(snap.id, {group = snap.sandbox_group_id})",
      raised(render.snapshots.get, snap), 1, true)
    assert.matches("render.snapshots.get: unknown option `gruop`", raised(render.snapshots.get, snap.id, { gruop = "x" }),
      1, true)
    render.snapshots.delete(snap)
    render.snapshots.delete(snap)
    render.snapshots.delete(snap.id)
    local err = raised(render.snapshots.get, snap.id)
    assert.are.same({ "snapshot_not_found", 404, snap.id }, { err.code, err.status, err.snapshot_id })
    err = raised(snap.refresh, snap)
    assert.are.equal("snapshot_not_found", err.code)
  end))

  it("raises snapshot_creating deleting one still being captured, then deletes it once available",
    T.async(function()
      local sb <close> = render.sandboxes.create {}
      -- 128 MiB of incompressible data: the capture takes far longer than one API round trip.
      sb:exec("head -c 134217728 /dev/urandom > /root/big"):check()
      local snap = sb:snapshot { wait = false }
      local err = raised(snap.delete, snap)
      assert.are.same({ "snapshot_creating", 409, snap.id }, { err.code, err.status, err.snapshot_id })
      snap:wait_available { timeout = 120 }
      snap:delete()
    end))

  it("raises snapshot_failed when the capture fails, naming the snapshot", T.async(function()
    local status = B:req("PUT", "/_moonbox/faults",
      { body = '[{"match":"POST /v1/sandboxes/*/snapshots","fault":"capture","count":1}]' })
    assert.are.equal(200, status)
    local sb <close> = render.sandboxes.create {}
    local snap = sb:snapshot { wait = false }
    local err = raised(snap.wait_available, snap, { timeout = 30 })
    B:req("DELETE", "/_moonbox/faults")
    assert.are.same({ "snapshot_failed", snap.id }, { err.code, err.snapshot_id })
    -- the fault fired once: the next capture succeeds
    assert.are.equal("available", sb:snapshot({ name = "ok-after" }).status)
  end))

  it("raises snapshot_plan_mismatch restoring a runtime snapshot onto another plan", T.async(function()
    local sb <close> = render.sandboxes.create { plan = "1c-2g" }
    local snap = sb:snapshot { kind = "runtime" }
    assert.are.same({ "runtime", "1c-2g" }, { snap.kind, snap.plan })
    local err = raised(render.sandboxes.create, { snapshot = snap, plan = "2c-4g" })
    assert.are.same({ "snapshot_plan_mismatch", 409 }, { err.code, err.status })
    local same <close> = render.sandboxes.create { snapshot = snap }
    assert.are.equal("1c-2g", same.plan)
  end))

  it("raises snapshot_not_available restoring a snapshot of another group", T.async(function()
    local other
    for g in render.groups.list() do if not g.is_default then other = g end end
    other = other or render.groups.create { name = "elsewhere" }
    local sb <close> = render.sandboxes.create { group = other.id }
    local snap = sb:snapshot { name = "in-other" }
    assert.are.equal(other.id, snap.sandbox_group_id)
    assert.are.equal(snap.id, render.snapshots.latest("in-other", { group = other }).id)
    assert.is_nil(render.snapshots.latest("in-other"))
    local err = raised(render.sandboxes.create, { snapshot = snap.id })
    assert.are.same({ "snapshot_not_available", 409 }, { err.code, err.status })
    local copy <close> = render.sandboxes.create { snapshot = snap }
    assert.are.equal(other.id, copy.sandbox_group_id)
  end))
end)
