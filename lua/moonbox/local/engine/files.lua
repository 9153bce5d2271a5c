--- moonbox.local.engine.files — a local sandbox's files, read and written from inside it.
--
-- Every operation is one `moonbox-sandbox files` process (tools/sandbox/fileops.c): it joins
-- the sandbox's namespaces, becomes the root of its user namespace, joins the "helper" leaf of
-- its cgroup (inside its limits, never frozen) and confines itself like any process inside,
-- and then does the work with its own code — it runs nothing of the sandbox's (no sh, cat,
-- find or tar of the sandbox's) and loads nothing from it. Paths are resolved by the kernel
-- against the sandbox's root, so a symlink the sandbox planted means the sandbox's file.
-- Directory transfers cross as "records" (see runtime/archive_records.c): a client's tar is
-- checked and turned into records here (moonbox.archive.to_records), the helper creates what
-- they say; the helper packs a tree into records and moonbox.archive.from_records makes the
-- tar. Temporary files live in the sandbox disk's spool, else <state_dir>/tmp (0600), and are
-- removed when the operation ends.
-- Paths are absolute (the service checks them as Render does) and may hold any byte but NUL.
-- Owned by an Engine (eng.files); only the engine and the service call it.
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local sys = require "moonbox.sys"
local host = require "moonbox.local.engine.host"

local Files = {}
Files.__index = Files

local fail = host.fail

local TYPES = { f = "file", d = "directory", l = "symlink", p = "other", s = "other", c = "other",
  b = "other" }

-- Helper exit codes of our own failures (before any file work): EXIT_HELPER.
local EXIT_HELPER = 125

--- Files.new(engine) -> Files. Does no I/O.
function Files.new(engine)
  return setmetatable({ engine = engine, seq = 0 }, Files)
end

local function check_path(fn, id, path)
  if type(path) ~= "string" or path:sub(1, 1) ~= "/" then
    error("local.engine.files." .. fn .. ": path must be an absolute path", 3)
  end
  if path:find("%z") then
    fail(fn, "invalid_path", id, "sandbox " .. id .. ": path contains a NUL byte")
  end
end

-- A temporary file name: on the sandbox disk's spool when there is one (so that no file
-- operation can eat the state directory's reserve), else under the state dir.
function Files:temp(what)
  self.seq = self.seq + 1
  local disk = self.engine.disk
  local dir = disk and disk.spool or self.engine.state_dir .. "/tmp"
  sys.mkdir_p(dir, tonumber("700", 8))
  return string.format("%s/%s.%d.%s", dir, what, self.seq, host.hash(tostring(task.now()) .. tostring({})))
end

