--- moonbox.local.image — the base images local sandboxes start from.
--
-- An image is a Debian root filesystem in <images>/<name>/rootfs, stored with ordinary 0-based
-- ids (each sandbox sees it through an idmapped mount of its own id range), never written to
-- after it is built, so any number of sandboxes and backends share it. The default image,
-- "debian-12", is what Render's base image is: Debian 12 with bash, coreutils, procps, git,
-- python3, nodejs, npm, curl, ca-certificates, tar and gzip. It is built once per machine with
-- mmdebstrap from this machine's own apt sources (nothing is downloaded but Debian packages
-- from the mirrors the machine already uses) and cached; a build holds a lock, so concurrent
-- first starts build it once. <images> is $MOONBOX_IMAGES, else $XDG_CACHE_HOME/moonbox/images,
-- else ~/.cache/moonbox/images. Used by `moonbox local` (which builds the default image on
-- first use) and `moonbox image`.
local proc = require "moonbox.proc"
local core = require "moonbox.core"
local sys = require "moonbox.sys"

local M = {}

M.DEFAULT = "debian-12"

-- What the default image holds besides Debian's essential packages and apt.
M.PACKAGES = { "bash", "coreutils", "procps", "git", "python3", "nodejs", "npm", "curl",
  "ca-certificates", "tar", "gzip", "findutils", "iproute2", "less" }

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() return true end
  return false
end

--- image.dir() -> the directory that holds the images.
function M.dir()
  local d = os.getenv("MOONBOX_IMAGES")
  if d and d ~= "" then return d end
  local cache = os.getenv("XDG_CACHE_HOME")
  if not cache or cache == "" then cache = (os.getenv("HOME") or "/root") .. "/.cache" end
  return cache .. "/moonbox/images"
end

local function check_name(name)
  if type(name) ~= "string" or not name:match("^[%w][%w._-]*$") or #name > 64 then
    error("image names are 1-64 letters, digits, '.', '_' or '-', got " .. tostring(name), 3)
  end
end

--- image.path(name) -> the root filesystem directory of image name (which may not exist).
function M.path(name)
  check_name(name or M.DEFAULT)
  return M.dir() .. "/" .. (name or M.DEFAULT) .. "/rootfs"
end

--- image.exists(name) -> whether image name is built.
function M.exists(name) return exists(M.path(name) .. "/bin/sh") end

