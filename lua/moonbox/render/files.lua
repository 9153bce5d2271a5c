--- moonbox.render.files — a sandbox's files: whole files read and written, files and trees
-- copied in and out, listing, stat, exists, and remove / mkdir / rename. A part of the Sandbox
-- class (lua/moonbox/render/sandbox.lua lists its methods); it sees a sandbox only through
-- sb.id, sb:connection() and sb:exec.
--
-- The sandbox path comes first in every call. Two mechanisms, chosen per call:
--   * Render's files API (read, write, copy_in, copy_out, ls, stat, exists): each transfer is
--     one data-plane request through moonbox.render.api (docs/wire.md, "Files"), a file token
--     minted on the API, then one request to the token's URI that carries only that token;
--     listing is one control-plane GET. Transfers are repeatable (the same bytes to the same
--     path, or a download again), so they are retried like any idempotent call, each attempt
--     with a fresh token. The path travels percent-encoded in the `path` query parameter, so
--     any byte but NUL reaches the sandbox as it is.
--   * The files API has no remove, mkdir or rename, so those run as argv commands with no
--     shell of ours: `rm`, `mkdir`, `mv` through sb:exec's argv form (each argument quoted so
--     the wrapper's bash only executes it, `--` before the paths so a leading dash is a name),
--     with LC_ALL=C so coreutils' messages are the C locale's. Their stderr and exit status are
--     mapped to the same typed errors the files API's answers are mapped to.
-- Remote paths are cleaned client-side exactly as Go's path.Clean does, because the API refuses
-- unclean ones. Downloads land in a temporary file and reach their destination by a rename (a
-- file) or by moonbox.archive's staged, checked unpack (a tree), so a failure never leaves a
-- half-written destination. Every temporary file is removed, whatever happens.
local api = require "moonbox.render.api"
local json = require "moonbox.json"
local archive = require "moonbox.archive"
local core = require "moonbox.core"
local schema = require "moonbox.schema"
local path_clean = require("moonbox.path").clean

local M = {}

-- ---- the declared calls -----------------------------------------------------------------------

local TRANSFER = {
  timeout = { type = "seconds", kind = "deadline",
    doc = "the longest the transfer takes (no bound by default)" },
  idle_timeout = { type = "seconds", kind = "deadline", default = 60,
    doc = "the longest the transfer may go without a byte moving" },
}

local function with(base, extra)
  local t = {}
  for k, v in pairs(base) do t[k] = v end
  for k, v in pairs(extra or {}) do t[k] = v end
  return t
end

local COMMAND = {
  timeout = { type = "seconds", kind = "deadline",
    doc = "the longest the command may take; on expiry it is killed and the call raises timeout" },
}

local PATH_ARG = { name = "path", type = "string" }
local OPTS_ARG = { name = "opts", type = "table", optional = true }

