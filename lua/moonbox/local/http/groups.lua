--- moonbox.local.http.groups — sandbox groups: list, create, delete.
local route = require "moonbox.local.http.route"
local wire = require "moonbox.local.wire"

local M = {}
local fail, field = route.fail, route.field

--- GET /v1/sandbox-groups?ownerId=W -> 200 page of groups, newest first. Raises invalid or
-- not_found when ownerId is missing, repeated or not this workspace. Does not yield.
function M.list(backend, req)
  route.owner_exactly_one(backend, req)
  return 200, wire.page(req, "sbg", "sandboxGroup", backend.svc:list_groups(), wire.group)
end

--- POST /v1/sandbox-groups {ownerId, name, region, concurrencyLimit} -> 201 group. Raises
-- invalid (a missing or mistyped field, an unknown region), not_found (another workspace),
-- conflict (10 groups already). Does not yield.
function M.create(backend, req)
  local body = route.body_json(req, true)
  route.owner_in_body(backend, body.ownerId or req:query_param("ownerId"))
  local where = "POST /sandbox-groups"
  local name = field(body, "name", "string", where)
  if not name or name == "" then fail("invalid", "name is required") end
  local region = field(body, "region", "string", where)
  if region and region ~= backend.svc.limits.region then fail("invalid", "unknown region " .. region) end
  local limit = field(body, "concurrencyLimit", "integer", where, 1, 1000)
  return 201, wire.group(backend.svc:create_group { name = name, region = region, limit = limit })
end

--- DELETE /v1/sandbox-groups/:gid -> 204. Raises invalid invalid_sandbox_group_id, not_found,
-- conflict (the default group, or one that still has live sandboxes, named). Does not yield.
function M.delete(backend, req)
  backend.svc:delete_group(route.group(backend, req))
  return 204
end

--- groups.install(api): registers the routes above through api(method, pattern, handler).
function M.install(api)
  api("GET", "/v1/sandbox-groups", M.list)
  api("POST", "/v1/sandbox-groups", M.create)
  api("DELETE", "/v1/sandbox-groups/:gid", M.delete)
end

return M