--- image.list() -> { {name, path, info}, ... } of the built images, by name. info is the
-- text the build wrote (suite, packages, date).
function M.list()
  local ok, names = pcall(sys.listdir, M.dir())
  local out = {}
  if not ok then return out end
  table.sort(names)
  for _, n in ipairs(names) do
    if n:match("^[%w][%w._-]*$") and M.exists(n) then
      local f = io.open(M.dir() .. "/" .. n .. "/info")
      local info = f and f:read("a") or ""
      if f then f:close() end
      out[#out + 1] = { name = n, path = M.path(n), info = info }
    end
  end
  return out
end

-- The machine's apt sources, as files mmdebstrap reads its mirrors from.
local function host_sources()
  local files = {}
  local f = io.open("/etc/apt/sources.list")
  if f then
    local text = f:read("a")
    f:close()
    if text:find("\ndeb%s") or text:find("^deb%s") then files[#files + 1] = "/etc/apt/sources.list" end
  end
  local ok, names = pcall(sys.listdir, "/etc/apt/sources.list.d")
  if ok then
    table.sort(names)
    for _, n in ipairs(names) do
      if n:match("%.list$") or n:match("%.sources$") then files[#files + 1] = "/etc/apt/sources.list.d/"
        .. n end
    end
  end
  return files
end

local function host_suite()
  local f = io.open("/etc/os-release")
  local text = f and f:read("a") or ""
  if f then f:close() end
  return text:match("\nVERSION_CODENAME=\"?([%w]+)") or text:match("^VERSION_CODENAME=\"?([%w]+)")
end

-- Runs under `flock` on the image's lock file: builds into <name>/rootfs.partial and renames it
-- into place, unless another process finished the same build while we waited for the lock.
-- $1 the image dir, $2 the info text, then mmdebstrap's arguments (target: $1/rootfs.partial).
local BUILD_SH = [[
set -e
d=$1 info=$2
shift 2
[ -e "$d/rootfs/bin/sh" ] && exit 0
rm -rf -- "$d/rootfs.partial"
mmdebstrap "$@"
printf '%s\n' "$info" > "$d/info"
mv -T -- "$d/rootfs.partial" "$d/rootfs"
]]

--- image.build(name[, opts]) -> path. Builds image name with mmdebstrap (a few minutes),
-- unless it exists. opts: packages = {...} (default M.PACKAGES), suite (default this
-- machine's Debian release), log = function(line) for progress (mmdebstrap's output).
-- Concurrent builds of one image wait for each other (flock) and build it once. Raises a
-- structured error (op "image.build", code "unsupported" when mmdebstrap or the apt sources are
-- missing, "build_failed" with mmdebstrap's last lines). [yields]
function M.build(name, opts)
  name = name or M.DEFAULT
  check_name(name)
  opts = opts or {}
  if M.exists(name) then return M.path(name) end
  local dir = M.dir() .. "/" .. name
  sys.mkdir_p(dir, tonumber("700", 8))
  local sources = host_sources()
  local suite = opts.suite or host_suite()
  if #sources == 0 or not suite then
    error(core.Error.new { op = "image.build", code = "unsupported", message =
      "cannot build the sandbox image " .. name .. ": this machine has no apt sources or no " ..
      "Debian release name in /etc/os-release (point moonbox local at a root filesystem with " ..
      "--image DIR)" }, 0)
  end
  local pkgs = table.concat(opts.packages or M.PACKAGES, ",")
  local args = { "flock", dir .. "/.lock", "sh", "-c", BUILD_SH, "moonbox-image", dir,
    string.format("suite=%s packages=%s built=%s", suite, pkgs, os.date("!%Y-%m-%dT%H:%M:%SZ")),
    "--variant=minbase", "--include=" .. pkgs,
    "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    -- Files the sandbox's keeper binds its own copies over (see tools/sandbox/start.c).
    "--customize-hook=echo 'nameserver 10.0.2.3' > \"$1/etc/resolv.conf\"",
    "--customize-hook=printf '127.0.0.1\\tlocalhost\\n::1\\tlocalhost ip6-localhost\\n' > \"$1/etc/hosts\"",
    "--customize-hook=echo moonbox > \"$1/etc/hostname\"",
    suite, dir .. "/rootfs.partial" }
  for _, s in ipairs(sources) do args[#args + 1] = s end
  args.stdin, args.stdout, args.stderr = "null", "pipe", "stdout"
  args.env = { LC_ALL = "C", PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" }
  local ok, p = pcall(proc.spawn, args)
  if not ok then
    error(core.Error.new { op = "image.build", code = "unsupported", message =
      "cannot build the sandbox image " .. name .. ": " .. tostring(type(p) == "table" and p.message or p) ..
      " (install the Debian packages mmdebstrap and util-linux)" }, 0)
  end
  local tail = {}
  for line in p:lines() do
    if opts.log then opts.log(line) end
    tail[#tail + 1] = line
    if #tail > 20 then table.remove(tail, 1) end
  end
  local code = p:wait()
  if code ~= 0 or not M.exists(name) then
    error(core.Error.new { op = "image.build", code = "build_failed", message =
      "building the sandbox image " .. name .. " with mmdebstrap failed (exit " .. tostring(code) .. "):\n" ..
      table.concat(tail, "\n") }, 0)
  end
  return M.path(name)
end

--- image.remove(name) -> true, or false when it does not exist. Sandboxes and snapshots made
-- from it stop working: restores say the image is missing. [yields]
function M.remove(name)
  check_name(name)
  local dir = M.dir() .. "/" .. name
  if not exists(dir) then return false end
  sys.remove_tree(dir)
  return true
end

return M
