--- moonbox.local.engine — the host side of `moonbox local` sandboxes (DESIGN.md §5).
--
-- A sandbox is three things on this machine, all owned by one Engine:
--   * an overlay filesystem mounted at <state_dir>/sandboxes/<id>/root: its lower layers are
--     the snapshot layers it was restored from (newest first) on top of the engine's base, a
--     read-only overlay of the base image (the host's / by default) whose upper directory
--     hides the masked paths; the upper layer <id>/upper takes every write;
--   * a "holder": bubblewrap with the overlay as /, a fresh in-memory /dev, its own /proc, and
--     new mount, PID, IPC and UTS namespaces (plus network for deny-all), running a small
--     shell loop as the namespace's PID 1 (the "init"). The init is the sandbox: execs and file
--     operations enter its namespaces with moonbox-nsexec, and killing it ends every process inside;
--   * a freezer cgroup holding every process of the sandbox (moonbox.local.engine.cgroup), for
--     idle suspend, for counting what is left, and for killing stragglers.
-- Invariants: a sandbox in self.sandboxes with state "running" is mounted, its init pid is
-- recorded and its cgroup exists (its processes may have died on their own: alive() and
-- info().state say so); teardown (terminate, failed create, recover) runs in one
-- place and is idempotent. Every host command goes through moonbox.proc; directories, mounts,
-- kills, unmounts and removals are system calls through moonbox.sys (on this machine's kind of
-- VM a fork/exec costs milliseconds). Execs and file operations enter the sandbox through
-- moonbox-nsexec (tools/nsexec.c), a small static helper built with moonbox. File operations run
-- inside the sandbox's mount namespace (moonbox.local.engine.files explains why).
-- docs/local-isolation.md describes the isolation this gives and what it does not.
-- Callers: the local API layer (moonbox.local) and spec/local_engine_spec.lua.
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local core = require "moonbox.core"
local host = require "moonbox.local.engine.host"
local cgroup = require "moonbox.local.engine.cgroup"
local sys = require "moonbox.sys"

local M = {}
local Engine = {}
Engine.__index = Engine
M.Engine = Engine

local fail = host.fail

-- The environment of every host-side helper, and the PATH commands see inside a sandbox
-- unless its create env sets one.
local DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
local HOST_ENV = { PATH = DEFAULT_PATH, LC_ALL = "C" }

-- Paths hidden from sandboxes whose base is the host's root, besides the state directory and
-- the caller's masks: other programs' temporary files (moonbox's own uploads land in a temp
-- dir), root's and users' home directories (keys, shell history, tokens).
local HOST_MASKS = { "/tmp", "/var/tmp", "/root", "/home" }

-- Capabilities removed from the bounding set of every process an exec or a file operation
-- starts. Root inside keeps what package managers, compilers and servers need (chown, setuid,
-- binding low ports, ptrace of its own processes, mounts); these would let a slip inside the
-- sandbox reach the host: raw disks and device nodes, kernel modules, the host clock,
-- open_by_handle_at (reads host files by inode), BPF and perf, MAC policy, the kernel log.
-- Not dropped: CAP_SYS_ADMIN, which entering the namespaces (setns) needs; docs/local-isolation.md says what
-- that leaves open. NET_ADMIN goes too when the sandbox shares the host's network.
local CAP_DROP = { "sys_module", "sys_rawio", "sys_boot", "sys_time", "mknod", "dac_read_search",
  "mac_admin", "mac_override", "syslog", "wake_alarm", "block_suspend", "audit_control", "bpf",
  "perfmon", "checkpoint_restore" }

-- Environment names a sandbox cannot have: bash refuses to export them (DESIGN.md §4).
local RESERVED_ENV = { UID = true, EUID = true, PPID = true, SHELLOPTS = true, BASHOPTS = true,
  BASH_VERSINFO = true }

-- Names the dynamic loader or libc of the host-side helpers (moonbox-nsexec, bwrap) would act
-- on. They travel under ENV_PREFIX and are renamed by a bash step inside
-- the sandbox, so a sandbox's LD_PRELOAD or LD_LIBRARY_PATH never loads host files into host
-- processes.
local LOADER_ENV = { GCONV_PATH = true, GETCONF_DIR = true, GLIBC_TUNABLES = true,
  HOSTALIASES = true, LOCALDOMAIN = true, LOCPATH = true, NIS_PATH = true, NLSPATH = true,
  RESOLV_HOST_CONF = true, RES_OPTIONS = true, TMPDIR = true, TZDIR = true }
local ENV_PREFIX = "MOONBOX_ENV_"

local function loader_sensitive(name)
  return LOADER_ENV[name] or name:sub(1, 3) == "LD_" or name:sub(1, 7) == "MALLOC_"
end

-- ---- shell scripts ----------------------------------------------------------------------------
-- Each is run as `sh -c SCRIPT NAME ARGS...`; data arrives as positional parameters, never
-- pasted into the script text.

-- The holder, inside the sandbox, is its PID 1 (bwrap --as-pid-1): it restores a saved /dev
-- (from stdin) when $1 is 1, says "ready" once the namespaces and mounts are in place, lets go
-- of our pipes (a process inside writing to /proc/1/fd/1 must not fill them), and then reaps
-- orphans forever: dash's `wait` collects any child, adopted ones included. Being PID 1 with
-- its signals ignored, it survives `kill -9 -1` and `kill -9 1` from inside (the kernel drops
-- signals to a namespace's init that it has no handler for); with bwrap's own init as PID 1
-- and a holder as PID 2, a user's "kill everything" ended the sandbox.
local HOLDER_SH = [[
if [ "$1" = 1 ]; then tar -xpf - -C /dev || exit 1; fi
echo ready
exec </dev/null >/dev/null 2>&1
trap '' HUP INT QUIT TERM USR1 USR2 PIPE ALRM
while :; do sleep 2147483647 & wait; done
]]

-- Inside the sandbox, for create envs with loader-sensitive names: rename MOONBOX_ENV_X to X,
-- then run the command as Render does, `bash -c COMMAND` (moonbox-nsexec --setsid already made
-- it a session leader).
local UNPREFIX_LOOP = 'for v in ${!' .. ENV_PREFIX .. '@}; do export "${v#' .. ENV_PREFIX ..
  '}=${!v}"; unset "$v"; done; '
local UNPREFIX_BASH = UNPREFIX_LOOP .. 'exec /bin/bash -c "$1"'

-- moonbox-nsexec (tools/nsexec.c), the one-process way into a sandbox (cgroup, capability
-- bounding set, namespaces, root): next to the moonbox binary (build tree), or in
-- ../libexec/moonbox (install tree). Returns its path, or nil and the places looked at.
local function find_nsexec()
  local ok, build = pcall(require, "moonbox.build")
  local exe = ok and type(build) == "table" and build.exe
  if not exe then return nil, "(no moonbox binary: the engine runs inside `moonbox`)" end
  local dir = exe:match("^(.*)/[^/]*$") or "."
  local places = { dir .. "/moonbox-nsexec", dir .. "/../libexec/moonbox/moonbox-nsexec" }
  for _, p in ipairs(places) do
    if host.exists(p) then return p end
  end
  return nil, table.concat(places, " and ")
end

-- Builds the mask layer (see docs/local-isolation.md, "Masks"): the upper directory of the
-- engine's base overlay, whose entries hide base paths: an opaque empty directory over a
-- directory, a whiteout (character device 0/0) over anything else. Parents are recreated with
-- the base's owner, mode and times, because a directory's attributes come from the topmost
-- layer that has it. The opaque directory is made by the kernel itself: removing a lower
-- directory through an overlay and creating it again leaves an upper copy carrying
-- trusted.overlay.opaque=y, which cp -a then copies (no setfattr needed on the host).
-- $1 base ("" for the host's root), $2 the layer to create; then the (resolved, sorted,
-- non-nested) paths to mask.
local MASK_SH = [[
set -e
b=$1 final=$2
shift 2
[ -d "$final" ] && exit 0
tmp=$final.tmp.$$
rm -rf -- "$tmp"
mkdir -p -- "$tmp/t/l/x" "$tmp/t/u" "$tmp/t/w" "$tmp/t/m" "$tmp/layer"
mount -t overlay moonbox-mask -o "lowerdir=$tmp/t/l,upperdir=$tmp/t/u,workdir=$tmp/t/w" "$tmp/t/m"
rmdir -- "$tmp/t/m/x"
mkdir -- "$tmp/t/m/x"
umount -- "$tmp/t/m"
for p in "$@"; do
  [ -e "$b$p" ] || [ -L "$b$p" ] || continue
  rest=${p#/} acc= ok=1
  while :; do
    case $rest in */*) ;; *) break ;; esac
    acc=$acc/${rest%%/*} rest=${rest#*/}
    if [ -L "$b$acc" ] || [ ! -d "$b$acc" ]; then ok=0; break; fi
    [ -d "$tmp/layer$acc" ] || mkdir -- "$tmp/layer$acc"
  done
  [ "$ok" = 1 ] || continue
  if [ -d "$b$p" ] && [ ! -L "$b$p" ]; then
    cp -a -- "$tmp/t/u/x" "$tmp/layer$p"
  else
    mknod -- "$tmp/layer$p" c 0 0
  fi
done
cd "$tmp/layer"
find . -mindepth 1 -type d -exec sh -c 'for d; do chown --reference="$0/$d" "$d"
  chmod --reference="$0/$d" "$d"; touch -r "$0/$d" "$d"; done' "$b/" {} +
cd /
rm -rf -- "$tmp/t"
mv -T -- "$tmp/layer" "$final"
rmdir -- "$tmp"
]]

-- Copies a sandbox's upper directory into a new layer, atomically (a layer directory either
-- does not exist or is complete), and prints its size. $1 upper, $2 layer directory.
local CAPTURE_SH = [[
set -e
src=$1 dst=$2
mkdir -p -- "${dst%/*}"
rm -rf -- "$dst.partial"
cp -a --reflink=auto -- "$src" "$dst.partial"
mv -T -- "$dst.partial" "$dst"
du -sb -- "$dst"
]]

-- Entries bwrap's --dev puts in /dev: device nodes bound from the host, devpts, and links.
-- A runtime snapshot keeps everything else (what the user created, /dev/shm included).
local DEV_BUILTIN = { "null", "zero", "full", "random", "urandom", "tty", "console", "pts", "ptmx",
  "fd", "stdin", "stdout", "stderr", "core", "mqueue" }

-- ---- construction -------------------------------------------------------------------------------

local function check_abs(what, path)
  if type(path) ~= "string" or path:sub(1, 1) ~= "/" then
    error("local.engine: " .. what .. " must be an absolute path, got " .. tostring(path), 3)
  end
  if path:find("[%z\n]") then error("local.engine: " .. what .. " contains a NUL or newline", 3) end
  return (path ~= "/" and path:gsub("/+$", "")) or path
end

--- Engine.new{ state_dir = DIR, image = nil|DIR, mask = {paths}, cgroup_root = nil|DIR } ->
-- Engine. state_dir (absolute) holds sandboxes/<id>/{upper,work,root} and the base overlay
-- base/<hash>/{upper,work,root}; image is a root filesystem directory (e.g. made by
-- debootstrap) used as the base instead of the host's /; mask lists absolute paths of the
-- base to hide from every sandbox (the state dir is always hidden; with the host's root as
-- base, so are /tmp, /var/tmp, /root and /home). cgroup_root overrides the cgroup hierarchy
-- (tests use it to exercise cgroup v2). Keep the engine referenced while its sandboxes live:
-- collecting it kills their holders. Does no I/O beyond looking for the cgroup hierarchy and
-- does not yield; problems surface in eng:check() and in the first operation. Raises on
-- malformed options (state_dir and image must not contain ':', ',' or '\', which overlayfs
-- options cannot carry).
function M.new(opts)
  if type(opts) ~= "table" then error("local.engine.new: expected an options table", 2) end
  local state_dir = check_abs("state_dir", opts.state_dir)
  local image = opts.image and check_abs("image", opts.image)
  for _, p in ipairs({ state_dir, image }) do
    if p:find("[:,\\]") then
      error("local.engine.new: " .. p .. " contains ':', ',' or '\\', which overlayfs " ..
        "options cannot carry", 2)
    end
  end
  local masks = { state_dir }
  for _, m in ipairs(opts.mask or {}) do masks[#masks + 1] = check_abs("mask entry", m) end
  if not image then
    for _, m in ipairs(HOST_MASKS) do masks[#masks + 1] = m end
  end
  local tag = host.hash(state_dir)
  local cg, cg_problem = cgroup.detect(tag, opts.cgroup_root)
  return setmetatable({
    state_dir = state_dir,
    image = image,
    base = image or "/",
    masks = masks,
    tag = tag,
    cg = cg,
    cg_problem = cg_problem,
    sandboxes = {}, -- id -> sandbox record (see Engine:create)
    tools = nil,    -- absolute paths of host tools, set by prepare
    base_root = nil, -- mount point of the base overlay, set by prepare
  }, Engine)
end

-- The sandbox directory of id.
function Engine:dir(id) return self.state_dir .. "/sandboxes/" .. id end

local function check_id(fn, id)
  if type(id) ~= "string" or not id:match("^[%w][%w._-]*$") or #id > 63 then
    error("local.engine." .. fn .. ": a sandbox id is 1-63 letters, digits, '.', '_' or '-', got " ..
      tostring(id), 3)
  end
end

-- Sorts paths shortest first and drops duplicates and paths inside another one: masking a
-- directory hides everything under it, and a nested mask created first would turn the outer
-- one into a plain (see-through) parent directory.
local function outermost(paths)
  table.sort(paths, function(a, b) return #a < #b or (#a == #b and a < b) end)
  local out = {}
  for _, p in ipairs(paths) do
    local nested = false
    for _, q in ipairs(out) do
      if p == q or q == "/" or p:sub(1, #q + 1) == q .. "/" then nested = true break end
    end
    if not nested and p ~= "/" then out[#out + 1] = p end
  end
  return out
end

-- Runs once per engine (concurrent callers wait for the first): creates the state layout,
-- finds the host tools, builds the mask layer and mounts the base overlay. A failure is raised
-- to every waiter and the next call tries again. [yields]
function Engine:prepare()
  if self.prepared then return end
  if self.preparing then
    while self.preparing do self.preparing:wait() end
    if self.prepared then return end
    if self.prepare_error then error(self.prepare_error, 0) end
  end
  local cond = core.cond()
  self.preparing = cond
  local ok, err = pcall(function()
    if not self.cg then fail("prepare", "unsupported", nil, self.cg_problem) end
    local r = host.run("prepare", nil, { "sh", "-c",
      'mkdir -p -- "$1/sandboxes" "$1/base" || exit 1; ' ..
      'command -v bwrap || { echo "the host has no bwrap command" >&2; exit 1; }',
      "moonbox-prepare", self.state_dir, env = HOST_ENV, env_mode = "replace" },
      { what = "preparing the state directory " .. self.state_dir .. " and finding bwrap",
        code = "unsupported" })
    local nsexec, looked = find_nsexec()
    if not nsexec then
      fail("prepare", "unsupported", nil, "moonbox-nsexec (built with moonbox) is missing: looked at " ..
        looked)
    end
    self.tools = { bwrap = r.stdout:match("[^\n]+"), nsexec = nsexec }
    -- Mask paths are resolved on the host when the host is the base (a mask given as
    -- /var/run/x must hide /run/x); in an image they are taken literally and skipped when a
    -- parent is a symlink.
    local masks = {}
    for i, m in ipairs(self.masks) do masks[i] = m end
    if self.base == "/" then
      local spec = { "realpath", "-m", "--", env = HOST_ENV, env_mode = "replace" }
      for _, m in ipairs(masks) do spec[#spec + 1] = m end
      local rr = host.run("prepare", nil, spec)
      masks = {}
      for line in rr.stdout:gmatch("[^\n]+") do masks[#masks + 1] = line end
    end
    masks = outermost(masks)
    local dir = self.state_dir .. "/base/" .. host.hash(self.base .. "\0" .. table.concat(masks, "\0"))
    local spec = { "sh", "-c", MASK_SH, "moonbox-mask", self.base == "/" and "" or self.base,
      dir .. "/upper", env = HOST_ENV, env_mode = "replace" }
    for _, m in ipairs(masks) do spec[#spec + 1] = m end
    host.run("prepare", nil, spec, { what = "building the mask layer " .. dir .. "/upper" })
    -- The engine's base: a read-only overlay of the base image (lower) and the mask layer
    -- (upper). Sandbox overlays stack their layers on this mount rather than on the image
    -- directly, because overlayfs refuses a lower layer inside another lower layer
    -- ("overlapping lowerdir path"), and with the host's / as the image every layer under
    -- the state dir would be one; the base overlay is a filesystem of its own.
    if not host.mounted(dir .. "/root") then
      local mok, merr = pcall(function()
        sys.mkdir_p(dir .. "/work")
        sys.mkdir_p(dir .. "/root")
        sys.mount_overlay({ self.base }, dir .. "/upper", dir .. "/work", dir .. "/root",
          { readonly = true, source = "moonbox-base" })
      end)
      if not mok then
        fail("prepare", "command_failed", nil, "mounting the base overlay " .. dir .. "/root failed: " ..
          tostring(type(merr) == "table" and merr.message or merr))
      end
    end
    self.base_root = dir .. "/root"
  end)
  self.preparing = nil
  if ok then
    self.prepared = true
    self.prepare_error = nil
  else
    self.prepare_error = err
  end
  cond:broadcast()
  if not ok then error(err, 0) end
end

-- ---- check ----------------------------------------------------------------------------------

--- eng:check() -> { ok = bool, problems = {sentence, ...} }. Tries what sandboxes need: root
-- privileges, bwrap and moonbox-nsexec, mounting an overlay under the state dir, creating the
-- namespaces, a freezer cgroup, the base image. Each problem says what cannot work and why.
-- Leaves nothing behind. [yields]
function Engine:check()
  local problems = {}
  local function problem(s) problems[#problems + 1] = s end
  local status = host.read("/proc/self/status") or ""
  if not status:match("\nUid:%s+0%s") then
    problem("moonbox local is not running as root: creating namespaces, mounting overlays and " ..
      "managing cgroups need root (run it with sudo, or as root in CI)")
  end
  if not find_nsexec() then
    problem("moonbox-nsexec, the helper built next to moonbox, is missing: execs and file " ..
      "operations cannot enter sandboxes without it (rebuild, or install it with moonbox)")
  end
  local r = proc.run { "sh", "-c", 'for t in bwrap cp tar; do ' ..
    'command -v "$t" >/dev/null || echo "$t"; done', env = HOST_ENV, env_mode = "replace" }
  for t in r.stdout:gmatch("%S+") do
    local pkg = t == "bwrap" and "bubblewrap" or "coreutils/tar"
    problem(string.format("the host has no '%s' command (Debian package %s): sandboxes cannot " ..
      "be %s without it", t, pkg, t == "bwrap" and "started" or "managed"))
  end
  if self.image and not host.exists(self.image .. "/bin/bash") then
    problem("the base image " .. self.image .. " has no /bin/bash: execs run `bash -c`, so " ..
      "commands could not run (point --image at a debootstrapped root filesystem)")
  end
  local dir = self.state_dir .. "/check." .. host.hash(tostring(task.now()) .. tostring({}))
  r = proc.run { "sh", "-c", [[
    mkdir -p -- "$1/l" "$1/u" "$1/w" "$1/m" || exit 1
    o="lowerdir=$1/l,upperdir=$1/u,workdir=$1/w"
    mount -t overlay moonbox-check -o "$o" "$1/m" || { rm -rf -- "$1"; exit 1; }
    umount -- "$1/m"; rm -rf -- "$1"]], "moonbox-check", dir, env = HOST_ENV, env_mode = "replace" }
  if r.code ~= 0 then
    problem("cannot mount an overlay filesystem under " .. self.state_dir .. " (" ..
      host.trim(r.stderr) .. "): sandbox root filesystems are overlays; the kernel needs " ..
      "overlayfs and the state dir must be on a filesystem overlayfs accepts as upper layer " ..
      "(ext4, xfs, btrfs, tmpfs)")
  end
  r = proc.run { "bwrap", "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
    "--unshare-ipc", "--unshare-uts", "--unshare-net", "--die-with-parent", "--", "true",
    env = HOST_ENV, env_mode = "replace" }
  if r.code ~= 0 then
    problem("bubblewrap cannot create mount, PID, IPC, UTS and network namespaces (" ..
      host.trim(r.stderr) .. "): sandboxes cannot be isolated (a container or seccomp policy " ..
      "may forbid namespaces)")
  end
  if not self.cg then
    problem(self.cg_problem)
  else
    local probe = self.cg.dir .. "/check-" .. host.hash(dir)
    r = proc.run { "sh", "-c", 'mkdir -p -- "$1" && rmdir -- "$1"', "moonbox-check", probe,
      env = HOST_ENV, env_mode = "replace" }
    if r.code ~= 0 then
      problem("cannot create a cgroup under " .. self.cg.root .. " (" .. host.trim(r.stderr) ..
        "): sandboxes could not be suspended and their processes not tracked")
    end
  end
  return { ok = #problems == 0, problems = problems }
end

-- ---- create ---------------------------------------------------------------------------------

-- Validates a create env and splits it into what the host-side helpers may carry as is and
-- what must travel under ENV_PREFIX. Raises a structured error naming a bad name.
local function exec_env(id, env)
  local plain = { PATH = DEFAULT_PATH, HOME = "/root" }
  local prefixed = false
  for name, value in pairs(env or {}) do
    if type(name) ~= "string" or not name:match("^[%a_][%w_]*$") then
      fail("create", "invalid_env", id, "sandbox " .. id .. ": environment variable name " ..
        string.format("%q", tostring(name)) .. " is not a valid shell name")
    end
    if RESERVED_ENV[name] or name:sub(1, #ENV_PREFIX) == ENV_PREFIX then
      fail("create", "invalid_env", id, "sandbox " .. id .. ": environment variable " .. name ..
        " cannot be set (bash does not let commands export it)")
    end
    local tv = type(value)
    if tv ~= "string" and tv ~= "number" and tv ~= "boolean" then
      fail("create", "invalid_env", id, "sandbox " .. id .. ": environment variable " .. name ..
        " must be a string, got " .. tv)
    end
    value = tostring(value)
    if value:find("%z") then
      fail("create", "invalid_env", id, "sandbox " .. id .. ": environment variable " .. name ..
        " contains a NUL byte")
    end
    if loader_sensitive(name) then
      plain[ENV_PREFIX .. name] = value
      prefixed = true
    else
      plain[name] = value
    end
  end
  return plain, prefixed
end

local function lowerdir(id, lowers, base_root)
  local parts = {}
  for i, l in ipairs(lowers) do
    if type(l) ~= "string" or l:sub(1, 1) ~= "/" then
      fail("create", "invalid_layer", id, "sandbox " .. id .. ": layer " .. i ..
        " must be an absolute directory path, got " .. tostring(l))
    end
    if l:find("[:,\\%z\n]") then
      fail("create", "invalid_layer", id, "sandbox " .. id .. ": layer path " .. l ..
        " contains ':', ',', '\\' or a newline, which overlayfs options cannot carry")
    end
    if not host.exists(l) then
      fail("create", "layer_missing", id, "sandbox " .. id .. ": layer " .. l .. " does not exist")
    end
    parts[#parts + 1] = l
  end
  parts[#parts + 1] = base_root
  return table.concat(parts, ":")
end

--- eng:create(id, opts) -> info. Starts sandbox id: mounts its overlay and starts its holder
-- (see the file header), waits until the namespaces are ready (tens of milliseconds).
-- opts: lowers = {layer_dir, ...} (newest first; may be empty), network = "allow-all"
-- (default) | "deny-all" (a private network namespace with only loopback), env = {NAME =
-- value} (what every exec sees, on top of PATH and HOME=/root), dev_tar = path of a /dev
-- archive from a runtime capture (restored into the new /dev), revive = true to start again
-- on the upper directory a previous run left (after recover(); processes and /dev are not
-- back). Returns info as eng:info(id). Raises structured errors (op "local.engine.create"):
-- exists, invalid_env, invalid_layer, layer_missing, start_failed (with bwrap's or mount's
-- stderr), timeout, unsupported. On any failure (and on cancellation) nothing is left behind
-- (with revive, the upper directory stays). [yields]
function Engine:create(id, opts)
  check_id("create", id)
  opts = opts or {}
  local network = opts.network or "allow-all"
  if network ~= "allow-all" and network ~= "deny-all" then
    error("local.engine.create: network must be \"allow-all\" or \"deny-all\", got " .. tostring(network), 2)
  end
  if self.sandboxes[id] then
    fail("create", "exists", id, "sandbox " .. id .. " already exists on this engine")
  end
  local env, prefixed = exec_env(id, opts.env)
  local sb = { id = id, state = "creating", cond = core.cond(), network = network, env = env,
    env_prefixed = prefixed, lowers = {}, execs = {}, helpers = setmetatable({}, { __mode = "k" }),
    frozen = false }
  for i, l in ipairs(opts.lowers or {}) do sb.lowers[i] = l end
  self.sandboxes[id] = sb
  if not opts.revive and host.exists(self:dir(id)) then
    self.sandboxes[id] = nil
    fail("create", "exists", id, "sandbox " .. id .. ": its directory " .. self:dir(id) ..
      " already exists (left by a previous run? see eng:recover())")
  end
  local ok, err = pcall(self.start_holder, self, sb, opts)
  if not ok then
    -- An "exists" from the create script means someone else's directory: leave it alone.
    local theirs = type(err) == "table" and err.code == "exists"
    if not theirs then pcall(self.teardown, self, id, sb, { keep_upper = opts.revive }) end
    if self.sandboxes[id] == sb then self.sandboxes[id] = nil end
    sb.state = "gone"
    sb.cond:broadcast()
    error(err, 0)
  end
  sb.state = "running"
  sb.cond:broadcast()
  return self:info(id)
end

-- The body of create: everything that may fail or yield. [yields]
function Engine:start_holder(sb, opts)
  local id = sb.id
  self:prepare()
  local lowers = lowerdir(id, sb.lowers, self.base_root)
  if opts.dev_tar and not host.exists(opts.dev_tar) then
    fail("create", "layer_missing", id, "sandbox " .. id .. ": /dev archive " .. tostring(opts.dev_tar) ..
      " does not exist")
  end
  local drop = {}
  for _, c in ipairs(CAP_DROP) do drop[#drop + 1] = c end
  if sb.network == "allow-all" then drop[#drop + 1] = "net_admin" end
  sb.cap_drop = table.concat(drop, ",")

  -- Directories and the overlay mount, by syscalls on this thread: a few mkdir(2) and one
  -- mount(2) of directories just looked at, with nothing to write back (moonbox.sys says why
  -- each is quick). No yield between the existence check and the mkdir.
  local dir = self:dir(id)
  if not opts.revive and host.exists(dir) then
    fail("create", "exists", id, "sandbox " .. id .. ": the sandbox directory " .. dir .. " already exists")
  end
  local mok, merr = pcall(function()
    for _, d in ipairs({ dir .. "/upper", dir .. "/work", dir .. "/root", self.cg:path(id) }) do
      sys.mkdir_p(d, tonumber("755", 8))
    end
    sys.mount_overlay(lowers, dir .. "/upper", dir .. "/work", dir .. "/root")
  end)
  if not mok then
    fail("create", "start_failed", id, "sandbox " .. id .. ": preparing its root filesystem failed: " ..
      tostring(type(merr) == "table" and merr.message or merr))
  end
  local procs = self.cg:path(id) .. "/cgroup.procs"
  -- The helper joins the cgroup before bwrap forks (every process of the sandbox is born inside
  -- it) and puts bwrap's --info-fd 3 on our stdout pipe.
  local argv = { self.tools.nsexec, "--cgroup", procs, "--dup", "1:3", "--" }
  for _, a in ipairs({ self.tools.bwrap, "--info-fd", "3", "--bind", dir .. "/root", "/",
    "--dev", "/dev", "--chmod", "1777", "/dev/shm", "--proc", "/proc",
    "--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts", "--hostname", id,
    "--die-with-parent",
    "--chdir", "/root" }) do
    argv[#argv + 1] = a
  end
  if sb.network == "deny-all" then argv[#argv + 1] = "--unshare-net" end
  for _, c in ipairs(drop) do
    argv[#argv + 1] = "--cap-drop"
    argv[#argv + 1] = "CAP_" .. c:upper()
  end
  for _, a in ipairs({ "--", "/bin/sh", "-c", HOLDER_SH, "moonbox-holder", opts.dev_tar and "1" or "0" }) do
    argv[#argv + 1] = a
  end
  argv.env, argv.env_mode = HOST_ENV, "replace"
  argv.stdin = opts.dev_tar and { file = opts.dev_tar } or "null"
  local p = proc.spawn(argv)
  sb.holder = p
  local out = ""
  local ready = task.timeout(60, function()
    while true do
      if out:match('"child%-pid"%s*:%s*%d+') and (out:find("^ready\n") or out:find("\nready\n")) then
        return true
      end
      local chunk = p:read("stdout")
      if not chunk then return false end
      out = out .. chunk
    end
  end)
  if not ready then
    local errs = {}
    for chunk in function() return p:read("stderr") end do errs[#errs + 1] = chunk end
    local code, sig = p:wait()
    fail("create", "start_failed", id, string.format(
      "sandbox %s: starting its namespaces failed (%s): %s", id,
      code and ("exit " .. code) or ("signal " .. tostring(sig)),
      host.trim(table.concat(errs)) ~= "" and host.trim(table.concat(errs)) or "no message"),
      { stderr = table.concat(errs) })
  end
  sb.init = tonumber(out:match('"child%-pid"%s*:%s*(%d+)'))
  if not host.alive(sb.init) then
    fail("create", "start_failed", id, "sandbox " .. id .. ": its init process " .. sb.init ..
      " exited right after starting")
  end
end

--- eng:info(id) -> { id, state, init_pid, holder_pid, network, lowers, upper, root, frozen }
-- or nil for an unknown sandbox. state is "creating", "running", "terminating" or "dead" (its
-- processes ended without terminate). Does not yield.
function Engine:info(id)
  local sb = self.sandboxes[id]
  if not sb then return nil end
  local lowers = {}
  for i, l in ipairs(sb.lowers) do lowers[i] = l end
  local state = sb.state
  if state == "running" and not host.alive(sb.init) then state = "dead" end
  return { id = id, state = state, init_pid = sb.init, holder_pid = sb.holder and sb.holder.pid,
    network = sb.network, lowers = lowers, upper = self:dir(id) .. "/upper",
    root = self:dir(id) .. "/root", frozen = sb.frozen }
end

--- eng:alive(id) -> boolean: the sandbox exists here and its namespace init still runs.
-- Does not yield.
function Engine:alive(id)
  local sb = self.sandboxes[id]
  return sb ~= nil and sb.state == "running" and sb.init ~= nil and host.alive(sb.init)
end

-- Returns the record of running sandbox id, or raises not_found, not_running or (unless
-- allow_frozen) frozen, as operation fn.
function Engine:live(fn, id, allow_frozen)
  local sb = self.sandboxes[id]
  if not sb then fail(fn, "not_found", id, "sandbox " .. tostring(id) .. " does not exist on this engine") end
  if sb.state ~= "running" or not host.alive(sb.init) then
    fail(fn, "not_running", id, "sandbox " .. id .. " is not running (" ..
      (sb.state == "running" and "its processes have ended" or sb.state) .. ")")
  end
  if sb.frozen and not allow_frozen then
    fail(fn, "frozen", id, "sandbox " .. id ..
      " is frozen (suspended); thaw it before running commands in it")
  end
  return sb
end

-- ---- exec ---------------------------------------------------------------------------------------

local Exec = {}

-- Reads what is left of both streams and reaps the process, then forgets it. Runs in two
-- tasks of the engine so that the command keeps running, unobserved, after its caller left.
local function drain(rec)
  if rec.draining then return end
  rec.draining = true
  local p = rec.process
  local function sink(stream)
    return function()
      while true do
        local ok, chunk = pcall(p.read, p, stream)
        if not ok or not chunk then return end
      end
    end
  end
  task.spawn(function()
    local t1, t2 = task.spawn(sink("stdout")), task.spawn(sink("stderr"))
    pcall(task.join, t1)
    pcall(task.join, t2)
    pcall(p.wait, p)
    rec.done = true
    rec.sb.execs[rec] = nil
  end)
end

--- h:read([stream [, max]]) -> the next chunk of "stdout" (default) or "stderr", nil at the
-- end; as moonbox.proc's p:read. [yields]
function Exec:read(stream, max) return self._rec.process:read(stream, max) end

--- h:lines([stream]) -> iterator over the lines of a stream; as moonbox.proc's p:lines. [yields]
function Exec:lines(stream) return self._rec.process:lines(stream) end

--- h:stats() -> moonbox.proc's buffer statistics of the process. Does not yield.
function Exec:stats() return self._rec.process:stats() end

--- h:wait() -> code, signal. Waits until `bash -c COMMAND` ends: code is its exit status, or
-- 128 + n when signal n killed it (signal then names it, e.g. "TERM"). Processes it started
-- in the background keep running. Like p:wait(), does not read the pipes: read them (from
-- other tasks if need be) or the command stalls once ~128 KiB are unread. [yields]
function Exec:wait()
  local rec = self._rec
  local code, sig = rec.process:wait()
  rec.done = true
  rec.sb.execs[rec] = nil
  if code then return code end
  return 128 + (host.SIGNALS[sig] or tonumber(tostring(sig):match("%d+")) or 0), sig
end

--- h:kill([sig]) -> boolean. Sends sig (default "TERM"; a name or number) to the command's
-- process group inside the sandbox (bash leads its own session and group there). Returns
-- false when the command has already ended. Raises a plain error for an unknown signal.
-- Does not yield.
function Exec:kill(sig)
  local rec = self._rec
  local n = host.signal_number(sig or "TERM")
  if rec.done then return false end
  -- The helper forks the process that becomes bash; after setsid it leads a group of its own,
  -- which the host-side group of the Process no longer reaches. Before that, it does.
  for _, pid in ipairs(rec.engine.cg:procs(rec.sb.id)) do
    local st = host.proc_stat(pid)
    if st and st.ppid == rec.process.pid and st.pgrp == pid then
      return (pcall(sys.kill, -pid, n))
    end
  end
  return rec.process:kill(n)
end

--- h:detach(): the caller stops reading; the command keeps running, its remaining output is
-- read and dropped by the engine, and it is reaped when it ends. Also what `<close>`,
-- h:close() and garbage collection of the handle do: dropping a handle never kills. Idempotent.
-- Does not yield.
function Exec:detach()
  local rec = self._rec
  if rec and not rec.done then drain(rec) end
end
Exec.close = Exec.detach

local ExecMT = {
  __index = Exec,
  __close = function(h) h:detach() end,
  __gc = function(h) pcall(Exec.detach, h) end,
  __tostring = function(h)
    local rec = h._rec
    return string.format("Exec %d in %s (%s)", h.pid, rec and rec.sb.id or "?",
      rec and rec.done and "ended" or "running")
  end,
}

--- eng:exec(id, command[, opts]) -> h, a handle of the running command. Runs `bash -c command`
-- as root in /root inside the sandbox's mount, PID, IPC, UTS (and network) namespaces and its
-- cgroup, as the leader of a new session and process group there, with the environment given
-- at create (plus PATH and HOME=/root unless it sets them) and stdin from /dev/null.
-- opts.buffer: bytes buffered per stream (moonbox.proc's default 64 KiB).
-- h.pid is the host pid of the helper (moonbox-nsexec) that waits for the command;
-- h.process its moonbox.proc Process (read it through h; do not close it: that would SIGKILL it and
-- leave the command writing into a closed pipe). h:read, h:lines, h:wait, h:kill, h:detach as
-- documented above. The command outlives a handle that is dropped or closed (see h:detach).
-- Raises structured errors (op "local.engine.exec"): not_found, not_running, frozen (thaw
-- first: a process joining a frozen cgroup would stop at once), spawn_failed. Does not yield.
function Engine:exec(id, command, opts)
  check_id("exec", id)
  if type(command) ~= "string" then error("local.engine.exec: command must be a string", 2) end
  opts = opts or {}
  local sb = self:live("exec", id)
  for rec in pairs(sb.execs) do -- forget commands that ended without being waited for
    if rec.process:kill(0) == false then sb.execs[rec] = nil end
  end
  local procs = self.cg:path(id) .. "/cgroup.procs"
  -- One helper process joins the cgroup, drops the capabilities, enters the namespaces and
  -- the init's root and cwd (/root: as `nsenter --root --wd` without values, opened before
  -- entering), forks into the PID namespace, and its child becomes a session leader and execs
  -- bash (tools/nsexec.c).
  local argv = { self.tools.nsexec, "--cgroup", procs, "--drop", sb.cap_drop, "--target",
    tostring(sb.init), "--ns", sb.network == "deny-all" and "ipc,uts,net,pid,mnt" or "ipc,uts,pid,mnt",
    "--root-wd", "--setsid", "--" }
  local run = sb.env_prefixed and { "/bin/bash", "-c", UNPREFIX_BASH, "moonbox-exec", command }
    or { "/bin/bash", "-c", command }
  for _, a in ipairs(run) do argv[#argv + 1] = a end
  argv.env, argv.env_mode, argv.buffer = sb.env, "replace", opts.buffer
  local ok, p = pcall(proc.spawn, argv)
  if not ok then
    fail("exec", "spawn_failed", id, "sandbox " .. id .. ": cannot start the exec helper: " ..
      tostring(type(p) == "table" and p.message or p))
  end
  local rec = { process = p, sb = sb, engine = self, done = false }
  sb.execs[rec] = true
  return setmetatable({ pid = p.pid, process = p, sandbox_id = id, _rec = rec }, ExecMT)
end

--- eng:run(id, command[, opts]) -> { code, signal, stdout, stderr }. eng:exec that reads both
-- streams and waits; code as h:wait(). The call returns once bash has exited and the output it
-- wrote has been read: a background process that inherited the pipes (`sleep 100 &` without a
-- redirect) does not hold it, and what such a process writes later is read and dropped. For
-- short commands (tests, internal chores): all output is held in memory. Raises what eng:exec
-- raises. [yields]
function Engine:run(id, command, opts)
  local h = self:exec(id, command, opts)
  local out, err = {}, {}
  local function reader(stream, into)
    return task.spawn(function()
      for chunk in function() return h:read(stream) end do into[#into + 1] = chunk end
    end)
  end
  local readers = { reader("stdout", out), reader("stderr", err) }
  local ok, code, sig = pcall(h.wait, h)
  if ok then
    -- What bash wrote is in the pipes by now: the readers get it within a loop iteration.
    pcall(task.timeout, 0.2, function() for _, t in ipairs(readers) do task.join(t) end end)
  end
  for _, t in ipairs(readers) do
    if task.result(t) == nil then task.cancel(t) end
  end
  for _, t in ipairs(readers) do pcall(task.join, t) end
  h:detach()
  if not ok then error(code, 0) end
  return { code = code, signal = sig, stdout = table.concat(out), stderr = table.concat(err) }
end

-- ---- suspend ------------------------------------------------------------------------------------

--- eng:freeze(id). Stops every process of the sandbox (idle suspend) and returns once all are
-- stopped; memory, /tmp and /dev stay as they are. Idempotent. Raises (op
-- "local.engine.freeze") not_found, not_running, freeze_failed. [yields]
function Engine:freeze(id)
  check_id("freeze", id)
  local sb = self:live("freeze", id, true)
  if sb.frozen then return end
  local ok, err = self.cg:freeze(id)
  if not ok then fail("freeze", "freeze_failed", id, "sandbox " .. id .. ": " .. err) end
  sb.frozen = true
end

--- eng:thaw(id). Lets a frozen sandbox run again (immediate). Idempotent. Raises (op
-- "local.engine.thaw") not_found, not_running, thaw_failed. Does not yield.
function Engine:thaw(id)
  check_id("thaw", id)
  local sb = self:live("thaw", id, true)
  local ok, err = self.cg:thaw(id)
  if not ok then fail("thaw", "thaw_failed", id, "sandbox " .. id .. ": " .. err) end
  sb.frozen = false
end

--- eng:frozen(id) -> boolean: whether the sandbox's processes are frozen (as the kernel says).
-- Does not yield.
function Engine:frozen(id)
  return self.cg ~= nil and self.sandboxes[id] ~= nil and self.cg:frozen(id)
end

--- eng:processes(id) -> array of host pids of the sandbox's processes still alive (its
-- cgroup's members: the holder, its init, everything started inside). Empty for an unknown
-- or terminated sandbox. Does not yield.
function Engine:processes(id)
  if not self.cg then return {} end
  return self.cg:procs(id)
end

-- ---- teardown -----------------------------------------------------------------------------------

-- Ends everything of sandbox id and frees it: thaws (a frozen process cannot die), kills the
-- namespace init (the kernel then kills every process of the PID namespace, and bwrap, its
-- parent, reaps it and exits), kills file helpers and whatever else is left in the cgroup
-- until it is empty, unmounts the overlay and removes the cgroup and (unless
-- opts.keep_upper) the sandbox directory. Only the init is killed at first, not bwrap's
-- whole group: an init whose parent died with it would wait as a zombie for the host's PID 1,
-- and its cgroup could not be removed until then. sb may be nil (after a restart).
-- Idempotent. [yields]
function Engine:teardown(id, sb, opts)
  opts = opts or {}
  local cg = self.cg
  if cg then cg:thaw(id) end
  if sb and sb.init and host.alive(sb.init) then
    pcall(sys.kill, sb.init, 9) -- it may end on its own meanwhile
  elseif sb and sb.holder then
    sb.holder:kill("KILL") -- create failed before the init was known
  end
  if sb then
    for p in pairs(sb.helpers) do pcall(p.kill, p, "KILL") end
  end
  if cg then
    local deadline, next_kill = task.now() + 15, task.now() + 0.2
    while true do
      local pids = cg:procs(id)
      if #pids == 0 then break end
      if task.now() >= next_kill then
        -- Stragglers: processes outside the PID namespace (exec helpers between fork and
        -- setns) or a holder we no longer have a handle for (recover after a restart).
        for _, pid in ipairs(pids) do pcall(sys.kill, pid, 9) end
        next_kill = task.now() + 0.2
      end
      if task.now() > deadline then
        fail("terminate", "terminate_failed", id, "sandbox " .. id .. ": processes " ..
          table.concat(pids, " ") .. " are still alive 15 s after SIGKILL")
      end
      task.sleep(0.002)
    end
  end
  if sb and sb.holder then pcall(sb.holder.wait, sb.holder) end
  local dir = self:dir(id)
  if host.mounted(dir .. "/root") then
    -- On a worker thread: unmounting a writable overlay syncs its upper filesystem.
    local uok, uerr = pcall(host.umount, dir .. "/root", true)
    if not uok then
      if not core.Error.is(uerr) then error(uerr, 0) end
      fail("terminate", "command_failed", id, "sandbox " .. id .. ": " .. uerr.message)
    end
  end
  if cg then
    -- The last processes leave cgroup.procs a moment before the kernel lets go of the
    -- cgroup (rmdir says EBUSY until their exit completes).
    local ok, err = cg:remove(id)
    local until_ = task.now() + 5
    while not ok and task.now() < until_ do
      task.sleep(0.005)
      ok, err = cg:remove(id)
    end
    if not ok then
      fail("terminate", "terminate_failed", id, "sandbox " .. id .. ": cannot remove its cgroup " ..
        cg:path(id) .. ": " .. tostring(err))
    end
  end
  if not opts.keep_upper and host.exists(dir) then
    -- On a worker thread: the upper directory may hold any number of files.
    local rok, rerr = pcall(host.remove_tree, dir)
    if not rok then
      if not core.Error.is(rerr) then error(rerr, 0) end
      fail("terminate", "command_failed", id, "sandbox " .. id .. ": " .. rerr.message)
    end
  end
end

--- eng:terminate(id[, opts]). Kills every process of the sandbox, waits until none is left,
-- unmounts its overlay and removes its directory (opts.keep_upper = true keeps
-- <state_dir>/sandboxes/<id> with its upper layer, e.g. when the backend shuts down).
-- Idempotent: an unknown or already terminated id is cleaned on disk if anything is left and
-- is otherwise a no-op. A terminate during create waits for the create to settle. Raises (op
-- "local.engine.terminate") terminate_failed, command_failed. [yields]
function Engine:terminate(id, opts)
  check_id("terminate", id)
  local sb = self.sandboxes[id]
  while sb and (sb.state == "creating" or sb.state == "terminating") do
    sb.cond:wait()
    sb = self.sandboxes[id]
  end
  if sb then sb.state = "terminating" end
  local ok, err = pcall(self.teardown, self, id, sb, opts)
  if sb then
    if self.sandboxes[id] == sb then self.sandboxes[id] = nil end
    sb.state = "gone"
    sb.cond:broadcast()
  end
  if not ok then error(err, 0) end
end

-- ---- snapshots ----------------------------------------------------------------------------------

--- eng:capture(id, layer_dir[, opts]) -> { size = bytes, dev_tar = path|nil, layers = {...} }.
-- Freezes the sandbox, copies its upper directory (cp -a --reflink=auto: whiteouts, opaque
-- directories and xattrs survive) to layer_dir (absolute, must not exist; created atomically),
-- and thaws it (a sandbox that was already frozen stays frozen). opts.kind = "filesystem"
-- (default) or "runtime"; runtime also saves the in-memory /dev area (files created there,
-- /dev/shm included) as the tar file <layer_dir>.dev.tar, beside the layer so the layer stays a
-- pure overlay layer. Processes, memory and open connections are not saved by either kind.
-- size counts the layer and the archive; layers is the lower stack a restore must use:
-- { layer_dir, <this sandbox's lowers>... } (pass it as create's lowers, dev_tar as dev_tar).
-- Raises (op "local.engine.capture") not_found, not_running, exists, busy, capture_failed.
-- [yields]
function Engine:capture(id, layer_dir, opts)
  check_id("capture", id)
  layer_dir = check_abs("layer_dir", layer_dir)
  opts = opts or {}
  local kind = opts.kind or "filesystem"
  if kind ~= "filesystem" and kind ~= "runtime" then
    error("local.engine.capture: kind must be \"filesystem\" or \"runtime\", got " .. tostring(kind), 2)
  end
  local sb = self:live("capture", id, true)
  if sb.capturing then fail("capture", "busy", id, "sandbox " .. id .. " is already being captured") end
  if host.exists(layer_dir) then
    fail("capture", "exists", id, "sandbox " .. id .. ": layer directory " .. layer_dir .. " already exists")
  end
  local dev_tar = kind == "runtime" and layer_dir .. ".dev.tar" or nil
  sb.capturing = true
  local was_frozen = sb.frozen
  local ok, result = pcall(function()
    if not was_frozen then
      local fok, ferr = self.cg:freeze(id)
      if not fok then fail("capture", "capture_failed", id, "sandbox " .. id .. ": " .. ferr) end
    end
    local size = 0
    local jobs = { function()
      local r = host.run("capture", id, { "sh", "-c", CAPTURE_SH, "moonbox-capture",
        self:dir(id) .. "/upper", layer_dir, env = HOST_ENV, env_mode = "replace" },
        { what = "copying the upper layer to " .. layer_dir, code = "capture_failed" })
      size = size + (tonumber(r.stdout:match("^(%d+)")) or 0)
    end }
    if dev_tar then
      jobs[2] = function()
        local args = { "-C", "/dev", "-cf", "-", "--anchored" }
        for _, name in ipairs(DEV_BUILTIN) do args[#args + 1] = "--exclude=./" .. name end
        args[#args + 1] = "."
        local partial = dev_tar .. ".partial"
        local r = self:inside("capture", sb, 'exec tar "$@"', args, { stdout = { file = partial } })
        if r.code ~= 0 then
          os.remove(partial)
          fail("capture", "capture_failed", id, "sandbox " .. id .. ": saving /dev failed: " ..
            host.trim(r.stderr))
        end
        local rok, rerr = os.rename(partial, dev_tar)
        if not rok then fail("capture", "capture_failed", id, "sandbox " .. id .. ": " .. tostring(rerr)) end
        local f = io.open(dev_tar, "rb")
        if f then
          size = size + f:seek("end")
          f:close()
        end
      end
    end
    task.all(jobs)
    return size
  end)
  -- Thaw unless the sandbox is (now) meant to be frozen: an idle suspend may have come in
  -- while we copied.
  if not sb.frozen and sb.state == "running" then self.cg:thaw(id) end
  sb.capturing = false
  if not ok then
    if dev_tar then os.remove(dev_tar) end
    error(result, 0)
  end
  local layers = { layer_dir }
  for _, l in ipairs(sb.lowers) do layers[#layers + 1] = l end
  return { size = result, dev_tar = dev_tar, layers = layers, kind = kind }
end

-- ---- recovery -----------------------------------------------------------------------------------

--- eng:recover() -> { {id, upper, had_processes, was_mounted}, ... }. After a backend restart:
-- finds sandbox directories under the state dir that this engine does not run (their
-- processes died with the previous backend, bwrap's --die-with-parent), kills anything of
-- theirs still alive, unmounts their overlays and removes their cgroups (and cgroups left
-- without a directory). Their upper directories stay: the caller decides. What the API layer
-- should do with each: report the sandbox as errored ("the backend restarted; its processes
-- did not survive") and terminate it, or start it again on the same filesystem with
-- eng:create(id, { revive = true, lowers = <its lowers>, ... }) (processes, memory and /dev
-- are gone: report it like a restore from a filesystem snapshot). [yields]
function Engine:recover()
  self:prepare()
  local report = {}
  local r = host.run("recover", nil, { "find", self.state_dir .. "/sandboxes", "-mindepth", "1",
    "-maxdepth", "1", "-type", "d", "-printf", "%f\\n", env = HOST_ENV, env_mode = "replace" })
  local seen = {}
  for id in r.stdout:gmatch("[^\n]+") do
    seen[id] = true
    if not self.sandboxes[id] and id:match("^[%w][%w._-]*$") then
      local item = { id = id, upper = self:dir(id) .. "/upper",
        had_processes = #self.cg:procs(id) > 0, was_mounted = host.mounted(self:dir(id) .. "/root") }
      self:teardown(id, nil, { keep_upper = true })
      report[#report + 1] = item
    end
  end
  if host.exists(self.cg.dir) then
    local cr = host.run("recover", nil, { "find", self.cg.dir, "-mindepth", "1", "-maxdepth", "1",
      "-type", "d", "-printf", "%f\\n", env = HOST_ENV, env_mode = "replace" })
    for id in cr.stdout:gmatch("[^\n]+") do
      if not seen[id] and not self.sandboxes[id] and id:match("^[%w][%w._-]*$") then
        self:teardown(id, nil, { keep_upper = true })
      end
    end
  end
  -- Base overlays of earlier configurations (other masks, another image) that nothing uses
  -- any more; one still in use by a mounted sandbox refuses to go, and stays.
  local info = host.read("/proc/self/mountinfo") or ""
  local prefix = self.state_dir .. "/base/"
  for line in info:gmatch("[^\n]+") do
    local mp = line:match("^%S+ %S+ %S+ %S+ (%S+)")
    if mp and mp:sub(1, #prefix) == prefix and mp ~= self.base_root then
      pcall(host.umount, mp)
    end
  end
  table.sort(report, function(a, b) return a.id < b.id end)
  return report
end

--- eng:close() -> boolean. Unmounts the engine's base overlay and removes its (empty) parent
-- cgroup when no sandbox of this engine is left (returns false and leaves both otherwise); the
-- next operation sets them up again. Sandbox directories kept by terminate{keep_upper = true}
-- do not hold them. [yields]
function Engine:close()
  if next(self.sandboxes) then return false end
  if self.base_root and host.mounted(self.base_root) then
    local uok, uerr = pcall(host.umount, self.base_root)
    if not uok then
      if not core.Error.is(uerr) then error(uerr, 0) end
      fail("close", "command_failed", nil, "unmounting the base overlay failed: " .. uerr.message)
    end
  end
  if self.cg then os.remove(self.cg.dir) end -- rmdir: only succeeds when no sandbox cgroup is left
  self.prepared = false
  return true
end

-- File operations (read_file, write_file, stat, list, tar_out, tar_in) and eng:inside live in
-- their own file; they add methods to Engine.
require("moonbox.local.engine.files").install(Engine, {
  HOST_ENV = HOST_ENV, check_id = check_id,
})

return M