--- files:spawn(fn, id, op, args[, opts]) -> Process, the record of the sandbox. Starts one
-- `moonbox-sandbox files --op=OP` in sandbox id; args are more --key=value words; opts.stdin,
-- opts.stdout as for proc.spawn (stderr is a pipe). Registered so terminate kills it. Raises
-- not_found/not_running (op "local.engine.<fn>") or spawn_failed. Does not yield.
function Files:spawn(fn, id, op, path, args, opts)
  opts = opts or {}
  local eng = self.engine
  local sb = opts.sb or eng:live(fn, id, true)
  local argv = { eng.tools.helper, "files" }
  for _, a in ipairs(eng:enter_args(sb, "helper")) do argv[#argv + 1] = a end
  argv[#argv + 1] = "--op=" .. op
  argv[#argv + 1] = "--path=" .. path
  for _, a in ipairs(args or {}) do argv[#argv + 1] = a end
  argv.env, argv.env_mode = host.ENV, "replace"
  argv.stdin, argv.stdout, argv.stderr = opts.stdin or "null", opts.stdout or "pipe", "pipe"
  local ok, p = pcall(proc.spawn, argv)
  if not ok then
    fail(fn, "spawn_failed", id, "sandbox " .. id .. ": cannot start a file helper: " ..
      tostring(type(p) == "table" and p.message or p))
  end
  sb.helpers[p] = true
  return p, sb
end

-- Raises the structured error a helper's stderr says: "CODE message" from the file code, or
-- "moonbox-sandbox: STEP: ..." from entering (a sandbox that is gone, for one).
local function raise(fn, id, err, code)
  local word, msg = err:match("^(%l[%l_]*) ([^\n]*)")
  if word and code ~= EXIT_HELPER then
    fail(fn, word, id, "sandbox " .. id .. ": " .. msg)
  end
  local line = host.trim(err):gsub("moonbox%-sandbox: ", "")
  if line:match("^gone:") then
    fail(fn, "not_running", id, "sandbox " .. id .. " is not running (" .. line:gsub("^gone: ", "") .. ")")
  end
  fail(fn, "helper_failed", id, "sandbox " .. id .. ": the file helper failed (exit " ..
    tostring(code) .. "): " .. (line ~= "" and line or "no message"))
end

-- Runs a helper to its end and returns its stdout; raises its error.
function Files:run(fn, id, op, path, args, opts)
  local p, sb = self:spawn(fn, id, op, path, args, opts)
  local out, err
  local t = task.spawn(function() err = host.read_stream(p, "stderr") end)
  if not (opts and opts.stdout) then out = host.read_stream(p, "stdout") end
  task.join(t)
  local code = p:wait()
  sb.helpers[p] = nil
  if code ~= 0 then raise(fn, id, err or "", code) end
  return out or "", err or ""
end

-- Parses entry records (find -printf '%f\0%y\0%s\0%T@\0%l\0%m\0').
local function parse_entries(out)
  local fields = {}
  for f in out:gmatch("([^%z]*)%z") do fields[#fields + 1] = f end
  local entries = {}
  for i = 1, #fields - 5, 6 do
    local typ = TYPES[fields[i + 1]] or "other"
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

--- files:stat(id, path[, {follow}]) -> {name, type, size, modifiedAt, mode, target} or nil when
-- nothing is at path. type is "file", "directory", "symlink" or "other" (device, fifo,
-- socket). follow: a final symlink is followed. Raises (op "local.engine.stat") not_found
-- (the sandbox), invalid_path, not_directory, io_error, helper_failed. [yields]
function Files:stat(id, path, opts)
  check_path("stat", id, path)
  local ok, out = pcall(self.run, self, "stat", id, "stat", path, (opts and opts.follow) and { "--follow" }
    or {})
  if not ok then
    if type(out) == "table" and out.code == "not_found" and out.op == "local.engine.stat" and
      out.message:find("no file", 1, true) then
      return nil
    end
    error(out, 0)
  end
  return parse_entries(out)[1]
end

--- files:list(id, path, depth) -> entries (as stat's, names relative to path), or nil when
-- nothing is at path. depth 0 is path itself; depth >= 1 lists the directory down to depth
-- levels (a symlink given as path is followed). Raises (op "local.engine.list") not_directory,
-- too_many (more than 100,000 entries), invalid, io_error, helper_failed. [yields]
function Files:list(id, path, depth)
  check_path("list", id, path)
  local ok, out = pcall(self.run, self, "list", id, "list", path, { "--depth=" .. depth })
  if not ok then
    if type(out) == "table" and out.code == "not_found" and out.message:find("no file", 1, true) then
      return nil
    end
    error(out, 0)
  end
  local entries = parse_entries(out)
  table.sort(entries, function(a, b) return a.name < b.name end)
  return entries
end

--- files:read(id, path) -> p, size: a running helper whose stdout carries the file's bytes
-- (read it with p:read("stdout") until nil, then p:wait()) and the size it had when opened.
-- Follows symlinks inside the sandbox. Raises (op "local.engine.read") not_found, is_directory,
-- not_regular (devices, fifos, sockets), io_error, helper_failed before any byte. [yields]
function Files:read(id, path)
  check_path("read", id, path)
  local p, sb = self:spawn("read", id, "read", path, {})
  local head = ""
  while not head:find("\n") do
    local chunk = p:read("stderr")
    if not chunk then break end
    head = head .. chunk
  end
  local size = head:match("^ok (%d+)\n")
  if not size then
    head = head .. host.read_stream(p, "stderr")
    local code = p:wait()
    sb.helpers[p] = nil
    raise("read", id, head, code)
  end
  return p, tonumber(size)
end

--- files:write(id, path, src_file[, {mode}]) writes the bytes of the host file src_file (the
-- service's upload temp file) to path inside the sandbox: parents made (0755), the file
-- replaced atomically (a reader never sees half of it; a symlink at path is replaced, not
-- written through), mode default 0600, owned by the sandbox's root. Raises (op
-- "local.engine.write") is_directory, not_directory, io_error, helper_failed. [yields]
function Files:write(id, path, src_file, opts)
  check_path("write", id, path)
  local mode = string.format("%o", (opts and opts.mode) or tonumber("600", 8))
  self:run("write", id, "write", path, { "--mode=" .. mode }, { stdin = { file = src_file } })
end

--- files:unpack_records(id, path, records_file[, sb]) creates what records_file holds under the
-- directory path (made if missing), replacing files and symlinks that are there. Raises (op
-- "local.engine.unpack") not_directory, invalid, io_error, helper_failed. [yields]
function Files:unpack_records(id, path, records_file, sb)
  check_path("unpack", id, path)
  self:run("unpack", id, "unpack", path, {}, { stdin = { file = records_file }, sb = sb })
end

--- files:pack_records(id, path, out_file[, {exclude, sb}]) -> bytes: writes the tree under the
-- directory path as records to the host file out_file (symlinks as symlinks; devices, fifos,
-- sockets left out; exclude names entries of path itself to leave out). Raises (op
-- "local.engine.pack") not_found, not_directory, io_error, helper_failed. [yields]
function Files:pack_records(id, path, out_file, opts)
  opts = opts or {}
  check_path("pack", id, path)
  local args = {}
  for _, n in ipairs(opts.exclude or {}) do args[#args + 1] = "--exclude=" .. n end
  self:run("pack", id, "pack", path, args, { stdout = { file = out_file }, sb = opts.sb })
  local f = io.open(out_file, "rb")
  local size = f and f:seek("end") or 0
  if f then f:close() end
  return size
end

--- files:tar_in(id, path, archive_file[, opts]) extracts a client's (gzip'd) tar into the
-- directory path inside the sandbox. Every member is checked first (moonbox.archive.to_records:
-- no absolute names, no "..", symlinks that stay inside, no hard links or devices); a refused
-- archive changes nothing. opts.max_bytes, opts.max_entries bound it. Raises the archive's
-- errors (op "archive.to_records": unsafe_archive with member, corrupt_archive,
-- archive_too_large) or unpack's. [yields]
function Files:tar_in(id, path, archive_file, opts)
  opts = opts or {}
  local rec = self:temp("upload-records")
  local ok, err = pcall(function()
    -- lazy: moonbox.archive loads libarchive, which only a tarball upload or download needs
    require("moonbox.archive").to_records(archive_file, rec,
      { max_bytes = opts.max_bytes, max_entries = opts.max_entries })
    self:unpack_records(id, path, rec)
  end)
  os.remove(rec)
  if not ok then error(err, 0) end
end

--- files:tar_out(id, path) -> archive_file: the directory path packed as a gzip'd tar in a
-- temporary host file the caller serves and then removes (os.remove). Raises pack's errors and
-- the archive's (op "archive.from_records"). [yields]
function Files:tar_out(id, path)
  local rec, out = self:temp("download-records"), self:temp("download") .. ".tar.gz"
  local ok, err = pcall(function()
    self:pack_records(id, path, rec)
    require("moonbox.archive").from_records(rec, out) -- lazy: libarchive, as in tar_in
  end)
  os.remove(rec)
  if not ok then
    os.remove(out)
    error(err, 0)
  end
  return out
end

return Files
