--- moonbox.local.engine.files — file operations of local sandboxes (render-api.md §6).
--
-- Every operation runs inside the sandbox's mount namespace and root (moonbox-nsexec --ns mnt
-- --root-wd, into the sandbox's init), using the sandbox's own sh,
-- cat, find and tar. That is the point:
-- a path is resolved by the kernel against the sandbox's root, so a symlink the sandbox made
-- (/root/x -> /etc/shadow, or -> /state/of/moonbox) means the sandbox's file, never the
-- host's. Working on the host through <state_dir>/sandboxes/<id>/root or /proc/<pid>/root
-- would follow absolute symlinks from the host's root and hand host files (other sandboxes'
-- layers, the backend's API key) to the caller. The helpers do not enter the PID namespace
-- or the cgroup: they work on a frozen (suspended) sandbox too, and ps inside does not show
-- them; terminate kills the ones still running.
-- Paths: absolute, or relative to /root (the helpers start there). The caller (the API layer)
-- normalises and checks paths as Render does; this module only refuses NULs and newlines.
-- Adds methods to moonbox.local.engine's Engine; only that module calls install().
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local host = require "moonbox.local.engine.host"

local M = {}
local fail = host.fail

-- read_file: refuses what is not a regular file, says so on stderr before any byte of the file
-- goes to stdout, so the caller can raise a clear error instead of streaming an error text.
local READ_SH = [[
p=$1
if [ -d "$p" ]; then echo is_directory >&2; exit 21; fi
if [ ! -e "$p" ]; then echo not_found >&2; exit 2; fi
if [ ! -f "$p" ]; then echo not_regular >&2; exit 22; fi
echo ok >&2
exec cat -- "$p"
]]

