--- moonbox.local.engine.cgroup — the freezer cgroup that holds every process of a sandbox.
--
-- Each sandbox gets <root>/moonbox/<tag>/<id>, where root is the cgroup v1 freezer hierarchy
-- (/sys/fs/cgroup/freezer) or, on a unified (v2) system, /sys/fs/cgroup itself; tag is derived
-- from the engine's state directory, so two engines on one machine (two test runs, two
-- backends) never touch each other's cgroups, not even in recover(). The engine creates the
-- directory and moves processes into it from the shell wrappers it spawns (a process must join
-- before it forks, or its children would stay outside); this module reads and writes the
-- control files. v1 says "FROZEN" in freezer.state once every task stopped; v2 says
-- "frozen 1" in cgroup.events. Both are polled: neither offers a readiness fd we could watch
-- through moonbox.proc, and freezing takes microseconds to milliseconds.
local task = require "moonbox.task"
local host = require "moonbox.local.engine.host"

local M = {}
local Cgroup = {}
Cgroup.__index = Cgroup

--- cgroup.detect(tag[, root]) -> Cgroup, or nil and a sentence saying why none is usable.
-- root overrides the hierarchy (a v2 hierarchy is recognised by its cgroup.controllers file;
-- anything else is taken as a v1 freezer hierarchy). Does not yield.
function M.detect(tag, root)
  local version
  if root then
    version = host.exists(root .. "/cgroup.controllers") and 2 or 1
  elseif host.exists("/sys/fs/cgroup/freezer/cgroup.procs") then
    root, version = "/sys/fs/cgroup/freezer", 1
  elseif host.exists("/sys/fs/cgroup/cgroup.controllers") then
    root, version = "/sys/fs/cgroup", 2
  else
    return nil, "no freezer cgroup is available (neither the cgroup v1 freezer hierarchy at " ..
      "/sys/fs/cgroup/freezer nor a unified cgroup v2 hierarchy at /sys/fs/cgroup is mounted), " ..
      "so sandboxes cannot be suspended and their processes cannot be tracked"
  end
  if not host.exists(root .. "/cgroup.procs") then
    return nil, "the cgroup hierarchy " .. root .. " is not mounted, so sandboxes cannot be " ..
      "suspended and their processes cannot be tracked"
  end
  return setmetatable({ root = root, version = version, dir = root .. "/moonbox/" .. tag }, Cgroup)
end

--- cg:path(id) -> the directory of sandbox id's cgroup.
function Cgroup:path(id) return self.dir .. "/" .. id end

--- cg:exists(id) -> whether sandbox id's cgroup directory exists.
function Cgroup:exists(id) return host.exists(self:path(id) .. "/cgroup.procs") end

--- cg:procs(id) -> array of host pids in the cgroup (empty when it does not exist). Zombies
-- that wait for their reaper are not listed by the kernel.
function Cgroup:procs(id)
  local s = host.read(self:path(id) .. "/cgroup.procs")
  local pids = {}
  for pid in (s or ""):gmatch("%d+") do pids[#pids + 1] = tonumber(pid) end
  return pids
end

--- cg:frozen(id) -> boolean: whether the cgroup is frozen or being frozen.
function Cgroup:frozen(id)
  if self.version == 1 then
    local s = host.read(self:path(id) .. "/freezer.state") or ""
    return s:find("FROZEN") ~= nil or s:find("FREEZING") ~= nil
  end
  return (host.read(self:path(id) .. "/cgroup.freeze") or ""):match("^%s*1") ~= nil
end

-- Whether the freeze requested for id has taken hold of every process.
function Cgroup:freeze_done(id)
  if self.version == 1 then
    return (host.read(self:path(id) .. "/freezer.state") or ""):match("^%s*FROZEN") ~= nil
  end
  return (host.read(self:path(id) .. "/cgroup.events") or ""):find("frozen 1", 1, true) ~= nil
end

--- cg:freeze(id[, seconds]) -> true, or nil and a message. Asks the kernel to stop every
-- process of the cgroup and waits (polling every millisecond, up to seconds, default 10)
-- until all are stopped; on a timeout the cgroup is thawed again. [yields]
function Cgroup:freeze(id, seconds)
  local file, value = "freezer.state", "FROZEN"
  if self.version == 2 then file, value = "cgroup.freeze", "1" end
  local ok, err = host.write(self:path(id) .. "/" .. file, value)
  if not ok then return nil, "cannot write " .. self:path(id) .. "/" .. file .. ": " .. tostring(err) end
  local deadline = task.now() + (seconds or 10)
  local polls = 0
  while not self:freeze_done(id) do
    if task.now() > deadline then
      self:thaw(id)
      return nil, "the processes of " .. self:path(id) .. " did not all stop within " ..
        (seconds or 10) .. " s (one may be stuck in the kernel)"
    end
    task.sleep(0.001)
    polls = polls + 1
    -- The v1 freezer can stay FREEZING when a task was busy in the kernel (forking, entering
    -- namespaces) at the moment of the request; asking again makes it retry those tasks, and
    -- a brief thaw now and then unblocks one caught between two others (runc does the same).
    if polls % 10 == 0 then host.write(self:path(id) .. "/" .. file, value) end
    if polls % 200 == 0 then
      self:thaw(id)
      task.sleep(0.001)
      host.write(self:path(id) .. "/" .. file, value)
    end
  end
  return true
end

--- cg:thaw(id) -> true, or nil and a message. Lets the processes run again; immediate.
-- Thawing a cgroup that is not frozen is a no-op. Does not yield.
function Cgroup:thaw(id)
  local file, value = "freezer.state", "THAWED"
  if self.version == 2 then file, value = "cgroup.freeze", "0" end
  local ok, err = host.write(self:path(id) .. "/" .. file, value)
  if not ok then return nil, "cannot write " .. self:path(id) .. "/" .. file .. ": " .. tostring(err) end
  return true
end

--- cg:remove(id) -> true, or nil and a message. Removes the (empty) cgroup directory; a
-- missing one counts as removed. Does not yield.
function Cgroup:remove(id)
  if not self:exists(id) then return true end
  local ok, err = os.remove(self:path(id)) -- remove(3) is rmdir(2) for a directory
  if not ok then return nil, err end
  return true
end

return M
