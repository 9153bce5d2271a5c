--- moonbox.local.http.sandboxes — /v1/sandboxes: create, list, get, terminate, suspend.
-- Decodes each request, calls the service, encodes the record in Render's JSON shapes (docs/local.md).
local route = require "moonbox.local.http.route"
local wire = require "moonbox.local.wire"
local json = require "moonbox.json"
local service = require "moonbox.local.service"

local M = {}
local fail, field = route.fail, route.field

-- Render accepts timeouts up to 30 days (0 = none); idle timeouts are 0 (off) or 300..86400.
local TIMEOUT_MAX = 30 * 86400

-- networkPolicy -> default, allowedDomains (an array for allow-list, else nil).
local function network(body)
  local np = field(body, "networkPolicy", "object", "networkPolicy")
  if np == nil then return "allow-all" end
  local default = np.default
  if default == nil then default = np.type end -- SDK 1.5.0 examples spell it `type`
  if default == nil then default = "allow-all" end
  if default ~= "allow-all" and default ~= "deny-all" and default ~= "allow-list" then
    fail("invalid", "networkPolicy.default must be allow-all, deny-all or allow-list, got " .. tostring(
      default))
  end
  local domains = np.allowedDomains
  if default ~= "allow-list" then
    if domains ~= nil and domains ~= json.null then
      fail("invalid", "networkPolicy.allowedDomains is only valid with default allow-list")
    end
    return default
  end
  if domains == nil or domains == json.null then
    fail("invalid", "networkPolicy.allowedDomains is required with default allow-list (host names, " ..
      "optionally with a leftmost \"*.\" wildcard)")
  end
  if type(domains) ~= "table" or (next(domains) ~= nil and domains[1] == nil) then
    fail("invalid", "networkPolicy.allowedDomains must be an array of host names")
  end
  local ok, why = service.check_allowed(domains)
  if not ok then fail("invalid", "networkPolicy.allowedDomains" .. why) end
  return default, domains
end

local function env(body)
  local e = field(body, "env", "object", "POST /sandboxes")
  if e == nil then return {} end
  local count, size = 0, 0
  for k, v in pairs(e) do
    if type(k) ~= "string" or type(v) ~= "string" then fail("invalid",
      "env must map names to string values") end
    if not k:match("^[A-Za-z_][A-Za-z0-9_]*$") then
      fail("invalid", string.format("env: %q is not a valid variable name", k))
    end
    if v:find("\0", 1, true) then
      fail("invalid", string.format("env: the value of %s holds a NUL byte, which no process environment "
        .. "can carry", k), "invalid_env")
    end
    count = count + 1
    size = size + #k + #v
  end
  if count > 100 then fail("invalid", "env: at most 100 variables (got " .. count .. ")") end
  if size > 256 * 1024 then fail("invalid", "env: at most 256 KB of names and values in total") end
  return e
end

--- POST /v1/sandboxes {ownerId, plan, region, timeoutSeconds, idleTimeoutSeconds, networkPolicy,
-- env, name, snapshotId | snapshotName, sandboxGroupId} -> 201 sandbox (status creating; it
-- boots in a task of the service's). Raises invalid (a missing or mistyped field, region,
-- network policy, env, plan), not_found (workspace, group, snapshot), conflict (a snapshot that
-- cannot be restored), rate_limited (the group at its concurrency limit; Retry-After). Does not
-- yield.
function M.create(backend, req)
  local body = route.body_json(req, true)
  route.owner_in_body(backend, body.ownerId)
  local where = "POST /sandboxes"
  local idle = field(body, "idleTimeoutSeconds", "integer", where, 0, 86400)
  if idle and idle ~= 0 and idle < 300 then fail("invalid",
    "idleTimeoutSeconds must be 0 (off) or between 300 and 86400") end
  local region = field(body, "region", "string", where)
  if region and region ~= backend.svc.limits.region then
    fail("invalid", "unknown region " .. json.encode(region) .. " (only " .. backend.svc.limits.region .. ")")
  end
  local net, domains = network(body)
  local rec = backend.svc:create_sandbox {
    network = net, allowed_domains = domains,
    plan = field(body, "plan", "string", where),
    timeout = field(body, "timeoutSeconds", "integer", where, 0, TIMEOUT_MAX),
    idle_timeout = idle, env = env(body),
    name = field(body, "name", "string", where),
    snapshot_id = field(body, "snapshotId", "string", where),
    snapshot_name = field(body, "snapshotName", "string", where),
    group_id = field(body, "sandboxGroupId", "string", where),
  }
  return 201, wire.sandbox(rec)
end

--- GET /v1/sandboxes?ownerId&status&name&sandboxGroupId&cursor&limit -> 200 page, newest first
-- (terminated ones only when a status asks for them). Raises invalid (a status or cursor),
-- not_found (another workspace). Does not yield.
function M.list(backend, req)
  for _, o in ipairs(req:query_all("ownerId")) do
    if o ~= backend.workspace then fail("not_found", "workspace not found") end
  end
  local q = { statuses = route.statuses(req, service.SANDBOX_STATUSES), name = req:query_param("name"),
    group_id = req:query_param("sandboxGroupId") }
  return 200, wire.page(req, "sbx", "sandbox", function(after, limit)
    q.after, q.limit = after, limit
    return backend.svc:list_sandboxes(q)
  end, wire.sandbox)
end

--- GET /v1/sandboxes/:id -> 200 sandbox. Raises not_found. Does not yield.
function M.get(backend, req)
  return 200, wire.sandbox(route.sandbox(backend, req))
end

--- POST /v1/sandboxes/:id/terminate -> 204 (idempotent): its processes stopped, its disk freed.
-- Raises not_found. [yields] until the sandbox is gone.
function M.terminate(backend, req)
  backend.svc:terminate(route.sandbox(backend, req))
  return 204
end

--- POST /v1/sandboxes/:id/suspend -> 202 sandbox (suspending; it finishes in a task).
-- Idempotent for a suspended one. Raises not_found, conflict sandbox_not_running. Does not
-- yield.
function M.suspend(backend, req)
  return 202, wire.sandbox(backend.svc:suspend(route.sandbox(backend, req)))
end

--- sandboxes.install(api): registers the routes above through api(method, pattern, handler).
function M.install(api)
  api("POST", "/v1/sandboxes", M.create)
  api("GET", "/v1/sandboxes", M.list)
  api("GET", "/v1/sandboxes/:id", M.get)
  api("POST", "/v1/sandboxes/:id/terminate", M.terminate)
  api("POST", "/v1/sandboxes/:id/suspend", M.suspend)
end

return M