M.SCHEMA = {
  ["render.normalize_path"] = {
    summary = "a sandbox path cleaned as the API wants it (Go's path.Clean) (empty or NUL: invalid_path)",
    args = { { name = "path", type = "string" } }, returns = "string", yields = false,
  },
  ["sb:read"] = {
    summary = "reads a whole sandbox file into a string",
    args = { PATH_ARG, OPTS_ARG },
    options = with(TRANSFER, { max_body = { type = "bytes", default = 256 * 1024 * 1024,
      doc = "the largest file accepted" } }),
    returns = "string", yields = true,
  },
  ["sb:write"] = {
    summary = "writes a string (any bytes) as a whole sandbox file, replacing it",
    args = { PATH_ARG, { name = "data", type = "string" }, OPTS_ARG },
    options = TRANSFER, yields = true,
  },
  ["sb:copy_in"] = {
    summary = "copies a local file or a local directory tree into the sandbox",
    args = { PATH_ARG, { name = "local_path", type = "string" }, OPTS_ARG },
    options = TRANSFER, yields = true,
  },
  ["sb:copy_out"] = {
    summary = "copies a sandbox file or directory tree to a local path",
    args = { PATH_ARG, { name = "local_path", type = "string" }, OPTS_ARG },
    options = with(TRANSFER, {
      merge = { type = "boolean", default = false,
        doc = "a directory: merge into an existing local directory" },
      max_bytes = { type = "bytes", doc = "a directory: the most bytes unpacked (archive.unpack)" },
      max_entries = { type = "integer", doc = "a directory: the most entries unpacked (archive.unpack)" },
      umask = { type = "integer", doc = "a directory: the umask applied to unpacked modes (archive.unpack)" },
      file_mode = { type = "integer", doc = "a directory: the mode of every unpacked file (archive.unpack)" },
    }),
    yields = true,
  },
  ["sb:ls"] = {
    summary = "lists a sandbox directory: one array of entries",
    -- opts "any": the call itself refuses the old ls(path, depth) naming the option
    args = { PATH_ARG, { name = "opts", type = "any", optional = true } },
    options = { depth = { type = "integer", default = 1,
      doc = "1: the directory's children; 0: the entry itself; up to 16 levels" } },
    returns = "table", yields = true,
  },
  ["sb:stat"] = {
    summary = "the type, size, modification time and link target of a sandbox path",
    args = { PATH_ARG }, options = {}, returns = "table", yields = true,
  },
  ["sb:exists"] = {
    summary = "whether anything (a dangling symlink included) is at a sandbox path",
    args = { PATH_ARG }, options = {}, returns = "boolean", yields = true,
  },
  ["sb:remove"] = {
    summary = "removes a sandbox file, symlink or empty directory (a whole tree with recursive)",
    args = { PATH_ARG, OPTS_ARG },
    options = with(COMMAND, { recursive = { type = "boolean", default = false,
      doc = "remove a directory and everything under it" } }),
    yields = true,
  },
  ["sb:mkdir"] = {
    summary = "makes a sandbox directory (and its missing parents with parents)",
    args = { PATH_ARG, OPTS_ARG },
    options = with(COMMAND, { parents = { type = "boolean", default = false,
      doc = "make missing parents too; an existing directory is then no error" } }),
    yields = true,
  },
  ["sb:rename"] = {
    summary = "renames a sandbox path, replacing a file or an empty directory at the new path",
    args = { { name = "from", type = "string" }, { name = "to", type = "string" }, OPTS_ARG },
    options = COMMAND, yields = true,
  },
}

schema.declare(M.SCHEMA)

--- Checks the options of the files call `call` ("sb:read", ...) against its declaration
-- (moonbox.schema: invalid_option naming the call, the option and the nearest name); opts may be
-- nil. Returns opts or {}.
local function check_options(call, opts, level)
  if opts == nil then return {} end
  return schema.check(call, opts, level + 1)
end

-- ---- paths -------------------------------------------------------------------------------------

--- render.normalize_path(p) -> p cleaned as Go's path.Clean does: repeated and trailing
-- slashes dropped, "." segments removed, ".." resolved ("/app/./data/../data.txt" →
-- "/app/data.txt", "//app/x" → "/app/x", "workspace/" → "workspace"). A relative path stays
-- relative (the server resolves it under the home directory; "." is home). Any other byte
-- (spaces, quotes, newlines, bytes that are not UTF-8) is kept. Raises a structured error with
-- code "invalid_path" for an empty path (it would silently mean the home directory) or one
-- containing a NUL byte (no path can hold one); a plain error when p is not a string.
local function normalize_path(p)
  if type(p) ~= "string" then
    error("render.normalize_path: path must be a string, got " .. type(p), 2)
  end
  if p == "" then
    error(api.error { op = "render.normalize_path", code = "invalid_path",
      message = "empty remote path: give a path (\".\" for the sandbox's home directory)" }, 2)
  end
  if p:find("%z") then
    error(api.error { op = "render.normalize_path", code = "invalid_path",
      message = "remote path contains a NUL byte, which no path can hold" }, 2)
  end
  return path_clean(p)
end
M.normalize_path = schema.wrap("render.normalize_path", normalize_path)

