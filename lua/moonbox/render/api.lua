--- moonbox.render.api — one Render API call: the request, its typed error, its retries.
--
-- Every call names its operation (`op`, e.g. "sandboxes.get") and whether repeating it is
-- safe. Idempotent calls (GET, terminate, delete, token mints) retry 429/502/503/504 and
-- connection failures with jittered exponential backoff that honours Retry-After, inside the
-- caller's deadline. A non-idempotent call (create) is never re-sent: it goes out on a fresh
-- connection, and a failure that leaves its outcome unknown becomes an `unknown_outcome` error.
-- The API key never appears in an error, a log line or a trace: it lives only in the header.
local http = require "moonbox.http"
local json = require "moonbox.json"
local task = require "moonbox.task"
local core = require "moonbox.core"
local trace = require "moonbox.trace"

local M = {}

--- Known error codes (render-api.md §1.6) and whether they can pass by themselves.
local RETRY_STATUS = { [429] = true, [502] = true, [503] = true, [504] = true }

--- api.error(fields) -> a structured error (core.Error) with the fields given.
local function api_error(fields)
  return core.Error.new(fields)
end
M.error = api_error

local function encode_query(q)
  if not q then return "" end
  local keys = {}
  for k in pairs(q) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for _, k in ipairs(keys) do
    local v = q[k]
    local vals = type(v) == "table" and v or { v }
    for _, one in ipairs(vals) do
      parts[#parts + 1] = k .. "=" .. tostring(one):gsub("[^%w%-_%.~]", function(c)
        return string.format("%%%02X", c:byte())
      end)
    end
  end
  return #parts > 0 and ("?" .. table.concat(parts, "&")) or ""
end
M.encode_query = encode_query

--- Seconds to wait before retry number `attempt` (1-based): Retry-After when the server gave
-- one, else exponential from 0.2 s with full jitter, capped at 10 s.
local function backoff(attempt, retry_after)
  local ra = tonumber(retry_after)
  if ra and ra >= 0 then return math.min(ra, 60) end
  local cap = math.min(10, 0.2 * 2 ^ (attempt - 1))
  return math.random() * cap
end
M.backoff = backoff

--- Builds the typed error of an HTTP answer that is not 2xx.
local function status_error(op, r, ctx)
  local ctype = r.headers["content-type"] or ""
  local body = ctype:find("json", 1, true) and json.decode(r.body) or nil
  local message, code
  if type(body) == "table" then
    message, code = body.message, body.code
  end
  if r.status == 403 and type(body) ~= "table" then
    -- Render's edge (a WAF) answers some requests with an HTML page: not a credentials problem.
    code = "edge_blocked"
    message = "the request was blocked at Render's edge (HTTP 403 with a non-JSON body), e.g. " ..
      "because of command text the firewall rejects; this is not an API key problem"
  end
  if not message or message == "" then
    message = r.body ~= "" and #r.body < 200 and r.body or ("HTTP " .. r.status)
  end
  if not code then
    if r.status == 401 then code = "unauthorized"
    elseif r.status == 404 then code = "not_found"
    elseif r.status == 429 then code = "rate_limited"
    elseif r.status >= 500 then code = "server_error"
    else code = "http_" .. r.status end
  end
  return api_error {
    op = op, status = r.status, code = code, message = message,
    request_id = r.headers["render-request-id"], retryable = RETRY_STATUS[r.status] or false,
    sandbox_id = ctx.sandbox_id, snapshot_id = ctx.snapshot_id,
    retry_after = tonumber(r.headers["retry-after"]),
  }
end

