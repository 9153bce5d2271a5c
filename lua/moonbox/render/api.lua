--- moonbox.render.api — one Render API request: how it is sent, retried, typed when it fails,
-- and traced. Every request of the client goes through here, control plane and data plane.
--
-- Requests go through moonbox.http, or through conn.transport when the connection has one (a
-- dry run's simulated backend, moonbox.render.dryrun, which answers the same shapes in memory).
--
-- Control-plane calls (api.call) go to the API with the API key. Data-plane requests (api.data:
-- exec streams, sync runs, file transfers) first mint a connect token on the API, then go to
-- the token's URI with only that token. Both share one retry loop and one mapping from HTTP
-- answers to typed errors, so a 503 means the same thing whichever plane it came from.
--
-- What may be sent again is decided per request, never by the transport: a repeatable request
-- (GET, terminate, delete, token mints, file transfers) retries 429/500/502/503/504 and
-- transient transport failures with jittered exponential backoff that honours Retry-After,
-- inside the request's deadline; a request that must not run twice (create, snapshot, starting
-- a command) is sent again only after a definite refusal (429, or a connection that was never
-- made). Its other failures are raised, and a failure that leaves its outcome unknown becomes an
-- `unknown_outcome` error. The API key and tokens never appear in an error, a log line or a
-- trace: they live only in the Authorization header.
local http = require "moonbox.http"
local json = require "moonbox.json"
local task = require "moonbox.task"
local core = require "moonbox.core"
local trace = require "moonbox.trace"
local schema = require "moonbox.schema"
local durable = require "moonbox.durable"

local M = {}

-- Answers that say "try again later" (docs/wire.md, "Errors"); 500 too, for repeatable requests:
-- repeating a request that is safe to repeat costs little, and Render's 500s are mostly
-- transient.
local REPEAT_STATUS = { [429] = true, [500] = true, [502] = true, [503] = true, [504] = true }
-- Transport failures after which the request certainly did not reach the server.
local NEVER_SENT = { connect_failed = true, dns_failed = true }
-- Transport failures after which it may have been carried out.
local MAYBE_SENT = { connection_reset = true, timeout = true }

--- api.error(fields) -> a structured error (core.Error) with the fields given; where and
-- traceback are filled in (where: the nearest recipe line). Does not raise.
local function api_error(fields)
  return core.Error.new(fields)
end
M.error = api_error

--- api.encode_query(q) -> "?k=v&..." (keys sorted, list values repeated, values percent-encoded)
-- or "" for nil/empty.
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

--- api.backoff(attempt, retry_after) -> seconds to wait before retry number `attempt`
-- (1-based): Retry-After when the server gave one (at most 60 s), else exponential from 0.2 s
-- with full jitter, capped at 10 s.
local function backoff(attempt, retry_after)
  local ra = tonumber(retry_after)
  if ra and ra >= 0 then return math.min(ra, 60) end
  local cap = math.min(10, 0.2 * 2 ^ (attempt - 1))
  return math.random() * cap
end
M.backoff = backoff

