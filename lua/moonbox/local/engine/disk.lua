--- moonbox.local.engine.disk — the sandbox disk: where every sandbox's writable layer lives,
-- bounded per sandbox, and kept apart from the state directory's own files.
--
-- One btrfs filesystem per state directory, in a sparse image file <state>/sandbox-disk.img
-- loop-mounted at <state>/sandboxes (docs/local.md, "Disk"). Each sandbox directory
-- (<state>/sandboxes/ID, holding its overlay upper and work directories) is a btrfs subvolume
-- whose quota group is limited to its plan's disk: a write past it fails inside with EDQUOT
-- ("Disk quota exceeded"). The host's ext4 here has no project quotas (the kernel lacks the
-- quota format ext4 needs, and XFS quotas), and a filesystem per sandbox would cost a mkfs per
-- create; a subvolume and its limit cost two ioctls (bindings/sys.c). Upload spools live on the
-- disk too (<state>/sandboxes/.spool), so that neither sandboxes nor uploads can eat the space
-- the state database and the server's own files need: the image is sized at its creation to
-- leave the state directory's filesystem a reserve.
-- Idempotent at start: a disk already mounted (the backend before was SIGKILLed; mounts
-- outlive it) is used as it is; an image not mounted is mounted again; its spool is emptied.
-- Callers: moonbox.local.engine (prepare, start, teardown, recover, close, check).
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local host = require "moonbox.local.engine.host"

local M = {}
local Disk = {}
Disk.__index = Disk

