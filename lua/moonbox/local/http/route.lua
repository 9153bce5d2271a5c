--- moonbox.local.http.route — what every route of `moonbox local` shares.
--
-- route.wrap(backend, fn, o) turns a handler function(backend, req, ctx, res) -> status, body,
-- headers into an httpd handler that: records the request in the journal (only authenticated
-- requests get this far: the server's pre-body gate answers the others), applies injected
-- faults (never to the control endpoint), turns ServiceErrors into Render's JSON errors
-- {message, code}, and adds render-request-id and the ratelimit-* headers of the rate limit it
-- enforces (route.meter).
-- Unexpected errors answer 500 with the request id only; their details (which name our source
-- files) go to the backend's log, never to the client. Also here: strict decoding of JSON
-- bodies and typed field access, so that every bad input is a 400 saying which field and why.
--
-- The handler contract, which the comment above each handler in moonbox.local.http.* refines:
-- a handler is function(backend, req, ctx, res) -> status, body, headers. req is the httpd
-- request (captures, query, headers, the body or body_file); ctx is {rid, entry (the journal's
-- record), fault, ratelimit}; body is a Lua value answered as JSON (none for 204). A handler
-- that answers by itself (a stream, a file) does so through res and returns nil. It raises a
-- ServiceError (route.fail here, or from the service) for every refusal: its kind picks the
-- status (route.STATUS) and its code Render's machine code. Each request runs in a task of its
-- own, so a handler may yield; the comment says "[yields]" when it does (it waits for the
-- service, the engine or the client) and "Does not yield" otherwise. It calls the service,
-- never the engine or the records (tests/lint/layers.py checks the requires).
local task = require "moonbox.task"
local core = require "moonbox.core"
local json = require "moonbox.json"
local cjson = require "cjson"
local ids = require "moonbox.ids"
local service = require "moonbox.local.service"

local M = {}
local fail = service.fail
M.fail = fail

-- Status of each ServiceError kind.
M.STATUS = { invalid = 400, unauthorized = 401, forbidden = 403, not_found = 404, conflict = 409,
  too_large = 413, unsupported_media = 415, rate_limited = 429, internal = 500, unavailable = 503,
  insufficient_storage = 507 }

-- A decoder of its own: no NaN/Infinity/hex numbers, and nesting bounded (the wire never needs
-- more than a few levels).
local strict = cjson.new()
strict.decode_invalid_numbers(false)
strict.decode_max_depth(32)

local function finite(v, depth)
  if type(v) == "number" then return v == v and v ~= math.huge and v ~= -math.huge end
  if type(v) == "table" then
    for k, x in pairs(v) do
      if not finite(x, depth + 1) or (type(k) == "number" and not finite(k, depth + 1)) then return false end
    end
  end
  return true
end

--- route.decode(raw) -> value, or nil and a message: JSON as the wire accepts it.
function M.decode(raw)
  local ok, v = pcall(strict.decode, raw)
  if not ok then
    local msg = tostring(v):gsub("^.-: ", "")
    if msg:find("too many nested") then msg = "it is nested more than 32 levels deep" end
    return nil, msg
  end
  if not finite(v, 0) then return nil, "it holds a number out of range (NaN, Infinity or beyond a double)" end
  if v == cjson.null then v = json.null end
  return v
end

--- route.body_json(req, required) -> the request's JSON object (nil when empty and not
-- required). Raises invalid with the reason. The decoded body is kept on req for the journal.
function M.body_json(req, required)
  if not req._json_done then
    req._json_done = true
    local raw = req.body or ""
    if not raw:match("^%s*$") then
      local v, err = M.decode(raw)
      if v == nil then
        req._json_error = "request body is not valid JSON: " .. err
      elseif type(v) ~= "table" or (#v > 0) then
        req._json_error = "request body must be a JSON object"
      else
        req._json = v
      end
    end
  end
  if req._json_error then fail("invalid", req._json_error) end
  if req._json == nil and required then fail("invalid", "a JSON request body is required") end
  return req._json
end

--- route.field(body, name, kind, where[, lo, hi]) -> the field's value or nil (absent or
-- null). kind: "string", "boolean", "integer" (lo..hi inclusive when given), "object", "array".
-- Raises invalid naming the field and what it must be.
function M.field(body, name, kind, where, lo, hi)
  local v = body[name]
  if v == nil or v == json.null then return nil end
  local ok
  if kind == "integer" then
    ok = math.type(v) == "integer" or (type(v) == "number" and v == math.floor(v) and math.abs(v) < 2 ^ 63)
    if ok then
      v = math.tointeger(v)
      ok = v ~= nil
    end
    if ok and ((lo and v < lo) or (hi and v > hi)) then
      fail("invalid", string.format("%s: field '%s' must be between %d and %d, got %d", where, name, lo,
        hi, v))
    end
  elseif kind == "object" then
    ok = type(v) == "table" and (next(v) == nil or #v == 0)
  elseif kind == "array" then
    ok = type(v) == "table" and (next(v) == nil or #v > 0)
  else
    ok = type(v) == kind
  end
  if not ok then
    fail("invalid", string.format("%s: field '%s' must be %s %s%s", where, name, kind == "integer" and "an"
      or "a",
      kind, kind == "integer" and lo and string.format(" between %d and %d", lo, hi) or ""))
  end
  return v
end

--- route.query_int(req, name, default, lo, hi) -> an integer query parameter. Raises invalid.
function M.query_int(req, name, default, lo, hi)
  local raw = req:query_param(name)
  if raw == nil then return default end
  local n = raw:match("^%s*%-?[%d.eE+]+%s*$") and tonumber(raw)
  local v = n and n == n and math.abs(n) < 2 ^ 63 and math.tointeger(n)
  if not v or v < lo or v > hi then
    fail("invalid", string.format("%s must be an integer between %d and %d", name, lo, hi))
  end
  return v
end

--- route.bearer(req) -> the bearer token of the Authorization header, or nil.
function M.bearer(req)
  local h = req.headers["authorization"]
  return h and h:match("^[Bb]earer%s+(%S+)%s*$")
end

--- route.respond(res, status, body, headers): sends a table as JSON, or a string as is.
function M.respond(res, status, body, headers)
  headers = headers or {}
  local text
  if type(body) == "table" then
    text = json.encode(body)
    headers["Content-Type"] = headers["Content-Type"] or "application/json"
  else
    text = body
  end
  return res:send(status, text, headers)
end

-- ---- the rate limit ------------------------------------------------------------------------
-- Requests under /v1 are counted in fixed windows of RATE_WINDOW seconds, one count for the
-- backend (it has one API key): at most backend.rate_limit per window (moonbox local --rate-limit,
-- default DEFAULT_RATE_LIMIT), and the one beyond is answered 429 with Retry-After (the seconds
-- left in the window). Every /v1 answer says where the count is: RateLimit-Limit, -Remaining
-- (after this request), -Reset (seconds until the window ends). Data-plane (/proxy) and control
-- requests are neither counted nor answered with them, as on Render.
local RATE_WINDOW = 60
M.DEFAULT_RATE_LIMIT = 100000

--- route.meter(backend) -> allowed, headers: counts one /v1 request in the backend's current window.
-- headers: the RateLimit-* (and, when refused, Retry-After) values to answer with.
function M.meter(backend)
  local now = backend.svc.clock.now()
  local m = backend.rate
  if not m or now >= m.start + RATE_WINDOW then
    m = { start = now, count = 0, limit = backend.rate_limit or M.DEFAULT_RATE_LIMIT }
    backend.rate = m
  end
  local reset = math.max(1, math.ceil(m.start + RATE_WINDOW - now))
  local allowed = m.count < m.limit
  if allowed then m.count = m.count + 1 end
  local headers = { ["RateLimit-Limit"] = tostring(m.limit),
    ["RateLimit-Remaining"] = tostring(m.limit - m.count),
    ["RateLimit-Reset"] = tostring(reset) }
  if not allowed then headers["Retry-After"] = tostring(reset) end
  return allowed, headers
end

-- Copies the RateLimit-* headers of the request's count into headers (kept where headers has its own).
local function ratelimit(headers, rl)
  for k, v in pairs(rl or {}) do
    if k ~= "Retry-After" and headers[k] == nil then headers[k] = v end
  end
  return headers
end

--- route.stream_headers(ctx, headers) -> headers with the request's RateLimit-* headers added: for
-- handlers that answer with a stream of their own (the logs SSE).
function M.stream_headers(ctx, headers)
  return ratelimit(headers, ctx.ratelimit)
end

--- route.wrap(backend, fn, o) -> an httpd handler (see the file header). o.control = true for the
-- control endpoint (no faults). backend is the moonbox.local Backend: its svc, journal,
-- faults and log. The returned handler journals the request, meters /v1 (429 when the window
-- is spent), applies a fault (latency, a status, Render's edge page, a dropped answer), runs fn
-- under a message handler and answers its result, a ServiceError as its status, anything else
-- as a 500 (details to the log). It raises only a cancellation, re-raised for httpd. [yields]
-- (injected latency, and whatever fn waits for).
function M.wrap(backend, fn, o)
  o = o or {}
  return function(req, res)
    -- Decode first so the journal can show the body; a bad body is still journaled as text.
    pcall(M.body_json, req, false)
    local entry = backend.journal:record(req, req._json)
    local rid = "req-" .. ids.token():sub(1, 20)
    local latency, fault = 0, nil
    local rl -- this request's RateLimit-* headers (/v1 only)
    if not o.control and req.path:sub(1, 4) == "/v1/" then
      local allowed
      allowed, rl = M.meter(backend)
      if not allowed then
        local headers = { ["render-request-id"] = rid, ["Retry-After"] = rl["Retry-After"] }
        entry.status = 429
        return M.respond(res, 429, { message = string.format("rate limit exceeded: at most %s requests " ..
          "every %d seconds (moonbox local --rate-limit); retry after %s s", rl["RateLimit-Limit"],
          RATE_WINDOW, rl["Retry-After"]) }, ratelimit(headers, rl))
      end
    end
    if not o.control then latency, fault = backend.faults:decide(req.method, req.path) end
    if latency > 0 then task.sleep(latency / 1000) end
    if fault and fault.fault == "status" then
      local headers = { ["render-request-id"] = rid }
      if fault.retry_after then
        -- An injected 429 says the window is spent, as a real one would.
        headers["Retry-After"] = tostring(fault.retry_after)
        headers["RateLimit-Remaining"], headers["RateLimit-Reset"] = "0", tostring(fault.retry_after)
      end
      if rl then ratelimit(headers, rl) end
      entry.status, entry.fault = fault.status, "status"
      return M.respond(res, fault.status, { message = fault.status == 429 and "rate limit exceeded"
        or "injected fault" }, headers)
    end
    if fault and fault.fault == "edge" then
      -- Render's edge firewall: an HTML page, none of Render's own headers.
      entry.status, entry.fault = 403, "edge"
      return res:send(403, "<!DOCTYPE html><html><head><title>Attention Required! | Cloudflare</title>" ..
        "</head><body>Sorry, you have been blocked</body></html>", { ["Content-Type"] = "text/html" })
    end
    if fault and fault.fault == "garbage" then
      entry.status, entry.fault = 200, "garbage"
      return res:send(200, "this is neither JSON nor gzip", { ["Content-Type"] = "text/plain",
        ["Content-Encoding"] = "gzip" })
    end
    local ctx = { rid = rid, entry = entry, fault = fault, ratelimit = rl }
    local ok, status, body, headers = xpcall(fn, core.msgh, backend, req, ctx, res)
    if not ok then
      local err = status
      if task.is_cancelled(err) then error(err, 0) end
      if service.is_error(err) then
        status, body = M.STATUS[err.kind] or 500, { message = err.message, code = err.code }
        headers = err.retry_after and { ["Retry-After"] = tostring(err.retry_after) } or nil
      else
        backend.log(string.format("%s %s (%s) failed: %s\n%s", req.method, req.path, rid, tostring(err),
          core.traceback_of(err) or ""))
        status, body = 500, { message = "internal error in moonbox local (request " .. rid ..
          "); the backend's log has the details" }
      end
    end
    if status == nil then -- answered itself (a stream)
      entry.status = entry.status or 200
      return
    end
    entry.status = status
    if fault and fault.fault == "drop" then
      entry.fault = "drop"
      res:drop()
      return
    end
    headers = headers or {}
    headers["render-request-id"] = rid
    if rl then ratelimit(headers, rl) end
    return M.respond(res, status, body, headers)
  end
end

--- route.unrouted(routes) -> a handler for the /v1 requests no route took: 404 "no route for
-- METHOD PATH", or 405 with Allow when a route has the path under another method — the answers
-- the server itself would give, but through route.wrap, so they are counted and carry the
-- RateLimit-* headers like every /v1 answer. routes: {method, pattern} as given to srv:route.
function M.unrouted(routes)
  local compiled = {}
  for _, rt in ipairs(routes) do
    local lp = rt[2]:gsub("[^%w/:]", "%%%0"):gsub(":[%w_]+", "[^/]+")
    compiled[#compiled + 1] = { method = rt[1], pattern = "^" .. lp .. "$" }
  end
  return function(_, req)
    local allow, seen = {}, {}
    for _, c in ipairs(compiled) do
      if req.path:find(c.pattern) and not seen[c.method] then
        seen[c.method] = true
        allow[#allow + 1] = c.method
        if c.method == "GET" then allow[#allow + 1] = "HEAD" end
      end
    end
    if #allow > 0 then
      return 405, { message = string.format("method %s is not allowed for %s", req.method, req.path) },
        { Allow = table.concat(allow, ", ") }
    end
    return 404, { message = string.format("no route for %s %s", req.method, req.path) }
  end
end

--- route.owner_optional(backend, req): ownerId as an optional query parameter: at most one value,
-- and it must be the workspace.
function M.owner_optional(backend, req)
  local all = req:query_all("ownerId")
  if #all > 1 then fail("invalid", "ownerId accepts at most one value", "invalid_owner_id") end
  if all[1] and all[1] ~= backend.workspace then fail("not_found", "workspace not found") end
end

--- route.owner_exactly_one(backend, req): ownerId required with exactly one value (group and
-- snapshot lists).
function M.owner_exactly_one(backend, req)
  local all = req:query_all("ownerId")
  if #all == 0 then fail("invalid", "ownerId is required", "invalid_owner_id") end
  if #all > 1 then fail("invalid", "ownerId accepts at most one value", "invalid_owner_id") end
  if all[1] ~= backend.workspace then fail("not_found", "workspace not found") end
end

--- route.owner_in_body(backend, owner): a create's ownerId (from its body): required, a string,
-- and the workspace. Raises invalid invalid_owner_id, not_found.
function M.owner_in_body(backend, owner)
  if owner == nil then fail("invalid", "ownerId is required", "invalid_owner_id") end
  if type(owner) ~= "string" then fail("invalid", "ownerId must be a string", "invalid_owner_id") end
  if owner ~= backend.workspace then fail("not_found", "workspace not found") end
end

--- route.sandbox(backend, req) -> the record of the sandbox a /v1/sandboxes/:id route names,
-- once its optional ownerId is the workspace (route.owner_optional). Raises invalid, not_found.
function M.sandbox(backend, req)
  M.owner_optional(backend, req)
  return backend.svc:find_sandbox(req.captures.id)
end

--- route.group(backend, req) -> the group a /v1/sandbox-groups/:gid route names, once its
-- optional ownerId is the workspace. Raises invalid invalid_sandbox_group_id, not_found.
function M.group(backend, req)
  M.owner_optional(backend, req)
  return backend.svc:find_group(req.captures.gid)
end

--- route.statuses(req, allowed) -> a set of the status query values (repeated or
-- comma-separated), or nil when there are none. Raises invalid invalid_status.
function M.statuses(req, allowed)
  local list = req:query_all("status")
  if #list == 0 then return nil end
  local want = {}
  for _, s in ipairs(list) do
    for one in s:gmatch("[^,]+") do
      if not allowed[one] then fail("invalid", "invalid status " .. one, "invalid_status") end
      want[one] = true
    end
  end
  return want
end

return M
