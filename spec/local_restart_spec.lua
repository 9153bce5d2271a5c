-- `moonbox local` killed with SIGKILL while it runs a sandbox and holds another suspended
-- (frozen): nothing of either may outlive it, and the next start on the same state directory
-- must say what happened to them and free what they left on disk. Everything here is the
-- host's view of a real backend process: its children, /proc, the cgroup hierarchies and every
-- process's mount namespace. (A clean stop, SIGTERM, is pinned by spec/local_api_spec.lua's
-- "restart" spec.) Needs root and slirp4netns (the suspended sandbox has a network: its
-- slirp4netns must go too); CI has both.
local T = require "moonbox.testing"
local json = require "moonbox.json"
local http = require "moonbox.http"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local L = require "spec.support.local_backend"
local files = require "spec.support.files"

local read_file = files.read

-- Every process on the host now: pid -> {start, ppid, uid, comm, mnt, user, pidns}. start is the
-- kernel's start time, so a pid reused by a new process is not taken for the old one.
local function host_processes()
  local r = proc.run { "sh", "-c", "find /proc -mindepth 3 -maxdepth 3 -path '/proc/[0-9]*/ns/*' " ..
    "\\( -name mnt -o -name user -o -name pid \\) -printf '%p %l\\n' 2>/dev/null; true" }
  local ns = {}
  for pid, name, target in r.stdout:gmatch("/proc/(%d+)/ns/(%a+) (%S*)\n") do
    ns[pid] = ns[pid] or {}
    ns[pid][name] = target
  end
  local out = {}
  for pid, n in pairs(ns) do
    local stat = read_file("/proc/" .. pid .. "/stat")
    local status = read_file("/proc/" .. pid .. "/status")
    if stat and status and (n.mnt or "") ~= "" then
      local comm, rest = stat:match("^%d+ %((.*)%) (.*)$")
      local fields = {}
      for f in rest:gmatch("%S+") do fields[#fields + 1] = f end
      out[tonumber(pid)] = { start = fields[20], ppid = tonumber(fields[2]), comm = comm,
        uid = tonumber(status:match("\nUid:%s*(%d+)")), mnt = n.mnt, user = n.user, pidns = n.pid }
    end
  end
  return out
end

local cgroup_dirs = L.cgroup_dirs

-- pids in the cgroups of sandbox id (any leaf, any hierarchy).
local function cgroup_pids(id)
  local pids = {}
  for _, d in ipairs(cgroup_dirs(id)) do
    local r = proc.run { "sh", "-c", 'cat "$1"/cgroup.procs "$1"/*/cgroup.procs 2>/dev/null; true', "sh", d }
    for pid in r.stdout:gmatch("%d+") do pids[tonumber(pid)] = true end
  end
  return pids
end

local wait_until = require("spec.support.poll").wait

-- Bytes under path, the sandbox disk's contents included (its mount at <state>/sandboxes), the
-- image file itself not (a sparse file whose apparent size is the whole disk's).
local function du(path)
  return tonumber(proc.run({ "du", "-sb", "--exclude=sandbox-disk.img", path }).stdout:match("^(%d+)")) or 0
end

-- What one sandbox is on the host, recorded while the backend still runs.
local function record(b, id)
  local all = host_processes()
  local pids = cgroup_pids(id)
  local rec = { id = id, procs = {}, mnt = {}, user = nil, base = nil, dir = b.state .. "/sandboxes/" .. id }
  -- its keeper: the backend's child that started it
  for pid, p in pairs(all) do
    if p.ppid == b.p.pid and (read_file("/proc/" .. pid .. "/cmdline") or ""):find("--id=" .. id, 1, true) then
      pids[pid] = true
    end
  end
  for pid in pairs(pids) do
    local p = all[pid]
    if p then
      rec.procs[pid] = p
      rec.mnt[p.mnt] = true
      local map = read_file("/proc/" .. pid .. "/uid_map") or ""
      local base = map:match("^%s*0%s+(%d+)%s+65536")
      if base then rec.base, rec.user = tonumber(base), p.user end
    end
  end
  return rec
end

-- The kernel's clock of process start times (clock ticks since boot), now.
local function ticks_now()
  local up = tonumber(read_file("/proc/uptime"):match("^([%d.]+)"))
  return math.floor(up * tonumber(proc.run({ "getconf", "CLK_TCK" }).stdout))
end

-- Processes of the recorded sandbox still alive anywhere on the host: the same pid and start,
-- or one in its user namespace or any of its mount namespaces (the host's own excepted) that
-- either started before the kill or runs in its id range. The kernel reuses namespace numbers
-- once they are freed, so a namespace alone would also catch another backend's new sandbox.
local function survivors(rec)
  local left = {}
  for pid, p in pairs(host_processes()) do
    local old = rec.procs[pid]
    local in_range = rec.base and p.uid and p.uid >= rec.base and p.uid < rec.base + 65536
    local ours = (tonumber(p.start) or 0) <= rec.killed_at or in_range
    local why = (old and old.start == p.start and "recorded before the kill")
      or (p.user == rec.user and ours and "in its user namespace")
      or (rec.mnt[p.mnt] and p.mnt ~= rec.host_mnt and ours and "in one of its mount namespaces")
    if why then left[#left + 1] = string.format("%d (%s): %s", pid, p.comm, why) end
  end
  return left
end

describe("a SIGKILLed server", function()
  local b, running, suspended, recs, self_mnt
  local MB = 1000 * 1000

  setup(T.async(function()
    assert(proc.run({ "id", "-u" }).stdout == "0\n", "this spec needs root")
    self_mnt = host_processes()[tonumber(read_file("/proc/self/stat"):match("^(%d+)"))].mnt
    b = L.start()
    running = b:create { networkPolicy = { default = "deny-all" } }
    suspended = b:create { networkPolicy = { default = "allow-all" } }
    for _, sb in ipairs({ running, suspended }) do
      -- a daemon of its own session, a background job, and 20 MB of its own files
      local r = b:exec(sb.id, "setsid -f sleep 100000; (sleep 100000 &); head -c 20000000 /dev/urandom > /root/big")
      assert(r.code == 0, "preparing " .. sb.id .. ": " .. r.stderr)
    end
    assert.are.equal(202, (b:req("POST", "/v1/sandboxes/" .. suspended.id .. "/suspend")))
    b:wait_status(suspended.id, "suspended")
    recs = { record(b, running.id), record(b, suspended.id) }
    for _, rec in ipairs(recs) do
      local n = 0
      for _ in pairs(rec.procs) do n = n + 1 end
      -- keeper, init, the two sleeps (and slirp4netns for the suspended one)
      local found = {}
      for pid, p in pairs(rec.procs) do found[#found + 1] = pid .. " " .. p.comm end
      assert(n >= 4, rec.id .. ": only " .. n .. " processes found: " .. table.concat(found, ", "))
      assert(rec.base and rec.user, rec.id .. ": no process shows the sandbox's id range")
      assert(du(rec.dir) > 20 * MB, rec.id .. ": its 20 MB are not in " .. rec.dir)
      -- The detector sees them while they live (else its silence later would prove nothing).
      rec.killed_at, rec.host_mnt = ticks_now(), self_mnt
      local seen = survivors(rec)
      assert(#seen >= n, rec.id .. ": survivors() sees only " .. table.concat(seen, ", "))
      local own_mnt = 0
      for ns in pairs(rec.mnt) do if ns ~= self_mnt then own_mnt = own_mnt + 1 end end
      assert(own_mnt >= 1, rec.id .. ": none of its processes has a mount namespace of its own")
      print(string.format("\n  %s before the kill: %s", rec.id, table.concat(seen, "; ")))
    end
    local frozen = false
    for _, d in ipairs(cgroup_dirs(suspended.id)) do
      local state = read_file(d .. "/sandbox/freezer.state")
      if state and state:find("FROZEN", 1, true) then frozen = true end
    end
    assert(frozen, "the suspended sandbox " .. suspended.id .. " is not frozen")
    b.p:kill("KILL")
    b.p:wait()
    for _, rec in ipairs(recs) do rec.killed_at, rec.host_mnt = ticks_now(), self_mnt end
  end))

  teardown(T.async(function()
    if b then
      for _, rec in ipairs(recs or {}) do
        for pid, p in pairs(rec.procs) do
          local now = host_processes()[pid]
          if now and now.start == p.start then pcall(sys.kill, pid, 9) end
        end
      end
      L.remove_tree(b.state)
    end
  end))

  it("leaves no process of a running or a suspended sandbox alive anywhere", T.async(function()
    for _, rec in ipairs(recs) do
      local left
      wait_until(30, function()
        left = survivors(rec)
        return #left == 0
      end, function() return "the processes of " .. rec.id .. " to end: " .. table.concat(left, ", ") end)
      local members = cgroup_pids(rec.id)
      assert.is_nil(next(members), rec.id .. "'s cgroups still hold processes")
    end
  end))

  it("leaves no mount of either sandbox in the host's or any other mount namespace", T.async(function()
    for _, rec in ipairs(recs) do
      wait_until(30, function() return #survivors(rec) == 0 end, function() return rec.id .. " to end" end)
      -- The sandbox disk (<state>/sandboxes) stays mounted for the next start; nothing else may.
      local info = read_file("/proc/self/mountinfo"):gsub("[^\n]* " .. b.state:gsub("%p", "%%%0") ..
        "/sandboxes [^\n]* %- btrfs [^\n]*\n", "")
      assert.is_nil(info:find(b.state, 1, true), "the host's mount table names the state dir:\n" .. info)
      -- a mount namespace outlives its processes only when something pins it: a process in it
      -- (none, see survivors), a bind mount of its nsfs file or an open descriptor
      for ns in pairs(rec.mnt) do
        if ns ~= self_mnt then
          local inode = ns:match("%[(%d+)%]")
          assert.is_nil(info:find("nsfs", 1, true) and info:find("mnt:%[" .. inode .. "%]"),
            rec.id .. "'s mount namespace " .. ns .. " is bind-mounted")
          local r = proc.run { "sh", "-c", 'ls -l /proc/[0-9]*/fd 2>/dev/null | grep -F "$1"; true', "sh", ns }
          assert.are.equal("", r.stdout, rec.id .. "'s mount namespace " .. ns .. " is held open")
        end
      end
    end
  end))

  it("leaves no root mount point in /run/moonbox/roots once their keepers are gone", T.async(function()
    -- no backend runs on the state dir now: the keepers themselves must remove them
    for _, rec in ipairs(recs) do
      wait_until(30, function() return #survivors(rec) == 0 end, function() return rec.id .. " to end" end)
      local left = {}
      for _, name in ipairs(sys.listdir("/run/moonbox/roots")) do
        if name:sub(-#rec.id - 1) == "-" .. rec.id then left[#left + 1] = name end
      end
      assert(#left == 0, rec.id .. "'s root mount point is still there: /run/moonbox/roots/" ..
        table.concat(left, ", "))
    end
  end))

  describe("the next start on the same state dir", function()
    local b2
    setup(T.async(function()
      for _, rec in ipairs(recs) do
        wait_until(30, function() return #survivors(rec) == 0 end, function() return rec.id .. " to end" end)
      end
      b2 = L.start { state = b.state }
    end))
    teardown(T.async(function() if b2 then b2:stop() end end))

    it("reports both sandboxes errored, saying why in their log streams", T.async(function()
      for _, sb in ipairs({ running, suspended }) do
        local s, got = b2:req("GET", "/v1/sandboxes/" .. sb.id)
        assert.are.equal(200, s)
        assert.are.equal("errored", got.status, sb.id)
        local resp <close> = http.stream { url = b2.url .. "/v1/sandboxes/" .. sb.id .. "/logs?follow=false",
          headers = { Authorization = "Bearer " .. b2.key, Accept = "text/event-stream" }, timeout = 30 }
        assert.are.equal(200, resp.status)
        local said, lifecycle = {}, {}
        while true do
          local ev = resp:read_event()
          if not ev then break end
          local d = json.decode(ev.data)
          if ev.event == "log" then said[#said + 1] = d.data end
          if ev.event == "lifecycle" then lifecycle[#lifecycle + 1] = d.type end
        end
        assert.matches("restarted", table.concat(said), 1, true)
        assert.are.equal("errored", lifecycle[#lifecycle], sb.id .. ": " .. json.encode(lifecycle))
      end
    end))

    it("frees their disk and removes their cgroups", T.async(function()
      for _, rec in ipairs(recs) do
        wait_until(30, function() return read_file(rec.dir .. "/upper/root/big") == nil and
          #cgroup_dirs(rec.id) == 0 end, function()
          return rec.id .. "'s directory and cgroups to go (" .. rec.dir .. ": " .. du(rec.dir) ..
            " bytes; cgroups: " .. table.concat(cgroup_dirs(rec.id), " ") .. ")"
        end)
        assert(du(rec.dir) < 1000 * 1000, rec.id .. " still holds " .. du(rec.dir) .. " bytes")
      end
      assert(du(b.state) < 10 * MB, "the state dir still holds " .. du(b.state) .. " bytes")
    end))

    it("runs new sandboxes as before", T.async(function()
      local sb = b2:create { networkPolicy = { default = "deny-all" } }
      assert.are.equal("fresh\n", b2:exec(sb.id, "echo fresh").stdout)
      assert.are.equal(204, (b2:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")))
    end))
  end)
end)

describe("a second backend on a state dir another one serves", function()
  it("does not start, and the first one's sandboxes keep running", T.async(function()
    local b1 = L.start()
    local ok, err = pcall(function()
      local sb = b1:create { networkPolicy = { default = "deny-all" } }
      local started, b2 = pcall(L.start, { state = b1.state })
      if started then b2:stop() end
      -- Whatever the second one did, the first one's sandbox is untouched...
      local _, got = b1:req("GET", "/v1/sandboxes/" .. sb.id)
      assert.are.equal("running", got.status)
      local r = b1:exec(sb.id, "echo alive")
      assert(r.status == 200 and r.stdout == "alive\n", "the first backend's sandbox " .. sb.id ..
        " no longer runs commands: " .. tostring(r.status) .. " " .. tostring(r.body))
      -- ...because the second one refused to serve from a state dir in use.
      assert.is_false(started, "a second backend started on " .. b1.state .. " while another served it")
    end)
    b1:destroy()
    if not ok then error(err, 0) end
  end))
end)