local MiB = 1024 * 1024
local GiB = 1024 * MiB
-- The smallest disk made: btrfs needs ~100 MiB for itself (mixed block groups below 1 GiB).
M.MIN_SIZE = 192 * MiB
-- What the state directory's filesystem keeps for the database and the server's files: 5% of
-- it, at least 64 MiB, at most 2 GiB.
function M.reserve_for(fs_size)
  return math.max(64 * MiB, math.min(2 * GiB, fs_size // 20))
end

local HOST_ENV = host.ENV

local function find_program(name)
  for dir in HOST_ENV.PATH:gmatch("[^:]+") do
    if host.exists(dir .. "/" .. name) then return dir .. "/" .. name end
  end
end

-- The mount at path as /proc/self/mountinfo says: its filesystem type, or nil.
local function mounted_type(path)
  local info = host.read("/proc/self/mountinfo") or ""
  local found
  for line in info:gmatch("[^\n]+") do
    local mp, fstype = line:match("^%S+ %S+ %S+ %S+ (%S+) .- %- (%S+)")
    if mp == path then found = fstype end -- the last one is on top
  end
  return found
end
M.mounted_type = mounted_type

local function run(what, argv)
  argv.env, argv.env_mode = HOST_ENV, "replace"
  local r = proc.run(argv)
  if r.code ~= 0 then
    error(what .. " failed (exit " .. tostring(r.code) .. "): " .. host.trim(r.stderr), 0)
  end
  return r
end

--- disk.open(state_dir[, opts]) -> Disk | nil, problem. Mounts (making it first if needed) the
-- sandbox disk of state_dir. opts.size: the image's size when it is made (default: the free
-- space of the state directory's filesystem less its reserve). nil and a sentence when this
-- machine cannot have one (no btrfs-progs, no loop devices, too little space): sandboxes then
-- write to the state directory's filesystem, unbounded. [yields]
function M.open(state_dir, opts)
  opts = opts or {}
  local self = setmetatable({ state_dir = state_dir, image = state_dir .. "/sandbox-disk.img",
    mnt = state_dir .. "/sandboxes" }, Disk)
  self.spool = self.mnt .. "/.spool"
  local made, mkerr = pcall(sys.mkdir_p, self.mnt, tonumber("700", 8)) -- the state dir with it
  if not made then
    return nil, "no sandbox disk: cannot make " .. self.mnt .. ": " ..
      tostring(type(mkerr) == "table" and mkerr.message or mkerr)
  end
  local sv = sys.statvfs(state_dir)
  self.reserve = M.reserve_for(sv.size)
  local ok, err = pcall(function()
    sys.mkdir_p(self.mnt, tonumber("700", 8))
    local fstype = mounted_type(self.mnt)
    if fstype and fstype ~= "btrfs" then
      error("something else (" .. fstype .. ") is mounted at the sandboxes directory", 0)
    end
    if not fstype then
      -- Left by a backend that ran without a disk: their sandboxes are gone.
      for _, name in ipairs(sys.listdir(self.mnt)) do host.remove_tree(self.mnt .. "/" .. name) end
      if not host.exists(self.image) then
        local mkfs = find_program("mkfs.btrfs")
        if not mkfs then error("mkfs.btrfs is missing (Debian package btrfs-progs)", 0) end
        local size = opts.size or (sv.avail - self.reserve)
        size = size // MiB * MiB
        if size < M.MIN_SIZE then
          error(string.format("the state directory's filesystem has %d MiB free: a sandbox disk needs " ..
            "%d MiB and the reserve %d MiB", sv.avail // MiB, M.MIN_SIZE // MiB, self.reserve // MiB), 0)
        end
        local tmp = self.image .. ".new"
        os.remove(tmp)
        local mk = { mkfs, "-q", "-f", "-K", "-m", "single", "-d", "single", "--byte-count", tostring(size) }
        if size < GiB then table.insert(mk, 2, "--mixed") end
        mk[#mk + 1] = tmp
        run("truncate", { "truncate", "-s", tostring(size), tmp })
        local mok, merr = pcall(run, "mkfs.btrfs", mk)
        if not mok then
          os.remove(tmp)
          error(merr, 0)
        end
        os.rename(tmp, self.image)
      end
      -- discard=async: space freed inside goes back to the state directory's filesystem.
      run("mounting the sandbox disk", { "mount", "-t", "btrfs", "-o", "loop,discard=async,noatime",
        self.image, self.mnt })
    end
    self.quota = sys.btrfs_quota_enable(self.mnt)
    if host.exists(self.spool) then host.remove_tree(self.spool) end
    sys.mkdir_p(self.spool, tonumber("700", 8))
  end)
  if not ok then
    return nil, "no sandbox disk (sandboxes' disk use is not limited and shares the state " ..
      "directory's filesystem): " .. tostring(type(err) == "table" and err.message or err)
  end
  return self
end

--- disk:make(dir, bytes). Creates the sandbox directory dir (on the disk) as a subvolume
-- limited to bytes (nil or 0: the disk's free space alone), with upper/ and work/ in it.
-- Raises sys's errors. Does not yield (three ioctls and two mkdirs, all metadata).
function Disk:make(dir, bytes) -- luacheck: no unused args
  sys.btrfs_subvol_create(dir)
  local ok, err = pcall(function()
    if bytes and bytes > 0 then sys.btrfs_qgroup_limit(dir, bytes) end
    sys.mkdir_p(dir .. "/upper", tonumber("755", 8))
    sys.mkdir_p(dir .. "/work", tonumber("755", 8))
  end)
  if not ok then
    pcall(os.remove, dir)
    error(err, 0)
  end
end

--- disk:freed(). After a sandbox directory was removed: starts the commit that gives its space
-- back (statvfs and quota groups count it once the commit is done, at once rather than at
-- btrfs's next 30 s commit). Never raises. Does not yield.
function Disk:freed() pcall(sys.btrfs_start_sync, self.mnt) end

--- disk:usage(dir) -> used, limit|nil: what sandbox directory dir holds and may hold (bytes,
-- as of btrfs's last commit), or nil when it cannot be read.
function Disk:usage(dir) -- luacheck: no unused args
  local ok, used, limit = pcall(sys.btrfs_qgroup, dir)
  if not ok then return nil end
  return used, limit
end

--- disk:space() -> { disk = {size, avail}, state = {size, avail, committed, reserve} }: the
-- sandbox disk's size and free bytes, and the state directory's filesystem: its free bytes
-- less what the sparse image may still grow by (committed), and the reserve kept for it.
function Disk:space()
  local d = sys.statvfs(self.mnt)
  local s = sys.statvfs(self.state_dir)
  local ok, allocated, apparent = pcall(sys.file_blocks, self.image)
  local committed = ok and math.max(0, apparent - allocated) or 0
  return { disk = { size = d.size, avail = d.avail },
    state = { size = s.size, avail = math.max(0, s.avail - committed), committed = committed,
      reserve = self.reserve } }
end

--- disk:close(). Unmounts the disk (its loop device goes with it); the image stays for the next
-- start. With sandboxes still mounted over it somewhere, it is detached lazily. [yields]
function Disk:close()
  if mounted_type(self.mnt) == "btrfs" then pcall(host.umount, self.mnt, true) end
end

return M
