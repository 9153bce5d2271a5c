-- render.snapshots.rebuild against a real `moonbox local`: the name rolls forward and keeps only
-- `keep` snapshots, a restore by name gets the newest, and every failure (verify, build_fn,
-- capture, timeout) deletes what it made, leaves the previous snapshot newest and no sandbox
-- running. The last part runs recipes/rebuild_schedule.lua three times with `moonbox run`.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local render = require "moonbox.render"
require "moonbox.render.snapshots"
local L = require "spec.support.local_backend"

local B

L.fixture(setup, teardown, function(b) B = b end)

local raised = T.raises

--- The ids of the snapshots with that name the backend still lists (any status), newest first.
local function named(name)
  local out = {}
  for s in render.snapshots.list {} do
    if s.name == name then out[#out + 1] = s.id end
  end
  return out
end

--- What a restore by name finds in /opt/rebuild/version.
local function version_by_name(name)
  local sb <close> = render.sandboxes.create { snapshot = name }
  return sb:exec("cat /opt/rebuild/version"):check().stdout
end

local function status_of(id)
  local _, sb = B:req("GET", "/v1/sandboxes/" .. id)
  return sb.status
end

--- Bumps /opt/rebuild/version (0 when the builder starts empty).
local function bump(sb)
  sb:exec("mkdir -p /opt/rebuild && n=$(cat /opt/rebuild/version 2>/dev/null || echo 0) && " ..
    "echo $((n + 1)) > /opt/rebuild/version"):check()
end

local function good_rebuild(name, opts)
  opts = opts or {}
  opts.base = render.snapshots.latest(name)
  opts.verify = opts.verify or "test -s /opt/rebuild/version"
  return render.snapshots.rebuild(name, bump, opts)
end

--- The checks every failed rebuild must pass: the error names the stage and the ids, the new
-- snapshot (if one was made) is gone, the previous one is newest and restores, nothing runs.
local function assert_failed_cleanly(err, name, stage, previous)
  assert.are.same({ "rebuild_failed", stage, name, previous.id },
    { err.code, err.stage, err.name, err.previous_id })
  assert.matches("^rebuild of '" .. name:gsub("%-", "%%-") .. "': " .. stage .. " failed: ", err.message)
  assert.matches("builder " .. err.builder_id, err.message, 1, true)
  assert.matches("the newest available is still " .. previous.id, err.message, 1, true)
  assert.are.equal("terminated", status_of(err.builder_id))
  if err.verifier_id then assert.are.equal("terminated", status_of(err.verifier_id)) end
  if err.snapshot_id then
    assert.matches("new snapshot " .. err.snapshot_id .. " deleted", err.message, 1, true)
    assert.are.equal("snapshot_not_found", raised(render.snapshots.get, err.snapshot_id).code)
  end
  assert.are.same({ previous.id }, named(name))
  assert.are.equal(previous.id, render.snapshots.latest(name).id)
  assert.are.equal("1\n", version_by_name(name))
  assert.are.equal(0, B:live())
end

describe("render.snapshots.rebuild", function()
  it("rolls the name forward three times, keeping only `keep`, and a restore by name gets the newest",
    T.async(function()
      local made = {}
      for i = 1, 3 do
        local seen_previous = false
        local snap, info = render.snapshots.rebuild("roll", function(sb, ctx)
          seen_previous = ctx.previous and ctx.previous.id or false
          bump(sb)
        end, { base = made[i - 1], keep = 2, verify = { "test", "-s", "/opt/rebuild/version" },
          network = "deny-all", timeout = "5m" })
        made[i] = snap
        assert.matches("^snp%-", snap.id)
        assert.are.same({ "available", "roll" }, { snap.status, snap.name })
        assert.are.equal(made[i - 1] and made[i - 1].id or false, seen_previous)
        for j = 1, i - 1 do assert.are_not.equal(made[j].id, snap.id) end
        assert.are.same({ "roll", snap.id, info.builder_id }, { info.name, info.snapshot_id, snap.source_sandbox_id })
        assert.are.equal(made[i - 1] and made[i - 1].id, info.previous_id)
        assert.matches("^sbx%-", info.verifier_id)
        assert.are.equal("terminated", status_of(info.builder_id))
        assert.are.equal("terminated", status_of(info.verifier_id))
        for _, stage in ipairs({ "builder", "build", "capture", "verify", "prune", "total" }) do
          assert.is_number(info.durations[stage], stage)
        end
        -- the new content, by name and by id
        assert.are.equal(i .. "\n", version_by_name("roll"))
        assert.are.equal(snap.id, render.snapshots.latest("roll").id)
        local expect_kept = i == 1 and { snap.id } or { snap.id, made[i - 1].id }
        assert.are.same(expect_kept, info.kept)
        assert.are.same(expect_kept, named("roll"))
        assert.are.same(i == 3 and { made[1].id } or {}, info.deleted)
        assert.are.same({}, info.prune_errors)
        assert.are.equal(0, B:live())
      end
      assert.are.equal("snapshot_not_found", raised(render.snapshots.get, made[1].id).code)
    end))

  it("deletes the new snapshot when verify fails and leaves the previous one newest", T.async(function()
    local previous = good_rebuild("verify-fails")
    local err = raised(render.snapshots.rebuild, "verify-fails", bump, {
      base = previous, verify = 'test "$(cat /opt/rebuild/version)" = 99 || { echo "want 99" >&2; exit 3; }' })
    assert.matches("verify failed: exit 3 from `test", err.message, 1, true)
    assert.matches("output: want 99", err.message, 1, true)
    assert.are.same({ 3, err.verifier_id }, { err.exit_code, err.sandbox_id })
    assert.matches("^snp%-", err.snapshot_id)
    assert.matches("verifier " .. err.verifier_id, err.message, 1, true)
    assert.are.equal("verify_failed", err.cause.code)
    assert_failed_cleanly(err, "verify-fails", "verify", previous)

    -- a verify function that returns false fails the same way
    err = raised(render.snapshots.rebuild, "verify-fails", bump, {
      base = previous, verify = function(sb) return sb:exec("cat /opt/rebuild/version").stdout == "99\n" end })
    assert.matches("verify failed: the verify function returned false", err.message, 1, true)
    assert_failed_cleanly(err, "verify-fails", "verify", previous)
  end))

  it("makes no snapshot when build_fn raises and terminates the builder", T.async(function()
    local previous = good_rebuild("build-fails")
    local err = raised(render.snapshots.rebuild, "build-fails", function(sb)
      bump(sb)
      sb:exec("exit 7"):check()
    end, { base = previous, verify = "true" })
    assert.is_nil(err.snapshot_id)
    assert.is_nil(err.verifier_id)
    assert.are.equal("exit_status", err.cause.code)
    assert.matches("build failed: sandbox:exec: command exited with 7: exit 7", err.message, 1, true)
    assert_failed_cleanly(err, "build-fails", "build", previous)

    err = raised(render.snapshots.rebuild, "build-fails", function() error("no compiler here") end,
      { base = previous })
    assert.matches("build failed: .*no compiler here", err.message)
    assert_failed_cleanly(err, "build-fails", "build", previous)
  end))

  -- Rebuilds name once cleanly, then again with its capture hit by the fault rule; returns the
  -- error of the second and the snapshot of the first.
  local function capture_faulted(name, rule)
    local previous = good_rebuild(name)
    B:faults(rule)
    local err = raised(render.snapshots.rebuild, name, bump, { base = previous, verify = "true" })
    B:faults("")
    return err, previous
  end

  it("deletes a snapshot whose capture failed (fault injection)", T.async(function()
    local err, previous = capture_faulted("capture-fails", "POST /v1/sandboxes/*/snapshots=capture#1")
    assert.are.same({ "snapshot_failed", err.snapshot_id }, { err.cause.code, err.cause.snapshot_id })
    assert.matches("capture failed: .*injected capture failure", err.message)
    assert.is_nil(err.verifier_id)
    assert_failed_cleanly(err, "capture-fails", "capture", previous)
  end))

  it("finds and deletes the snapshot of a capture whose answer was lost (fault injection)", T.async(function()
    local err, previous = capture_faulted("capture-lost", "POST /v1/sandboxes/*/snapshots=drop#1")
    assert.are.equal("unknown_outcome", err.cause.code)
    assert.matches("^snp%-", err.snapshot_id)
    assert_failed_cleanly(err, "capture-lost", "capture", previous)
  end))

  it("records a failed prune without failing the rebuild; the next rebuild prunes it", T.async(function()
    local first = good_rebuild("prune-fails", { keep = 1 })
    -- (a 500 would be retried: a delete is safe to repeat; a 400 is not repeated)
    B:req("PUT", "/_moonbox/faults", { body = "DELETE /v1/sandbox-groups/*/snapshots/*=400#1" })
    local second, info = good_rebuild("prune-fails", { keep = 1 })
    B:req("DELETE", "/_moonbox/faults")
    assert.are.same({}, info.deleted)
    assert.are.equal(1, #info.prune_errors)
    assert.are.same({ first.id, "http_400" }, { info.prune_errors[1].id, info.prune_errors[1].error.code })
    assert.are.same({ second.id, first.id }, named("prune-fails"))
    local third, info3 = good_rebuild("prune-fails", { keep = 1 })
    assert.are.same({ second.id, first.id }, info3.deleted)
    assert.are.same({ third.id }, named("prune-fails"))
    assert.are.equal("3\n", version_by_name("prune-fails"))
    assert.are.equal(0, B:live())
  end))

  it("raises code timeout naming the stage when opts.timeout expires, and cleans up", T.async(function()
    local previous = good_rebuild("too-slow")
    local started = false
    local err = raised(render.snapshots.rebuild, "too-slow", function()
      started = true
      task.sleep(3600)
    end, { base = previous, timeout = 10 })
    assert.is_true(task.is_timeout(err))
    assert.are.same({ "snapshots.rebuild", "too-slow", started and "build" or "builder" },
      { err.op, err.name, err.stage })
    assert.matches("rebuild of 'too-slow': timed out after 10 s during " .. err.stage, err.message, 1, true)
    assert.are.equal("terminated", status_of(err.builder_id))
    assert.are.same({ previous.id }, named("too-slow"))
    assert.are.equal(0, B:live())
  end))

  it("re-raises a cancellation unchanged after terminating the builder", T.async(function()
    local builder_id
    local t = task.spawn(render.snapshots.rebuild, "cancelled", function(sb)
      builder_id = sb.id
      task.sleep(3600)
    end, {})
    while not builder_id do task.sleep(0.05) end
    task.cancel(t)
    local ok, err = pcall(task.join, t)
    assert.is_false(ok)
    assert.is_true(task.is_cancelled(err))
    assert.are.equal("terminated", status_of(builder_id))
    assert.are.same({}, named("cancelled"))
    assert.are.equal(0, B:live())
  end))

  it("refuses bad arguments before creating anything", T.async(function()
    local f = function() end
    local function says(text, ...) assert.matches(text, tostring(raised(render.snapshots.rebuild, ...)), 1, true) end
    says("argument 1 (name) is required", nil, f)
    says("argument 2 (build_fn) must be function", "x", "echo")
    says("unknown option `keeep` (did you mean `keep`?)", "x", f, { keeep = 2 })
    says("keep must be an integer >= 1", "x", f, { keep = 0 })
    says("option `kind` must be one of", "x", f, { kind = "memory" })
    says("option `verify` must be string | table | function", "x", f, { verify = 1 })
    says("option `timeout` must be seconds", "x", f, { timeout = "soon" })
    says("option `timeout_seconds` was renamed: write `lifetime`", "x", f, { timeout_seconds = 60 })
    assert.are.equal(0, B:live())
  end))
end)

describe("recipes/rebuild_schedule.lua", function()
  it("runs three times: rolls the name forward, keeps 2, nothing left running", T.async(function()
    require "moonbox.schedule" -- the recipe's; a module that does not load fails here, by name
    local state = proc.run({ "mktemp", "-d", "/tmp/moonbox-rebuild-recipe.XXXXXX" }).stdout:gsub("%s+$", "")
    local newest = {}
    for i = 1, 3 do
      local r = proc.run { L.BIN, "run", "recipes/rebuild_schedule.lua", env = {
        RENDER_LOCAL_DEV_URL = B.url, RENDER_API_KEY = B.key, RENDER_WORKSPACE_ID = B.workspace,
        XDG_STATE_HOME = state } }
      assert.are.equal(0, r.code, r.stdout .. r.stderr)
      local latest = render.snapshots.latest("rebuild-base")
      for j = 1, i - 1 do assert.are_not.equal(newest[j], latest.id) end
      newest[i] = latest.id
      assert.matches("rebuild-base is now " .. latest.id, r.stdout, 1, true)
      assert.matches("restored by name: base build " .. i .. ", built ", r.stdout, 1, true)
      assert.are.equal(math.min(i, 2), #named("rebuild-base"))
      assert.are.equal(0, B:live())
    end
    L.remove_tree(state)
  end))
end)
