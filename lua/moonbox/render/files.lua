--- moonbox.render.files — moving files and directory trees in and out of a sandbox. A part of
-- the Sandbox class (lua/moonbox/render/sandbox.lua lists its methods); it sees a sandbox only
-- through sb.id and sb:connection().
--
-- Each transfer is one data-plane request through moonbox.render.api (docs/wire.md, "Files"): a file
-- token minted on the API, then one request to the token's URI that carries only that token.
-- Transfers are repeatable (the same bytes to the same path, or a download again), so they are
-- retried like any idempotent call, each attempt with a fresh token. Remote paths are cleaned
-- client-side exactly as Go's path.Clean does, because the API refuses unclean ones. Downloads
-- land in a temporary file and reach their destination by a rename (a file) or by
-- moonbox.archive's staged, checked unpack (a tree), so a failure never leaves a half-written
-- destination. Every temporary file is removed, whatever happens.
local api = require "moonbox.render.api"
local json = require "moonbox.json"
local archive = require "moonbox.archive"
local core = require "moonbox.core"

local M = {}

--- render.normalize_path(p) -> p cleaned as Go's path.Clean does: repeated and trailing
-- slashes dropped, "." segments removed, ".." resolved ("/app/./data/../data.txt" →
-- "/app/data.txt", "//app/x" → "/app/x", "workspace/" → "workspace"). A relative path stays
-- relative (the server resolves it under the home directory; "." is home). Raises a structured
-- error with code "invalid_path" for an empty path (it would silently mean the home directory)
-- or one containing a NUL byte; a plain error when p is not a string.
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
      message = "remote path contains a NUL byte" }, 2)
  end
  return require("moonbox.path").clean(p)
end
M.normalize_path = normalize_path

-- ---- helpers --------------------------------------------------------------------------------

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

local function exists(path) return os.rename(path, path) ~= nil end

--- The structured error of a transfer that failed with an HTTP answer (err from api.data): a
-- 404 with Render's file_not_found code names the path; a 404 without it means the sandbox is
-- gone; every message names the path and the sandbox.
local function transfer_error(op, sb, rpath, err)
  err.op, err.path, err.sandbox_id = op, rpath, sb.id
  if err.status == 404 and err.code == "file_not_found" then
    err.message = string.format("no file or directory at %s in sandbox %s", rpath, sb.id)
  elseif err.status == 404 then
    err.code = "not_found"
    err.message = string.format("%s %s: sandbox %s is gone (404 without file_not_found): %s", op, rpath,
      sb.id, tostring(err.message))
  else
    err.message = string.format("%s %s in sandbox %s: %s", op, rpath, sb.id, tostring(err.message))
  end
  return err
end

--- The one data-plane request of a transfer of `kind` ("upload" | "download") at rpath (already
-- normalised). Raises transfer errors. [yields]
local function transfer(sb, op, kind, rpath, req, opts)
  local c = sb:connection()
  req.timeout = opts and opts.timeout
  req.idle_timeout = opts and opts.idle_timeout or 60
  local ok, r = pcall(api.data, c, op,
    { path = "/sandboxes/" .. sb.id .. "/files/" .. kind .. "/token",
      query = { path = rpath, ownerId = c.workspace } },
    req, { name = "files." .. req.method, span_path = "(file transfer)", sandbox_id = sb.id, path = rpath,
      repeatable = true })
  if ok then return r end
  if type(r) == "table" and r.status and not api.is_interruption(r) then
    r = transfer_error(op, sb, rpath, r)
  end
  error(r, 0)
end

local GZIP_OK = { gzip = true, ["x-gzip"] = true, identity = true }

local function media_type(r)
  return ((r.headers["content-type"] or ""):match("^%s*([^;%s]+)") or ""):lower()
end

local function check_string(fname, what, v, level)
  if type(v) ~= "string" then
    error(string.format("sb:%s: %s must be a string, got %s", fname, what, type(v)), level + 1)
  end
end

-- ---- single files ---------------------------------------------------------------------------

-- The upload of one file to rpath (normalised): req carries the body (body or body_file).
-- Raises transfer errors. [yields]
local function upload_one(sb, op, rpath, req, opts)
  req.method, req.headers = "PUT", { ["Content-Type"] = "application/octet-stream" }
  transfer(sb, op, "upload", rpath, req, opts)
end

