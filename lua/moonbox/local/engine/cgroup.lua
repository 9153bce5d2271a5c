--- moonbox.local.engine.cgroup — the cgroups that hold, limit and freeze a sandbox.
--
-- Each sandbox gets one cgroup per controller moonbox uses, <hierarchy>/moonbox/<tag>/<id>,
-- where tag is derived from the engine's state directory (two engines on one machine never
-- touch each other's cgroups). Its plan's limits are set there: memory (and swap to the same
-- bound: nothing beyond the plan), CPU quota, number of processes. Where the freezer is (the
-- v1 freezer hierarchy, or the v2 unified one), it has two leaves:
--   sandbox  every process of the sandbox (its init, commands, slirp4netns); frozen on suspend;
--   helper   the file helpers of the backend; never frozen, so files can be read from a
--            suspended sandbox and a runtime capture can save /dev while the sandbox is frozen;
--            still inside the sandbox's limits.
-- The v1 memory, cpu and pids hierarchies need no leaves (nothing is frozen there, so nothing
-- has to be kept apart): every process of the sandbox lives in <id> itself, under its limits.
-- A cgroup directory costs the kernel a good part of a millisecond to make and remove (memory
-- cgroups most), so a sandbox has six on v1 rather than twelve.
-- cgroup v1 (one hierarchy per controller, as on these machines) and v2 (one unified
-- hierarchy, controllers enabled down the tree through cgroup.subtree_control) are both
-- supported. Processes are put in by the helper (moonbox-sandbox writes cgroup.procs before it
-- forks, so everything a sandbox starts is born inside); this module makes the directories,
-- writes limits and freezer state, and reads membership.
-- Freezing is polled (1 ms): neither version offers a readiness fd we could watch, and a
-- freeze takes microseconds to milliseconds.
local task = require "moonbox.task"
local host = require "moonbox.local.engine.host"
local sys = require "moonbox.sys"

local M = {}
local Cgroup = {}
Cgroup.__index = Cgroup

local V1_CONTROLLERS = { "freezer", "memory", "cpu", "pids" }

