--- moonbox.local.http.files — file tokens, the data-plane uploads and downloads they open, and
-- the control-plane listing. Uploads of application/octet-stream (optionally gzip'd) become a
-- file; application/x-tar or application/gzip bodies are archives extracted into a directory.
-- Bodies reach these handlers only after the pre-body gate checked the token, streamed into a
-- 0600 temporary file that is removed once the request ends.
local ids = require "moonbox.ids"
local json = require "moonbox.json"
local route = require "moonbox.local.http.route"
local wire = require "moonbox.local.wire"
local public = require "moonbox.local.http.public"
local proc = require "moonbox.proc"

local M = {}
local fail = route.fail

--- POST /v1/sandboxes/:id/files/:op/token?path=P -> 201 {executionId, token, uri, method,
-- expiresAt}: op is upload (PUT) or download (GET) of P, a path inside the sandbox. Raises
-- invalid (op, path), not_found, conflict (errored). [yields] (it wakes a suspended sandbox).
function M.token(backend, req)
  route.owner_optional(backend, req)
  local op = req.captures.op
  if op ~= "upload" and op ~= "download" then fail("invalid", "operation must be upload or download, got "
    .. tostring(op)) end
  local base = public.base(backend, req)
  local rec = backend.svc:find_sandbox(req.captures.id)
  local path = req:query_param("path")
  local abs = wire.sandbox_path(path)
  local e, token, expires = backend.svc:mint_file(rec, op, abs, path)
  return 201, {
    executionId = e.id, token = token, method = op == "upload" and "PUT" or "GET",
    expiresAt = ids.iso(expires), uri = string.format("%s/proxy/%s/files/%s", base, rec.id, op),
  }
end

-- Decompresses a gzip'd plain upload into a new temporary file, after a first pass that only
-- counts the inflated bytes, and stops counting one byte past limit: a small body that
-- inflates past limit (a decompression bomb) is refused with 413 before a byte of it is
-- written to the host's disk, and costs no more than limit bytes of decompression. Two passes
-- cost twice the decompression CPU; trusting gzip's own length field would not do (it is the
-- length modulo 4 GiB, of the last member only).
local function gunzip(backend, src, limit)
  -- "BYTES GZIP_STATUS": gzip dies of SIGPIPE (141) when head has had enough.
  local count = proc.run { "bash", "-c",
    'n=$(gzip -dc < "$1" | head -c "$2" | wc -c; echo " ${PIPESTATUS[0]}"); echo $n', "moonbox-gunzip", src,
    tostring(limit + 1) }
  local n, st = count.stdout:match("(%d+)%s+(%d+)")
  n, st = tonumber(n), tonumber(st)
  if n and n > limit then
    fail("too_large", string.format("the upload inflates to more than the limit of %d bytes", limit))
  end
  if count.code ~= 0 or st ~= 0 then
    fail("invalid", "the upload says Content-Encoding: gzip but is not gzip data")
  end
  local out = (backend.spool_dir or backend.state_dir .. "/tmp") .. "/gunzip." .. ids.token():sub(1, 16)
  local gunzip_run = proc.run { "gzip", "-dc", stdin = { file = src }, stdout = { file = out } }
  if gunzip_run.code ~= 0 then
    os.remove(out)
    if gunzip_run.stderr:find("No space left", 1, true) then
      fail("insufficient_storage", "the backend's disk is full; the upload was not written")
    end
    fail("invalid", "the upload says Content-Encoding: gzip but is not gzip data")
  end
  return out
end