--- A path for a message: control bytes, DEL and bytes that are not UTF-8 shown as \xNN, the
-- rest as it is.
local function shown(p)
  if utf8.len(p) and not p:find("[%c\127]") then return p end
  local out, i = {}, 1
  while i <= #p do
    local b = p:byte(i)
    local len = b >= 0xC2 and b <= 0xF4 and (b < 0xE0 and 2 or b < 0xF0 and 3 or 4) or 1
    local seq = p:sub(i, i + len - 1)
    if len > 1 and #seq == len and utf8.len(seq) then
      out[#out + 1] = seq
      i = i + len
    else
      out[#out + 1] = (b < 0x20 or b >= 0x7f) and string.format("\\x%02X", b) or string.char(b)
      i = i + 1
    end
  end
  return table.concat(out)
end

--- The remote path argument of a files call: normalized, or a clear error at the recipe's
-- line naming the call (level counted from the caller of this helper).
local function remote_path(call, p, what, level)
  if type(p) ~= "string" then
    error(string.format("%s: %s must be a string (a sandbox path), got %s", call, what or "path", type(p)),
      level + 1)
  end
  local ok, res = pcall(normalize_path, p)
  if ok then return res end
  res.op = call
  res.message = call .. ": " .. res.message
  error(res, level + 1)
end

-- ---- helpers ------------------------------------------------------------------------------------

--- A `<close>` guard that removes the file at `path` when the scope ends (success or not).
local function removed_on_close(path)
  return setmetatable({}, { __close = function() os.remove(path) end })
end

--- A fresh name beside `path` (same directory, so a rename is atomic): ".<base>.moonbox-<hex>".
local function temp_beside(path)
  local dir, base = path:match("^(.*/)([^/]*)$")
  if not dir then dir, base = "", path end
  for _ = 1, 16 do
    local name = string.format("%s.%s.moonbox-%08x%08x", dir, base,
      math.random(0, 0x7fffffff), math.random(0, 0x7fffffff))
    if not os.rename(name, name) then return name end -- renaming to itself succeeds iff it exists
  end
  error("moonbox.render: could not find a free temporary name beside " .. path, 0)
end

local function local_exists(path) return os.rename(path, path) ~= nil end

--- local_kind(path) -> "directory" | "file", or nil, message when nothing readable is there.
-- Symlinks are followed. Does no yielding I/O beyond one open.
local function local_kind(path)
  local f, msg = io.open(path, "rb")
  if not f then return nil, msg end
  local _, _, code = f:read(0)
  f:close()
  return code == 21 and "directory" or "file" -- 21: EISDIR, what reading a directory says
end

--- A typed files error: op is the call ("sb:read"), code one of the typed codes, the message
-- names the call, the path and the sandbox.
local function typed(call, sb, rpath, code, detail, extra)
  local err = api.error { op = call, code = code, path = rpath, sandbox_id = sb.id,
    message = string.format("%s %s in sandbox %s: %s", call, shown(rpath), sb.id, detail) }
  for k, v in pairs(extra or {}) do err[k] = v end
  return err
end

local TYPED_DETAIL = {
  not_found = "no such file or directory", exists = "something is already there",
  not_a_directory = "a component of the path is not a directory", is_a_directory = "it is a directory",
  not_empty = "the directory is not empty", permission_denied = "permission denied",
}

--- The typed error of a files-API answer err (from api.call / api.data) for `call` at rpath:
-- 404 file_not_found is not_found; a 404 without it means the sandbox is gone
-- (sandbox_gone); 409 "path is a directory" is is_a_directory; a 400 saying "not a
-- directory" is not_a_directory; 403 with a JSON body is permission_denied. Other errors keep
-- their code, with op, path, sandbox_id and a message naming all three.
local function api_answer_error(call, sb, rpath, err)
  if type(err) ~= "table" or not err.status or api.is_interruption(err) then return err end
  local msg = tostring(err.message)
  local code
  if err.status == 404 and err.code == "file_not_found" then code = "not_found"
  elseif err.status == 404 then
    err.code = "sandbox_gone"
    err.op, err.path, err.sandbox_id = call, rpath, sb.id
    err.message = string.format("%s %s: sandbox %s is gone (404 without file_not_found): %s", call,
      shown(rpath), sb.id, msg)
    return err
  elseif err.status == 409 and err.code ~= "sandbox_not_running" and msg:find("is a directory", 1, true) then
    code = "is_a_directory"
  elseif err.status == 400 and msg:lower():find("not a directory", 1, true) then code = "not_a_directory"
  elseif err.status == 403 and err.code ~= "edge_blocked" then code = "permission_denied"
  end
  if code then
    local t = typed(call, sb, rpath, code, TYPED_DETAIL[code] .. " (" .. msg .. ")",
      { status = err.status, request_id = err.request_id })
    return t
  end
  err.op, err.path, err.sandbox_id = call, rpath, sb.id
  err.message = string.format("%s %s in sandbox %s: %s", call, shown(rpath), sb.id, msg)
  return err
end

--- The one data-plane request of a transfer of `kind` ("upload" | "download") at rpath (already
-- normalised). Raises typed errors (api_answer_error). [yields]
local function transfer(sb, call, kind, rpath, req, opts)
  local c = sb:connection()
  req.timeout = opts.timeout
  req.idle_timeout = opts.idle_timeout or 60
  local ok, r = pcall(api.data, c, call,
    { path = "/sandboxes/" .. sb.id .. "/files/" .. kind .. "/token",
      query = { path = rpath, ownerId = c.workspace } },
    req, { name = "files." .. req.method, span_path = "(file transfer)", sandbox_id = sb.id, path = rpath,
      repeatable = true })
  if ok then return r end
  error(api_answer_error(call, sb, rpath, r), 0)
end

local GZIP_OK = { gzip = true, ["x-gzip"] = true, identity = true }

local function media_type(r)
  return ((r.headers["content-type"] or ""):match("^%s*([^;%s]+)") or ""):lower()
end

local function check_string(call, what, v, level)
  if type(v) ~= "string" then
    error(string.format("%s: %s must be a string, got %s", call, what, type(v)), level + 1)
  end
end

-- ---- whole files ------------------------------------------------------------------------------

--- sb:read(path [, opts]) -> the bytes of the sandbox file `path`, as a string (relative paths
-- are under the sandbox's home directory; a symlink is followed). opts: timeout, idle_timeout
-- (default 60), max_body (bytes, default 256 MiB). Raises "invalid_path" before any request;
-- typed errors with op "sb:read": not_found, is_a_directory (use sb:copy_out for a tree),
-- not_a_directory, permission_denied, sandbox_gone; the API's other structured errors. [yields]
function M.read(sb, path, opts)
  opts = check_options("sb:read", opts, 2)
  local rpath = remote_path("sb:read", path, nil, 2)
  local r = transfer(sb, "sb:read", "download", rpath,
    { method = "GET", accept_encoding = "gzip", max_body = opts.max_body }, opts)
  if media_type(r) == "application/x-tar" then
    error(typed("sb:read", sb, rpath, "is_a_directory", "it is a directory (sb:copy_out copies a tree)"), 0)
  end
  return r.body
end

--- sb:write(path, data [, opts]): writes the string `data` (any bytes) as the whole sandbox
-- file `path`, replacing what was there (Render: the file lands root-owned 0600; missing
-- parents are made). opts: timeout, idle_timeout. Raises "invalid_path" before any request;
-- typed errors with op "sb:write": is_a_directory, not_a_directory, permission_denied,
-- sandbox_gone; the API's other structured errors. [yields]
function M.write(sb, path, data, opts)
  opts = check_options("sb:write", opts, 2)
  local rpath = remote_path("sb:write", path, nil, 2)
  check_string("sb:write", "data", data, 2)
  transfer(sb, "sb:write", "upload", rpath,
    { method = "PUT", body = data, headers = { ["Content-Type"] = "application/octet-stream" } }, opts)
end

-- ---- copies -----------------------------------------------------------------------------------

--- sb:copy_in(path, local_path [, opts]): copies the local file or directory local_path into the
-- sandbox at `path`, detected by local_path's type (a symlink is followed). A file is streamed
-- (never held in memory) and replaces the sandbox file; a directory is packed with
-- moonbox.archive (symlinks inside it as symlinks, special files skipped) into a temporary
-- .tgz and extracted at `path` (made if missing; files there replaced, others kept). opts:
-- timeout, idle_timeout. Raises "invalid_path" before any request; "local_not_found" (op
-- "sb:copy_in", field local_path) when nothing readable is at local_path; archive.pack's
-- errors before any request; typed errors as sb:write (op "sb:copy_in"); the server's
-- "unsafe_archive" among the API's structured errors. [yields]
function M.copy_in(sb, path, local_path, opts)
  opts = check_options("sb:copy_in", opts, 2)
  local rpath = remote_path("sb:copy_in", path, nil, 2)
  check_string("sb:copy_in", "local_path", local_path, 2)
  local kind, msg = local_kind(local_path)
  if not kind then
    error(api.error { op = "sb:copy_in", code = "local_not_found", path = rpath, sandbox_id = sb.id,
      local_path = local_path,
      message = string.format("sb:copy_in %s in sandbox %s: cannot read the local path %s: %s", shown(rpath),
        sb.id, local_path, tostring(msg)) }, 2)
  end
  if kind == "file" then
    transfer(sb, "sb:copy_in", "upload", rpath, { method = "PUT", body_file = local_path,
      headers = { ["Content-Type"] = "application/octet-stream" } }, opts)
    return
  end
  local tgz = os.tmpname()
  local _tgz_guard <close> = removed_on_close(tgz)
  archive.pack(local_path, tgz)
  transfer(sb, "sb:copy_in", "upload", rpath, { method = "PUT", body_file = tgz,
    headers = { ["Content-Type"] = "application/x-tar", ["Content-Encoding"] = "gzip" } }, opts)
end

local UNPACK_OPTS = { "max_bytes", "max_entries", "umask", "file_mode" }

--- sb:copy_out(path, local_path [, opts]): copies the sandbox file or directory `path` to
-- local_path, detected by the download's Content-Type (application/x-tar: a directory). The
-- download lands in a temporary file beside local_path. A file is then renamed over local_path
-- (local_path is afterwards the whole file or what it was before). A directory is unpacked by
-- moonbox.archive, which treats it as hostile: it extracts into fresh staging beside
-- local_path and refuses absolute names, ".." components and links escaping the tree, so
-- nothing is written outside local_path and a refused archive leaves no local_path behind; an
-- existing local_path is refused (target_exists) unless opts.merge. opts: timeout,
-- idle_timeout, merge, max_bytes, max_entries, umask, file_mode (as archive.unpack). Raises
-- "invalid_path" before any request; typed errors as sb:read (op "sb:copy_out");
-- "target_exists"; "unsupported_encoding" for a Content-Encoding other than gzip; "io_error"
-- when the file cannot be moved into place; archive.unpack's errors ("unsafe_archive" with
-- err.member, "corrupt_archive", ...) with sandbox_id and path added. [yields]
function M.copy_out(sb, path, local_path, opts)
  opts = check_options("sb:copy_out", opts, 2)
  local rpath = remote_path("sb:copy_out", path, nil, 2)
  check_string("sb:copy_out", "local_path", local_path, 2)
  local call = "sb:copy_out"
  local tmp = temp_beside(local_path)
  local _tmp_guard <close> = removed_on_close(tmp)
  local r = transfer(sb, call, "download", rpath,
    { method = "GET", accept_encoding = "gzip", output_file = tmp }, opts)
  if media_type(r) ~= "application/x-tar" then
    local ok, msg = os.rename(tmp, local_path)
    if not ok then
      error(api.error { op = call, code = "io_error", sandbox_id = sb.id, path = rpath,
        local_path = local_path,
        message = string.format("%s %s in sandbox %s: could not move the download into place at %s: %s", call,
          shown(rpath), sb.id, local_path, tostring(msg)) }, 0)
    end
    return
  end
  if not opts.merge and local_exists(local_path) then
    error(api.error { op = call, code = "target_exists", sandbox_id = sb.id, path = rpath,
      target = local_path,
      message = string.format("%s %s in sandbox %s: it is a directory and %s already exists (pass merge = " ..
        "true to merge into it)", call, shown(rpath), sb.id, local_path) }, 2)
  end
  local enc = (r.headers["content-encoding"] or "identity"):lower():gsub("%s", "")
  if not GZIP_OK[enc] then
    error(api.error { op = call, code = "unsupported_encoding", sandbox_id = sb.id, path = rpath,
      message = "the directory came with Content-Encoding " .. enc .. ", which moonbox cannot undo" }, 0)
  end
  local uopts = { merge = opts.merge or nil }
  for _, k in ipairs(UNPACK_OPTS) do uopts[k] = opts[k] end
  local ok, err = pcall(archive.unpack, tmp, local_path, uopts)
  if not ok then
    if core.Error.is(err) then
      err.sandbox_id, err.path, err.remote_path = sb.id, rpath, rpath
    end
    error(err, 0)
  end
end

-- ---- listing, stat, exists ----------------------------------------------------------------------

--- GET /sandboxes/{id}/files/list of rpath at depth -> the decoded answer. Raises typed errors
-- for `call`. [yields]
local function list(sb, call, rpath, depth)
  local ok, res = pcall(api.call, sb:connection(), call, "GET", "/sandboxes/" .. sb.id .. "/files/list",
    { query = { path = rpath, depth = depth }, sandbox_id = sb.id })
  if not ok then error(api_answer_error(call, sb, rpath, res), 0) end
  return type(res) == "table" and res or {}
end

local function entry_of(e)
  local target = e.target
  if target == json.null then target = nil end
  return { name = e.name, type = e.type, size = e.size, modified_at = e.modifiedAt, target = target }
end

--- sb:ls(path [, opts]) -> entries: one array, the listing of the sandbox directory `path`
-- (GET /sandboxes/{id}/files/list), in the server's order. opts.depth: 1 (default) the
-- directory's children, 0 the entry itself, more for deeper levels (names relative to path).
-- Each entry: {name, type ("file"|"directory"|"symlink"), size (0 for directories and
-- links), modified_at (RFC 3339 string), target (symlinks only)}. Names come through JSON:
-- bytes that are not UTF-8 come back as U+FFFD (sb:stat and sb:exists with a path you hold are
-- exact). Raises "invalid_path" before any request; typed errors with op "sb:ls": not_found,
-- not_a_directory (a file, at depth 1), sandbox_gone; "sandbox_not_running" and the API's
-- other structured errors. [yields]
function M.ls(sb, path, opts)
  if type(opts) == "number" then
    error("sb:ls: depth is an option now: sb:ls(path, { depth = " .. tostring(opts) .. " })", 2)
  end
  opts = check_options("sb:ls", opts, 2)
  local rpath = remote_path("sb:ls", path, nil, 2)
  local depth = opts.depth
  if depth ~= nil and (math.type(depth) ~= "integer" or depth < 0) then
    error("sb:ls: depth must be an integer >= 0, got " .. tostring(depth), 2)
  end
  local res = list(sb, "sb:ls", rpath, depth or 1)
  local entries = {}
  for i, e in ipairs(type(res.entries) == "table" and res.entries or {}) do entries[i] = entry_of(e) end
  return entries
end

--- The depth-0 listing of rpath: its entry, or nil when nothing is there (not_found, or a
-- parent that is not a directory when quiet). Raises other typed errors for `call`. [yields]
local function entry_at(sb, call, rpath, quiet)
  local ok, res = pcall(list, sb, call, rpath, 0)
  if not ok then
    if quiet and type(res) == "table" and (res.code == "not_found" or res.code == "not_a_directory") then
      return nil
    end
    error(res, 0)
  end
  local e = type(res.entries) == "table" and res.entries[1]
  if not e then
    if quiet then return nil end
    error(typed(call, sb, rpath, "not_found", TYPED_DETAIL.not_found), 0)
  end
  return entry_of(e)
end

--- sb:stat(path) -> {type = "file"|"directory"|"symlink", size, modified_at, target}: what is at
-- the sandbox path itself (a symlink is not followed: type "symlink" with its target), from
-- the files API's listing at depth 0. size is 0 for directories and symlinks; modified_at an
-- RFC 3339 string. Raises "invalid_path" before any request; typed errors with op "sb:stat":
-- not_found, not_a_directory (a parent is a file), sandbox_gone; the API's other structured
-- errors. [yields]
function M.stat(sb, path)
  local rpath = remote_path("sb:stat", path, nil, 2)
  local e = entry_at(sb, "sb:stat", rpath, false)
  return { type = e.type, size = e.size, modified_at = e.modified_at, target = e.target }
end

--- sb:exists(path) -> true when anything is at the sandbox path (a dangling symlink
-- included), false when nothing is (a parent that is a file included). Raises
-- "invalid_path" before any request; sandbox_gone and the API's other errors. [yields]
function M.exists(sb, path)
  local rpath = remote_path("sb:exists", path, nil, 2)
  return entry_at(sb, "sb:exists", rpath, true) ~= nil
end

-- ---- commands: remove, mkdir, rename ----------------------------------------------------------

-- coreutils' C-locale reasons (the end of its message) and the typed codes they are. EPERM and
-- EROFS are permission_denied too, as the files API answers a read-only path (403).
local REASONS = {
  ["No such file or directory"] = "not_found", ["File exists"] = "exists",
  ["Not a directory"] = "not_a_directory", ["Is a directory"] = "is_a_directory",
  ["Directory not empty"] = "not_empty", ["Permission denied"] = "permission_denied",
  ["Operation not permitted"] = "permission_denied", ["Read-only file system"] = "permission_denied",
}

--- exec.typed_reason(stderr) -> the typed code coreutils' C-locale stderr says, or nil. The
-- reason is the end of a line, after the quoted name (coreutils quotes names, so a name never
-- spans lines and a reason inside a name is inside its quotes); mv's "cannot overwrite
-- non-directory 'B' with directory 'A'" is not_a_directory, "cannot overwrite directory 'B'
-- with non-directory" is_a_directory.
local function typed_reason(stderr)
  for line in stderr:gmatch("[^\n]+") do
    if line:find("^mv: cannot overwrite non%-directory ") then return "not_a_directory" end
    if line:find("^mv: cannot overwrite directory ") then return "is_a_directory" end
    local reason = line:match("['\"]: ([%a ]+)$")
    if reason and REASONS[reason] then return REASONS[reason] end
  end
  return nil
end
M.typed_reason = typed_reason

--- Runs argv (mkdir/rm/mv and their arguments, no shell) in sb with LC_ALL=C through sb:exec's
-- argv form; raises the typed error its stderr says (op `call`, path rpath, extra fields), or
-- exec_failed with the stderr in the message. [yields]
local function command(sb, call, rpath, argv, opts, extra)
  local ok, r = pcall(sb.exec, sb, argv, { env = { LC_ALL = "C" }, timeout = opts.timeout })
  if not ok then
    -- the exec's own errors (its env upload's too) become this call's
    if core.Error.is(r) and not api.is_interruption(r) then
      r.op, r.path, r.sandbox_id = call, rpath, sb.id
      if r.code == "timeout" then
        r.message = string.format("%s %s in sandbox %s did not finish within %g s; it was killed", call,
          shown(rpath), sb.id, opts.timeout)
      end
    end
    error(r, 0)
  end
  if r.code == 0 then return end
  local stderr = r.stderr:gsub("%s+$", "")
  local code = r.code == 1 and typed_reason(stderr) or nil
  local fields = { exit_code = r.code, stderr = stderr, exec_id = r.exec_id }
  for k, v in pairs(extra or {}) do fields[k] = v end
  if code then
    error(typed(call, sb, rpath, code, TYPED_DETAIL[code] .. " (" .. shown(stderr) .. ")", fields), 0)
  end
  error(typed(call, sb, rpath, "exec_failed", string.format("`%s` exited with %s: %s", argv[1],
    tostring(r.code), stderr ~= "" and shown(stderr) or "no message"), fields), 0)
end

--- sb:remove(path [, opts]): removes what is at the sandbox path: a file, a symlink (never what
-- it points to) or an empty directory (`rm -d`); with opts.recursive a directory and everything
-- under it (`rm -r`, not atomic: a failure part-way leaves part of the tree). opts: recursive,
-- timeout. Raises "invalid_path" before any request; typed errors with op "sb:remove":
-- not_found, not_empty (a non-empty directory without recursive), not_a_directory,
-- permission_denied; exec_failed (e.g. "." or "/") with coreutils' message; sb:exec's errors.
-- [yields]
function M.remove(sb, path, opts)
  opts = check_options("sb:remove", opts, 2)
  local rpath = remote_path("sb:remove", path, nil, 2)
  command(sb, "sb:remove", rpath, { "rm", opts.recursive and "-r" or "-d", "--", rpath }, opts)
end

--- sb:mkdir(path [, opts]): makes the sandbox directory `path` (`mkdir`); with opts.parents
-- its missing parents too, and an existing directory (or a symlink to one) is then no error
-- (`mkdir -p`). opts: parents, timeout. Raises "invalid_path" before any request; typed
-- errors with op "sb:mkdir": exists (anything at path without parents; a non-directory at
-- path with parents), not_found (a missing parent without parents), not_a_directory (a
-- parent is a file), permission_denied; exec_failed; sb:exec's errors. [yields]
function M.mkdir(sb, path, opts)
  opts = check_options("sb:mkdir", opts, 2)
  local rpath = remote_path("sb:mkdir", path, nil, 2)
  local argv = opts.parents and { "mkdir", "-p", "--", rpath } or { "mkdir", "--", rpath }
  command(sb, "sb:mkdir", rpath, argv, opts)
end

--- sb:rename(from, to [, opts]): renames the sandbox path `from` to `to` (`mv -T`: `to` is the
-- new name itself, never a directory to move into). One rename(2) when both are on one
-- filesystem: atomic, replacing a file or an empty directory at `to`. opts: timeout. Raises
-- "invalid_path" before any request; typed errors with op "sb:rename" (err.path = from,
-- err.to = to): not_found (from is missing, or to's parent), not_empty (to is a non-empty
-- directory), not_a_directory (a directory onto a file), is_a_directory (a file onto a
-- directory), permission_denied; exec_failed (e.g. a directory into itself); sb:exec's
-- errors. [yields]
function M.rename(sb, from, to, opts)
  opts = check_options("sb:rename", opts, 2)
  local rfrom = remote_path("sb:rename", from, "from", 2)
  local rto = remote_path("sb:rename", to, "to", 2)
  command(sb, "sb:rename", rfrom, { "mv", "-T", "--", rfrom, rto }, opts, { to = rto })
end

-- ---- the old names ------------------------------------------------------------------------------

local RENAMED = {
  upload = "sb:write(path, data)", download = "sb:read(path)",
  upload_file = "sb:copy_in(path, local_path) — the sandbox path first now",
  put_dir = "sb:copy_in(path, local_dir) — the sandbox path first now",
  download_file = "sb:copy_out(path, local_path)", get_dir = "sb:copy_out(path, local_dir)",
}

--- files.renamed -> {old name = function raising at the recipe's line "sb:<old> was renamed:
-- use <new call and its argument order>"}, for the Sandbox method table.
M.renamed = {}
for old, new in pairs(RENAMED) do
  M.renamed[old] = function()
    error(string.format("sb:%s was renamed: use %s", old, new), 2)
  end
end


-- Each files method checks its positional arguments and options against its declaration first
-- (moonbox.schema: invalid_argument / invalid_option at the recipe's line).
for name in pairs(M.SCHEMA) do
  local method = name:match("^sb:(.+)$")
  if method and M[method] then M[method] = schema.wrap(name, M[method]) end
end

return M