-- write_file: parents are created (0755), the data lands in a temporary file in the target
-- directory (umask 077: mode 0600 from the start) which then replaces the path atomically, so
-- a reader never sees half a file. mv -T replaces a symlink at the path rather than writing
-- through it. $1 path, $2 mode (octal digits).
local WRITE_SH = [[
p=$1 mode=$2
if [ -d "$p" ]; then echo is_directory >&2; exit 21; fi
case $p in */*) d=${p%/*} ;; *) d=. ;; esac
[ -n "$d" ] || d=/
if [ ! -d "$d" ] && ! err=$(mkdir -p -- "$d" 2>&1); then
  case $err in *"Not a directory"*|*"File exists"*) echo not_directory >&2 ;; *) echo "$err" >&2 ;; esac
  exit 20
fi
t=$d/.moonbox-upload.$$
umask 077
if ! cat > "$t"; then rm -f -- "$t"; exit 1; fi
if [ "$mode" != 600 ]; then chmod -- "$mode" "$t" || { rm -f -- "$t"; exit 1; }; fi
exec mv -fT -- "$t" "$p"
]]

-- stat and list: find prints NUL-separated fields (names may hold newlines): name, type letter,
-- size, mtime, link target. Depth 0 is the entry itself (not following a symlink); depth >= 1
-- follows a symlink given as the path (-H) and lists relative names (%P) down to depth.
local STAT_SH = [[
p=$1 follow=$2
[ -e "$p" ] || [ -L "$p" ] || exit 2
exec find "$follow" "$p" -maxdepth 0 -printf '%f\0%y\0%s\0%T@\0%l\0%m\0'
]]
local LIST_SH = [[
p=$1 depth=$2
[ -e "$p" ] || [ -L "$p" ] || exit 2
if [ "$depth" = 0 ]; then exec find "$p" -maxdepth 0 -printf '%f\0%y\0%s\0%T@\0%l\0%m\0'; fi
[ -d "$p" ] || { echo not_directory >&2; exit 20; }
exec find -H "$p" -mindepth 1 -maxdepth "$depth" -printf '%P\0%y\0%s\0%T@\0%l\0%m\0'
]]

-- tar_out: member names relative to the directory without a "./" prefix (as Render's clients
-- write them), symlinks stored as symlinks, gzip -1 (speed over ratio: it crosses a loopback).
local TAR_OUT_SH = [[
d=$1
if [ ! -e "$d" ]; then echo not_found >&2; exit 2; fi
if [ ! -d "$d" ]; then echo not_directory >&2; exit 20; fi
cd -- "$d" || exit 1
echo ok >&2
find . -mindepth 1 -maxdepth 1 -printf '%P\0' | tar -cf - --null -T - -I 'gzip -1'
]]

-- tar_in: extracts into the directory (created if missing) as root-owned files keeping the
-- archive's modes. GNU tar strips leading "/" and refuses ".." members on its own, and
-- whatever an archive does, it does inside the sandbox. $1 dir, $2 "-z" or "".
local TAR_IN_SH = [[
d=$1 z=$2
if [ -e "$d" ] && [ ! -d "$d" ]; then echo not_directory >&2; exit 20; fi
mkdir -p -- "$d" || exit 1
exec tar -x $z -f - -C "$d" --no-same-owner
]]

local TYPES = { f = "file", d = "directory", l = "symlink" }

local function path_arg(fn, id, path)
  if type(path) ~= "string" or path == "" then
    error("local.engine." .. fn .. ": path must be a non-empty string", 3)
  end
  if path:find("[%z\n]") then
    fail(fn, "invalid_path", id, "sandbox " .. id .. ": path contains a NUL or newline")
  end
  -- find and sh's test would read "-x" as an option; "./-x" is the same file.
  if path:sub(1, 1) ~= "/" then return "./" .. path end
  return path
end

-- Parses find's NUL-separated records into entries.
local function parse_entries(out)
  local fields = {}
  for f in out:gmatch("([^%z]*)%z") do fields[#fields + 1] = f end
  local entries = {}
  for i = 1, #fields - 5, 6 do
    local typ = TYPES[fields[i + 1]] or "file"
    local e = {
      name = fields[i], type = typ,
      size = typ == "file" and (tonumber(fields[i + 2]) or 0) or 0,
      modifiedAt = math.floor(tonumber(fields[i + 3]) or 0),
      mode = tonumber(fields[i + 5], 8),
    }
    e.mtime = e.modifiedAt
    if typ == "symlink" then e.target = fields[i + 4] end
    entries[#entries + 1] = e
  end
  return entries
end

--- M.install(Engine, shared): adds the file operations to Engine. shared carries HOST_ENV and
-- check_id from the engine module.
function M.install(Engine, shared)
  local HOST_ENV, check_id = shared.HOST_ENV, shared.check_id

  --- eng:spawn_inside(fn, sb, script, args[, opts]) -> Process. Starts `sh -c script` inside
  -- sandbox record sb's mount namespace and root, in /root, with the engine's capability
  -- bounding set, args as $1...; opts.stdin / opts.stdout as for proc.spawn (stderr is a
  -- pipe). The process is registered so terminate kills it. Raises spawn_failed (op
  -- "local.engine.<fn>"). Does not yield. For the engine's own modules.
  function Engine:spawn_inside(fn, sb, script, args, opts)
    opts = opts or {}
    local argv = { self.tools.nsexec, "--drop", sb.cap_drop, "--target", tostring(sb.init), "--ns", "mnt",
      "--root-wd", "--" }
    for _, a in ipairs({ "/bin/sh", "-c", script, "moonbox-" .. fn }) do argv[#argv + 1] = a end
    for _, a in ipairs(args) do argv[#argv + 1] = a end
    argv.env, argv.env_mode = HOST_ENV, "replace"
    argv.stdin, argv.stdout, argv.stderr = opts.stdin or "null", opts.stdout or "pipe", "pipe"
    local ok, p = pcall(proc.spawn, argv)
    if not ok then
      fail(fn, "spawn_failed", sb.id, "sandbox " .. sb.id .. ": cannot start a file helper: " ..
        tostring(type(p) == "table" and p.message or p))
    end
    sb.helpers[p] = true
    return p
  end

  --- eng:inside(fn, sb, script, args[, opts]) -> {code, stdout, stderr}: eng:spawn_inside run
  -- to completion, both streams read concurrently (stdout is "" when opts.stdout is not a
  -- pipe). code is nil when a signal ended it. [yields]
  function Engine:inside(fn, sb, script, args, opts)
    opts = opts or {}
    local p = self:spawn_inside(fn, sb, script, args, opts)
    local out, err = {}, {}
    local readers = { function()
      for chunk in function() return p:read("stderr") end do err[#err + 1] = chunk end
    end }
    if (opts.stdout or "pipe") == "pipe" then
      readers[2] = function()
        for chunk in function() return p:read("stdout") end do out[#out + 1] = chunk end
      end
    end
    local ok, e = pcall(task.all, readers)
    if not ok then
      p:close() -- cancelled: the helper must not outlive its caller
      error(e, 0)
    end
    local code = p:wait()
    return { code = code, stdout = table.concat(out), stderr = table.concat(err) }
  end

  -- Raises the error a helper's failure stands for: the scripts name expected failures with
  -- one word on the first line of stderr; anything else is reported with the whole stderr.
  local function helper_failed(fn, id, path, code, stderr)
    local head = stderr:match("^([%w_]+)\n") or ""
    if head == "not_found" then
      fail(fn, "not_found", id, "sandbox " .. id .. ": no file or directory at " .. path)
    elseif head == "is_directory" then
      fail(fn, "is_directory", id, "sandbox " .. id .. ": " .. path .. " is a directory")
    elseif head == "not_directory" then
      fail(fn, "not_directory", id, "sandbox " .. id .. ": " .. path ..
        " (or one of its parents) is not a directory")
    elseif head == "not_regular" then
      fail(fn, "not_regular", id, "sandbox " .. id .. ": " .. path ..
        " is not a regular file (a device, fifo or socket)")
    end
    fail(fn, "command_failed", id, string.format("sandbox %s: %s of %s failed (%s): %s", id, fn,
      path, code and ("exit " .. code) or "killed", host.trim(stderr)))
  end

  -- Starts a streaming helper whose script announces "ok" on stderr before streaming; returns
  -- the Process positioned at the first byte of stdout, or raises what went wrong. [yields]
  local function stream_after_ok(self, fn, id, sb, script, args, path)
    local p = self:spawn_inside(fn, sb, script, args)
    local head = ""
    local ok, err = pcall(function()
      while not head:find("\n") do
        local chunk = p:read("stderr")
        if not chunk then break end
        head = head .. chunk
      end
    end)
    if not ok then
      p:close()
      error(err, 0)
    end
    if head:match("^ok\n") then return p end
    for chunk in function() return p:read("stderr") end do head = head .. chunk end
    local code = p:wait()
    helper_failed(fn, id, path, code, head)
  end

  --- eng:read_file(id, path) -> Process streaming the file's bytes on stdout (read it with
  -- p:read("stdout"), then p:wait() -> 0). Symlinks resolve inside the sandbox. Raises (op
  -- "local.engine.read_file") not_found, is_directory, not_regular, not_running,
  -- command_failed before any byte is streamed. Closing the Process stops the transfer.
  -- [yields]
  function Engine:read_file(id, path)
    check_id("read_file", id)
    local sb = self:live("read_file", id, true)
    return stream_after_ok(self, "read_file", id, sb, READ_SH, { path_arg("read_file", id, path) }, path)
  end

  --- eng:write_file(id, path, src_file[, opts]). Copies the host file src_file to path inside
  -- the sandbox: parents are created (mode 0755), the file is owned by root with mode
  -- opts.mode (default 0600, as Render's uploads) and replaces an existing file (or symlink)
  -- at path atomically. Raises (op "local.engine.write_file") is_directory (path is a
  -- directory), not_directory (a parent is a file), not_found (src_file missing),
  -- not_running, command_failed. [yields]
  function Engine:write_file(id, path, src_file, opts)
    check_id("write_file", id)
    opts = opts or {}
    local mode = opts.mode or tonumber("600", 8)
    if math.type(mode) ~= "integer" or mode < 0 or mode > tonumber("7777", 8) then
      error("local.engine.write_file: mode must be an integer permission (e.g. tonumber(\"644\", 8))", 2)
    end
    local sb = self:live("write_file", id, true)
    if type(src_file) ~= "string" or not host.exists(src_file) then
      fail("write_file", "not_found", id, "sandbox " .. id .. ": the source file " ..
        tostring(src_file) .. " does not exist on the host")
    end
    local r = self:inside("write_file", sb, WRITE_SH,
      { path_arg("write_file", id, path), string.format("%o", mode) }, { stdin = { file = src_file } })
    if r.code ~= 0 then helper_failed("write_file", id, path, r.code, r.stderr) end
  end

  --- eng:stat(id, path[, opts]) -> { type = "file"|"directory"|"symlink", size, mtime,
  -- modifiedAt, mode, target } or nil when nothing is at path. A symlink at path is reported
  -- as such (target its text) unless opts.follow, which describes what it points to (what
  -- read_file and tar_out would read; a dangling link stays "symlink"). size is 0 for
  -- directories and symlinks; mtime/modifiedAt in unix seconds; devices, fifos and sockets
  -- report as "file" with size 0. Raises (op "local.engine.stat") not_running,
  -- command_failed. [yields]
  function Engine:stat(id, path, opts)
    check_id("stat", id)
    local sb = self:live("stat", id, true)
    local follow = opts and opts.follow and "-H" or "-P"
    local r = self:inside("stat", sb, STAT_SH, { path_arg("stat", id, path), follow })
    if r.code == 2 then return nil end
    if r.code ~= 0 then helper_failed("stat", id, path, r.code, r.stderr) end
    local e = parse_entries(r.stdout)[1]
    if not e then return nil end
    e.name = nil
    return e
  end

  --- eng:list(id, path, depth) -> entries, or nil when nothing is at path. Each entry:
  -- { name, type = "file"|"directory"|"symlink", size, modifiedAt (unix seconds), mtime,
  -- mode, target (symlinks) }. depth 0: the entry itself (name = its basename). depth 1: the
  -- children of the directory. depth > 1: every entry down to that depth, flattened, name
  -- relative to path ("sub/file.txt"). Entries come sorted by name. A symlink given as path is
  -- followed for depth >= 1. Raises (op "local.engine.list") not_directory (depth >= 1 on a
  -- non-directory), not_running, command_failed. [yields]
  function Engine:list(id, path, depth)
    check_id("list", id)
    depth = depth or 1
    if math.type(depth) ~= "integer" or depth < 0 then
      error("local.engine.list: depth must be an integer >= 0", 2)
    end
    local sb = self:live("list", id, true)
    local r = self:inside("list", sb, LIST_SH, { path_arg("list", id, path), tostring(depth) })
    if r.code == 2 then return nil end
    if r.code ~= 0 then helper_failed("list", id, path, r.code, r.stderr) end
    local entries = parse_entries(r.stdout)
    table.sort(entries, function(a, b) return a.name < b.name end)
    return entries
  end

  --- eng:tar_out(id, dir) -> Process streaming a gzip'd tar of directory dir on stdout: member
  -- names relative to dir (no "./" prefix), symlinks stored as symlinks. Read stdout, then
  -- p:wait() -> 0; tar's warnings (a file changed while read) come on stderr. Raises (op
  -- "local.engine.tar_out") not_found, not_directory, not_running, command_failed before
  -- streaming. [yields]
  function Engine:tar_out(id, dir)
    check_id("tar_out", id)
    local sb = self:live("tar_out", id, true)
    return stream_after_ok(self, "tar_out", id, sb, TAR_OUT_SH, { path_arg("tar_out", id, dir) }, dir)
  end

  --- eng:tar_in(id, dir, src_tar[, opts]). Extracts the host file src_tar (a tar archive,
  -- gzip'd or not: detected from its first bytes) into dir inside the sandbox (created if
  -- missing), files owned by root with the archive's modes. The caller validates member names
  -- beforehand; extraction cannot escape the sandbox either way. Raises (op
  -- "local.engine.tar_in") not_directory, not_found (src_tar missing), not_running,
  -- command_failed (a corrupt archive, with tar's message). [yields]
  function Engine:tar_in(id, dir, src_tar)
    check_id("tar_in", id)
    local sb = self:live("tar_in", id, true)
    local f = type(src_tar) == "string" and io.open(src_tar, "rb")
    if not f then
      fail("tar_in", "not_found", id, "sandbox " .. id .. ": the archive " .. tostring(src_tar) ..
        " does not exist on the host")
    end
    local magic = f:read(2)
    f:close()
    local z = magic == "\31\139" and "-z" or ""
    local r = self:inside("tar_in", sb, TAR_IN_SH, { path_arg("tar_in", id, dir), z },
      { stdin = { file = src_tar } })
    if r.code ~= 0 then helper_failed("tar_in", id, dir, r.code, r.stderr) end
  end
end

return M