--- sb:upload(path, data [, opts]): writes the string `data` (any bytes) to the file `path` in
-- the sandbox (relative paths are under its home directory; the file lands root-owned 0600).
-- opts: timeout (seconds for the transfer), idle_timeout (default 60). Raises "invalid_path"
-- before any request for an empty path, and structured errors with op "sandbox:upload" (e.g.
-- conflict when path is a directory). [yields]
function M.upload(sb, path, data, opts)
  check_string("upload", "data", data, 2)
  upload_one(sb, "sandbox:upload", normalize_path(path), { body = data }, opts)
end

--- sb:upload_file(local_path, path [, opts]): streams the local file to `path` in the sandbox
-- without holding it in memory. opts as sb:upload. Raises as sb:upload (op
-- "sandbox:upload_file"), and http's "file_error" when local_path cannot be read. [yields]
function M.upload_file(sb, local_path, path, opts)
  check_string("upload_file", "local_path", local_path, 2)
  upload_one(sb, "sandbox:upload_file", normalize_path(path), { body_file = local_path }, opts)
end

--- sb:download(path [, opts]) -> the bytes of the file `path` in the sandbox, as a string.
-- opts: timeout, idle_timeout (default 60), max_body (bytes, default http's 256 MiB). Raises
-- "invalid_path" before any request for an empty path; "file_not_found" (naming the path and
-- sandbox) when nothing is there; "is_directory" when path is a directory (use sb:get_dir);
-- other structured errors with op "sandbox:download". [yields]
function M.download(sb, path, opts)
  local rpath = normalize_path(path)
  local r = transfer(sb, "sandbox:download", "download", rpath,
    { method = "GET", accept_encoding = "gzip", max_body = opts and opts.max_body }, opts)
  if media_type(r) == "application/x-tar" then
    error(api.error { op = "sandbox:download", code = "is_directory", sandbox_id = sb.id, path = rpath,
      message = rpath .. " in sandbox " .. sb.id .. " is a directory: use sb:get_dir" }, 0)
  end
  return r.body
end

--- sb:download_file(path, local_path [, opts]): writes the sandbox file `path` to local_path.
-- The body goes to a temporary file beside local_path, renamed over local_path only after a
-- complete 2xx answer: local_path is afterwards the whole file or what it was before. opts:
-- timeout, idle_timeout. Raises as sb:download (op "sandbox:download_file"), and http's
-- "file_error" when the temporary file cannot be written. [yields]
function M.download_file(sb, path, local_path, opts)
  check_string("download_file", "local_path", local_path, 2)
  local rpath = normalize_path(path)
  local op = "sandbox:download_file"
  local tmp = temp_beside(local_path)
  local _tmp_guard <close> = removed_on_close(tmp)
  local r = transfer(sb, op, "download", rpath,
    { method = "GET", accept_encoding = "gzip", output_file = tmp }, opts)
  if media_type(r) == "application/x-tar" then
    error(api.error { op = op, code = "is_directory", sandbox_id = sb.id, path = rpath,
      message = rpath .. " in sandbox " .. sb.id .. " is a directory: use sb:get_dir" }, 0)
  end
  local ok, msg = os.rename(tmp, local_path)
  if not ok then
    error(api.error { op = op, code = "io_error", sandbox_id = sb.id, path = rpath,
      message = "could not move the download into place: " .. tostring(msg) }, 0)
  end
end

-- ---- directory trees ------------------------------------------------------------------------

--- sb:put_dir(local_dir, path [, opts]): copies the tree under local_dir into the sandbox at
-- `path` (created if missing; existing files there are replaced, others kept). Packed with
-- moonbox.archive (symlinks as symlinks, special files skipped) into a temporary .tgz, sent as
-- application/x-tar with Content-Encoding gzip. opts: timeout, idle_timeout. Raises
-- "invalid_path" before any request; archive.pack's errors ("not_found", "io_error") before any
-- request; structured errors with op "sandbox:put_dir" (the server's "unsafe_archive" among
-- them). [yields]
function M.put_dir(sb, local_dir, path, opts)
  check_string("put_dir", "local_dir", local_dir, 2)
  local rpath = normalize_path(path)
  local tgz = os.tmpname()
  local _tgz_guard <close> = removed_on_close(tgz)
  archive.pack(local_dir, tgz)
  transfer(sb, "sandbox:put_dir", "upload", rpath, { method = "PUT", body_file = tgz,
    headers = { ["Content-Type"] = "application/x-tar", ["Content-Encoding"] = "gzip" } }, opts)
end

local UNPACK_OPTS = { "max_bytes", "max_entries", "umask", "file_mode" }

--- sb:get_dir(path, local_dir [, opts]): copies the sandbox directory `path` to local_dir. The
-- tarball is downloaded to a temporary file and unpacked by moonbox.archive, which treats it as
-- hostile: it extracts into fresh staging beside local_dir and refuses absolute names, ".."
-- components and links escaping the tree, so nothing is written outside local_dir and a
-- refused archive leaves no local_dir behind. opts: merge (true: merge into an existing
-- local_dir; without it an existing local_dir is refused before any request), max_bytes,
-- max_entries, umask, file_mode (as archive.unpack), timeout, idle_timeout. Raises
-- "invalid_path" and "target_exists" before any request; "file_not_found"; "not_a_directory"
-- when path is a file; "unsupported_encoding" for a Content-Encoding other than gzip;
-- archive.unpack's errors ("unsafe_archive" with err.member, "corrupt_archive", ...) with
-- sandbox_id and remote_path added; other structured errors with op "sandbox:get_dir". [yields]
function M.get_dir(sb, path, local_dir, opts)
  check_string("get_dir", "local_dir", local_dir, 2)
  opts = opts or {}
  local rpath = normalize_path(path)
  local op = "sandbox:get_dir"
  if not opts.merge and exists(local_dir) then
    error(api.error { op = op, code = "target_exists", sandbox_id = sb.id, path = rpath, target = local_dir,
      message = local_dir .. " already exists (pass merge = true to merge into it)" }, 2)
  end
  local tgz = os.tmpname()
  local _tgz_guard <close> = removed_on_close(tgz)
  local r = transfer(sb, op, "download", rpath, { method = "GET", output_file = tgz }, opts)
  local mt = media_type(r)
  if mt ~= "application/x-tar" then
    error(api.error { op = op, code = "not_a_directory", sandbox_id = sb.id, path = rpath,
      message = string.format("%s in sandbox %s is not a directory (it came back as %s): use " ..
        "sb:download_file", rpath, sb.id, mt ~= "" and mt or "no content type") }, 0)
  end
  local enc = (r.headers["content-encoding"] or "identity"):lower():gsub("%s", "")
  if not GZIP_OK[enc] then
    error(api.error { op = op, code = "unsupported_encoding", sandbox_id = sb.id, path = rpath,
      message = "the directory came with Content-Encoding " .. enc .. ", which moonbox cannot undo" }, 0)
  end
  local uopts = { merge = opts.merge or nil }
  for _, k in ipairs(UNPACK_OPTS) do uopts[k] = opts[k] end
  local ok, err = pcall(archive.unpack, tgz, local_dir, uopts)
  if not ok then
    if core.Error.is(err) then
      err.sandbox_id, err.remote_path = sb.id, rpath
    end
    error(err, 0)
  end
end

-- ---- listing --------------------------------------------------------------------------------

--- sb:ls(path [, depth]) -> entries, listed_path: the directory listing of `path` (GET
-- /sandboxes/{id}/files/list). depth: 1 (default) the immediate children, 0 the entry itself.
-- Each entry: {name, type ("file"|"directory"|"symlink"), size (0 for dirs and links),
-- modified_at (RFC 3339 string), target (symlinks only)}. listed_path is the absolute path the
-- server listed. Raises "invalid_path" before any request; "file_not_found" naming the path and
-- sandbox; structured errors with op "sandbox:ls" ("sandbox_not_running" unless running). [yields]
function M.ls(sb, path, depth)
  local rpath = normalize_path(path)
  if depth ~= nil and math.type(depth) ~= "integer" then
    error("sb:ls: depth must be an integer, got " .. tostring(depth), 2)
  end
  local c = sb:connection()
  local ok, res = pcall(api.call, c, "sandbox:ls", "GET", "/sandboxes/" .. sb.id .. "/files/list",
    { query = { path = rpath, depth = depth or 1 }, sandbox_id = sb.id })
  if not ok then
    if type(res) == "table" and res.code == "file_not_found" then
      res.path = rpath
      res.message = string.format("no file or directory at %s in sandbox %s", rpath, sb.id)
    end
    error(res, 0)
  end
  local entries = {}
  for i, e in ipairs(type(res) == "table" and res.entries or {}) do
    local target = e.target
    if target == json.null then target = nil end
    entries[i] = { name = e.name, type = e.type, size = e.size, modified_at = e.modifiedAt, target = target }
  end
  return entries, type(res) == "table" and res.path or rpath
end

return M
