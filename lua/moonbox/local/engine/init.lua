--- moonbox.local.engine — the host side of `moonbox local` sandboxes.
--
-- A sandbox is, on this machine:
--   * a keeper: `moonbox-sandbox start` (tools/sandbox/start.c), a host process that claims an
--     unprivileged id range for the sandbox, mounts its overlay root (lower layers: the snapshot
--     layers it was restored from and the base image, all idmapped into that range; upper: the
--     sandbox's own writes) inside a private mount namespace, and starts the init;
--   * an init: PID 1 of new user, mount, PID, IPC, UTS, network and cgroup namespaces, root of
--     its user namespace only (host id = the range's base), confined like every process inside
--     (capabilities of a default container, no_new_privs, a seccomp filter), reaping orphans and
--     starting execs on requests over a channel only the keeper holds (tools/sandbox/starter.c);
--   * cgroups (moonbox.local.engine.cgroup) that limit it to its plan, freeze it on suspend and
--     count what is left;
--   * for a network with egress, a slirp4netns the keeper starts in those cgroups.
-- An exec goes through `moonbox-sandbox exec`, which hands the command and its pipes to the init
-- over that channel (or, when the init cannot fork, enters the sandbox itself); file operations
-- through `files`: a helper joins its cgroup and namespaces, becomes its root, confines itself
-- and runs our own file code (moonbox.local.engine.files): nothing of the sandbox's runs on the
-- host, ever.
-- The keeper dies with the backend (PR_SET_PDEATHSIG) and takes the sandbox with it, thawing a
-- frozen one first; its mounts live only in namespaces that die with it. docs/local-isolation.md
-- explains the threat model and each defence.
-- Invariants: a sandbox in self.sandboxes with state "running" has a live keeper handle, an init
-- pid, the keeper's descriptor number of the starter's channel (sb.channel) and its cgroups (its
-- processes may have died on their own: alive() and info().state say so); teardown (terminate,
-- failed create, recover) runs in one place and is idempotent. Every host program is started
-- through moonbox.proc; directories, kills and removals are system calls through moonbox.sys.
-- Callers: the local backend's service (moonbox.local.service) and spec/local_engine_spec.lua.
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local core = require "moonbox.core"
local host = require "moonbox.local.engine.host"
local cgroup = require "moonbox.local.engine.cgroup"
local Files = require "moonbox.local.engine.files"
local Disk = require "moonbox.local.engine.disk"
local sys = require "moonbox.sys"
-- moonbox.build is the binary's (main.c): without it (plain lua5.4) no helper is found.
local has_build, build = pcall(require, "moonbox.build")

local M = {}
local Engine = {}
Engine.__index = Engine
M.Engine = Engine

local fail = host.fail

local DEFAULT_PATH, HOST_ENV = host.DEFAULT_PATH, host.ENV -- (host.lua)

-- Sandbox id ranges: slot k maps root inside to host id ID_BASE + k * 65536. Above every id a
-- distribution gives users and below 2^31 (some programs treat ids as signed).
M.ID_BASE = 1073741824
M.ID_SLOTS = 16384
M.SLOTS_DIR = "/run/moonbox/id-slots"
-- Where sandbox roots are mounted (inside their keepers' mount namespaces; on the host these
-- are empty directories). Its parents are 0711: the init, an unprivileged host uid from its
-- first instant, must be able to reach its root whatever the state directory's permissions.
M.ROOTS_DIR = "/run/moonbox/roots"

-- The host's firewall rule for sandbox traffic: slirp4netns runs as the sandbox's own host
-- uid, so a rule on those uids keeps every allow-all sandbox off the host's own addresses
-- (loopback and the rest) while it goes anywhere else. DNS (port 53) is let through: slirp4netns
-- forwards the sandbox's queries to the host's resolver, which may listen on a local address.
local NFT_RULES = string.format([[
table inet moonbox
delete table inet moonbox
table inet moonbox {
  chain output {
    type filter hook output priority 0; policy accept;
    meta skuid %d-%d fib daddr type local th dport != 53 reject
  }
}
]], 1073741824, 2147483647)

-- How each network policy is built (moonbox-sandbox --net): deny-all has loopback only;
-- allow-all goes out through slirp4netns; allow-list through its gate (see
-- docs/local-isolation.md), whose address is also the sandbox's resolver.
local NET_MODE = { ["deny-all"] = "none", ["allow-all"] = "slirp", ["allow-list"] = "allowlist" }
local SLIRP_DNS, GATE_ADDR = "10.0.2.3", "10.200.0.1"
M.MAX_ALLOWED = 200

--- M.check_domain(name) -> true | false, why. Whether name can be an allow-list entry: a host
-- name (labels of letters, digits, '-' and '_', at most 253 characters, an optional final dot),
-- optionally with a leftmost "*." wildcard that covers every name below it (never the name
-- itself); not an IP address, a URL or a name with a port.
function M.check_domain(name)
  if type(name) ~= "string" then return false, "expected a host name string, got " .. type(name) end
  if name:find("://", 1, true) or name:find("/", 1, true) then
    return false, string.format("%q is a URL; give the host name alone", name)
  end
  if name:find(":", 1, true) then
    return false, string.format("%q has a port; allow-list entries are host names (HTTP and HTTPS " ..
      "on ports 80 and 443)", name)
  end
  local bare = name:gsub("%.$", "")
  local rest = bare:match("^%*%.(.+)$") or bare
  if rest:find("*", 1, true) then
    return false, string.format("%q: only a leftmost \"*.\" wildcard is allowed", name)
  end
  if #bare == 0 or #bare > 253 then
    return false, string.format("%q is not a host name (1 to 253 characters)", name)
  end
  for label in (rest .. "."):gmatch("([^.]*)%.") do
    if #label == 0 or #label > 63 or not label:match("^[%w_]([%w_-]*)$") or label:match("%-$") then
      return false, string.format("%q is not a host name (label %q)", name, label)
    end
  end
  if rest:match("^[%d.]+$") then
    return false, string.format("%q is an IP address; allow-list entries are host names", name)
  end
  return true
end

-- Paths hidden from sandboxes whose base is the host's root (an explicit, discouraged mode),
-- besides the state directory: other programs' temporary files and home directories.
local HOST_MASKS = { "/tmp", "/var/tmp", "/root", "/home" }

-- Environment names a sandbox cannot have: bash refuses to export them.
local RESERVED_ENV = { UID = true, EUID = true, PPID = true, SHELLOPTS = true, BASHOPTS = true,
  BASH_VERSINFO = true }

-- Entries the init puts in /dev: a runtime snapshot keeps everything else (what the user made,
-- /dev/shm included).
local DEV_BUILTIN = { "null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "fd",
  "stdin", "stdout", "stderr", "mqueue" }

-- Builds the mask layer of the host-root base (see docs/local-isolation.md, "--host-root"): an
-- opaque empty directory over each masked directory, a whiteout over anything else, parents
-- recreated with the base's attributes. $1 base ("" for /), $2 the layer; then the paths.
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

-- ---- construction -------------------------------------------------------------------------------

local function check_abs(what, path)
  if type(path) ~= "string" or path:sub(1, 1) ~= "/" then
    error("local.engine: " .. what .. " must be an absolute path, got " .. tostring(path), 3)
  end
  if path:find("[%z\n]") then error("local.engine: " .. what .. " contains a NUL or newline", 3) end
  return (path ~= "/" and path:gsub("/+$", "")) or path
end

--- Engine.new{ state_dir = DIR, image = DIR | host_root = true, mask = {paths},
-- cgroup_root = DIR, slots_dir = DIR, dns = IPV4, disk = true | false, disk_size = bytes } ->
-- Engine. state_dir (absolute) holds sandboxes/<id>/{upper,work,root}: on the sandbox disk
-- (moonbox.local.engine.disk, mounted by prepare; disk_size its size when it is made) unless
-- disk = false, and then on the state directory's filesystem, unbounded. image is the base root
-- filesystem (0-based ids, e.g. from moonbox.local.image); host_root = true uses the host's /
-- instead (discouraged: files appear owned by nobody inside, the state dir, /tmp, /var/tmp,
-- /root, /home and mask are hidden).
-- cgroup_root overrides the cgroup hierarchy; slots_dir the machine-wide id-range locks (tests);
-- dns the resolver allow-list gates ask (default: slirp4netns's, which asks the host's).
-- Keep the engine referenced while its sandboxes live. Does no I/O beyond looking for the
-- cgroup hierarchy and does not yield; problems surface in eng:check() and the first operation.
-- Raises on malformed options.
function M.new(opts)
  if type(opts) ~= "table" then error("local.engine.new: expected an options table", 2) end
  local state_dir = check_abs("state_dir", opts.state_dir)
  if not opts.image and not opts.host_root then
    error("local.engine.new: an image directory (or host_root = true) is required", 2)
  end
  local image = opts.image and check_abs("image", opts.image)
  if opts.dns ~= nil and not (type(opts.dns) == "string" and opts.dns:match("^%d+%.%d+%.%d+%.%d+$")) then
    error("local.engine.new: dns must be an IPv4 address, got " .. tostring(opts.dns), 2)
  end
  local masks = { state_dir }
  for _, m in ipairs(opts.mask or {}) do masks[#masks + 1] = check_abs("mask entry", m) end
  if opts.host_root then
    for _, m in ipairs(HOST_MASKS) do masks[#masks + 1] = m end
  end
  local tag = host.hash(state_dir)
  local cg, cg_problem = cgroup.detect(tag, opts.cgroup_root)
  local self = setmetatable({
    state_dir = state_dir,
    image = image,
    host_root = opts.host_root and true or false,
    masks = masks,
    tag = tag,
    cg = cg,
    cg_problem = cg_problem,
    slots_dir = opts.slots_dir or M.SLOTS_DIR,
    dns = opts.dns,
    fairness = opts.fairness ~= false, -- see cgroup.lua (fairness); false: the bench's "before"
    use_disk = opts.disk ~= false,
    disk_size = opts.disk_size,
    disk = nil,         -- the sandbox disk (moonbox.local.engine.disk), set by prepare
    disk_problem = nil, -- why there is none
    sandboxes = {}, -- id -> sandbox record (see Engine:create)
    tools = nil,    -- absolute paths of host programs, set by prepare
  }, Engine)
  self.files = Files.new(self)
  return self
end

--- eng:join_host([pid]): moves process pid (default: this one, all its threads) into the
-- engine's host-side CPU cgroup, weighted above every sandbox (cgroup.lua, fairness); prepares
-- the engine first. A no-op with fairness off. Raises what prepare raises, or a plain error. [yields]
function Engine:join_host(pid)
  self:prepare()
  if self.fairness then self.cg:join_host(pid or 0) end -- 0: the writer itself
end

--- eng:dir(id) -> the sandbox directory of id.
function Engine:dir(id) return self.state_dir .. "/sandboxes/" .. id end

--- eng:root_dir(id) -> the (host-side, empty) mount point of sandbox id's root.
function Engine:root_dir(id) return M.ROOTS_DIR .. "/" .. self.tag .. "-" .. id end

local function check_id(fn, id)
  if type(id) ~= "string" or not id:match("^[%w][%w._-]*$") or #id > 63 then
    error("local.engine." .. fn .. ": a sandbox id is 1-63 letters, digits, '.', '_' or '-', got " ..
      tostring(id), 3)
  end
end
M.check_id = check_id

-- moonbox-sandbox: next to the moonbox binary (build tree), or in ../libexec/moonbox (install
-- tree). Returns its path, or nil and the places looked at.
local function find_helper()
  local exe = has_build and type(build) == "table" and build.exe
  if not exe then return nil, "(no moonbox binary: the engine runs inside `moonbox`)" end
  local dir = exe:match("^(.*)/[^/]*$") or "."
  local places = { dir .. "/moonbox-sandbox", dir .. "/../libexec/moonbox/moonbox-sandbox" }
  for _, p in ipairs(places) do
    if host.exists(p) then return p end
  end
  return nil, table.concat(places, " and ")
end

local function find_program(name)
  for dir in DEFAULT_PATH:gmatch("[^:]+") do
    if host.exists(dir .. "/" .. name) then return dir .. "/" .. name end
  end
end

-- Sorts paths shortest first, dropping duplicates and paths inside another one.
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

-- The host-root base: a read-only overlay of / under the mask layer, mounted once per
-- configuration (overlayfs refuses / itself as a lower layer beside layers inside it).
function Engine:prepare_host_root()
  local spec = { "realpath", "-m", "--", env = HOST_ENV, env_mode = "replace" }
  for _, m in ipairs(self.masks) do spec[#spec + 1] = m end
  local rr = host.run("prepare", nil, spec)
  local masks = {}
  for line in rr.stdout:gmatch("[^\n]+") do masks[#masks + 1] = line end
  masks = outermost(masks)
  local dir = self.state_dir .. "/base/" .. host.hash("/\0" .. table.concat(masks, "\0"))
  local ms = { "sh", "-c", MASK_SH, "moonbox-mask", "", dir .. "/upper", env = HOST_ENV,
    env_mode = "replace" }
  for _, m in ipairs(masks) do ms[#ms + 1] = m end
  host.run("prepare", nil, ms, { what = "building the mask layer " .. dir .. "/upper" })
  if not host.mounted(dir .. "/root") then
    sys.mkdir_p(dir .. "/work")
    sys.mkdir_p(dir .. "/root")
    sys.mount_overlay({ "/" }, dir .. "/upper", dir .. "/work", dir .. "/root",
      { readonly = true, source = "moonbox-base" })
  end
  self.base_root = dir .. "/root"
end

--- eng:prepare(). Runs once per engine (concurrent callers wait for the first): creates the
-- state layout and finds the helper and slirp4netns; with host_root, builds the mask layer and
-- mounts the base. A failure is raised to every waiter; the next call tries again. [yields]
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
    self.cg:prepare(self.fairness)
    if self.use_disk and not self.disk then
      self.disk, self.disk_problem = Disk.open(self.state_dir, { size = self.disk_size })
    end
    sys.mkdir_p(self.state_dir .. "/sandboxes", tonumber("700", 8))
    sys.mkdir_p(self.slots_dir, tonumber("700", 8))
    local helper, looked = find_helper()
    if not helper then
      fail("prepare", "unsupported", nil, "moonbox-sandbox (built with moonbox) is missing: looked at "
        .. looked)
    end
    if self.image and not host.exists(self.image .. "/bin/sh") then
      fail("prepare", "unsupported", nil, "the base image " .. self.image
        .. " has no /bin/sh (build one with " ..
        "`moonbox image build`, or point --image at a Debian root filesystem)")
    end
    self.tools = { helper = helper, slirp = find_program("slirp4netns"), nft = find_program("nft") }
    sys.mkdir_p(M.ROOTS_DIR, tonumber("711", 8))
    if self.tools.nft then
      -- One transaction that replaces the table whole: several backends may do it at once.
      local r = proc.run { self.tools.nft, "-f", "-", input = NFT_RULES, env = HOST_ENV,
        env_mode = "replace" }
      self.firewall = r.code == 0
      self.firewall_error = r.code ~= 0 and host.trim(r.stderr) or nil
    end
    if self.host_root then
      local mok, merr = pcall(self.prepare_host_root, self)
      if not mok then
        fail("prepare", "command_failed", nil, "preparing the host-root base failed: " ..
          tostring(type(merr) == "table" and merr.message or merr))
      end
    end
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

--- eng:check() -> { ok = bool, problems = {sentence, ...} }. Says what this machine cannot do
-- for sandboxes and why: root, the helper, slirp4netns, cgroup controllers, the image, and then
-- tries the real thing (a sandbox started and terminated). Leaves nothing behind. [yields]
function Engine:check()
  local problems = {}
  local function problem(s) problems[#problems + 1] = s end
  local status = host.read("/proc/self/status") or ""
  if not status:match("\nUid:%s+0%s") then
    problem("moonbox local is not running as root: creating namespaces, idmapped mounts and " ..
      "cgroups needs root (run it with sudo, or as root in CI)")
  end
  if not find_helper() then
    problem("moonbox-sandbox, the helper built next to moonbox, is missing: sandboxes cannot be " ..
      "started or entered without it (rebuild, or install it with moonbox)")
  end
  if not find_program("nft") then
    problem("the host has no nft (Debian package nftables): allow-all sandboxes can reach services " ..
      "bound to the host's own non-loopback addresses")
  end
  if not find_program("slirp4netns") then
    problem("the host has no slirp4netns (Debian package slirp4netns): sandboxes with network " ..
      "egress (allow-all, allow-list) cannot be created; deny-all ones can")
  end
  if not self.cg then
    problem(self.cg_problem)
  elseif #self.cg.missing > 0 then
    problem("the cgroup controllers " .. table.concat(self.cg.missing, ", ") .. " are not available: " ..
      "plans cannot limit " .. table.concat(self.cg.missing, ", ") .. " here")
  end
  if #problems == 0 then
    local pok = pcall(self.prepare, self)
    if pok and self.disk_problem then problem(self.disk_problem) end
    local id = "check-" .. host.hash(tostring(task.now()) .. tostring({}))
    local ok, err = pcall(self.create, self, id, { network = "deny-all" })
    if not ok then
      problem("a test sandbox could not be started: " .. tostring(type(err) == "table" and err.message
        or err))
    end
    pcall(self.terminate, self, id)
  end
  return { ok = #problems == 0, problems = problems }
end

-- ---- create ---------------------------------------------------------------------------------

-- Validates a create env and returns the helper's environment: MBENV_NAME=value for each
-- variable the command will see (PATH and HOME=/root unless set). Raises a structured error
-- naming a bad name.
local function exec_env(id, env)
  local out = { MBENV_PATH = DEFAULT_PATH, MBENV_HOME = "/root" }
  for name, value in pairs(env or {}) do
    if type(name) ~= "string" or not name:match("^[%a_][%w_]*$") then
      fail("create", "invalid_env", id, "sandbox " .. id .. ": environment variable name " ..
        string.format("%q", tostring(name)) .. " is not a valid shell name")
    end
    if RESERVED_ENV[name] then
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
    out["MBENV_" .. name] = value
  end
  return out
end

local function check_layers(id, lowers)
  for i, l in ipairs(lowers) do
    if type(l) ~= "string" or l:sub(1, 1) ~= "/" or l:find("[%z\n]") then
      fail("create", "invalid_layer", id, "sandbox " .. id .. ": layer " .. i .. " must be an absolute path")
    end
    if not host.exists(l) then
      fail("create", "layer_missing", id, "sandbox " .. id .. ": a layer it needs is gone (" ..
        l:match("[^/]*$") .. ")")
    end
  end
end

--- eng:create(id, opts) -> info. Starts sandbox id and returns once its init is ready (a few
-- milliseconds; the network of an allow-all sandbox may still be coming up: an exec waits for
-- it). opts: lowers = {layer_dir, ...} (snapshot layers, newest first, 0-based), network =
-- "allow-all" (default: egress through slirp4netns, no way to the host) | "deny-all" (loopback
-- only) | "allow-list" (HTTP and HTTPS to the names of opts.allowed only, through the sandbox's
-- gate; names as M.check_domain, at most M.MAX_ALLOWED), env = {NAME = value} (every exec
-- sees it, on top of PATH and HOME=/root), dev_records =
-- path of a /dev capture to restore, limits = {memory = bytes, cpus = n, pids = n}. Returns
-- info as eng:info(id). Raises structured errors (op "local.engine.create"): exists,
-- invalid_env, invalid_layer, layer_missing, start_failed (with the helper's message),
-- unsupported. On any failure (and on cancellation) nothing is left behind. [yields]
function Engine:create(id, opts)
  check_id("create", id)
  opts = opts or {}
  local network = opts.network or "allow-all"
  if network ~= "allow-all" and network ~= "deny-all" and network ~= "allow-list" then
    error("local.engine.create: network must be \"allow-all\", \"deny-all\" or \"allow-list\", got " ..
      tostring(network), 2)
  end
  local allowed = {}
  if network == "allow-list" then
    if type(opts.allowed) ~= "table" then
      error("local.engine.create: allow-list needs opts.allowed, a list of host names", 2)
    end
    if #opts.allowed > M.MAX_ALLOWED then
      error("local.engine.create: at most " .. M.MAX_ALLOWED .. " allowed names, got " .. #opts.allowed, 2)
    end
    for i, name in ipairs(opts.allowed) do
      local ok, why = M.check_domain(name)
      if not ok then error("local.engine.create: opts.allowed[" .. i .. "]: " .. why, 2) end
      allowed[i] = name:lower():gsub("%.$", "")
    end
  end
  if self.sandboxes[id] then
    fail("create", "exists", id, "sandbox " .. id .. " already exists on this engine")
  end
  local sb = { id = id, state = "creating", cond = core.cond(), network = network, allowed = allowed,
    env = exec_env(id, opts.env), lowers = {}, execs = {}, helpers = setmetatable({}, { __mode = "k" }),
    frozen = false, net = network == "deny-all" and "ready" or "pending" }
  for i, l in ipairs(opts.lowers or {}) do sb.lowers[i] = l end
  self.sandboxes[id] = sb
  if host.exists(self:dir(id)) then
    self.sandboxes[id] = nil
    fail("create", "exists", id, "sandbox " .. id .. ": its directory already exists (left by a " ..
      "previous run? see eng:recover())")
  end
  local ok, err = pcall(self.start, self, sb, opts)
  if not ok then
    local theirs = type(err) == "table" and err.code == "exists"
    if not theirs then pcall(self.teardown, self, id, sb) end
    if self.sandboxes[id] == sb then self.sandboxes[id] = nil end
    sb.state = "gone"
    sb.cond:broadcast()
    error(err, 0)
  end
  sb.state = "running"
  sb.cond:broadcast()
  return self:info(id)
end

-- Reads the keeper's output lines after "ready": "net" or "net-failed ...", then waits for it
-- to end (the init ended: terminate, or the sandbox died). Its stderr (where slirp4netns
-- speaks) is drained meanwhile, keeping the last 4 KiB to explain a failure.
local function watch_keeper(sb, keeper, rest)
  sb.keeper_err = ""
  task.spawn(function()
    while true do
      local ok, chunk = pcall(keeper.read, keeper, "stderr")
      if not ok or not chunk then break end
      sb.keeper_err = (sb.keeper_err .. chunk):sub(-4096)
    end
  end)
  task.spawn(function()
    local buf = rest
    while true do
      local line = buf:match("^([^\n]*)\n")
      if line then
        buf = buf:sub(#line + 2)
        if line == "net" then
          sb.net = "ready"
        elseif line:match("^net%-failed") then
          sb.net = "failed"
          local said = host.trim(sb.keeper_err):match("([^\n]*)$") or ""
          sb.net_error = line:match("^net%-failed%s*(.*)$") .. (said ~= "" and (" (" .. said .. ")") or "")
        end
        sb.cond:broadcast()
      else
        local ok, chunk = pcall(keeper.read, keeper, "stdout")
        if not ok or not chunk then break end
        buf = buf .. chunk
      end
    end
    if sb.net == "pending" then
      sb.net = "failed"
      sb.net_error = "the sandbox ended before its network was up"
    end
    pcall(keeper.wait, keeper)
    sb.keeper_done = true
    sb.cond:broadcast()
  end)
end

--- eng:start(sb, opts): the body of create, everything that may fail or yield: prepares the
-- engine, checks the layers and the tools the network policy needs, starts the keeper
-- (moonbox-sandbox start), waits up to 60 s for its "ready" line and hands the rest of its
-- output to watch_keeper (the network comes up later; an exec waits for it).
-- Raises the structured errors create lists (op "local.engine.create"); create's handler
-- tears down whatever it had started. [yields]
function Engine:start(sb, opts)
  local id = sb.id
  self:prepare()
  check_layers(id, sb.lowers)
  if sb.network ~= "deny-all" then
    local need = { { "slirp", "slirp4netns", "slirp4netns" }, { "nft", "nft", "nftables" } }
    for _, t in ipairs(need) do
      if not self.tools[t[1]] then
        fail("create", "unsupported", id, string.format("sandbox %s: %s needs %s (Debian package %s), " ..
          "which this machine lacks; use deny-all or install it", id, sb.network, t[2], t[3]))
      end
    end
    -- Without the host rule, egress could reach services on the host's own addresses.
    if not self.firewall then
      fail("create", "unsupported", id, string.format("sandbox %s: %s needs the host firewall rule " ..
        "that keeps sandboxes off the host's addresses, and nft could not install it: %s", id, sb.network,
        tostring(self.firewall_error)))
    end
  end
  if opts.dev_records and not host.exists(opts.dev_records) then
    fail("create", "layer_missing", id, "sandbox " .. id .. ": the /dev capture it needs is gone")
  end
  local dir = self:dir(id)
  local mok, merr = pcall(function()
    if self.disk then
      self.disk:make(dir, opts.limits and opts.limits.disk)
    else
      for _, d in ipairs({ dir .. "/upper", dir .. "/work" }) do
        sys.mkdir_p(d, tonumber("755", 8))
      end
    end
    sys.mkdir_p(self:root_dir(id), tonumber("755", 8))
    self.cg:create(id, opts.limits)
  end)
  if not mok then
    fail("create", "start_failed", id, "sandbox " .. id
      .. ": preparing its directories and cgroups failed: " ..
      tostring(type(merr) == "table" and merr.message or merr))
  end
  local argv = { self.tools.helper, "start", "--id=" .. id, "--root=" .. self:root_dir(id),
    "--upper=" .. dir .. "/upper", "--work=" .. dir .. "/work",
    "--slots=" .. self.slots_dir, "--slot-hint=" .. (tonumber(host.hash(id):sub(1, 6), 16) % M.ID_SLOTS),
    "--slot-count=" .. M.ID_SLOTS, "--id-base=" .. M.ID_BASE,
    "--freezer=" .. self.cg:freezer(id),
    "--net=" .. NET_MODE[sb.network],
    "--resolv=nameserver " .. (sb.network == "allow-list" and GATE_ADDR or SLIRP_DNS) .. "\n",
    "--hosts=127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n127.0.1.1\t" .. id .. "\n" }
  if self.tools.slirp then argv[#argv + 1] = "--slirp=" .. self.tools.slirp end
  if sb.network == "allow-list" then
    argv[#argv + 1] = "--nft=" .. self.tools.nft
    if self.dns then argv[#argv + 1] = "--dns=" .. self.dns end
    for _, name in ipairs(sb.allowed) do argv[#argv + 1] = "--allow=" .. name end
  end
  for _, l in ipairs(sb.lowers) do argv[#argv + 1] = "--layer=" .. l end
  if self.image then argv[#argv + 1] = "--layer=" .. self.image end
  if self.base_root then argv[#argv + 1] = "--base=" .. self.base_root end
  for _, d in ipairs(self.cg:leaves(id, "sandbox")) do argv[#argv + 1] = "--cgroup=" .. d end
  argv.env, argv.env_mode, argv.stdin = HOST_ENV, "replace", "null"
  local sok, keeper = pcall(proc.spawn, argv)
  if not sok then
    fail("create", "start_failed", id, "sandbox " .. id .. ": cannot start moonbox-sandbox: " ..
      tostring(type(keeper) == "table" and keeper.message or keeper))
  end
  sb.keeper = keeper
  local out = ""
  local ready = task.timeout(60, function()
    while not out:find("\n") do
      local chunk = keeper:read("stdout")
      if not chunk then return false end
      out = out .. chunk
    end
    return true
  end)
  local pid, base, slot, channel = out:match("^ready (%d+) (%d+) (%d+) (%d+)\n")
  if not ready or not pid then
    local errs = host.read_stream(keeper, "stderr")
    local code, sig = keeper:wait()
    local msg = host.trim(errs):gsub("moonbox%-sandbox: ", "")
    fail("create", "start_failed", id, string.format("sandbox %s: starting it failed (%s): %s", id,
      code and ("exit " .. code) or ("signal " .. tostring(sig)), msg ~= "" and msg or "no message"))
  end
  sb.init, sb.uid_base, sb.slot, sb.channel = tonumber(pid), tonumber(base), tonumber(slot), tonumber(channel)
  watch_keeper(sb, keeper, out:sub(#out:match("^[^\n]*\n") + 1))
  if opts.dev_records then self.files:unpack_records(id, "/dev", opts.dev_records, sb) end
end

--- eng:info(id) -> { id, state, init_pid, keeper_pid, uid_base, network, lowers, upper, frozen }
-- or nil for an unknown sandbox. state is "creating", "running", "terminating" or "dead" (its
-- processes ended without terminate). Does not yield.
function Engine:info(id)
  local sb = self.sandboxes[id]
  if not sb then return nil end
  local lowers = {}
  for i, l in ipairs(sb.lowers) do lowers[i] = l end
  local state = sb.state
  if state == "running" and not host.alive(sb.init) then state = "dead" end
  return { id = id, state = state, init_pid = sb.init, keeper_pid = sb.keeper and sb.keeper.pid,
    uid_base = sb.uid_base, network = sb.network, lowers = lowers, upper = self:dir(id) .. "/upper",
    frozen = sb.frozen }
end

--- eng:alive(id) -> boolean: the sandbox exists here and its init still runs. Does not yield.
function Engine:alive(id)
  local sb = self.sandboxes[id]
  return sb ~= nil and sb.state == "running" and sb.init ~= nil and host.alive(sb.init)
end

--- eng:live(fn, id[, allow_frozen]) -> the record of running sandbox id; raises not_found,
-- not_running or (unless allow_frozen) frozen, as operation fn. For this module and its parts.
function Engine:live(fn, id, allow_frozen)
  local sb = self.sandboxes[id]
  if not sb then fail(fn, "not_found", id, "sandbox " .. tostring(id) .. " does not exist on this engine") end
  if sb.state ~= "running" or not host.alive(sb.init) then
    fail(fn, "not_running", id, "sandbox " .. id .. " is not running (" ..
      (sb.state == "running" and "its processes have ended" or sb.state) .. ")")
  end
  if sb.frozen and not allow_frozen then
    fail(fn, "frozen", id, "sandbox " .. id
      .. " is frozen (suspended); thaw it before running commands in it")
  end
  return sb
end

--- eng:enter_args(sb, leaf) -> the argument words that make a helper join sandbox record sb
-- (its init, id range and the cgroup leaf "sandbox" or "helper"). For this module and its parts.
function Engine:enter_args(sb, leaf)
  local a = { "--id=" .. sb.id, "--target=" .. sb.init, "--uid-base=" .. sb.uid_base }
  for _, d in ipairs(self.cg:leaves(sb.id, leaf)) do a[#a + 1] = "--cgroup=" .. d end
  -- the helper stays on the host side; only what it forks joins (cgroup.lua, fairness)
  if self.cg.fair then a[#a + 1] = "--join-in-child" end
  return a
end

-- ---- exec ---------------------------------------------------------------------------------------

-- Bash's builtins and reserved words: a command naming one as its program needs bash. true and
-- false are not here: /bin/true and /bin/false do exactly what the builtins do.
local SHELL_WORDS = {}
for w in ([[alias bg bind break builtin caller cd command compgen complete compopt continue
  declare dirs disown echo enable eval exec exit export fc fg getopts hash help history jobs kill
  let local logout mapfile popd printf pushd pwd read readarray readonly return set shift shopt
  source suspend test times trap type typeset ulimit umask unalias unset wait if then else elif
  fi case esac for select while until do done in function time coproc . :]]):gmatch("%S+") do
  SHELL_WORDS[w] = true
end

--- M.words_of(command) -> argv or nil. The words of a shell command that bash would run as one
-- program with those arguments and nothing else: words of letters, digits and `-_./=:,+@%`, or
-- single-quoted words without a quote inside, separated by blanks; the first neither a builtin
-- or reserved word of bash nor an assignment. Anything else (quotes within words, `$`, globs,
-- `~`, redirections, `;`, `&`, pipes, newlines...) is nil: bash must read it. Does not yield.
function M.words_of(command)
  if type(command) ~= "string" or #command > 65536 then return nil end
  local words, pos = {}, 1
  while true do
    pos = command:match("^[ \t]*()", pos)
    if pos > #command then break end
    local word, after = command:match("^([%w%-_%./=:,+@%%]+)()", pos)
    if not word then word, after = command:match("^'([^']*)'()", pos) end
    if not word or (after <= #command and not command:sub(after, after):match("[ \t]")) then return nil end
    words[#words + 1] = word
    pos = after
  end
  local first = words[1]
  if not first or first == "" or SHELL_WORDS[first] or first:match("^[%w_]+=") then return nil end
  return words
end

local Exec = {}

-- Reads what is left of both streams and reaps the process, then forgets it. Runs in tasks of
-- the engine so that the command keeps running, unobserved, after its caller left.
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

--- handle:read([stream [, max]]) -> the next chunk of "stdout" (default) or "stderr", nil at the
-- end; as moonbox.proc's p:read. [yields]
function Exec:read(stream, max) return self._rec.process:read(stream, max) end

--- handle:lines([stream]) -> iterator over the lines of a stream; as moonbox.proc's p:lines. [yields]
function Exec:lines(stream) return self._rec.process:lines(stream) end

--- handle:stats() -> moonbox.proc's buffer statistics of the process. Does not yield.
function Exec:stats() return self._rec.process:stats() end

--- handle:wait() -> code, signal. Waits until the command (`bash -c COMMAND`, or its program) ends:
-- code is its exit status, or 128 + n when signal n killed it (signal then names it, e.g. "KILL":
-- 137 is what the kernel's OOM killer leaves). Processes it started in the background keep
-- running. Does not read the pipes: read them (from other tasks if need be) or the command stalls
-- once the buffers are full. [yields]
function Exec:wait()
  local rec = self._rec
  local code, sig = rec.process:wait()
  rec.done = true
  rec.sb.execs[rec] = nil
  if code then return code end
  return 128 + (host.SIGNALS[sig] or tonumber(tostring(sig):match("%d+")) or 0), sig
end

--- handle:kill([sig]) -> boolean. Sends sig (default "TERM"; a name or number) to the command's
-- process group inside the sandbox (bash leads its own session and group there). Returns false
-- when the command has already ended. Raises a plain error for an unknown signal. Does not
-- yield.
function Exec:kill(sig)
  local rec = self._rec
  local n = host.signal_number(sig or "TERM")
  if rec.done then return false end
  -- The helper relays every signal it can catch to the command's group (moonbox-sandbox exec);
  -- SIGKILL ends the helper, and the init then kills the group (starter.c).
  return rec.process:kill(n)
end

--- handle:detach(): the caller stops reading; the command keeps running, its remaining output is
-- read and dropped by the engine, and it is reaped when it ends. Also what `<close>`, handle:close()
-- and garbage collection do: dropping a handle never kills. Idempotent. Does not yield.
function Exec:detach()
  local rec = self._rec
  if rec and not rec.done then drain(rec) end
end
Exec.close = Exec.detach

local ExecMT = {
  __index = Exec,
  __close = function(handle) handle:detach() end,
  __gc = function(handle) pcall(Exec.detach, handle) end,
  __tostring = function(handle)
    local rec = handle._rec
    return string.format("Exec %d in %s (%s)", handle.pid, rec and rec.sb.id or "?",
      rec and rec.done and "ended" or "running")
  end,
}

--- eng:exec(id, command[, opts]) -> handle, a handle of the running command. command is a shell
-- string, run by `bash -c command` unless it is plain words (M.words_of: then its program runs
-- directly, with PWD and SHLVL=1 as bash would export them, and bash only when the program cannot
-- be executed, to say why), or an argv table (program and arguments, run directly; a program
-- without a slash is looked up in the command's PATH). It runs as root (of the sandbox's user
-- namespace) in /root, inside all the sandbox's namespaces, its cgroup and its confinement,
-- started by the sandbox's init (or, at its process limit, from the host side), as the leader of a
-- new session and process group, with the create env (plus PATH and HOME) and stdin from
-- /dev/null. Waits first for the network of an allow-all sandbox to be up (milliseconds after
-- create). opts.buffer: bytes buffered per stream (moonbox.proc's default 64 KiB); opts.cwd:
-- working directory inside. handle.pid is the host pid of the helper that waits for the command.
-- The command outlives a dropped handle (handle:detach). Raises structured errors (op
-- "local.engine.exec"): not_found, not_running, frozen (thaw first), network_failed, spawn_failed.
-- [yields]
function Engine:exec(id, command, opts)
  check_id("exec", id)
  local words, shell
  if type(command) == "table" then
    if #command == 0 then error("local.engine.exec: an argv table needs a program", 2) end
    words = {}
    for i, a in ipairs(command) do
      if type(a) ~= "string" or a:find("\0", 1, true) then
        error("local.engine.exec: argv[" .. i .. "] must be a string without NUL", 2)
      end
      words[i] = a
    end
  elseif type(command) == "string" then
    words = M.words_of(command)
    shell = words and command
  else
    error("local.engine.exec: command must be a string or an argv table", 2)
  end
  opts = opts or {}
  local sb = self:live("exec", id)
  local deadline = task.now() + 30
  while sb.net == "pending" and task.now() < deadline do
    pcall(task.timeout, deadline - task.now(), sb.cond.wait, sb.cond)
  end
  if sb.net ~= "ready" then
    fail("exec", "network_failed", id, "sandbox " .. id .. ": its network did not come up: " ..
      tostring(sb.net_error or "slirp4netns took longer than 30 s"))
  end
  sb = self:live("exec", id)
  -- The init starts it (its starter, over the channel the keeper holds); the enter arguments are
  -- for when it cannot fork (the sandbox at its process limit), which the helper does instead.
  local argv = { self.tools.helper, "exec", "--keeper=" .. sb.keeper.pid, "--channel=" .. sb.channel }
  for _, a in ipairs(self:enter_args(sb, "sandbox")) do argv[#argv + 1] = a end
  if opts.cwd then argv[#argv + 1] = "--cwd=" .. opts.cwd end
  if shell then argv[#argv + 1] = "--shell=" .. shell end
  argv[#argv + 1] = "--setsid"
  argv[#argv + 1] = "--"
  local env = sb.env
  if words then
    for _, a in ipairs(words) do argv[#argv + 1] = a end
    if shell then
      env = {}
      for k, v in pairs(sb.env) do env[k] = v end
      env.MBENV_PWD = env.MBENV_PWD or opts.cwd or "/root"
      env.MBENV_SHLVL = env.MBENV_SHLVL or "1"
    end
  else
    for _, a in ipairs({ "/bin/bash", "-c", command }) do argv[#argv + 1] = a end
  end
  argv.env, argv.env_mode, argv.buffer = env, "replace", opts.buffer
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
-- streams and waits. For short commands (tests, internal chores): all output is held in memory,
-- up to opts.max_output bytes per stream (default 16 MiB; the rest is read and dropped).
-- Raises what eng:exec raises. [yields]
function Engine:run(id, command, opts)
  opts = opts or {}
  local cap = opts.max_output or 16 * 1024 * 1024
  local handle = self:exec(id, command, opts)
  local out, err = { n = 0 }, { n = 0 }
  local function reader(stream, into)
    return task.spawn(function()
      for chunk in function() return handle:read(stream) end do
        if into.n < cap then
          into[#into + 1] = chunk:sub(1, cap - into.n)
          into.n = into.n + #chunk
        end
      end
    end)
  end
  local readers = { reader("stdout", out), reader("stderr", err) }
  local ok, code, sig = pcall(handle.wait, handle)
  if ok then
    pcall(task.timeout, 0.2, function() for _, t in ipairs(readers) do task.join(t) end end)
  end
  for _, t in ipairs(readers) do
    if task.result(t) == nil then task.cancel(t) end
  end
  for _, t in ipairs(readers) do pcall(task.join, t) end
  handle:detach()
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
function Engine:frozen(id)
  return self.cg ~= nil and self.sandboxes[id] ~= nil and self.cg:frozen(id)
end

--- eng:processes(id) -> array of host pids of the sandbox's processes still alive (its
-- cgroups' members: the init, everything started inside, file helpers). Does not yield.
function Engine:processes(id)
  if not self.cg then return {} end
  return self.cg:procs(id)
end

--- eng:oom_kills(id) -> how many processes the kernel's OOM killer ended in the sandbox.
function Engine:oom_kills(id)
  return self.cg and self.cg:oom_kills(id)
end

-- ---- teardown -----------------------------------------------------------------------------------

-- Ends everything of sandbox id and frees it: thaws (a frozen process cannot die), kills the
-- init (the kernel then kills every process of its PID namespace), kills file helpers and
-- whatever else is left in the cgroups until they are empty, waits for the keeper (its mount
-- namespace, holding the overlay, goes with it), removes the cgroups and the sandbox directory.
-- sb may be nil (after a restart). Idempotent. [yields]
function Engine:teardown(id, sb)
  local cg = self.cg
  if cg then cg:thaw(id) end
  if sb and sb.init and host.alive(sb.init) then
    pcall(sys.kill, sb.init, 9) -- it may end on its own meanwhile
  elseif sb and sb.keeper then
    sb.keeper:kill("KILL") -- create failed before the init was known
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
        -- Stragglers: helpers between joining the cgroup and entering the PID namespace, or a
        -- sandbox left by a previous backend.
        cg:thaw(id)
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
  if sb and sb.keeper then pcall(sb.keeper.wait, sb.keeper) end
  if cg then
    -- The last processes leave cgroup.procs a moment before the kernel lets go of the cgroup
    -- (rmdir says EBUSY until their exit completes).
    local ok, err = cg:remove(id)
    local until_ = task.now() + 5
    while not ok and task.now() < until_ do
      task.sleep(0.005)
      ok, err = cg:remove(id)
    end
    if not ok then
      fail("terminate", "terminate_failed", id, "sandbox " .. id .. ": cannot remove its cgroup: "
        .. tostring(err))
    end
  end
  os.remove(self:root_dir(id)) -- rmdir: empty once the keeper's namespaces are gone
  local dir = self:dir(id)
  if host.exists(dir) then
    if host.mounted(dir .. "/root") then pcall(host.umount, dir .. "/root", true) end -- an older backend's
    local rok, rerr = pcall(host.remove_tree, dir)
    if not rok then
      if not core.Error.is(rerr) then error(rerr, 0) end
      fail("terminate", "command_failed", id, "sandbox " .. id .. ": " .. rerr.message)
    end
    if self.disk then self.disk:freed() end
  end
end

--- eng:terminate(id). Kills every process of the sandbox, waits until none is left and removes
-- its directory and cgroups. Idempotent: an unknown or already terminated id is cleaned if
-- anything is left and is otherwise a no-op. A terminate during create waits for the create to
-- settle. Raises (op "local.engine.terminate") terminate_failed, command_failed. [yields]
function Engine:terminate(id)
  check_id("terminate", id)
  local sb = self.sandboxes[id]
  while sb and (sb.state == "creating" or sb.state == "terminating") do
    sb.cond:wait()
    sb = self.sandboxes[id]
  end
  if sb then sb.state = "terminating" end
  local ok, err = pcall(self.teardown, self, id, sb)
  if sb then
    if self.sandboxes[id] == sb then self.sandboxes[id] = nil end
    sb.state = "gone"
    sb.cond:broadcast()
  end
  if not ok then error(err, 0) end
end

-- ---- snapshots ----------------------------------------------------------------------------------

--- M.CAPTURE_TIMEOUT: how long (seconds) a capture may keep its sandbox frozen by default.
M.CAPTURE_TIMEOUT = 60

--- eng:capture(id, layer_dir[, opts]) -> { size = bytes, dev_records = path|nil, dev_size = bytes,
-- manifest = {files, bytes, tree}, layers = {...}, kind }. Freezes the sandbox, copies its
-- upper layer to layer_dir (absolute, must not exist; copied into layer_dir.partial, synced,
-- then renamed) with ids made 0-based, and the helper writes layer_dir.manifest (moonbox-sandbox
-- capture: what the layer holds, file count, bytes, a checksum of the tree); then thaws it (a
-- sandbox that was already frozen stays frozen). opts.kind = "filesystem" (default) or
-- "runtime"; runtime also saves the in-memory /dev area (files created there, /dev/shm
-- included) as records in <layer_dir>.dev, beside the layer. Processes, memory and open
-- connections are not saved by either kind. opts.timeout (seconds, default M.CAPTURE_TIMEOUT)
-- bounds the freeze: a capture still copying then is stopped (its helpers killed), the sandbox
-- thawed, and capture_timeout raised. manifest is what the helper printed; helper_kib the copying
-- helper's peak resident memory (KiB, its getrusage ru_maxrss; nil if it did not say). layers is the lower
-- stack a restore passes as create's lowers: { layer_dir, <this sandbox's lowers>... }. On
-- failure nothing of the layer is left (layer, .partial, .dev, .manifest). Raises (op
-- "local.engine.capture") not_found, not_running, exists, busy, capture_failed,
-- capture_timeout. [yields]
function Engine:capture(id, layer_dir, opts)
  check_id("capture", id)
  layer_dir = check_abs("layer_dir", layer_dir)
  opts = opts or {}
  local kind = opts.kind or "filesystem"
  if kind ~= "filesystem" and kind ~= "runtime" then
    error("local.engine.capture: kind must be \"filesystem\" or \"runtime\", got " .. tostring(kind), 2)
  end
  local limit = opts.timeout or M.CAPTURE_TIMEOUT
  local sb = self:live("capture", id, true)
  if sb.capturing then fail("capture", "busy", id, "sandbox " .. id .. " is already being captured") end
  if host.exists(layer_dir) then
    fail("capture", "exists", id, "sandbox " .. id .. ": the snapshot layer already exists")
  end
  local dev = kind == "runtime" and layer_dir .. ".dev" or nil
  sb.capturing = true
  local was_frozen = sb.frozen
  local ok, result = pcall(function()
    if not was_frozen then
      local fok, ferr = self.cg:freeze(id)
      if not fok then fail("capture", "capture_failed", id, "sandbox " .. id .. ": " .. ferr) end
    end
    sys.mkdir_p(layer_dir:match("^(.*)/[^/]*$"), tonumber("700", 8))
    local out = { size = 0, dev_size = 0 }
    local jobs = { function()
      local r = host.run("capture", id, { self.tools.helper, "capture", "--src=" .. self:dir(id) .. "/upper",
        "--dst=" .. layer_dir, "--uid-base=" .. sb.uid_base, env = HOST_ENV, env_mode = "replace" },
        { what = "copying the upper layer", code = "capture_failed" })
      local files, bytes, tree = r.stdout:match("files=(%d+) bytes=(%d+) tree=(%x+)")
      if not files then
        fail("capture", "capture_failed", id, "sandbox " .. id .. ": the capture wrote no manifest")
      end
      out.manifest = { files = tonumber(files), bytes = tonumber(bytes), tree = tree }
      out.size = tonumber(bytes)
      out.helper_kib = tonumber(r.stderr:match("maxrss=(%d+)"))
    end }
    if dev then
      jobs[2] = function()
        out.dev_size = self.files:pack_records(id, "/dev", dev, { exclude = DEV_BUILTIN, sb = sb })
      end
    end
    local tok, terr = pcall(task.timeout, limit, task.all, jobs)
    if not tok then
      if task.is_timeout(terr) then
        fail("capture", "capture_timeout", id, string.format("sandbox %s: the capture did not finish " ..
          "within %g s (the limit on how long a capture keeps a sandbox frozen); it was stopped and " ..
          "the sandbox thawed", id, limit))
      end
      error(terr, 0)
    end
    return out
  end)
  -- Thaw unless the sandbox is (now) meant to be frozen: a suspend may have come in meanwhile.
  if not sb.frozen and sb.state == "running" then self.cg:thaw(id) end
  sb.capturing = false
  if not ok then
    for _, f in ipairs({ layer_dir .. ".partial", layer_dir, layer_dir .. ".manifest", dev }) do
      if host.exists(f) then pcall(host.remove_tree, f) end
    end
    error(result, 0)
  end
  local layers = { layer_dir }
  for _, l in ipairs(sb.lowers) do layers[#layers + 1] = l end
  return { size = result.size + result.dev_size, dev_records = dev, dev_size = result.dev_size,
    manifest = result.manifest, layers = layers, kind = kind, helper_kib = result.helper_kib }
end

--- engine.verify_layer(layer[, opts]) -> {files, bytes} | nil, why, code. Checks a snapshot layer
-- against the manifest its capture wrote beside it (layer .. ".manifest") with moonbox-sandbox
-- verify: opts.full also reads every file's contents and xattrs (--check); without it, the
-- quick check (names, types, sizes, modes, owners, counts). code is "mismatch" (why names the
-- first difference, by its path inside the layer), "missing" (no layer) or "no_manifest"
-- (a layer captured without one). Raises (op "local.engine.verify") verify_failed when the
-- check itself cannot run (the helper's usage or I/O error). Never names a host path. [yields]
function M.verify_layer(layer, opts)
  opts = opts or {}
  local name = layer:match("[^/]*$")
  if not host.exists(layer) then return nil, "layer " .. name .. " is gone", "missing" end
  local manifest = layer .. ".manifest"
  if not host.exists(manifest) then return nil, "layer " .. name .. " has no manifest", "no_manifest" end
  local helper, places = find_helper()
  if not helper then
    fail("verify", "verify_failed", nil, "cannot find moonbox-sandbox (looked at " .. places .. ")")
  end
  local argv = { helper, "verify", "--layer=" .. layer, "--manifest=" .. manifest, env = HOST_ENV,
    env_mode = "replace" }
  if not opts.full then argv[#argv + 1] = "--quick" end
  local r = proc.run(argv)
  local function said(text)
    local msg = host.trim(text):gsub("^moonbox%-sandbox: ", ""):gsub("^verify: ", "")
    return (msg:gsub(layer:gsub("%p", "%%%0"), name))
  end
  if r.code == 0 then
    return { files = tonumber(r.stdout:match("files=(%d+)")),
      bytes = tonumber(r.stdout:match("bytes=(%d+)")) }
  elseif r.code == 1 then
    return nil, "layer " .. name .. ": " .. said(r.stderr), "mismatch"
  end
  fail("verify", "verify_failed", nil, "checking layer " .. name .. " failed (" ..
    (r.code and ("exit " .. r.code) or ("signal " .. tostring(r.signal))) .. "): " .. said(r.stderr))
end

--- eng:verify_layer(layer[, opts]) -> as engine.verify_layer. A successful check is kept for the
-- life of the engine (layers never change once captured): the quick check of a layer already
-- checked answers at once; opts.full always reads the layer. [yields]
function Engine:verify_layer(layer, opts)
  opts = opts or {}
  self.verified = self.verified or {}
  if not opts.full and self.verified[layer] then return self.verified[layer] end
  local res, why, code = M.verify_layer(layer, opts)
  if res then self.verified[layer] = res end
  return res, why, code
end

--- eng:forget_layer(layer): the layer was freed; a later one of the same name is checked anew.
function Engine:forget_layer(layer)
  if self.verified then self.verified[layer] = nil end
end

-- ---- recovery -----------------------------------------------------------------------------------

--- eng:recover() -> { {id, upper, had_processes}, ... }. After a backend restart: finds sandbox
-- directories and cgroups under the state dir that this engine does not run (their processes
-- died with the previous backend's keepers), kills anything of theirs still alive, removes their
-- cgroups, and unmounts what an older moonbox left mounted under the state dir. Upper
-- directories stay: the caller decides (the service reports each sandbox errored and
-- terminates it). [yields]
function Engine:recover()
  self:prepare()
  local report, seen = {}, {}
  local ok, names = pcall(sys.listdir, self.state_dir .. "/sandboxes")
  for _, id in ipairs(ok and names or {}) do
    seen[id] = true
    if not self.sandboxes[id] and id:match("^[%w][%w._-]*$") then
      report[#report + 1] = { id = id, upper = self:dir(id) .. "/upper", had_processes = #self.cg:procs(
        id) > 0 }
    end
  end
  for _, id in ipairs(self.cg:ids()) do
    if not self.sandboxes[id] and not seen[id] and id:match("^[%w][%w._-]*$") then
      report[#report + 1] = { id = id, had_processes = #self.cg:procs(id) > 0 }
    end
  end
  for _, item in ipairs(report) do
    local dir = self:dir(item.id)
    pcall(function()
      self.cg:thaw(item.id)
      for _, pid in ipairs(self.cg:procs(item.id)) do pcall(sys.kill, pid, 9) end
      local deadline = task.now() + 5
      while #self.cg:procs(item.id) > 0 and task.now() < deadline do task.sleep(0.005) end
      local until_ = task.now() + 5
      while not self.cg:remove(item.id) and task.now() < until_ do task.sleep(0.005) end
      if host.mounted(dir .. "/root") then host.umount(dir .. "/root", true) end
    end)
  end
  -- Mounts an older moonbox made in the host's namespace (base overlays, sandbox roots).
  local info = host.read("/proc/self/mountinfo") or ""
  local prefix = self.state_dir .. "/"
  for line in info:gmatch("[^\n]+") do
    local mp = line:match("^%S+ %S+ %S+ %S+ (%S+)")
    if mp and mp:sub(1, #prefix) == prefix and mp ~= self.base_root and not (self.disk and mp ==
      self.disk.mnt) then
      pcall(host.umount, mp, true)
    end
  end
  table.sort(report, function(a, b) return a.id < b.id end)
  return report
end

--- eng:close() -> boolean. With no sandbox left, unmounts the host-root base (if any) and
-- removes the engine's (empty) parent cgroups; returns false and leaves them otherwise. [yields]
function Engine:close()
  if next(self.sandboxes) then return false end
  if self.base_root and host.mounted(self.base_root) then pcall(host.umount, self.base_root, true) end
  if self.disk then
    self.disk:close()
    self.disk = nil
  end
  if self.cg then
    for _, dir in pairs(self.cg.dirs) do os.remove(dir) end
    if self.cg:host_dir() then os.remove(self.cg:host_dir()) end -- kept while a process is in it
  end
  self.prepared = false
  return true
end

M.HOST_ENV = HOST_ENV
return M
