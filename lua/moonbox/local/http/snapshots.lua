--- moonbox.local.http.snapshots — snapshot create (on a sandbox), get, list, delete (in a group).
local ids = require "moonbox.ids"
local json = require "moonbox.json"
local route = require "moonbox.local.http.route"
local wire = require "moonbox.local.wire"
local service = require "moonbox.local.service"

local M = {}
local fail, field = route.fail, route.field

--- POST /v1/sandboxes/:id/snapshots {kind, name, expiresAt} -> 202 snapshot (creating; the
-- capture runs in a task, and an injected capture fault makes it fail). Raises not_found,
-- invalid (kind, name, expiresAt), conflict sandbox_not_running. Does not yield.
function M.create(backend, req)
  local rec = route.sandbox(backend, req)
  local body = route.body_json(req, false) or {}
  local kind = field(body, "kind", "string", "snapshot") or "filesystem"
  if kind ~= "filesystem" and kind ~= "runtime" then fail("invalid",
    "kind must be filesystem or runtime, got " .. json.encode(kind)) end
  local name = body.name
  if name == json.null then name = nil end
  if name ~= nil and not service.valid_snapshot_name(name) then
    fail("invalid", "snapshot names are 1 to 64 characters and do not start with snp-",
      "invalid_snapshot_name")
  end
  local expires
  if body.expiresAt ~= nil and body.expiresAt ~= json.null then
    expires = type(body.expiresAt) == "string" and ids.parse_iso(body.expiresAt)
    if not expires then fail("invalid", "expiresAt must be an RFC 3339 timestamp") end
    if expires <= backend.svc:now() then fail("invalid", "expiresAt must be in the future") end
  end
  local _, capture_fault = backend.faults:decide(req.method, req.path, { capture = true })
  local snap = backend.svc:create_snapshot(rec, { kind = kind, name = name, expires = expires,
    fail_capture = capture_fault ~= nil })
  return 202, wire.snapshot(snap)
end

-- The snapshot :sid of the group :gid (a deleted one too), once ownerId is the workspace.
local function find(backend, req)
  return backend.svc:find_snapshot(route.group(backend, req), req.captures.sid)
end

--- GET /v1/sandbox-groups/:gid/snapshots/:sid -> 200 snapshot. Raises invalid (ids),
-- not_found (group, snapshot; a deleted one too). Does not yield.
function M.get(backend, req)
  local snap = find(backend, req)
  if snap._deleted then fail("not_found", "snapshot not found", "snapshot_not_found") end
  return 200, wire.snapshot(snap)
end

--- GET /v1/sandbox-groups/:gid/snapshots?ownerId&status -> 200 page, newest first. Raises
-- invalid or not_found (ownerId, group, status). Does not yield.
function M.list(backend, req)
  route.owner_exactly_one(backend, req)
  local g = backend.svc:find_group(req.captures.gid)
  local recs = backend.svc:list_snapshots(g, route.statuses(req, service.SNAPSHOT_STATUSES))
  return 200, wire.page(req, "snp", "snapshot", recs, wire.snapshot)
end

--- DELETE /v1/sandbox-groups/:gid/snapshots/:sid -> 204 (idempotent). Raises invalid,
-- not_found, conflict snapshot_creating. [yields] (its layers are removed).
function M.delete(backend, req)
  backend.svc:delete_snapshot(find(backend, req))
  return 204
end

--- snapshots.install(api): registers the routes above through api(method, pattern, handler).
function M.install(api)
  api("POST", "/v1/sandboxes/:id/snapshots", M.create)
  api("GET", "/v1/sandbox-groups/:gid/snapshots", M.list)
  api("GET", "/v1/sandbox-groups/:gid/snapshots/:sid", M.get)
  api("DELETE", "/v1/sandbox-groups/:gid/snapshots/:sid", M.delete)
end

return M
