--- moonbox.local.http.groups — sandbox groups: list, create, delete.
local route = require "moonbox.local.http.route"
local wire = require "moonbox.local.wire"

local M = {}
local fail, field = route.fail, route.field

--- GET /v1/sandbox-groups -> 200 page.
function M.list(b, req)
  route.owner_exactly_one(b, req)
  return 200, wire.page(req, "sbg", "sandboxGroup", b.svc:list_groups(), wire.group)
end

--- POST /v1/sandbox-groups -> 201 group.
function M.create(b, req)
  local body = route.body_json(req, true)
  local owner = body.ownerId or req:query_param("ownerId")
  if owner == nil then fail("invalid", "ownerId is required", "invalid_owner_id") end
  if owner ~= b.workspace then fail("not_found", "workspace not found") end
  local where = "POST /sandbox-groups"
  local name = field(body, "name", "string", where)
  if not name or name == "" then fail("invalid", "name is required") end
  local region = field(body, "region", "string", where)
  if region and region ~= b.svc.limits.region then fail("invalid", "unknown region " .. region) end
  local limit = field(body, "concurrencyLimit", "integer", where, 1, 1000)
  return 201, wire.group(b.svc:create_group { name = name, region = region, limit = limit })
end

--- DELETE /v1/sandbox-groups/:gid -> 204.
function M.delete(b, req)
  route.owner_optional(b, req)
  b.svc:delete_group(b.svc:find_group(req.captures.gid))
  return 204
end

function M.install(r)
  r("GET", "/v1/sandbox-groups", M.list)
  r("POST", "/v1/sandbox-groups", M.create)
  r("DELETE", "/v1/sandbox-groups/:gid", M.delete)
end

return M