--- cgroup.detect(tag[, root]) -> Cgroup, or nil and a sentence saying why none is usable.
-- root overrides the hierarchy (a v2 hierarchy is recognised by its cgroup.controllers file;
-- anything else is taken as the directory holding v1 controller hierarchies). Limits that a
-- hierarchy cannot enforce are listed in cg.missing (eng:check() reports them). Does not yield.
function M.detect(tag, root)
  local base = root or "/sys/fs/cgroup"
  local cg = setmetatable({ tag = tag, dirs = {}, missing = {} }, Cgroup)
  if host.exists(base .. "/freezer/cgroup.procs") then
    cg.version = 1
    for _, c in ipairs(V1_CONTROLLERS) do
      if host.exists(base .. "/" .. c .. "/cgroup.procs") then
        cg.dirs[c] = base .. "/" .. c .. "/moonbox/" .. tag
      else
        cg.missing[#cg.missing + 1] = c
      end
    end
    cg.root = base .. "/freezer"
  elseif host.exists(base .. "/cgroup.controllers") then
    cg.version = 2
    cg.dirs.unified = base .. "/moonbox/" .. tag
    cg.root = base
    local have = host.read(base .. "/cgroup.controllers") or ""
    for _, c in ipairs({ "memory", "cpu", "pids" }) do
      if not have:find("%f[%w]" .. c .. "%f[%W]") then cg.missing[#cg.missing + 1] = c end
    end
  else
    return nil, "no usable cgroup hierarchy (neither the cgroup v1 freezer hierarchy at " ..
      base .. "/freezer nor a unified cgroup v2 hierarchy at " .. base .. " is mounted), " ..
      "so sandboxes cannot be limited, suspended or tracked"
  end
  cg.dir = cg.dirs.freezer or cg.dirs.unified -- the hierarchy membership is read from
  return cg
end

--- cg:path(id[, leaf[, controller]]) -> a directory of sandbox id's cgroup: its top (where the
-- limits are), or its "sandbox" or "helper" leaf, in the freezer (v1) or unified hierarchy,
-- or in the given v1 controller's.
function Cgroup:path(id, leaf, controller)
  local d = (controller and self.dirs[controller] or self.dir) .. "/" .. id
  return leaf and (d .. "/" .. leaf) or d
end

-- Whether hierarchy c (a key of cg.dirs) has the sandbox and helper leaves (see the header).
local function has_leaves(c) return c == "freezer" or c == "unified" end

--- cg:leaves(id, leaf) -> array of the directories a process of the leaf ("sandbox" or
-- "helper") must join, one per hierarchy: the leaf where the freezer is, <id> itself in the
-- other v1 controllers' hierarchies.
function Cgroup:leaves(id, leaf)
  local out = {}
  for _, c in ipairs(self.version == 1 and V1_CONTROLLERS or { "unified" }) do
    local dir = self.dirs[c]
    if dir then out[#out + 1] = dir .. "/" .. id .. (has_leaves(c) and ("/" .. leaf) or "") end
  end
  return out
end

--- cg:freezer(id) -> the directory whose freezer stops the sandbox's processes.
function Cgroup:freezer(id) return self:path(id, "sandbox") end

local function write(path, value)
  local ok, err = host.write(path, value)
  if not ok then error("cannot write " .. value .. " to " .. path .. ": " .. tostring(err), 0) end
end

-- v2: enables the controllers we limit in a parent's subtree_control (idempotent).
local function enable_v2(dir)
  local ctl = host.read(dir .. "/cgroup.controllers") or ""
  local want = {}
  for _, c in ipairs({ "memory", "cpu", "pids" }) do
    if ctl:find("%f[%w]" .. c .. "%f[%W]") then want[#want + 1] = "+" .. c end
  end
  if #want > 0 then host.write(dir .. "/cgroup.subtree_control", table.concat(want, " ")) end
end

-- ---- fairness: the engine's parent cgroups and the host side -------------------------------------
-- Three rules keep one hostile sandbox from slowing the backend and the other sandboxes:
--   * the sandboxes' parent (<hierarchy>/moonbox/<tag>) caps what all of them take together:
--     CPU to the machine's CPUs less HOST_CPU_RESERVE (a CFS quota: with 2 CPUs, 1.5), memory to
--     the machine's less a headroom (so their pressure is reclaimed inside their own cgroups,
--     not in the server's allocations), processes to three quarters of the kernel's pid space;
--   * every sandbox has the same CPU weight (SANDBOX_SHARES), whatever its plan: the plan's
--     quota caps it, the weight only decides who waits when the parent's quota is contended;
--   * the host side (the server and the helpers it starts) lives in the CPU cgroup
--     <cpu>/moonbox/<tag>.host, weighted HOST_SHARES against the parent's SANDBOX_SHARES, so
--     it wins the CPU whenever both want it, and (eng:exec, files) the helper that enters a
--     sandbox stays there: only the process it forks joins the sandbox's cgroups, so a sandbox
--     at its pids or memory limit does not stop the host's helper, and the helper is never
--     counted in a sandbox's limits.
-- cg:prepare(false) (MOONBOX_LOCAL_FAIRNESS=off, for the noisy-neighbour bench) undoes the
-- first and last rules: the parent unlimited, the host side not weighted.
M.HOST_CPU_RESERVE = 0.5
M.SANDBOX_SHARES = 1024
M.HOST_SHARES = 8192
M.MEMORY_HEADROOM = 1024 * 1024 * 1024 -- at least; 1/8 of the machine's memory when larger
M.PERIOD = 100000

-- The machine's CPUs (online), memory (bytes) and pid space, from /sys and /proc.
local function machine()
  local cpus = 0
  local online = host.read("/sys/devices/system/cpu/online") or "0"
  for a, b in online:gmatch("(%d+)%-?(%d*)") do
    cpus = cpus + (b ~= "" and (tonumber(b) - tonumber(a) + 1) or 1)
  end
  local mem = tonumber((host.read("/proc/meminfo") or ""):match("MemTotal:%s+(%d+)")) or 0
  local pid_max = tonumber(host.read("/proc/sys/kernel/pid_max") or "") or 32768
  local threads = tonumber(host.read("/proc/sys/kernel/threads-max") or "") or pid_max
  return math.max(cpus, 1), mem * 1024, math.min(pid_max, threads)
end
M.machine = machine

--- cg:fair_limits() -> { cpus, memory, pids }: what the sandboxes' parent is capped to (see
-- above), from this machine's size (the same for every engine).
function Cgroup.fair_limits()
  local cpus, mem, pids = machine()
  return { cpus = math.max(cpus - M.HOST_CPU_RESERVE, 0.5),
    memory = math.max(mem - math.max(M.MEMORY_HEADROOM, mem // 8), M.MEMORY_HEADROOM),
    pids = math.floor(pids * 3 / 4) }
end

--- cg:host_dir() -> the CPU cgroup of this engine's host side (v1: <cpu>/moonbox/<tag>.host; v2:
-- <root>/moonbox/<tag>.host), nil without a CPU hierarchy.
function Cgroup:host_dir()
  local d = self.dirs.cpu or self.dirs.unified
  return d and (d .. ".host")
end

--- cg:prepare(fair) makes the engine's parent cgroups and its host side's, and sets or (fair ==
-- false) clears the parent's caps and the host side's weight (see above). Idempotent. Raises a
-- plain error naming the file that could not be written. Does not yield.
function Cgroup:prepare(fair)
  self.fair = fair ~= false
  local lim = self:fair_limits()
  for c, dir in pairs(self.dirs) do
    sys.mkdir_p(dir, tonumber("755", 8))
    if self.version == 2 then
      enable_v2(self.root)
      enable_v2(self.root .. "/moonbox")
      enable_v2(dir)
    end
    if c == "cpu" then
      if self.fair then -- an older backend's sandboxes may have more than the cap (see cg:quota)
        local ok, names = pcall(sys.listdir, dir)
        for _, n in ipairs(ok and names or {}) do
          local q = tonumber(host.read(dir .. "/" .. n .. "/cpu.cfs_quota_us") or "")
          if q and (q < 0 or q > lim.cpus * M.PERIOD) then
            host.write(dir .. "/" .. n .. "/cpu.cfs_quota_us", tostring(math.floor(lim.cpus * M.PERIOD)))
          end
        end
      end
      write(dir .. "/cpu.cfs_period_us", tostring(M.PERIOD))
      write(dir .. "/cpu.cfs_quota_us", self.fair and tostring(math.floor(lim.cpus * M.PERIOD)) or "-1")
      write(dir .. "/cpu.shares", tostring(M.SANDBOX_SHARES))
    elseif c == "memory" then
      -- memsw first when lowering: it may never be below limit_in_bytes (and the reverse
      -- when raising); "-1" is unlimited for both.
      local v = self.fair and tostring(lim.memory) or "-1"
      local sw = host.exists(dir .. "/memory.memsw.limit_in_bytes")
      if self.fair then
        write(dir .. "/memory.limit_in_bytes", v)
        if sw then write(dir .. "/memory.memsw.limit_in_bytes", v) end
      else
        if sw then write(dir .. "/memory.memsw.limit_in_bytes", v) end
        write(dir .. "/memory.limit_in_bytes", v)
      end
    elseif c == "pids" then
      write(dir .. "/pids.max", self.fair and tostring(lim.pids) or "max")
    elseif c == "unified" then
      if host.exists(dir .. "/cpu.max") then
        write(dir .. "/cpu.max", (self.fair and tostring(math.floor(lim.cpus * M.PERIOD)) or "max")
          .. " " .. M.PERIOD)
      end
      if host.exists(dir .. "/memory.max") then
        write(dir .. "/memory.max", self.fair and tostring(lim.memory) or "max")
      end
      if host.exists(dir .. "/pids.max") then
        write(dir .. "/pids.max", self.fair and tostring(lim.pids) or "max")
      end
    end
  end
  local hd = self:host_dir()
  if hd then
    sys.mkdir_p(hd, tonumber("755", 8))
    if self.version == 1 then
      write(hd .. "/cpu.shares", tostring(self.fair and M.HOST_SHARES or 1024))
    elseif host.exists(hd .. "/cpu.weight") then
      -- v2 weights: 100 is a default task's; the same ratio as v1's shares
      write(hd .. "/cpu.weight", tostring(self.fair and (100 * M.HOST_SHARES // 1024) or 100))
    end
  end
end

--- cg:quota(cpus) -> the CFS quota (µs per 100 ms) of a sandbox of cpus CPUs: at most the
-- parent's while it is capped (v1 refuses a child's quota above its parent's: a 2c-4g plan
-- on a 2-CPU machine gets 1.5 CPUs, which is all that sandboxes get together there).
function Cgroup:quota(cpus)
  local q = math.floor(cpus * M.PERIOD)
  if self.fair then q = math.min(q, math.floor(self:fair_limits().cpus * M.PERIOD)) end
  return q
end

--- cg:join_host(pid): moves process pid (all its threads) into the host side's CPU cgroup
-- (cg:prepare first). No-op without one. Raises a plain error when the write fails. On v2 a
-- process in a cgroup with children ("no internal processes") cannot be moved there: the
-- host side's cgroup has none. Does not yield.
function Cgroup:join_host(pid)
  local hd = self:host_dir()
  if hd then write(hd .. "/cgroup.procs", tostring(pid)) end
end

--- cg:create(id, limits): makes sandbox id's cgroups and both leaves, and sets limits:
-- { memory = bytes, cpus = n (may be fractional), pids = n } (any may be nil: unlimited).
-- Raises a plain error naming the file that could not be written. Does not yield.
function Cgroup:create(id, limits)
  limits = limits or {}
  for c, dir in pairs(self.dirs) do
    local top = dir .. "/" .. id
    sys.mkdir_p(top, tonumber("755", 8)) -- the parent usually exists: one mkdir and a chmod
    if has_leaves(c) then
      sys.mkdir_p(top .. "/sandbox", tonumber("755", 8))
      sys.mkdir_p(top .. "/helper", tonumber("755", 8))
    end
    if self.version == 2 then
      local moonbox = self.root .. "/moonbox"
      enable_v2(self.root)
      enable_v2(moonbox)
      enable_v2(dir)
      enable_v2(top)
    end
    if c == "memory" and limits.memory then
      write(top .. "/memory.limit_in_bytes", tostring(limits.memory))
      if host.exists(top .. "/memory.memsw.limit_in_bytes") then
        write(top .. "/memory.memsw.limit_in_bytes", tostring(limits.memory))
      end
    elseif c == "cpu" then
      write(top .. "/cpu.shares", tostring(M.SANDBOX_SHARES)) -- the same for every plan
      if limits.cpus then
        write(top .. "/cpu.cfs_period_us", "100000")
        write(top .. "/cpu.cfs_quota_us", tostring(self:quota(limits.cpus)))
      end
    elseif c == "pids" and limits.pids then
      write(top .. "/pids.max", tostring(limits.pids))
    elseif c == "unified" then
      if limits.memory and host.exists(top .. "/memory.max") then
        write(top .. "/memory.max", tostring(limits.memory))
        if host.exists(top .. "/memory.swap.max") then write(top .. "/memory.swap.max", "0") end
      end
      if limits.cpus and host.exists(top .. "/cpu.max") then
        write(top .. "/cpu.max", self:quota(limits.cpus) .. " 100000")
      end
      if limits.pids and host.exists(top .. "/pids.max") then write(top .. "/pids.max", tostring(
        limits.pids)) end
    end
  end
end

--- cg:exists(id) -> whether sandbox id's cgroup exists.
function Cgroup:exists(id) return host.exists(self:path(id) .. "/cgroup.procs") end

--- cg:procs(id) -> array of host pids in sandbox id's cgroup, both leaves (empty when it does
-- not exist). Zombies that wait for their reaper are not listed by the kernel.
function Cgroup:procs(id)
  local pids = {}
  for _, leaf in ipairs({ "sandbox", "helper", false }) do
    local s = host.read((leaf and self:path(id, leaf) or self:path(id)) .. "/cgroup.procs")
    for pid in (s or ""):gmatch("%d+") do pids[#pids + 1] = tonumber(pid) end
  end
  return pids
end

--- cg:oom_kills(id) -> how many processes the kernel's OOM killer ended in the sandbox; nil
-- when the hierarchy does not say. Read from <id>: on v1 that is where every process of the
-- sandbox lives (a v1 memory cgroup counts the kills of its own processes only); v2's
-- memory.events counts those of its descendants too.
function Cgroup:oom_kills(id)
  local f = self.version == 1 and (self:path(id, nil, "memory") .. "/memory.oom_control")
    or (self:path(id) .. "/memory.events")
  return tonumber((host.read(f) or ""):match("oom_kill (%d+)"))
end

--- cg:frozen(id) -> boolean: whether the sandbox leaf is frozen or being frozen.
function Cgroup:frozen(id)
  local d = self:freezer(id)
  if self.version == 1 then
    local s = host.read(d .. "/freezer.state") or ""
    return s:find("FROZEN") ~= nil or s:find("FREEZING") ~= nil
  end
  return (host.read(d .. "/cgroup.freeze") or ""):match("^%s*1") ~= nil
end

local function freeze_done(self, id)
  local d = self:freezer(id)
  if self.version == 1 then
    return (host.read(d .. "/freezer.state") or ""):match("^%s*FROZEN") ~= nil
  end
  return (host.read(d .. "/cgroup.events") or ""):find("frozen 1", 1, true) ~= nil
end

--- cg:freeze(id[, seconds]) -> true, or nil and a message. Asks the kernel to stop every
-- process of the sandbox leaf and waits (polling every millisecond, up to seconds, default 10)
-- until all are stopped; on a timeout the leaf is thawed again. [yields]
function Cgroup:freeze(id, seconds)
  local d = self:freezer(id)
  local file, value = "freezer.state", "FROZEN"
  if self.version == 2 then file, value = "cgroup.freeze", "1" end
  local ok, err = host.write(d .. "/" .. file, value)
  if not ok then return nil, "cannot write " .. d .. "/" .. file .. ": " .. tostring(err) end
  local deadline = task.now() + (seconds or 10)
  local polls = 0
  while not freeze_done(self, id) do
    if task.now() > deadline then
      self:thaw(id)
      return nil, "the processes of sandbox " .. id .. " did not all stop within " ..
        (seconds or 10) .. " s (one may be stuck in the kernel)"
    end
    task.sleep(0.001)
    polls = polls + 1
    -- The v1 freezer can stay FREEZING when a task was busy in the kernel (forking, entering
    -- namespaces) at the moment of the request; asking again makes it retry those tasks, and
    -- a brief thaw now and then unblocks one caught between two others (runc does the same).
    if polls % 10 == 0 then host.write(d .. "/" .. file, value) end
    if polls % 200 == 0 then
      self:thaw(id)
      task.sleep(0.001)
      host.write(d .. "/" .. file, value)
    end
  end
  return true
end

--- cg:thaw(id) -> true, or nil and a message. Lets the processes run again; immediate.
-- Thawing a leaf that is not frozen (or does not exist) is a no-op. Does not yield.
function Cgroup:thaw(id)
  local d = self:freezer(id)
  if not host.exists(d) then return true end
  local file, value = "freezer.state", "THAWED"
  if self.version == 2 then file, value = "cgroup.freeze", "0" end
  local ok, err = host.write(d .. "/" .. file, value)
  if not ok then return nil, "cannot write " .. d .. "/" .. file .. ": " .. tostring(err) end
  return true
end

-- rmdir(2) of d (remove(3): an unlink that fails, then rmdir): true, false when d is missing,
-- or nil and the message.
local function rmdir(d)
  local ok, err, code = os.remove(d)
  if ok then return true end
  if code == 2 then return false end -- ENOENT
  return nil, err
end

--- cg:remove(id) -> true, or nil and a message. Removes sandbox id's (empty) cgroups in every
-- hierarchy, leaves first; missing ones count as removed. A hierarchy without leaves (see the
-- header) may still hold them when an older backend made the cgroups: they go too. Does not
-- yield.
function Cgroup:remove(id)
  for c, dir in pairs(self.dirs) do
    local top = dir .. "/" .. id
    if has_leaves(c) or rmdir(top) == nil then
      for _, d in ipairs({ top .. "/sandbox", top .. "/helper", top }) do
        local ok, err = rmdir(d)
        if ok == nil then return nil, err end
      end
    end
  end
  return true
end

--- cg:ids() -> array of the sandbox ids that have a cgroup under this engine's tag.
function Cgroup:ids()
  local ok, names = pcall(sys.listdir, self.dir)
  if not ok then return {} end
  local out = {}
  for _, n in ipairs(names) do
    if host.exists(self.dir .. "/" .. n .. "/cgroup.procs") then out[#out + 1] = n end
  end
  return out
end

return M