--- api.status_error(op, r, ctx, text) -> the typed error of an HTTP answer r that is not 2xx
-- (text: its body, when r.body does not hold it). ctx: sandbox_id, snapshot_id, group_id, exec_id, path
-- are copied into the error. Codes: the one Render sent, else unauthorized (401), not_found
-- (404), conflict (409), rate_limited (429), server_error (5xx), http_NNN; a 403 whose body is
-- not JSON is edge_blocked (Render's firewall, not a credentials problem). Each is a row of
-- docs/reference/render.md's "Error codes", which spec/render_errors_spec.lua provokes.
local function status_error(op, r, ctx, text)
  text = text or r.body or ""
  local ctype = r.headers["content-type"] or ""
  local body
  if ctype:find("json", 1, true) then
    local ok, v = pcall(json.decode, text)
    if ok and type(v) == "table" then body = v end
  end
  local message, code
  if body then message, code = body.message, body.code end
  if r.status == 403 and not body then
    code = "edge_blocked"
    message = "the request was blocked at Render's edge (HTTP 403 with a non-JSON body), e.g. " ..
      "because of command text the firewall rejects; this is not an API key problem"
  end
  if type(message) ~= "string" or message == "" then
    message = text ~= "" and #text < 200 and text or ("HTTP " .. r.status)
  end
  if type(code) ~= "string" then
    if r.status == 401 then code = "unauthorized"
    elseif r.status == 404 then code = "not_found"
    elseif r.status == 409 then code = "conflict"
    elseif r.status == 429 then code = "rate_limited"
    elseif r.status >= 500 then code = "server_error"
    else code = "http_" .. r.status end
  end
  return api_error {
    op = op, status = r.status, code = code, message = message,
    request_id = r.headers["render-request-id"], retryable = REPEAT_STATUS[r.status] or false,
    sandbox_id = ctx.sandbox_id, snapshot_id = ctx.snapshot_id, group_id = ctx.group_id,
      exec_id = ctx.exec_id,
    path = ctx.path,
    retry_after = tonumber(r.headers["retry-after"]),
  }
end
M.status_error = status_error

--- api.definite(err) -> whether err proves that a request which must not run twice was not
-- carried out: an answer the server gave (any 4xx, and a 429 above all), or a connection that
-- was never made. A 5xx or a lost answer is not definite (on Render a 5xx may come from a
-- proxy after the service acted).
function M.definite(err)
  if type(err) ~= "table" then return false end
  if type(err.status) == "number" then return err.status >= 400 and err.status < 500 end
  return NEVER_SENT[err.code] == true or NEVER_SENT[err.cause] == true
end

-- The typed error of a transport failure (an http.request / http.stream error).
local function transport_error(op, r, ctx, repeatable)
  if not repeatable and MAYBE_SENT[r.code] then
    return api_error {
      op = op, code = "unknown_outcome", retryable = false, cause = r.code,
      message = "the request may or may not have been carried out: " .. tostring(r.message) ..
        " (it was sent; no answer came back). Check before repeating it",
      sandbox_id = ctx.sandbox_id, snapshot_id = ctx.snapshot_id, group_id = ctx.group_id,
        exec_id = ctx.exec_id,
    }
  end
  return api_error { op = op, code = r.code, message = r.message, retryable = r.retryable,
    sandbox_id = ctx.sandbox_id, snapshot_id = ctx.snapshot_id, group_id = ctx.group_id,
      exec_id = ctx.exec_id,
    path = ctx.path }
end

--- api.is_interruption(err): task.is_interruption (a cancellation or an enclosing deadline).
local is_interruption = task.is_interruption
M.is_interruption = is_interruption

--- api.error_text(err) -> the text of any error for a message that names its own context: a
-- structured error's tostring without its leading "file:line: " (its where), anything else's
-- tostring. Does not yield.
function M.error_text(err)
  local s = tostring(err)
  local where = type(err) == "table" and rawget(err, "where")
  if type(where) == "string" and s:sub(1, #where + 2) == where .. ": " then s = s:sub(#where + 3) end
  return s
end

--- The one retry loop. send(attempt) makes one attempt and returns true, results... on success,
-- or false, err after a failure (err typed; err.again says whether this request may be sent
-- again after it). Raises the last error when no attempt is left, the next wait would pass the
-- deadline, or the failure may not be repeated. [yields]
local function with_retries(op, opts, info, send)
  local deadline = task.now() + (opts.deadline or 120)
  local attempts = opts.retries or 5
  for attempt = 1, attempts + 1 do
    info.attempts = attempt
    local r = table.pack(send(attempt))
    if r[1] then return table.unpack(r, 2, r.n) end
    local err = r[2]
    if err.status == 429 then
      M.throttled = M.throttled + 1
      -- Tell the adaptive windows (task.map, render.restore) to back off.
      task.congested(err.retry_after)
      trace.instant("throttled", "api", { op = op, retry_after = err.retry_after, attempt = attempt })
    end
    local wait = backoff(attempt, err.retry_after)
    if not err.again or attempt > attempts or task.now() + wait > deadline then
      err.again = nil
      err.attempts = attempt
      error(err, 0)
    end
    err.again = nil
    trace.instant("retry", "api", { op = op, attempt = attempt, wait_s = wait, code = err.code })
    task.sleep(wait)
  end
end

-- A 502 or 504 that is not the API's own JSON comes from a proxy or edge in front of it that lost
-- the API's answer, or never got one: for a request that must not run twice its outcome is as
-- unknown as that of a connection that broke after sending.
local GATEWAY_LOST = { [502] = true, [504] = true }

local function lost_at_gateway(op, r, ctx)
  return api_error {
    op = op, code = "unknown_outcome", retryable = false, cause = "http_" .. r.status, status = r.status,
    message = "the request may or may not have been carried out: a proxy in front of the API answered " ..
      r.status .. " instead of the API. Check before repeating it",
    request_id = r.headers["render-request-id"], sandbox_id = ctx.sandbox_id,
    snapshot_id = ctx.snapshot_id, group_id = ctx.group_id,
  }
end

-- Whether a failed attempt may be followed by another: a repeatable request after a transient
-- failure; any request after a definite refusal (429, never connected).
local function may_repeat(err, repeatable)
  if err.status == 429 then return true end
  if NEVER_SENT[err.code] then return true end
  if not repeatable then return false end
  if err.status then return REPEAT_STATUS[err.status] == true end
  return err.retryable == true
end

--- api.headers(token, extra) -> the headers of every request moonbox sends to a backend:
-- Authorization (Bearer token: the API key, or a connect token on the data plane), User-Agent,
-- and extra's. The one place they are built.
function M.headers(token, extra)
  local h = { Authorization = "Bearer " .. token, ["User-Agent"] = "moonbox/" .. core.version }
  for k, v in pairs(extra or {}) do h[k] = v end
  return h
end

-- One control-plane call with its retries; `info` receives the last status, attempts and
-- request id (for the trace span). GET and DELETE are repeatable unless opts.idempotent says
-- otherwise; a request that is not is never re-sent after its answer was lost. Returns the
-- decoded JSON answer (true for an empty 2xx body), status and headers. Raises the typed error
-- of the last attempt (status_error, transport_error, malformed_response, unknown_outcome)
-- and re-raises an interruption at once. [yields]
local function call(conn, op, method, path, opts, info)
  local repeatable = opts.idempotent
  if repeatable == nil then repeatable = method == "GET" or method == "DELETE" end
  local url = conn.base .. path .. encode_query(opts.query)
  local headers = M.headers(conn.api_key, { Accept = "application/json" })
  local body
  if opts.body ~= nil then
    body = json.encode(opts.body)
    headers["Content-Type"] = "application/json"
  end
  local ctx = { sandbox_id = opts.sandbox_id, snapshot_id = opts.snapshot_id, group_id = opts.group_id }
  return with_retries(op, opts, info, function(attempt)
    local via = conn.transport or http -- a dry run's simulated backend (moonbox.render.dryrun)
    local ok, r = pcall(via.request, { method = method, url = url, headers = headers, body = body,
      timeout = opts.timeout or 60, connect_timeout = 10, no_resend = not repeatable })
    if not ok then
      if is_interruption(r) or type(r) ~= "table" then error(r, 0) end
      local err = transport_error(op, r, ctx, repeatable)
      conn:note(op, method, path, r.code, attempt)
      info.status = r.code
      err.again = err.code ~= "unknown_outcome" and may_repeat(err, repeatable)
      return false, err
    end
    info.status, info.request_id = r.status, r.headers["render-request-id"]
    conn:note(op, method, path, r.status, attempt)
    if r.status >= 200 and r.status < 300 then
      if r.body == "" then return true, true, r.status, r.headers end
      local v = json.decode(r.body)
      if v == nil then
        error(api_error { op = op, code = "malformed_response", status = r.status,
          message = "the answer is not JSON", request_id = r.headers["render-request-id"],
          sandbox_id = ctx.sandbox_id }, 0)
      end
      return true, v, r.status, r.headers
    end
    local err = status_error(op, r, ctx)
    local ctype = r.headers["content-type"] or ""
    if not repeatable and GATEWAY_LOST[r.status] and not ctype:find("json", 1, true) then
      err = lost_at_gateway(op, r, ctx)
    end
    err.again = err.code ~= "unknown_outcome" and may_repeat(err, repeatable)
    return false, err
  end)
end

--- api.calls_made: how many API calls (control and data plane) this process made; retries of
-- one call are not counted again.
M.calls_made = 0

--- api.outcomes: {outcome = count} of finished API calls of this process ("ok", a failed
-- call's error code, "cancelled"); api.throttled: 429 answers seen (each attempt). Read by
-- `moonbox schedule --listen`'s /metrics.
M.outcomes = {}
M.throttled = 0

local function counted(ok, ...)
  local k = "ok"
  if not ok then
    local e = ...
    k = is_interruption(e) and "cancelled" or (type(e) == "table" and type(e.code) == "string" and e.code)
      or "error"
  end
  M.outcomes[k] = (M.outcomes[k] or 0) + 1
  if ok then return ... end
  error((...), 0)
end

-- One call as it goes to the backend: counted, traced, through the retry loop. [yields]
local function live_call(conn, op, method, path, opts)
  M.calls_made = M.calls_made + 1
  local info = {}
  if not trace.on then return counted(pcall(call, conn, op, method, path, opts, info)) end
  local _span <close> = M.span(op, method, path, opts, info)
  return counted(pcall(call, conn, op, method, path, opts, info))
end

-- The answer headers a journal keeps (moonbox.durable): what callers read, nothing secret.
local KEPT_HEADERS = { "content-type", "render-request-id", "retry-after", "location" }

local function kept_headers(h)
  local out = {}
  for _, k in ipairs(KEPT_HEADERS) do out[k] = h and h[k] end
  return out
end

local function encode_call(v, status, headers)
  return { v = v, status = status, h = kept_headers(headers) }
end

local function decode_call(a)
  return a.v, a.status, a.h or {}
end

--- api.call(conn, op, method, path, opts) -> decoded body (or true for an empty 2xx), status,
-- headers. opts: query, body (table → JSON), idempotent (may it be sent again? default: GET and
-- DELETE), sandbox_id / snapshot_id / group_id (for errors), timeout (per attempt, default 60 s),
-- deadline (overall seconds, default 120), retries (default 5); for a durable run's journal
-- (moonbox.durable): journal (what the entry keeps besides: the ledger intent of a create),
-- journal_ahead (journal a repeatable call `started` before it is sent, too) and
-- in_flight(entry) (how to find out what the call did when a crash left it in flight; default:
-- a repeatable call is sent again, any other raises unknown_outcome). Raises structured errors
-- (see the file's header for what is retried). With a trace on, the call is one span (cat
-- "api"). With a journal active, the call is journaled, or answered from the journal. [yields]
function M.call(conn, op, method, path, opts)
  opts = opts or {}
  if not durable.active() then return live_call(conn, op, method, path, opts) end
  local repeatable = opts.idempotent
  if repeatable == nil then repeatable = method == "GET" or method == "DELETE" end
  local meta = opts.journal
  if opts.sandbox_id then
    meta = meta or {}
    meta.sandbox_id = opts.sandbox_id
  end
  return durable.call({
    sig = op .. " " .. method .. " " .. path .. encode_query(opts.query) .. " " ..
      durable.body_sig(opts.body),
    op = op, repeatable = repeatable, meta = meta, sandbox_id = opts.sandbox_id,
    in_flight = opts.in_flight, encode = encode_call, decode = decode_call, lazy = method == "GET",
    ahead = opts.journal_ahead,
  }, function() return live_call(conn, op, method, path, opts) end)
end

--- api.data(conn, op, mint, req, opts) -> response, token, span. A data-plane request: mints
-- a connect token (api.call(conn, op, "POST", mint.path, {body = mint.body, query = mint.query})
-- — one span of its own, retried like any token mint), then sends req to the token's URI with
-- only the token as bearer. A new token is minted for every attempt, so a retry never meets an
-- expired one.
-- req: the http options method, body, body_file, output_file, headers, accept_encoding,
--   max_body, timeout, idle_timeout; req.stream = true to get an http.stream response (status
--   checked, body still to be read) instead of a whole one.
-- opts: repeatable (may the request itself be sent again after a transient failure: file
--   transfers yes, starting a command no; default false), name (the data request's trace span
--   and error op, default op .. ".data"), span_path (what the trace shows instead of the
--   token's URL), sandbox_id, path (for errors), deadline, retries.
-- Returns the 2xx response, the token ({token, uri, executionId?, ...}) and, for a stream, its
-- trace span (nil when no trace is on), which the caller closes when it is done with the
-- stream (span:close_with(err) or `<close>`); a whole request's span is written here. A
-- non-2xx answer raises its typed error (err.body: the first 64 KiB of a body that is not
-- JSON); a lost answer of a request that is not repeatable raises unknown_outcome (with
-- err.exec_id when the token named one). [yields]
local function live_data(conn, op, mint, req, opts)
  local name = opts.name or (op .. ".data")
  M.calls_made = M.calls_made + 1
  local info = {}
  local span = trace.on and M.span(name, req.method or "GET", opts.span_path or "(data plane)", opts, info)
    or nil
  local ctx = { sandbox_id = opts.sandbox_id, path = opts.path }
  local ok, resp, tok = pcall(with_retries, name, opts, info, function()
    local t = M.call(conn, op, "POST", mint.path,
      { body = mint.body, query = mint.query, idempotent = true, sandbox_id = opts.sandbox_id })
    ctx.exec_id = t.executionId
    info.exec_id = t.executionId
    local r_opts = {}
    for k, v in pairs(req) do r_opts[k] = v end
    r_opts.stream = nil
    r_opts.url = t.uri
    r_opts.connect_timeout = r_opts.connect_timeout or 10
    -- Kept-alive connections are reused even for a command's start: one of its own per exec
    -- would cost a TLS handshake per command on Render. libcurl's silent re-send (http.md) is
    -- kept off it all the same (no_resend = "reuse": a start whose body went out is never sent
    -- again by libcurl, over HTTP/2 or HTTP/1.1); its lost answer surfaces as unknown_outcome.
    if not opts.repeatable and r_opts.body then r_opts.no_resend = "reuse" end
    local headers = M.headers(t.token, req.headers)
    headers.Authorization = "Bearer " .. t.token -- whatever req.headers said
    r_opts.headers = headers
    local via = conn.transport or http -- a dry run's simulated backend (moonbox.render.dryrun)
    -- the structured command travels only to an in-memory backend; the wire carries the body
    if via == http then r_opts.intent = nil end
    local sent, r = pcall(req.stream and via.stream or via.request, r_opts)
    if not sent then
      if is_interruption(r) or type(r) ~= "table" then error(r, 0) end
      local err = transport_error(name, r, ctx, opts.repeatable)
      err.again = err.code ~= "unknown_outcome" and may_repeat(err, opts.repeatable)
      info.status = r.code
      return false, err
    end
    info.status, info.request_id = r.status, r.headers["render-request-id"]
    if r.status >= 200 and r.status < 300 then return true, r, t end
    local text = r.body
    if req.stream then
      text = r:read() or ""
      r:close()
    elseif req.output_file then
      local f = io.open(req.output_file, "rb")
      text = f and (f:read(64 * 1024) or "") or ""
      if f then f:close() end
    end
    local err = status_error(name, r, ctx, text)
    if not text:find("^%s*{") then err.body = text:sub(1, 64 * 1024) end
    err.again = may_repeat(err, opts.repeatable)
    return false, err
  end)
  if not ok then
    if span then span:close_with(resp) end
    error(resp, 0)
  end
  if span and not req.stream then
    span:close_with(nil)
    span = nil
  end
  return resp, tok, span
end

-- ---- data-plane requests in a journal (moonbox.durable) --------------------------------------

-- What a journal keeps of a connect token: never the token or its URI.
local function kept_token(tok)
  return { executionId = tok and tok.executionId }
end

local function read_whole(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- A recorded stream, read back: read_output gives the recorded events in order, then nil when
-- the recording read to the end; a recording cut short (its reader stopped) waits, as the live
-- stream did, until the reader is interrupted.
local function replayed_stream(a)
  local i, events = 0, a.ev or {}
  local r = { status = a.status, headers = a.h or {} }
  function r.read_output()
    i = i + 1
    local e = events[i]
    if e then return e[1], e[2] ~= json.null and e[2] or nil, durable.unbin(e[3]) end
    if not a.ended then core.cond():wait() end
    return nil
  end
  function r.read() return nil end
  function r.close() end
  return r
end

-- The live stream, recording what is read from it into its journal entry e of journal j (the
-- reader may be a task of another tree); the entry is done when the stream ended or was closed.
local function recording_stream(resp, e, a, j)
  local finished = false
  local function finish(ended)
    if finished then return end
    finished = true
    a.ended = ended
    j:finish(e, a)
  end
  local proxy = setmetatable({}, { __index = function(_, k)
    local v = resp[k]
    if type(v) == "function" then return function(_, ...) return v(resp, ...) end end
    return v
  end })
  function proxy.read_output()
    local event, stream, data = resp:read_output()
    if not event then
      finish(true)
      return nil
    end
    a.ev[#a.ev + 1] = { event, stream or json.null, durable.bin(data) }
    return event, stream, data
  end
  function proxy.close()
    finish(false)
    return resp:close()
  end
  return proxy
end

--- api.data(conn, op, mint, req, opts): see live_data above; with a journal active the request
-- is journaled, or answered from the journal (a stream with its recorded events, a download
-- with its recorded bytes written to req.output_file). opts.idempotent_run: a command that may
-- run again when a crash left it in flight (sb:exec's idempotent); otherwise such a command is
-- unknown_outcome on resume, and a repeatable request is sent again. [yields]
function M.data(conn, op, mint, req, opts)
  opts = opts or {}
  local j = durable.active()
  if not j then return live_data(conn, op, mint, req, opts) end
  -- an exec's env file (moonbox.render.exec) is all secrets: not even its digest is kept
  local env_file = type(opts.path) == "string" and opts.path:match("^/dev/%.moonbox/.*%.env$")
  local sent = env_file and "env file" or req.body and durable.digest(req.body)
    or req.body_file and ("file " .. durable.digest(read_whole(req.body_file) or "")) or "-"
  local sig = op .. " " .. mint.path .. encode_query(mint.query) .. " " .. durable.body_sig(mint.body) ..
    " -> " .. (req.method or "GET") .. " " .. tostring(opts.span_path or "") .. " " .. sent ..
    (req.stream and " stream" or "") .. (req.output_file and " download" or "")
  return durable.call({
    sig = sig, op = op, repeatable = opts.repeatable or opts.idempotent_run or false,
    meta = opts.sandbox_id and { sandbox_id = opts.sandbox_id } or nil, sandbox_id = opts.sandbox_id,
    encode = function(resp, tok)
      local a = { status = resp.status, h = kept_headers(resp.headers), tok = kept_token(tok) }
      if req.stream then
        a.ev = json.array {}
      elseif req.output_file then
        a.file = durable.bin(read_whole(req.output_file) or "")
      else
        a.body = durable.bin(resp.body)
      end
      return a
    end,
    on_done = function(e, resp, tok, span)
      if not req.stream then return resp, tok, span end
      e.st = "streaming" -- done once read (recording_stream)
      return recording_stream(resp, e, e.a, j), tok, span
    end,
    decode = function(a)
      local tok = a.tok or {}
      if req.stream then return replayed_stream(a), tok, nil end
      if req.output_file then
        local f = assert(io.open(req.output_file, "wb"))
        f:write(durable.unbin(a.file) or "")
        f:close()
        return { status = a.status, headers = a.h or {}, body = "" }, tok, nil
      end
      return { status = a.status, headers = a.h or {}, body = durable.unbin(a.body) }, tok, nil
    end,
  }, function() return live_data(conn, op, mint, req, opts) end)
end

--- api.span(op, method, path, ids, info) -> a span value: span:close_with(err) (or `<close>`)
-- writes the call's trace span (cat "api"); `info` (status, attempts, request_id, exec_id) is
-- read at that moment. Writes nothing when no trace is on; a second close is ignored.
function M.span(op, method, path, ids, info)
  local t0 = trace.now_us()
  local done = false
  local function close(_, err)
    if done or not trace.on then return end
    done = true
    local code = err ~= nil and (type(err) == "table" and err.code or "error") or nil
    trace.complete(op, "api", t0, { method = method, path = path, status = info.status,
      attempts = info.attempts, request_id = info.request_id, sandbox_id = ids and ids.sandbox_id,
      snapshot_id = ids and ids.snapshot_id, exec_id = info.exec_id, error = code })
  end
  local span = { close_with = function(self, err) close(self, err) end }
  return setmetatable(span, { __close = close })
end

--- api.shielded(fn, ...) -> interruption, ok, results... | interruption, false, err. Runs
-- fn(...) in a task of its own and waits until it has finished, even when the calling task is
-- cancelled (more than once) or its deadline passes meanwhile: a request that must not be
-- abandoned half-way (a create whose sandbox would be lost, a terminate, a kill) runs to its
-- end. Returns the caller's first interruption (nil when none came; the caller re-raises it
-- once it has dealt with the outcome), then fn's outcome as pcall gives it. fn's failure is
-- never reported as an unjoined task. [yields]
function M.shielded(fn, ...)
  local t = task.spawn(fn, ...)
  durable.inherit(t) -- its calls are the caller's, journaled in the caller's stream
  core.observe(t)
  local interruption
  while true do
    local ok, err = pcall(core.join, t)
    if ok then break end
    interruption = interruption or err
  end
  return interruption, core.result(t)
end

--- api.pages(conn, op, path, query, opts, fname) -> iterator over the items of a list endpoint,
-- every page, fetched as the iterator reaches them. opts (a recipe's, already checked against
-- the declaration of the public call fname by moonbox.schema): page_size (1..100, default 100:
-- the items each request asks for), limit (stop after that many items, never asking for more).
-- A page_size or limit out of range raises invalid_option naming fname before any request.
-- query: the endpoint's query besides cursor and limit. [yields]
function M.pages(conn, op, path, query, opts, fname)
  opts = opts or {}
  local size, limit = opts.page_size or 100, opts.limit
  if math.type(size) ~= "integer" or size < 1 or size > 100 then
    schema.invalid(fname, { option = "page_size", got = size,
      message = "option `page_size` must be an integer from 1 to 100, got " .. tostring(opts.page_size) })
  end
  if limit ~= nil and (math.type(limit) ~= "integer" or limit < 0) then
    schema.invalid(fname, { option = "limit", got = limit,
      message = "option `limit` must be a non-negative integer, got " .. tostring(limit) })
  end
  local cursor, page, i, done, given = nil, {}, 0, limit == 0, 0
  return function()
    i = i + 1
    if i > #page then
      if done then return nil end
      local want = limit and math.min(size, limit - given) or size
      local q = { cursor = cursor, limit = want }
      for k, v in pairs(query) do q[k] = v end
      page = M.call(conn, op, "GET", path, { query = q })
      i = 1
      if #page < want then done = true end
      if #page == 0 then return nil end
      cursor = page[#page].cursor
    end
    given = given + 1
    if limit and given >= limit then done = true end
    if limit and given > limit then return nil end
    return page[i]
  end
end

return M