-- One API call with its retries; `info` receives the last status, attempts and request id.
local function call(conn, op, method, path, opts, info)
  local idempotent = opts.idempotent
  if idempotent == nil then idempotent = method == "GET" or method == "DELETE" end
  local url = conn.base .. path .. encode_query(opts.query)
  local headers = { Authorization = "Bearer " .. conn.api_key, Accept = "application/json",
    ["User-Agent"] = "moonbox/" .. core.version }
  local body
  if opts.body ~= nil then
    body = json.encode(opts.body)
    headers["Content-Type"] = "application/json"
  end
  local deadline = core.now() + (opts.deadline or 120)
  local attempts = opts.retries or 5
  local ctx = { sandbox_id = opts.sandbox_id, snapshot_id = opts.snapshot_id }
  for attempt = 1, attempts + 1 do
    local ok, r = pcall(http.request, { method = method, url = url, headers = headers, body = body,
      timeout = opts.timeout or 60, connect_timeout = 10, fresh_connect = not idempotent })
    local err
    if ok then
      info.status, info.attempts, info.request_id = r.status, attempt, r.headers["render-request-id"]
      if r.status >= 200 and r.status < 300 then
        conn:note(op, method, path, r.status, attempt)
        if r.body == "" then return true, r.status, r.headers end
        local v = json.decode(r.body)
        if v == nil then
          error(api_error { op = op, code = "malformed_response", status = r.status,
            message = "the answer is not JSON", request_id = r.headers["render-request-id"] }, 0)
        end
        return v, r.status, r.headers
      end
      err = status_error(op, r, ctx)
      conn:note(op, method, path, r.status, attempt)
      if r.status == 429 then
        -- Tell the adaptive windows (task.map, render.restore) to back off.
        task.congested(err.retry_after)
        trace.instant("throttled", "api", { op = op, retry_after = err.retry_after, attempt = attempt })
      end
    else
      if task.is_cancelled(r) or task.is_timeout(r) or (type(r) == "table" and r.code == "deadline") then
        error(r, 0)
      end
      if type(r) ~= "table" then error(r, 0) end
      -- A transport failure: for a create the server may have acted on it.
      if not idempotent and (r.code == "connection_reset" or r.code == "timeout") then
        error(api_error {
          op = op, code = "unknown_outcome", retryable = false, cause = r.code,
          message = "the request may or may not have been carried out: " .. tostring(r.message) ..
            " (it was sent; no answer came back). Check before repeating it",
          sandbox_id = ctx.sandbox_id,
        }, 0)
      end
      err = api_error { op = op, code = r.code, message = r.message, retryable = r.retryable,
        sandbox_id = ctx.sandbox_id, snapshot_id = ctx.snapshot_id }
      conn:note(op, method, path, r.code, attempt)
      info.status, info.attempts = r.code, attempt
    end
    local wait = backoff(attempt, err.retry_after)
    -- A 429 is a definite refusal (nothing was done), so even a create may be sent again.
    local again = (idempotent and err.retryable) or err.status == 429
    if not again or attempt > attempts or core.now() + wait > deadline then
      err.attempts = attempt
      error(err, 0)
    end
    trace.instant("retry", "api", { op = op, attempt = attempt, wait_s = wait, code = err.code })
    task.sleep(wait)
  end
end

--- api.calls_made: how many API calls (control and data plane) this process made.
M.calls_made = 0

--- api.call(conn, op, method, path, opts) -> decoded body (or true for an empty 2xx), status,
-- headers. opts: query, body (table → JSON), idempotent (default: GET/DELETE and explicit
-- true), sandbox_id / snapshot_id (for errors), timeout (per attempt, default 60 s),
-- deadline (overall seconds, default 120), retries (default 5). Raises structured errors.
-- A 429 tells task.congested (adaptive windows back off) and is retried even for a create.
-- With a trace on, the call is one span (cat "api"). [yields]
function M.call(conn, op, method, path, opts)
  opts = opts or {}
  M.calls_made = M.calls_made + 1
  local info = {}
  if not trace.on then return call(conn, op, method, path, opts, info) end
  local _span <close> = M.span(op, method, path, opts, info)
  return call(conn, op, method, path, opts, info)
end

--- api.span(op, method, path, ids, info) -> a to-be-closed value that writes the call's trace
-- span when it closes; `info` (status, attempts, request_id, ...) is read at that moment.
-- Used by api.call and by the data-plane requests (exec streams, file transfers).
function M.span(op, method, path, ids, info)
  local t0 = trace.now_us()
  return setmetatable({}, { __close = function(_, err)
    if not trace.on then return end
    local code = err ~= nil and (type(err) == "table" and err.code or "error") or nil
    trace.complete(op, "api", t0, { method = method, path = path, status = info.status,
      attempts = info.attempts, request_id = info.request_id, sandbox_id = ids and ids.sandbox_id,
      snapshot_id = ids and ids.snapshot_id, exec_id = info.exec_id, error = code })
  end })
end

--- api.traced(op, method, path, ids, fn, ...) -> fn(...): runs a data-plane request (fn) as one
-- trace span; `path` names the operation (never the token URL). The span's status is that of
-- the first result when it has one.
function M.traced(op, method, path, ids, fn, ...)
  M.calls_made = M.calls_made + 1
  if not trace.on then return fn(...) end
  local info = {}
  local _span <close> = M.span(op, method, path, ids, info)
  local r = table.pack(fn(...))
  if type(r[1]) == "table" then info.status = r[1].status end -- an http.request answer
  return table.unpack(r, 1, r.n)
end

return M