--- PUT /proxy/:id/files/upload (bearer: an upload token) -> 204 once the body is in place: a
-- file (octet-stream, gzip'd or not) or an archive extracted into a directory (x-tar, gzip).
-- Raises unauthorized / forbidden / not_found (the token), unsupported_media (an encoding
-- other than gzip), too_large (over max_upload, inflated too), invalid (not gzip, an unsafe or
-- broken archive), conflict, insufficient_storage. [yields] while it decompresses and writes.
function M.upload(backend, req)
  local rec, info = backend.svc:check_token(route.bearer(req), req.captures.id, "files/upload")
  local ctype = (req.headers["content-type"] or ""):match("^%s*([^;%s]+)") or ""
  local enc = (req.headers["content-encoding"] or "identity"):lower()
  local is_archive = ctype == "application/x-tar" or ctype == "application/gzip"
  if enc ~= "identity" and enc ~= "gzip" then
    fail("unsupported_media", "Content-Encoding " .. enc .. " is not supported (gzip or identity)")
  end
  local body = req.body_file
  local plain
  if not is_archive and enc == "gzip" then
    plain = gunzip(backend, body, backend.svc.limits.max_upload)
    body = plain
  end
  local ok, err = pcall(backend.svc.upload, backend.svc, rec, info, body, is_archive and "archive" or "file")
  if plain then os.remove(plain) end
  if not ok then error(err, 0) end
  return 204
end

--- GET /proxy/:id/files/download (bearer: a download token) -> 200 octet-stream (a file, as a
-- stream) or gzip'd x-tar (a directory), answered through res (returns nil). Raises, before
-- the answer starts, unauthorized / forbidden / not_found (token, file_not_found), invalid
-- not_regular_file; a client that leaves stops the read. [yields] until the body is sent.
function M.download(backend, req, ctx, res)
  local rec, info = backend.svc:check_token(route.bearer(req), req.captures.id, "files/download")
  local d = backend.svc:download(rec, info)
  if d.kind == "directory" then
    local ok = pcall(res.send_file, res, 200, d.file, { ["Content-Type"] = "application/x-tar",
      ["Content-Encoding"] = "gzip", ["render-request-id"] = ctx.rid })
    os.remove(d.file)
    backend.svc:end_run(rec)
    ctx.entry.status = ok and 200 or 499
    return nil
  end
  local w = res:stream(200, { ["Content-Type"] = "application/octet-stream", ["render-request-id"] = ctx.rid,
    ["Content-Disposition"] = string.format('attachment; filename="%s"', (d.name:gsub('["\\%c]', "_"))) })
  local p = d.stream
  local ok = pcall(function()
    for chunk in function() return p:read("stdout") end do w:write(chunk) end
  end)
  if not ok then p:kill("KILL") end
  p:wait()
  backend.svc:end_run(rec)
  w:close()
  return nil
end

--- GET /v1/sandboxes/:id/files/list?path=P&depth=N -> 200 {path, entries} (N from 0 to 16,
-- default 1). Raises not_found (sandbox, file_not_found), invalid (path, depth), conflict
-- sandbox_not_running. [yields] (a file helper reads the tree inside the sandbox).
function M.list(backend, req)
  local rec = backend.svc:find_sandbox(req.captures.id)
  local abs = wire.sandbox_path(req:query_param("path"))
  local depth = route.query_int(req, "depth", 1, 0, 16)
  local out = json.array()
  for _, e in ipairs(backend.svc:list_files(rec, abs, depth)) do
    out[#out + 1] = { name = json.utf8_clean(e.name), type = e.type, size = e.size or 0,
      modifiedAt = ids.iso(e.modifiedAt or 0), target = e.target and json.utf8_clean(e.target) }
  end
  return 200, { path = abs, entries = out }
end

--- files.install(api, data, max_upload[, space_dir]): registers the routes. An upload whose
-- declared length does not fit the spool's free space, or the room of space_dir/<id> (the
-- sandbox's quota on the sandbox disk), is refused 507 before its body is read (httpd's
-- opts.space).
function M.install(api, data, max_upload, space_dir)
  api("POST", "/v1/sandboxes/:id/files/:op/token", M.token)
  api("GET", "/v1/sandboxes/:id/files/list", M.list)
  data("PUT", "/proxy/:id/files/upload", M.upload, "files/upload", { body = "file", max_body = max_upload,
    space = space_dir or true })
  data("GET", "/proxy/:id/files/download", M.download, "files/download")
end

return M
