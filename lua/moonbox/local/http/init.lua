--- moonbox.local.http — every route of `moonbox local`, one module per resource:
--   sandboxes  /v1/sandboxes (create, list, get, terminate, suspend)
--   runs       run tokens, exec records, /proxy/:id/runs/{stream,sync}
--   files      file tokens, /proxy/:id/files/{upload,download}, files/list
--   snapshots  snapshot create/get/list/delete
--   groups     /v1/sandbox-groups
--   logs       /v1/sandboxes/:id/logs (SSE)
--   control    /_moonbox (faults, journal, health)
-- Routes under /v1 and /_moonbox require the API key, data-plane routes (/proxy) a connect
-- token of their scope; the server checks both before reading a body (runtime/http_server.c).
-- Until the start's recovery is done, /v1 answers 503 (gated below) and /_moonbox/health says
-- ready: false; /proxy needs a token, and none exists before then.
-- Handlers decode, call the service (moonbox.local.service) and encode; route.wrap adds what
-- they share.
local route = require "moonbox.local.http.route"
local sandboxes = require "moonbox.local.http.sandboxes"
local runs = require "moonbox.local.http.runs"
local files = require "moonbox.local.http.files"
local snapshots = require "moonbox.local.http.snapshots"
local groups = require "moonbox.local.http.groups"
local logs = require "moonbox.local.http.logs"
local control_routes = require "moonbox.local.http.control"

local M = {}

-- The start's gate: until the backend has recovered what the previous one left (backend.ready,
-- set by moonbox.local.start), a /v1 request is refused with 503 and Retry-After: 1 in
-- Render's error shape, having done nothing: a create then is never mistaken for one the crash
-- left, a list never shows a dead sandbox running. Does not yield.
local function gated(fn)
  return function(backend, req, ctx, res)
    if not backend.ready then
      route.fail("unavailable", "moonbox local is starting: it is recovering what its previous run left; " ..
        "retry in a moment", nil, 1)
    end
    return fn(backend, req, ctx, res)
  end
end

--- http.install(backend): adds every route to backend.srv. The backend (moonbox.local's
-- Backend) carries svc, journal, faults, log, url, workspace, state_dir.
function M.install(backend)
  local srv = backend.srv
  local api_routes = {} -- {method, pattern} of every /v1 route, for route.unrouted
  local function api(method, pattern, fn)
    srv:route(method, pattern, route.wrap(backend, gated(fn)), { auth = "key" })
    api_routes[#api_routes + 1] = { method, pattern }
  end
  local function control(method, pattern, fn)
    srv:route(method, pattern, route.wrap(backend, fn, { control = true }), { auth = "key" })
  end
  local function data(method, pattern, fn, scope, opts)
    local o = { auth = "token", scope = scope }
    for k, v in pairs(opts or {}) do o[k] = v end
    srv:route(method, pattern, route.wrap(backend, fn), o)
  end
  sandboxes.install(api)
  runs.install(api, data)
  files.install(api, data, backend.svc.limits.max_upload, backend.space_dir)
  snapshots.install(api)
  groups.install(api)
  logs.install(api)
  control_routes.install(control)
  -- Unauthenticated, for health checkers: free space only (no ids, no paths).
  srv:route("GET", "/healthz", function(req, res)
    local _ = req
    local h = control_routes.healthz(backend)
    return route.respond(res, h.ok and 200 or 503, h)
  end)
  -- Last: what no /v1 route takes is still answered by the application (RateLimit-* included).
  srv:route("*", "/v1/*", route.wrap(backend, gated(route.unrouted(api_routes))), { auth = "key" })
end

return M
