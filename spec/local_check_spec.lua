-- `moonbox local --check` and the restore's own check (issue 22, item 1: "a `moonbox local
-- --check` verifies every layer against its manifest and reports"; "restores verify the
-- manifest before a sandbox starts; a snapshot whose data does not match is failed"), against
-- the state directory of a real `moonbox local`: an untouched one checks ok; one layer file
-- truncated and another's byte flipped on disk are each reported MISMATCH by snapshot id; the
-- check refuses while a backend serves the directory; and a restarted backend refuses to
-- restore the truncated snapshot (409, the snapshot then failed) while the untouched one
-- restores. Before 9a3c1fa there was no --check. Needs root; CI has it.
local T = require "moonbox.testing"
local json = require "moonbox.json"
local proc = require "moonbox.proc"
local L = require "spec.support.local_backend"

local function check(state)
  local r = proc.run { L.BIN, "local", "--check", "--state", state }
  return r.code, r.stdout .. r.stderr
end

local snapshot_path = L.snapshot_path

local function capture(b, id)
  local got = b:settled(b:snapshot(id))
  assert(got.status == "available", "the capture of " .. got.id .. ": " .. tostring(got.error))
  return got
end

local function run(b, id, command)
  local r = b:exec(id, command)
  assert(r.code == 0, "in " .. id .. ": `" .. command .. "` exited " .. tostring(r.code) .. ": " .. r.stderr)
  return r.stdout
end

local function restore(b, snap)
  return b:req("POST", "/v1/sandboxes", { body = { ownerId = b.workspace, snapshotId = snap.id,
    networkPolicy = { default = "deny-all" } } })
end

describe("moonbox local --check", function()
  local b, state
  local made = {} -- the first test's snapshots, by what was done to them
  teardown(T.async(function()
    if b then b:destroy() end
  end))

  it("reports every snapshot ok, then each damaged one MISMATCH by id; refuses while served", T.async(function()
    b = L.start()
    state = b.state
    local sb = b:create { networkPolicy = { default = "deny-all" } }
    run(b, sb.id, "mkdir -p /root/d && head -c 50000 /dev/urandom > /root/d/one && echo two > /root/d/two")
    local truncated = capture(b, sb.id)
    run(b, sb.id, "echo three > /root/d/three")
    local flipped = capture(b, sb.id)
    run(b, sb.id, "echo four > /root/d/four")
    local intact = capture(b, sb.id)
    made.truncated, made.intact = truncated, intact

    local code, out = check(state)
    assert.are.equal(1, code, out)
    assert.matches("a moonbox local serves " .. state, out, nil, true)
    assert.matches("stop it first", out, nil, true)

    b:stop()
    code, out = check(state)
    assert.are.equal(0, code, out)
    for _, snap in ipairs({ truncated, flipped, intact }) do
      assert.matches(snap.id .. " ok: ", out, nil, true)
    end
    assert.matches("3 snapshots checked", out, nil, true)

    -- The damage, on disk: a file of one layer cut short, a byte of another's changed in place
    -- (same size, same owner and mode: only a read of its contents tells).
    local cut = state .. "/layers/" .. truncated.id .. "/root/d/one"
    assert.are.equal(0, proc.run({ "truncate", "-s", "49999", cut }).code)
    local f = assert(io.open(state .. "/layers/" .. flipped.id .. "/root/d/two", "r+b"))
    f:seek("set", 1)
    f:write(f:read(1) == "x" and "y" or "x")
    f:close()

    code, out = check(state)
    assert.are.equal(1, code, out)
    assert.matches(truncated.id .. " MISMATCH: ", out, nil, true)
    assert.matches(flipped.id .. " MISMATCH: ", out, nil, true)
    assert.matches(intact.id .. " ok: ", out, nil, true)
    assert.matches("1 ok, 2 mismatched", out, nil, true)
    assert.is_nil(out:find(state .. "/layers", 1, true), "--check names a layer by its host path:\n" .. out)
  end))

  it("lets a restarted backend refuse the damaged snapshot's restore and mark it failed", T.async(function()
    assert(state, "the first test made the state directory")
    b = L.start { state = state }
    local truncated, intact = made.truncated, made.intact

    local s, body = restore(b, truncated)
    assert.are.equal(409, s, json.encode(body))
    local msg = json.encode(body)
    assert.matches(truncated.id, msg, nil, true)
    assert.matches("cannot be restored", msg, nil, true)
    assert.is_nil(msg:find(state, 1, true), "the answer names a host path: " .. msg)
    local _, now = b:req("GET", snapshot_path(truncated))
    assert.are.equal("failed", now.status, json.encode(now))
    assert.matches("does not match what was captured", tostring(now.error), nil, true)

    s, body = restore(b, intact)
    assert.are.equal(201, s, json.encode(body))
    local sb = b:wait_status(body.id, "running")
    assert.are.equal("two\nfour\n", run(b, sb.id, "cat /root/d/two /root/d/four"))
  end))
end)
