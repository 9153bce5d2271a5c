-- `moonbox local` SIGKILLed in the middle of an operation, then started again on the same state
-- directory: what the crash left must be gone (0 bytes: nothing spooled in tmp/, no sandbox
-- directory, cgroup or mount without a live record, no layer file no snapshot needs) and every
-- record must say what is true (a terminated sandbox has no process or directory, a capture cut
-- short says failed). The crash points are the fault injector's stall rules (docs/local.md,
-- "Fault injection": the operation stops at the point until the server is killed there), one
-- per operation that writes to disk: a terminate after its first write, an upload whose body is
-- spooled, a capture whose layer is copied but not recorded, a boot whose sandbox exists. All
-- four are stalled at once and the server killed once (a restart costs seconds; each `it` looks
-- at one point's sandbox). Then: a create sent the moment a fresh or restarted server's port
-- opens is never killed by its recovery (before, the recovery ran after the port opened and
-- took a sandbox created meanwhile for one the crash left). Needs root; CI has it.
local T = require "moonbox.testing"
local json = require "moonbox.json"
local http = require "moonbox.http"
local proc = require "moonbox.proc"
local task = require "moonbox.task"
local L = require "spec.support.local_backend"
local files = require "spec.support.files"
local wait_until = require("spec.support.poll").wait

local read_file = files.read
local MB = 1000 * 1000

local cgroup_dirs = L.cgroup_dirs

local function du(path)
  return tonumber(proc.run({ "du", "-sb", path }).stdout:match("^(%d+)")) or 0
end

local listdir = require("spec.support.files").listdir

local ALL = "creating,running,suspending,suspended,resuming,errored,terminated"
local LIVE = { creating = true, running = true, suspending = true, suspended = true, resuming = true }

-- Every sandbox record of the backend: id -> record.
local function sandboxes(b)
  local out, cursor = {}, nil
  repeat
    local s, page = b:req("GET", "/v1/sandboxes", { query = { status = ALL, limit = 100, cursor = cursor } })
    assert(s == 200, "listing sandboxes: " .. tostring(s))
    for _, item in ipairs(page) do out[item.sandbox.id] = item.sandbox end
    cursor = page[#page] and page[#page].cursor
  until #page < 100
  return out
end

-- Every snapshot record of the backend's default group: id -> record.
local function snapshots(b, gid)
  local s, page = b:req("GET", "/v1/sandbox-groups/" .. gid .. "/snapshots", { query = { ownerId = b.workspace } })
  assert(s == 200, "listing snapshots: " .. tostring(s) .. " " .. json.encode(page))
  local out = {}
  for _, item in ipairs(page) do
    local snap = item.snapshot or item
    out[snap.id] = snap
  end
  return out
end

-- Where uploads are spooled: the sandbox disk's spool, else (a machine without one) tmp/.
local SPOOLS = { "tmp", "sandboxes/.spool" }

-- What the state dir holds that no record needs, as lines (empty: nothing): files in tmp/,
-- sandbox directories and cgroups of sandboxes not live, layer files of no available snapshot
-- (a snapshot's layer snp-X, its /dev records snp-X.dev and its manifest snp-X.manifest), mounts
-- under the state dir. ids: the sandbox ids the spec made (their cgroups are looked for).
local function leftovers(b, gid, ids)
  local out = {}
  for _, dir in ipairs(SPOOLS) do
    for _, name in ipairs(listdir(b.state .. "/" .. dir)) do
      out[#out + 1] = string.format("%s/%s (%d bytes)", dir, name, du(b.state .. "/" .. dir .. "/" .. name))
    end
  end
  local recs = sandboxes(b)
  for _, id in ipairs(listdir(b.state .. "/sandboxes")) do
    if id ~= ".spool" and not (recs[id] and LIVE[recs[id].status]) then
      out[#out + 1] = string.format("sandboxes/%s (%d bytes; its record: %s)", id, du(b.state .. "/sandboxes/" .. id),
        recs[id] and recs[id].status or "none")
    end
  end
  for _, id in ipairs(ids) do
    if not (recs[id] and LIVE[recs[id].status]) then
      for _, d in ipairs(cgroup_dirs(id)) do
        out[#out + 1] = "cgroup " .. d .. " (record: " .. (recs[id] and recs[id].status or "none") .. ")"
      end
    end
  end
  local needed = {}
  for id, snap in pairs(snapshots(b, gid)) do
    if snap.status == "available" then
      needed[id], needed[id .. ".dev"], needed[id .. ".manifest"] = true, true, true
    end
  end
  for _, name in ipairs(listdir(b.state .. "/layers")) do
    if not needed[name] then
      out[#out + 1] = string.format("layers/%s (%d bytes)", name, du(b.state .. "/layers/" .. name))
    end
  end
  local info = read_file("/proc/self/mountinfo") or ""
  for line in info:gmatch("[^\n]+") do
    local mp = line:match("^%S+ %S+ %S+ %S+ (%S+)")
    -- The sandbox disk is mounted at <state>/sandboxes while a backend serves the dir.
    if line:find(b.state, 1, true) and mp ~= b.state .. "/sandboxes" then out[#out + 1] = "mount: " .. line end
  end
  return out
end

-- Waits until the fault rules have all fired (each operation reached its point). [yields]
local function wait_fired(b, n)
  wait_until(60, function()
    local _, d = b:req("GET", "/_moonbox/faults")
    local fired = 0
    for _, r in ipairs(d.rules) do fired = fired + (r.fired or 0) end
    return fired >= n
  end, function()
    local _, d = b:req("GET", "/_moonbox/faults")
    return "every operation to reach its crash point: " .. json.encode(d.rules)
  end)
end

describe("a server SIGKILLed at a crash point, started again on its state dir", function()
  local b, b2, gid
  local term, up, cap, boot, snap_id -- the sandbox of each point, and the snapshot captured
  local pending = {} -- tasks of the requests the kill cut short

  setup(T.async(function()
    assert(proc.run({ "id", "-u" }).stdout == "0\n", "this spec needs root")
    b = L.start()
    local deny = { networkPolicy = { default = "deny-all" } }
    term, up, cap = b:create(deny), b:create(deny), b:create(deny)
    gid = term.sandboxGroupId
    for _, sb in ipairs({ term, cap }) do
      local r = b:exec(sb.id, "head -c 20000000 /dev/urandom > /root/big && mkdir -p /dev/shm && echo x > /dev/shm/x")
      assert(r.code == 0, "preparing " .. sb.id .. ": " .. r.stderr)
    end
    b:faults("*=stall:terminate#1;*=stall:upload#1;*=stall:capture#1;*=stall:boot#1")

    -- mid-terminate: its first write done, its processes and 20 MB still there
    pending[#pending + 1] = task.spawn(function()
      return pcall(b.req, b, "POST", "/v1/sandboxes/" .. term.id .. "/terminate", { timeout = 120 })
    end)
    -- mid-upload: 8 MB spooled in tmp/, not yet written inside
    local s, tok = b:req("POST", "/v1/sandboxes/" .. up.id .. "/files/upload/token", { query = { path = "/root/up.bin" } })
    assert(s == 201, "upload token: " .. tostring(s) .. " " .. json.encode(tok))
    pending[#pending + 1] = task.spawn(function()
      return pcall(http.request, { method = "PUT", url = tok.uri, body = string.rep("u", 8 * MB), timeout = 120,
        headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/octet-stream" } })
    end)
    -- mid-capture: the layer (and /dev records) copied, the record still creating
    local snap
    s, snap = b:req("POST", "/v1/sandboxes/" .. cap.id .. "/snapshots", { body = { kind = "runtime" } })
    assert(s == 202, "snapshot: " .. tostring(s) .. " " .. json.encode(snap))
    snap_id = snap.id
    -- mid-create: the sandbox's directory, cgroups and processes made, its record creating
    s, boot = b:req("POST", "/v1/sandboxes", { body = { ownerId = b.workspace, networkPolicy = deny.networkPolicy } })
    assert(s == 201, "create: " .. tostring(s) .. " " .. json.encode(boot))

    wait_fired(b, 4)
    -- What a crash here leaves, while the server still runs (else its absence later proves
    -- nothing).
    local spooled = 0
    for _, dir in ipairs(SPOOLS) do
      for _, name in ipairs(listdir(b.state .. "/" .. dir)) do spooled = spooled + du(b.state .. "/" .. dir .. "/" .. name) end
    end
    assert(spooled >= 8 * MB, "the upload is not spooled in tmp/ or sandboxes/.spool (" .. spooled .. " bytes there)")
    assert(du(b.state .. "/sandboxes/" .. term.id) > 20 * MB, "the terminating sandbox's 20 MB are gone already")
    assert(#cgroup_dirs(boot.id) > 0, "the booting sandbox " .. boot.id .. " has no cgroup")
    assert(#listdir(b.state .. "/sandboxes/" .. boot.id) > 0, "the booting sandbox has no directory")
    assert(#listdir(b.state .. "/layers/" .. snap_id) > 0, "the capture's layer is not there")
    b.p:kill("KILL")
    b.p:wait()
    for _, t in ipairs(pending) do task.join(t) end
    -- The keepers die with the server (parent-death signal); the next start must not race them.
    b2 = L.start { state = b.state }
  end))

  teardown(T.async(function()
    if b2 then b2:stop() end
    if b then L.remove_tree(b.state) end
  end))

  it("mid-terminate: the sandbox is terminated, and nothing of it is left", T.async(function()
    local _, got = b2:req("GET", "/v1/sandboxes/" .. term.id)
    assert.are.equal("terminated", got.status, term.id)
    assert(du(b.state .. "/sandboxes/" .. term.id) < MB, "its 20 MB are still there")
    assert.are.same({}, listdir(b.state .. "/sandboxes/" .. term.id), term.id .. "'s directory is still there")
    assert.are.same({}, cgroup_dirs(term.id), term.id .. "'s cgroups are still there")
  end))

  it("mid-upload: nothing spooled survives, and the sandbox says the restart ended it", T.async(function()
    for _, dir in ipairs(SPOOLS) do
      assert.are.same({}, listdir(b.state .. "/" .. dir), dir .. " still holds the spooled upload")
    end
    local _, got = b2:req("GET", "/v1/sandboxes/" .. up.id)
    assert.are.equal("errored", got.status, up.id)
    assert.are.same({}, listdir(b.state .. "/sandboxes/" .. up.id), up.id .. "'s directory is still there")
  end))

  it("mid-capture: the snapshot says failed, and its layer files are gone", T.async(function()
    local s, snap = b2:req("GET", "/v1/sandbox-groups/" .. gid .. "/snapshots/" .. snap_id,
      { query = { ownerId = b2.workspace } })
    assert.are.equal(200, s)
    assert.are.equal("failed", snap.status, json.encode(snap))
    assert.is_string(snap.error)
    for _, name in ipairs(listdir(b.state .. "/layers")) do
      assert(name:sub(1, #snap_id) ~= snap_id, "layers/" .. name .. " of the failed snapshot is still there")
    end
  end))

  it("mid-create: the sandbox says the restart ended it, and its directory and cgroups are gone", T.async(function()
    local _, got = b2:req("GET", "/v1/sandboxes/" .. boot.id)
    assert.are.equal("errored", got.status, boot.id)
    assert.are.same({}, listdir(b.state .. "/sandboxes/" .. boot.id), boot.id .. "'s directory is still there")
    assert.are.same({}, cgroup_dirs(boot.id), boot.id .. "'s cgroups are still there")
  end))

  it("leaves 0 bytes the records do not account for", T.async(function()
    local left = leftovers(b2, gid, { term.id, up.id, cap.id, boot.id })
    assert(#left == 0, "left after the restart:\n  " .. table.concat(left, "\n  "))
  end))
end)

-- A free TCP port on loopback (the kernel's choice, let go of at once). [yields]
local function free_port()
  local srv = require("moonbox.httpd").listen { host = "127.0.0.1", also_host = "::1", port = 0 }
  local port = srv.port
  srv:close()
  return port
end

-- Sends make() in a tight loop from before the server listens, and answers what the first
-- request that got through got (status, body, headers): the request goes out the moment a
-- connection is made. [yields]
local function first_through(make, until_)
  while true do
    local ok, r = pcall(make)
    if ok then return r end
    local code = type(r) == "table" and r.code
    assert(code == "connect_failed", "a request failed other than by a refused connection: " .. tostring(r))
    assert(task.now() < until_, "the server did not open its port")
  end
end

-- POST /v1/sandboxes the moment the port opens; 503 (with Retry-After) is a refusal to retry.
-- Returns the created sandbox's id. [yields]
local function create_at_open(b)
  local body = json.encode { ownerId = b.workspace, networkPolicy = { default = "deny-all" } }
  local function create()
    return http.request { method = "POST", url = b.url .. "/v1/sandboxes", body = body, timeout = 60,
      fresh_connect = true, headers = { Authorization = "Bearer " .. b.key, ["Content-Type"] = "application/json" } }
  end
  local r = first_through(create, task.now() + 120)
  local first = r.status
  while r.status == 503 do
    assert.are.equal("1", r.headers["retry-after"], "a 503 at start without Retry-After: 1")
    local err = json.decode(r.body)
    assert(type(err) == "table" and type(err.message) == "string", "a 503 not in Render's error shape: " .. r.body)
    task.sleep(0.01)
    r = create()
  end
  assert(r.status == 201, "the create sent as the port opened answered " .. r.status .. ": " .. r.body)
  return json.decode(r.body).id, first
end

describe("a create sent the moment the port opens", function()
  local seen = {}
  teardown(function() print("\n  first answers at open: " .. table.concat(seen, " ")) end)

  it("on a fresh state dir, is never killed by the start's recovery", T.async(function()
    for round = 1, 3 do
      local b = L.start { port = free_port(), nowait = true }
      local ok, err = pcall(function()
        local id, first = create_at_open(b)
        seen[#seen + 1] = "fresh:" .. first
        local got = b:wait_status(id, "running")
        assert.are.equal("running", got.status, "round " .. round)
        local r = b:exec(id, "echo alive")
        assert.are.equal("alive\n", r.stdout, "round " .. round .. ": " .. tostring(r.body))
      end)
      b:destroy()
      if not ok then error(err, 0) end
    end
  end))

  it("on a restarted server, is never killed by its recovery, and nothing dead is listed running", T.async(function()
    local b = L.start()
    local ok, err = pcall(function()
      for round = 1, 2 do
        local dead = b:create { networkPolicy = { default = "deny-all" } }
        b.p:kill("KILL")
        b.p:wait()
        b = L.start { state = b.state, port = free_port(), nowait = true }
        -- Two clients at once: one lists what runs, one creates.
        local lister = task.spawn(function()
          return first_through(function()
            return http.request { url = b.url .. "/v1/sandboxes/" .. dead.id, timeout = 60, fresh_connect = true,
              headers = { Authorization = "Bearer " .. b.key } }
          end, task.now() + 120)
        end)
        local id, first = create_at_open(b)
        seen[#seen + 1] = "restart:" .. first
        local r = task.join(lister)
        if r.status ~= 503 then
          assert.are.equal(200, r.status, r.body)
          assert.are_not.equal("running", json.decode(r.body).status,
            "round " .. round .. ": the dead sandbox " .. dead.id .. " was answered running")
        end
        local got = b:wait_status(id, "running")
        assert.are.equal("running", got.status, "round " .. round)
        local _, d = b:req("GET", "/v1/sandboxes/" .. dead.id)
        assert.are.equal("errored", d.status)
      end
    end)
    b:destroy()
    if not ok then error(err, 0) end
  end))
end)

-- The records' side of "memory never runs ahead of the database": a write SQLite refuses as
-- full (a real SQLITE_FULL: the database is held at its current size by max_page_count) leaves
-- the record, the memory tables and the database as they were, and says which record and why.
describe("a record write refused by a full database", function()
  it("changes nothing: not the record, not memory, not the database", T.async(function()
    local State = require "moonbox.local.state"
    local dir = proc.run({ "mktemp", "-d", "/tmp/moonbox-crash-state.XXXXXX" }).stdout:gsub("%s+$", "")
    local ok, err = pcall(function()
      local st = State.open(dir .. "/local.db")
      local rec = { id = "sbx-full0000000000000000000", status = "running", sandboxGroupId = "sbg-x" }
      st:update("sandbox", rec, {})
      assert.is_number(rec._seq)
      local pages = st.db:value("PRAGMA page_count")
      st.db:value("PRAGMA max_page_count = " .. pages)
      local pad = string.rep("x", 256 * 1024) -- needs pages the database may not grow by
      local uok, uerr = pcall(st.update, st, "sandbox", rec, { status = "terminated", _pending = State.NONE, pad = pad })
      assert.is_false(uok, "the write went through")
      assert.are.equal("disk_full", uerr.code, tostring(uerr))
      assert.matches(rec.id, uerr.message, 1, true)
      assert.is_nil(uerr.message:find(dir, 1, true), "the message names a host path: " .. uerr.message)
      assert.are.equal("running", rec.status)
      assert.is_nil(rec.pad)
      assert.are.equal(rec, rawget(st.sandboxes, rec.id), "the live record left memory")
      -- a new record that cannot be written is not in memory either
      local new = { id = "sbx-full0000000000000000001", status = "creating", pad = pad }
      assert.is_false((pcall(st.update, st, "sandbox", new, {})))
      assert.is_nil(new._seq)
      assert.is_nil(rawget(st.sandboxes, new.id))
      st:close()
      local again = State.open(dir .. "/local.db")
      assert.are.equal("running", again.sandboxes[rec.id].status)
      assert.is_nil(again.sandboxes[new.id])
      again:close()
    end)
    proc.run { "rm", "-rf", dir }
    if not ok then error(err, 0) end
  end))
end)
