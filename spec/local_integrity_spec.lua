-- A snapshot that says `available` is whole (issue 22, item 1): against a real `moonbox local`,
-- captures race the layer collector that runs whenever another sandbox terminates or another
-- snapshot is deleted, and runtime restores race the deletion of their snapshot while they boot.
-- Randomized (the tree's contents, when the unrelated terminates and deletes land): the seed is
-- printed, MOONBOX_SPEC_SEED=N replays it.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local json = require "moonbox.json"
local proc = require "moonbox.proc"
local L = require "spec.support.local_backend"

local SEED = tonumber(os.getenv("MOONBOX_SPEC_SEED") or "") or (os.time() % 100000)
io.stderr:write("local_integrity_spec: seed ", SEED, " (MOONBOX_SPEC_SEED=", SEED, " replays it)\n")
math.randomseed(SEED)

local ROUNDS = 20 -- captures racing the collector
local RESTORES = 12 -- runtime restores racing the deletion of their snapshot
local HELPER = L.BIN:match("^(.*)/[^/]*$") .. "/moonbox-sandbox"

local B
setup(T.async(function() B = L.start() end))
teardown(T.async(function() if B then B:destroy() end end))

local DENY = { default = "deny-all" }

local function start(body)
  body = body or {}
  body.ownerId = B.workspace
  body.networkPolicy = body.networkPolicy or DENY
  local s, sb = B:req("POST", "/v1/sandboxes", { body = body })
  return s, sb
end

local function create(body)
  local s, sb = start(body)
  assert(s == 201, "create: " .. s .. " " .. json.encode(sb))
  return B:wait_status(sb.id, "running")
end

local function run(id, command)
  local r = B:exec(id, command)
  assert(r.code == 0, "in " .. id .. ": `" .. command .. "` exited " .. tostring(r.code) .. ": " .. r.stderr)
  return r.stdout
end

local function terminate(id) B:req("POST", "/v1/sandboxes/" .. id .. "/terminate") end

local function capture(id, kind) return B:snapshot(id, kind) end
local snapshot_path = L.snapshot_path
local function settled(snap) return B:settled(snap) end

local function delete(snap)
  local s = B:req("DELETE", snapshot_path(snap))
  assert(s == 204, "delete of " .. snap.id .. ": " .. s)
end

-- What a tree is, as seen from inside: every entry's type, mode, owner, size and name, sorted,
-- then every file's sha256; answered as "<entries> <sha256 of all of it>". A directory's size is
-- left out: it is the filesystem's own figure (4096 on the layers' ext4, the names' length on
-- the sandbox disk's btrfs), not something a capture keeps.
local LISTING = "cd /root/t && { find . \\( -type d -printf '%y %m %U:%G - %p\\n' \\) -o " ..
  "-printf '%y %m %U:%G %s %p\\n' | LC_ALL=C sort; " ..
  "find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; } > /tmp/listing && " ..
  "echo $(find . | wc -l) $(sha256sum < /tmp/listing | cut -c1-64)"

-- The bytes `moonbox-sandbox verify` says a layer's manifest holds (nil, why when it cannot).
local function manifest_bytes(snap)
  local layer = B.state .. "/layers/" .. snap.id
  local r = proc.run { HELPER, "verify", "--layer=" .. layer, "--manifest=" .. layer .. ".manifest" }
  if r.code ~= 0 then return nil, (r.stderr:gsub("%s+$", "")) end
  return tonumber(r.stdout:match("bytes=(%d+)"))
end

describe("a capture racing the layer collector", function()
  it("comes back whole every time others terminate and delete meanwhile", T.async(function()
    -- The source: about 3,000 files (a few larger ones make the copy take a while) in 30
    -- directories, contents from the seed.
    local src = create()
    run(src.id, string.format([[python3 - <<'EOF'
import os, random
random.seed(%d)
for d in range(30):
    p = "/root/t/d%%02d/sub" %% d
    os.makedirs(p)
    for f in range(100):
        n = random.choice([0, 1, 100, 4096, 9000]) if f else 400000
        with open("%%s/f%%03d" %% (p, f), "wb") as o:
            o.write(random.randbytes(n))
    os.symlink("sub/f001", "/root/t/d%%02d/link" %% d)
    os.chmod("%%s/f002" %% p, 0o640)
EOF]], SEED))
    local want = run(src.id, LISTING)
    -- Unrelated work: sandboxes to terminate and snapshots (of another sandbox) to delete.
    local others, jobs = {}, {}
    for i = 1, ROUNDS do jobs[i] = function() others[i] = create() end end
    task.all(jobs)
    local small = create()
    run(small.id, "mkdir -p /root/t && echo small > /root/t/a")
    local doomed = {}
    for i = 1, ROUNDS do doomed[i] = settled(capture(small.id)) end

    local snaps = {}
    for i = 1, ROUNDS do
      local d1, d2 = math.random() * 0.3, math.random() * 0.3
      snaps[i] = capture(src.id)
      task.all {
        function() task.sleep(d1) terminate(others[i].id) end,
        function() task.sleep(d2) delete(doomed[i]) end,
      }
      snaps[i] = settled(snaps[i])
    end

    -- Every snapshot that says available restores to exactly the tree captured, in parallel.
    local bad, failed, sizes, restores = {}, {}, {}, {}
    local sem = task.semaphore(5)
    for i, snap in ipairs(snaps) do
      restores[i] = function()
        if snap.status ~= "available" then
          failed[#failed + 1] = snap.id .. ": " .. tostring(snap.error)
          return
        end
        local bytes, why = manifest_bytes(snap)
        if bytes ~= snap.sizeBytes then
          sizes[#sizes + 1] = string.format("%s: sizeBytes %s, the manifest's %s", snap.id, tostring(snap.sizeBytes),
            tostring(bytes or why))
        end
        sem:with(function()
          local s, sb = start { snapshotId = snap.id }
          if s ~= 201 then
            bad[#bad + 1] = snap.id .. ": restore answered " .. s .. " " .. json.encode(sb)
            return
          end
          local ok, err = pcall(B.wait_status, B, sb.id, "running")
          if not ok then
            bad[#bad + 1] = snap.id .. ": its restore " .. tostring(err)
          else
            local got = B:exec(sb.id, LISTING).stdout
            if got ~= want then
              bad[#bad + 1] = string.format("%s: restored %s, captured %s (entries, sha256)", snap.id,
                got:gsub("%s+$", ""), want:gsub("%s+$", ""))
            end
          end
          terminate(sb.id)
        end)
      end
    end
    task.all(restores)
    table.sort(bad)
    table.sort(sizes)
    assert.are.same({ failed = {}, incomplete = {}, sizes = {} }, { failed = failed, incomplete = bad, sizes = sizes },
      "captures that failed, available snapshots that are not whole, sizes that are not the manifest's (seed "
      .. SEED .. ")")
    terminate(src.id)
    terminate(small.id)
  end))
end)

describe("a runtime restore racing the deletion of its snapshot", function()
  it("boots with its /dev data every time", T.async(function()
    local src = create()
    local snaps, marks = {}, {}
    for i = 1, RESTORES do
      marks[i] = string.format("mark-%d-%d", i, math.random(1, 1e9))
      run(src.id, "mkdir -p /root/t && echo " .. marks[i] .. " > /dev/shm/mark && echo " .. marks[i] ..
        " > /root/t/mark && head -c 100000 /dev/zero > /dev/shm/pad")
      snaps[i] = settled(capture(src.id, "runtime"))
      assert(snaps[i].status == "available", "runtime capture " .. snaps[i].id .. ": " .. tostring(snaps[i].error))
    end
    local bad, jobs = {}, {}
    for i, snap in ipairs(snaps) do
      jobs[i] = function()
        local s, sb = start { snapshotId = snap.id }
        assert(s == 201, "restore of " .. snap.id .. ": " .. s .. " " .. json.encode(sb))
        delete(snap)
        local ok, err = pcall(B.wait_status, B, sb.id, "running")
        if not ok then
          local _, logs = B:req("GET", "/v1/sandboxes/" .. sb.id)
          bad[#bad + 1] = snap.id .. " → " .. sb.id .. ": " .. tostring(err) .. " " .. tostring(logs and logs.error)
        else
          local got = B:exec(sb.id, "cat /dev/shm/mark /root/t/mark; wc -c < /dev/shm/pad")
          local want = marks[i] .. "\n" .. marks[i] .. "\n100000\n"
          if got.stdout ~= want then
            bad[#bad + 1] = snap.id .. " → " .. sb.id .. ": has " .. json.encode(got.stdout .. got.stderr)
          end
        end
        terminate(sb.id)
      end
    end
    task.all(jobs)
    table.sort(bad)
    assert.are.same({}, bad, "restores that did not start with their data (seed " .. SEED .. ")")
    terminate(src.id)
  end))
end)
