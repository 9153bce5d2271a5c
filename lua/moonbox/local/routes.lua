--- moonbox.local.routes — every HTTP route of `moonbox local` (render-api.md §2, §12).
--
-- Each route is a function(b, req, ctx) returning status, body (a table encoded as JSON, a
-- string, or nil) and extra headers — or nothing when it answered itself (streams). A wrapper
-- around each one does what every request shares: journal entry, injected faults (latency,
-- error statuses, dropped responses), authentication, JSON errors, and a render-request-id.
local task = require "moonbox.task"
local core = require "moonbox.core"
local json = require "moonbox.json"
local ids = require "moonbox.local.ids"
local wire = require "moonbox.local.wire"
local loc = require "moonbox.local"

local fail = loc.fail
local M = {}

local function now() return core.time() end

-- ---- request plumbing --------------------------------------------------------------------------

local REDACTED = "<redacted>"

--- A copy of a decoded request body with secrets removed, for the journal: env values.
local function redact_body(body)
  if type(body) ~= "table" then return body end
  local out = {}
  for k, v in pairs(body) do
    if k == "env" and type(v) == "table" then
      local env = {}
      for name in pairs(v) do env[name] = REDACTED end
      out[k] = env
    else
      out[k] = v
    end
  end
  return out
end

local function journal(b, req)
  b.journal_seq = b.journal_seq + 1
  local headers = {}
  for _, h in ipairs({ "content-type", "accept", "content-encoding", "accept-encoding",
    "user-agent", "content-length" }) do
    headers[h] = req.headers[h]
  end
  if req.headers["authorization"] then
    headers.authorization = req.headers["authorization"]:match("^(%S+)") .. " " .. REDACTED
  end
  local entry = {
    seq = b.journal_seq, at = ids.iso(now()), t = now(), method = req.method, path = req.path,
    query = req.query, headers = headers,
  }
  if req.body_file then
    entry.body_bytes = req.body_size
  elseif req.body and req.body ~= "" then
    local v = json.decode(req.body)
    if type(v) == "table" then
      entry.body = redact_body(v)
      entry.body_json = json.encode(entry.body)
    else
      entry.body_text = #req.body <= 4096 and req.body or (req.body:sub(1, 4096) .. "...")
    end
  end
  local j = b.journal
  j[#j + 1] = entry
  if #j > b.limits.journal_max then table.remove(j, 1) end
  return entry
end

local function bearer(req)
  local h = req.headers["authorization"]
  return h and h:match("^[Bb]earer%s+(%S+)%s*$")
end

--- Constant-time comparison, so a wrong key's timing says nothing about the right one.
local function same_secret(a, b)
  if type(a) ~= "string" or type(b) ~= "string" or #a ~= #b then return false end
  local diff = 0
  for i = 1, #a do diff = diff | (a:byte(i) ~ b:byte(i)) end
  return diff == 0
end

--- The request's JSON body: nil when empty (if allowed), else a table. Raises 400.
local function body_json(req, required)
  local raw = req.body or ""
  if raw:match("^%s*$") then
    if required then fail(400, "a JSON request body is required") end
    return nil
  end
  local v, err = json.decode(raw)
  if v == nil then fail(400, "request body is not valid JSON: " .. err) end
  if type(v) ~= "table" or (#v > 0) then fail(400, "request body must be a JSON object") end
  return v
end

local function field(body, name, kind, where)
  local v = body[name]
  if v == nil or v == json.null then return nil end
  local ok
  if kind == "integer" then
    ok = math.type(v) == "integer" or (type(v) == "number" and v == math.floor(v))
    if ok then v = math.tointeger(v) end
  elseif kind == "object" then
    ok = type(v) == "table" and (next(v) == nil or #v == 0)
  elseif kind == "array" then
    ok = type(v) == "table" and (next(v) == nil or #v > 0)
  else
    ok = type(v) == kind
  end
  if not ok then fail(400, string.format("%s: field '%s' must be %s %s", where, name,
    kind == "integer" and "an" or "a", kind)) end
  return v
end

local function respond(res, status, body, headers)
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

--- Wraps a route: journal, faults, auth, errors. o.auth: "key" (API key), "none".
local function route(b, fn, o)
  o = o or {}
  return function(req, res)
    local entry = journal(b, req)
    local rid = "req-" .. ids.token():sub(1, 20)
    local latency, fault = b.faults:decide(req.method, req.path)
    if latency > 0 then task.sleep(latency / 1000) end
    if fault and fault.fault == "status" then
      local h = { ["render-request-id"] = rid }
      if fault.retry_after then
        h["Retry-After"] = tostring(fault.retry_after)
        h["RateLimit-Limit"], h["RateLimit-Remaining"], h["RateLimit-Reset"] = "400", "0",
          tostring(fault.retry_after)
      end
      entry.status, entry.fault = fault.status, "status"
      local msg = fault.status == 429 and "rate limit exceeded" or "injected fault"
      return respond(res, fault.status, { message = msg }, h)
    end
    if fault and fault.fault == "edge" then
      -- Render's edge firewall: an HTML page, none of Render's own headers.
      entry.status, entry.fault = 403, "edge"
      return res:send(403, "<!DOCTYPE html><html><head><title>Attention Required! | Cloudflare</title>" ..
        "</head><body>Sorry, you have been blocked</body></html>", { ["Content-Type"] = "text/html" })
    end
    local ctx = { rid = rid, entry = entry }
    local ok, status, body, headers = xpcall(function()
      if o.auth ~= "none" and not same_secret(bearer(req), b.api_key) then
        fail(401, "unauthorized: send Authorization: Bearer <RENDER_API_KEY>")
      end
      return fn(b, req, ctx, res)
    end, core.msgh)
    if not ok then
      local err = status
      if task.is_cancelled(err) then error(err, 0) end
      if wire.is_api_error(err) then
        status, body, headers = err.status, { message = err.message, code = err.code }, err.headers
      else
        b.log(string.format("%s %s failed: %s\n%s", req.method, req.path,
          tostring(err), core.traceback_of(err) or ""))
        status, body = 500, { message = "internal error: " .. tostring(err) }
      end
    end
    if status == nil then -- answered itself (a stream)
      entry.status = 200
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
    return respond(res, status, body, headers)
  end
end

-- ---- ownerId --------------------------------------------------------------------------------

local function check_owner(b, v)
  if v ~= b.workspace then fail(404, "workspace not found") end
end

--- ownerId as an optional query parameter: at most one value, and it must be ours.
local function owner_optional(b, req)
  local all = req:query_all("ownerId")
  if #all > 1 then fail(400, "ownerId accepts at most one value", "invalid_owner_id") end
  if all[1] then check_owner(b, all[1]) end
end

--- ownerId as a required query parameter with exactly one value (group and snapshot lists).
local function owner_exactly_one(b, req)
  local all = req:query_all("ownerId")
  if #all == 0 then fail(400, "ownerId is required", "invalid_owner_id") end
  if #all > 1 then fail(400, "ownerId accepts at most one value", "invalid_owner_id") end
  check_owner(b, all[1])
end

-- ---- groups ----------------------------------------------------------------------------------

local function new_group(b, name, is_default, limit)
  local t = ids.iso(now())
  local g = {
    id = ids.new("sbg"), ownerId = b.workspace, name = name, region = "oregon",
    isDefault = is_default, environmentId = nil, concurrencyLimit = limit or b.limits.concurrency_limit,
    createdAt = t, updatedAt = t,
  }
  b.st:save("group", g)
  b.st.groups[g.id] = g
  return g
end

--- The workspace's default group, created with the first sandbox.
local function default_group(b)
  for _, g in pairs(b.st.groups) do
    if g.isDefault then return g end
  end
  return new_group(b, "Default", true)
end

local function find_group(b, gid)
  if not ids.valid("sbg", gid) then
    fail(400, "invalid sandbox group id " .. tostring(gid), "invalid_sandbox_group_id")
  end
  local g = b.st.groups[gid]
  if not g or g._deleted then fail(404, "sandbox group not found") end
  return g
end

local function live_count(b, gid)
  local n = 0
  for _, s in pairs(b.st.sandboxes) do
    if s.sandboxGroupId == gid and loc.LIVE[s.status] then n = n + 1 end
  end
  return n
end

-- ---- sandboxes: control plane -----------------------------------------------------------------

local function find_sandbox(b, id)
  local s = b.st.sandboxes[id]
  if not s then fail(404, "sandbox not found") end
  return s
end

local function validate_network(body)
  local np = field(body, "networkPolicy", "object", "networkPolicy")
  if np == nil then return { default = "allow-all" } end
  local default = np.default
  if default == nil then default = np.type end -- SDK 1.5.0 examples spell it `type`
  if default == nil then default = "allow-all" end
  if default ~= "allow-all" and default ~= "deny-all" and default ~= "allow-list" then
    fail(400, "networkPolicy.default must be allow-all, deny-all or allow-list, got " .. tostring(default))
  end
  local domains = np.allowedDomains
  if default == "allow-list" then
    fail(400, "networkPolicy allow-list is not supported by moonbox local: it cannot yet restrict " ..
      "HTTP(S) egress to named domains, and it will not pretend to. Use deny-all or allow-all " ..
      "locally; allow-list works against Render's cloud")
  end
  if domains ~= nil and domains ~= json.null then
    fail(400, "networkPolicy.allowedDomains is only valid with default allow-list")
  end
  return { default = default }
end

local function validate_env(env)
  if env == nil then return {} end
  local count, size = 0, 0
  for k, v in pairs(env) do
    if type(k) ~= "string" or type(v) ~= "string" then
      fail(400, "env must map names to string values")
    end
    if not k:match("^[A-Za-z_][A-Za-z0-9_]*$") then
      fail(400, string.format("env: %q is not a valid variable name", k))
    end
    count = count + 1
    size = size + #k + #v
  end
  if count > 100 then fail(400, "env: at most 100 variables (got " .. count .. ")") end
  if size > 256 * 1024 then fail(400, "env: at most 256 KB of names and values in total") end
  return env
end

local SNAPSHOT_NAME_MAX = 64

local function valid_snapshot_name(name)
  return type(name) == "string" and #name >= 1 and utf8.len(name) and utf8.len(name) <= SNAPSHOT_NAME_MAX
    and name:sub(1, 4) ~= "snp-"
end

--- Resolves and checks the snapshot of a restore, in the order Render's fake does (§7.6).
local function restore_source(b, body, plan_given, group)
  local sid, sname = body.snapshotId, body.snapshotName
  if sid ~= nil and sname ~= nil then fail(400, "snapshotId and snapshotName are mutually exclusive") end
  if sid == nil and sname == nil then return nil end
  local snap
  if sname ~= nil then
    if not valid_snapshot_name(sname) then
      fail(400, "invalid snapshot name " .. json.encode(sname), "invalid_snapshot_name")
    end
    local best
    for _, s in pairs(b.st.snapshots) do
      if not s._deleted and s.name == sname and s.sandboxGroupId == group.id and s.status == "available"
        and (not best or s._seq > best._seq) then
        best = s
      end
    end
    if not best then fail(404, "no available snapshot named " .. sname, "snapshot_not_found") end
    snap = best
  else
    if type(sid) ~= "string" then fail(400, "snapshotId must be a string") end
    snap = b.st.snapshots[sid]
    if not snap or snap._deleted then fail(404, "snapshot " .. sid .. " not found", "snapshot_not_found") end
    if snap.sandboxGroupId ~= group.id then
      fail(409, "snapshot " .. sid .. " belongs to another sandbox group", "snapshot_not_available")
    end
    if snap.status ~= "available" then
      fail(409, "snapshot " .. sid .. " is " .. snap.status, "snapshot_not_available")
    end
  end
  if snap.kind == "runtime" and plan_given and plan_given ~= snap.plan then
    fail(409, string.format("runtime snapshot %s was captured on plan %s, not %s", snap.id, snap.plan,
      plan_given), "snapshot_plan_mismatch")
  end
  return snap
end

local function create_sandbox(b, req)
  local body = body_json(req, true)
  local owner = body.ownerId
  if owner == nil then fail(400, "ownerId is required", "invalid_owner_id") end
  if type(owner) ~= "string" then fail(400, "ownerId must be a string", "invalid_owner_id") end
  check_owner(b, owner)
  local where = "POST /sandboxes"
  local plan = field(body, "plan", "string", where)
  if plan and not loc.PLANS[plan] then
    fail(400, "unknown plan " .. json.encode(plan) .. " (use 1c-2g, 2c-4g, 4c-8g or 8c-16g)")
  end
  local timeout = field(body, "timeoutSeconds", "integer", where)
  if timeout and timeout < 0 then fail(400, "timeoutSeconds must be >= 0 (0 = no timeout)") end
  local idle = field(body, "idleTimeoutSeconds", "integer", where)
  if idle and idle ~= 0 and (idle < 300 or idle > 86400) then
    fail(400, "idleTimeoutSeconds must be 0 (off) or between 300 and 86400")
  end
  local region = field(body, "region", "string", where)
  if region and region ~= "oregon" then
    fail(400, "unknown region " .. json.encode(region) .. " (only oregon)")
  end
  local network = validate_network(body)
  local env = validate_env(field(body, "env", "object", where))
  local name = field(body, "name", "string", where)
  field(body, "snapshotId", "string", where)
  field(body, "snapshotName", "string", where)
  local gid = field(body, "sandboxGroupId", "string", where)
  local group = gid and find_group(b, gid) or default_group(b)
  local snap = restore_source(b, body, plan, group)
  if live_count(b, group.id) >= group.concurrencyLimit then
    fail(429, string.format("sandbox group %s is at its concurrency limit (%d)", group.id,
      group.concurrencyLimit), nil, { ["Retry-After"] = "1" })
  end
  local rec = {
    id = ids.new("sbx"), status = "creating",
    plan = plan or (snap and snap.plan) or loc.DEFAULTS.plan,
    networkPolicy = network, region = "oregon",
    timeoutSeconds = timeout or b.limits.timeout_seconds,
    idleTimeoutSeconds = idle or b.limits.idle_timeout_seconds,
    createdAt = ids.iso(now()), terminatedAt = nil,
    sandboxGroupId = group.id, name = name,
    _env = env, _lowers = snap and snap._layers or {}, _dev_tar = snap and snap._dev_tar,
    _snapshot = snap and snap.id,
  }
  b.st.sandboxes[rec.id] = rec
  b:set_status(rec, "creating")
  b:boot(rec)
  return 201, wire.sandbox(rec)
end

local function list_sandboxes(b, req)
  for _, o in ipairs(req:query_all("ownerId")) do check_owner(b, o) end
  local statuses = req:query_all("status")
  local want
  if #statuses > 0 then
    want = {}
    for _, s in ipairs(statuses) do
      for one in s:gmatch("[^,]+") do
        if not loc.SANDBOX_STATUSES[one] then fail(400, "invalid status " .. one, "invalid_status") end
        want[one] = true
      end
    end
  end
  local name = req:query_param("name")
  local gid = req:query_param("sandboxGroupId")
  local recs = b.st.sorted(b.st.sandboxes, function(s)
    if want then
      if not want[s.status] then return false end
    elseif s.status == "terminated" then
      return false
    end
    if name and s.name ~= name then return false end
    if gid and s.sandboxGroupId ~= gid then return false end
    return true
  end)
  return 200, wire.page(req, "sbx", "sandbox", recs, wire.sandbox, fail)
end

local function get_sandbox(b, req)
  owner_optional(b, req)
  return 200, wire.sandbox(find_sandbox(b, req.captures.id))
end

local function terminate_sandbox(b, req)
  owner_optional(b, req)
  b:terminate(find_sandbox(b, req.captures.id))
  return 204
end

local function suspend_sandbox(b, req)
  owner_optional(b, req)
  local rec = find_sandbox(b, req.captures.id)
  if rec.status == "suspended" or rec.status == "suspending" then return 202, wire.sandbox(rec) end
  if rec.status ~= "running" then
    fail(409, "sandbox " .. rec.id .. " is " .. rec.status .. ", not running", "sandbox_not_running")
  end
  b:set_status(rec, "suspending")
  task.spawn(function()
    local ok, err = pcall(b.engine.freeze, b.engine, rec.id)
    if rec.status ~= "suspending" then return end
    if ok then
      b:set_status(rec, "suspended")
    else
      b.log("suspending " .. rec.id .. ": " .. tostring(err))
      b:set_status(rec, "running")
    end
  end)
  return 202, wire.sandbox(rec)
end

-- ---- tokens and exec records ------------------------------------------------------------------

local function new_exec(b, rec, typ, operation, command)
  local e = {
    id = ids.new("exe"), sandboxId = rec.id, type = typ, operation = operation,
    command = command and (#command > 4096 and command:sub(1, 4096) or command) or nil,
    userId = b.user, startedAt = ids.iso(now()),
  }
  b.st.execs[e.id] = e
  b.st:save("exec", e)
  return e
end

local function mint(b, rec, exec, op, path)
  local token = ids.token()
  local expires = now() + b.limits.token_ttl
  b.tokens[token] = { sandbox = rec.id, op = op, path = path, exec = exec.id, expires = expires }
  return token, expires
end

local function run_token(b, req)
  owner_optional(b, req)
  local op = req.captures.op
  if op ~= "stream" and op ~= "sync" then
    fail(400, "operation must be stream or sync, got " .. tostring(op))
  end
  local rec = find_sandbox(b, req.captures.id)
  local body = body_json(req, false) or {}
  local command = field(body, "command", "string", "run token")
  if rec.status == "terminated" then fail(404, "sandbox " .. rec.id .. " is terminated") end
  b:ensure_running(rec)
  local e = new_exec(b, rec, "runs", op, command)
  local token, expires = mint(b, rec, e, "runs/" .. op, nil)
  return 201, {
    executionId = e.id, token = token, method = "POST", expiresAt = ids.iso(expires),
    uri = string.format("%s/proxy/%s/runs/%s", b.url, rec.id, op),
  }
end

local function file_token(b, req)
  owner_optional(b, req)
  local op = req.captures.op
  if op ~= "upload" and op ~= "download" then
    fail(400, "operation must be upload or download, got " .. tostring(op))
  end
  local rec = find_sandbox(b, req.captures.id)
  local path = req:query_param("path")
  local abs = wire.sandbox_path(path, fail)
  if rec.status == "terminated" then fail(404, "sandbox " .. rec.id .. " is terminated") end
  b:ensure_running(rec)
  local e = new_exec(b, rec, "files", op, path)
  local token, expires = mint(b, rec, e, "files/" .. op, abs)
  return 201, {
    executionId = e.id, token = token, method = op == "upload" and "PUT" or "GET",
    expiresAt = ids.iso(expires), uri = string.format("%s/proxy/%s/files/%s", b.url, rec.id, op),
  }
end

local function list_execs(b, req)
  owner_optional(b, req)
  local rec = find_sandbox(b, req.captures.id)
  local recs = b.st.sorted(b.st.execs, function(e) return e.sandboxId == rec.id end)
  return 200, wire.page(req, "exe", "execution", recs, wire.exec, fail)
end

local function find_exec(b, req)
  local rec = find_sandbox(b, req.captures.id)
  local e = b.st.execs[req.captures.eid]
  if not e or e.sandboxId ~= rec.id then fail(404, "execution not found") end
  return e
end

local function get_exec(b, req)
  owner_optional(b, req)
  return 200, wire.exec(find_exec(b, req))
end

local function exec_status(b, req)
  owner_optional(b, req)
  local e = find_exec(b, req)
  local body = body_json(req, true)
  local code = field(body, "exitCode", "integer", "exec status")
  if code == nil then fail(400, "exitCode is required") end
  e.exitCode = code
  e.stoppedAt = e.stoppedAt or ids.iso(now())
  b.st:save("exec", e)
  local out = wire.exec(e)
  out.execId, out.id, out.userId = e.id, nil, nil
  return 200, out
end

-- ---- data plane -------------------------------------------------------------------------------

--- Checks the connect token of a data-plane request; returns the sandbox and the token info.
local function check_token(b, req, op)
  local tok = bearer(req)
  local info = tok and b.tokens[tok]
  if not info then fail(401, "invalid or missing connect token") end
  if info.expires < now() then fail(401, "connect token expired; mint a new one") end
  if info.sandbox ~= req.captures.id or info.op ~= op then
    fail(403, "this connect token is for another sandbox or operation")
  end
  local rec = b.st.sandboxes[info.sandbox]
  if not rec or rec.status == "terminated" then fail(404, "sandbox is gone") end
  return rec, info
end

--- Splits s into the longest prefix of whole UTF-8 sequences and the (up to 3) trailing bytes
-- of a sequence that continues in the next chunk.
local function utf8_split(s)
  local n = #s
  for back = 1, math.min(3, n) do
    local c = s:byte(n - back + 1)
    if c >= 0xC0 then -- a lead byte: is its sequence complete?
      local need = c >= 0xF0 and 4 or c >= 0xE0 and 3 or 2
      if back < need then return s:sub(1, n - back), s:sub(n - back + 1) end
      return s, ""
    elseif c < 0x80 then
      return s, ""
    end
  end
  return s, ""
end

--- Reads one output stream of an exec into queue items {stream, data} until EOF.
local function pump(p, stream, push)
  local carry = ""
  while true do
    local chunk = p:read(stream)
    if not chunk then break end
    local whole
    whole, carry = utf8_split(carry .. chunk)
    if whole ~= "" then push(stream, whole) end
  end
  if carry ~= "" then push(stream, carry) end
end

local function run_stream(b, req, ctx, res)
  local rec, info = check_token(b, req, "runs/stream")
  local body = body_json(req, false) or {}
  local command = field(body, "command", "string", "run") or ""
  b:ensure_running(rec)
  b:activity(rec.id, 1)
  local ok, h = pcall(b.engine.exec, b.engine, rec.id, command)
  if not ok then
    b:activity(rec.id, -1)
    fail(500, "could not start the command: " .. tostring(type(h) == "table" and h.message or h))
  end
  local _, cut = b.faults:decide(req.method, req.path, { cut = true })
  local w = res:stream(200, { ["Content-Type"] = "text/event-stream", ["Cache-Control"] = "no-cache",
    ["render-request-id"] = ctx.rid })
  local queue, cond, done_streams = {}, core.cond(), 0
  local code, exited
  local function push(stream, data)
    b:emit(rec.id, "log", { stream = stream, data = data, execId = info.exec })
    queue[#queue + 1] = { stream = stream, data = data }
    cond:signal()
  end
  -- Helpers of this request: they only read. The command itself belongs to the engine and keeps
  -- running whatever happens to this stream (h:detach hands its output over to the engine).
  local helpers = {}
  for _, s in ipairs({ "stdout", "stderr" }) do
    helpers[#helpers + 1] = task.spawn(function()
      pump(h, s, push)
      done_streams = done_streams + 1
      cond:signal()
    end)
  end
  helpers[#helpers + 1] = task.spawn(function()
    code = h:wait()
    exited = true
    cond:signal()
  end)
  helpers[#helpers + 1] = task.spawn(function()
    while true do
      task.sleep(b.limits.keepalive)
      queue[#queue + 1] = { keepalive = true }
      cond:signal()
    end
  end)
  local function send_all()
    while #queue > 0 do
      local item = table.remove(queue, 1)
      if item.keepalive then
        w:comment("keep-alive")
      else
        w:sse("output", json.encode({ stream = item.stream, data = item.data }))
      end
    end
  end
  local function stop_helpers()
    for _, t in ipairs(helpers) do task.cancel(t) end
  end
  local wok, werr = pcall(function()
    -- Output ends at EOF of both pipes, or shortly after bash exits: a background process
    -- (`sleep 100 &`) may hold the pipes open long after the command itself is done.
    local grace_until
    while done_streams < 2 do
      send_all()
      if exited and not grace_until then grace_until = core.now() + 0.1 end
      if grace_until then
        local left = grace_until - core.now()
        if left <= 0 then break end
        pcall(task.timeout, left, cond.wait, cond)
      else
        cond:wait()
      end
    end
    send_all()
    while not exited do cond:wait() end
  end)
  stop_helpers()
  if not exited or done_streams < 2 then h:detach() end
  b:activity(rec.id, -1)
  if not wok then
    if task.is_cancelled(werr) then error(werr, 0) end
    return nil -- the client went away; the command goes on under the engine
  end
  if cut then
    ctx.entry.fault = "cut"
    w:close()
    return nil
  end
  pcall(w.sse, w, "exit", json.encode({ exit_code = code }))
  w:close()
  return nil
end

local function run_sync(b, req)
  local rec = check_token(b, req, "runs/sync")
  local body = body_json(req, false) or {}
  local command = field(body, "command", "string", "run") or ""
  b:ensure_running(rec)
  b:activity(rec.id, 1)
  local ok, r = pcall(b.engine.run, b.engine, rec.id, command)
  b:activity(rec.id, -1)
  if not ok then
    fail(500, "could not run the command: " .. tostring(type(r) == "table" and r.message or r))
  end
  b:emit(rec.id, "log", { stream = "stdout", data = r.stdout })
  return 200, { stdout = r.stdout, stderr = r.stderr, exit_code = r.code }
end

--- Refuses an archive any of whose members could land outside the extraction root: absolute
-- names, ".." components, links pointing outside, device/fifo members (before anything is
-- extracted, so nothing is written). Raises 400 unsafe_archive naming the member.
local function check_archive(path)
  local archive = require "moonbox.archive"
  local ok, members = pcall(archive.list, path)
  if not ok then
    fail(400, "the upload is not a readable (gzip'd) tar archive: " ..
      tostring(type(members) == "table" and members.message or members), "invalid_archive")
  end
  local function escapes(rel)
    local depth = 0
    for seg in rel:gmatch("[^/]+") do
      if seg == ".." then depth = depth - 1 elseif seg ~= "." then depth = depth + 1 end
      if depth < 0 then return true end
    end
    return false
  end
  for _, m in ipairs(members) do
    local name = m.name or ""
    local bad
    if name:sub(1, 1) == "/" then
      bad = "has an absolute name"
    elseif escapes(name) or name:match("^%.%.$") or name:match("^%.%./") or name:match("/%.%./")
      or name:match("/%.%.$") then
      bad = "has a '..' component"
    elseif m.type == "symlink" then
      local target = m.target or ""
      local dir = name:match("^(.*)/[^/]*$") or ""
      if target:sub(1, 1) == "/" or escapes((dir ~= "" and dir .. "/" or "") .. target) then
        bad = "is a symlink pointing outside the extraction root (" .. target .. ")"
      end
    elseif m.type == "hardlink" then
      local target = m.target or ""
      if target:sub(1, 1) == "/" or escapes(target) then
        bad = "is a hard link to a path outside the archive"
      end
    elseif m.type == "other" then
      bad = "is a device, fifo or socket"
    end
    if bad then
      fail(400, string.format("archive member %q %s; nothing was extracted", name, bad), "unsafe_archive")
    end
  end
end

local function upload(b, req)
  local rec, info = check_token(b, req, "files/upload")
  b:ensure_running(rec)
  local ctype = (req.headers["content-type"] or ""):match("^%s*([^;%s]+)") or ""
  local enc = req.headers["content-encoding"]
  local is_archive = ctype == "application/x-tar" or ctype == "application/gzip"
  if not is_archive and enc and enc ~= "identity" then
    fail(415, "Content-Encoding " .. enc .. " is only accepted for application/x-tar uploads")
  end
  if is_archive then check_archive(req.body_file) end
  b:activity(rec.id, 1)
  local ok, err = pcall(function()
    if is_archive then
      b.engine:tar_in(rec.id, info.path, req.body_file)
    else
      b.engine:write_file(rec.id, info.path, req.body_file, { mode = tonumber("600", 8) })
    end
  end)
  b:activity(rec.id, -1)
  if not ok then
    if wire.is_api_error(err) then error(err, 0) end
    local code = type(err) == "table" and err.code
    if code == "is_directory" then fail(409, "path is a directory") end
    fail(400, "upload failed: " .. tostring(type(err) == "table" and err.message or err))
  end
  return 204
end

local function download(b, req, ctx, res)
  local rec, info = check_token(b, req, "files/download")
  b:ensure_running(rec)
  local st = b.engine:stat(rec.id, info.path, { follow = true })
  if not st then fail(404, "no file or directory at path", "file_not_found") end
  b:activity(rec.id, 1)
  local p, headers
  if st.type == "directory" then
    p = b.engine:tar_out(rec.id, info.path)
    headers = { ["Content-Type"] = "application/x-tar", ["Content-Encoding"] = "gzip" }
  else
    p = b.engine:read_file(rec.id, info.path)
    local base = info.path:match("([^/]+)$") or "download"
    headers = { ["Content-Type"] = "application/octet-stream",
      ["Content-Disposition"] = string.format('attachment; filename="%s"', base:gsub('["\\]', "_")) }
  end
  headers["render-request-id"] = ctx.rid
  local w = res:stream(200, headers)
  local ok, err = pcall(function()
    while true do
      local chunk = p:read("stdout")
      if not chunk then break end
      w:write(chunk)
    end
  end)
  if not ok then p:kill("KILL") end
  p:wait()
  b:activity(rec.id, -1)
  w:close()
  if not ok and task.is_cancelled(err) then error(err, 0) end
  return nil
end

local function files_list(b, req)
  local rec = find_sandbox(b, req.captures.id)
  local path = req:query_param("path")
  local abs = wire.sandbox_path(path, fail)
  local depth = math.tointeger(tonumber(req:query_param("depth") or "1"))
  if not depth or depth < 0 or depth > 16 then fail(400, "depth must be an integer between 0 and 16") end
  if rec.status ~= "running" then
    fail(409, "sandbox " .. rec.id .. " is " .. rec.status .. ", not running", "sandbox_not_running")
  end
  local entries = b.engine:list(rec.id, abs, depth)
  if not entries then fail(404, "no file or directory at path", "file_not_found") end
  local out = json.array()
  for _, e in ipairs(entries) do
    out[#out + 1] = { name = e.name, type = e.type, size = e.size or 0,
      modifiedAt = ids.iso(e.modifiedAt or e.mtime or now()), target = e.target }
  end
  return 200, { path = abs, entries = out }
end

-- ---- logs -----------------------------------------------------------------------------------

local function logs(b, req, ctx, res)
  local rec = find_sandbox(b, req.captures.id)
  local since = req:query_param("since")
  local since_t = since and ids.parse_iso(since)
  if since and not since_t then fail(400, "since must be an RFC 3339 timestamp") end
  local follow = req:query_param("follow") ~= "false"
  local exec_id = req:query_param("execId")
  local w = res:stream(200, { ["Content-Type"] = "text/event-stream; charset=utf-8",
    ["Cache-Control"] = "no-cache", ["render-request-id"] = ctx.rid })
  local cond = b.log_conds[rec.id] or core.cond()
  b.log_conds[rec.id] = cond
  local seen = 0 -- events carry increasing numbers; the oldest may have been dropped meanwhile
  local ok = pcall(function()
    while true do
      local list = b.logs[rec.id] or {}
      local finished = false
      local first = 1
      while first <= #list and list[first].n <= seen do first = first + 1 end
      for i = first, #list do
        local ev = list[i]
        seen = ev.n
        local keep = (not since_t or ev.t >= since_t) and
          (ev.event ~= "log" or not exec_id or ev.data.execId == exec_id)
        if keep then w:sse(ev.event, json.encode(ev.data)) end
        if ev.event == "lifecycle" and (ev.data.type == "terminated" or ev.data.type == "errored") then
          finished = true
        end
      end
      if finished or not follow then break end
      cond:wait()
    end
  end)
  if ok then w:close() end
  return nil
end

-- ---- snapshots -------------------------------------------------------------------------------

local function create_snapshot(b, req)
  owner_optional(b, req)
  local rec = find_sandbox(b, req.captures.id)
  local body = body_json(req, false) or {}
  local kind = field(body, "kind", "string", "snapshot") or "filesystem"
  if kind ~= "filesystem" and kind ~= "runtime" then
    fail(400, "kind must be filesystem or runtime, got " .. json.encode(kind))
  end
  local name = body.name
  if name ~= nil and name ~= json.null and not valid_snapshot_name(name) then
    fail(400, "snapshot names are 1 to 64 characters and do not start with snp-", "invalid_snapshot_name")
  end
  if name == json.null then name = nil end
  local t = now()
  local expires = t + b.limits.snapshot_lifetime
  if body.expiresAt ~= nil and body.expiresAt ~= json.null then
    expires = ids.parse_iso(body.expiresAt)
    if not expires then fail(400, "expiresAt must be an RFC 3339 timestamp") end
    if expires <= t then fail(400, "expiresAt must be in the future") end
  end
  if rec.status ~= "running" then
    fail(409, "sandbox is " .. rec.status, "sandbox_not_running")
  end
  local snap = {
    id = ids.new("snp"), sandboxGroupId = rec.sandboxGroupId, sourceSandboxId = rec.id,
    kind = kind, status = "creating", plan = rec.plan, requestedAt = ids.iso(t),
    expiresAt = ids.iso(expires), name = name, capturedAt = nil, sizeBytes = nil, error = nil,
  }
  b.st.snapshots[snap.id] = snap
  b.st:save("snapshot", snap)
  b:activity(rec.id, 1)
  local r = b:rt(rec.id)
  r.capture_lock = r.capture_lock or task.semaphore(1)
  local _, capture_fault = b.faults:decide(req.method, req.path, { capture = true })
  task.spawn(function()
    local layer = b.state_dir .. "/layers/" .. snap.id
    if capture_fault then
      task.sleep(0.05)
      b:activity(rec.id, -1)
      snap.status, snap.error = "failed", "injected capture failure (disk full)"
      b.st:save("snapshot", snap)
      return
    end
    -- Captures of one sandbox take turns: each freezes it, and a thaw by one must not land in
    -- the middle of another's copy.
    local ok, result = pcall(r.capture_lock.with, r.capture_lock, b.engine.capture, b.engine, rec.id,
      layer, { kind = kind })
    if not ok then b.log("snapshot " .. snap.id .. " of " .. rec.id .. " failed: " .. tostring(result)) end
    b:activity(rec.id, -1)
    if ok then
      snap.status, snap.capturedAt = "available", ids.iso(now())
      snap.sizeBytes = type(result) == "table" and result.size or result
      snap._layers = { layer, table.unpack(rec._lowers or {}) }
      if type(result) == "table" and result.dev_tar then snap._dev_tar = result.dev_tar end
    else
      snap.status = "failed"
      snap.error = type(result) == "table" and result.message or tostring(result)
    end
    b.st:save("snapshot", snap)
    if snap.status == "failed" then b:gc_layers() end
  end)
  return 202, wire.snapshot(snap)
end

local function find_snapshot(b, req)
  local g = find_group(b, req.captures.gid)
  local sid = req.captures.sid
  if not ids.valid("snp", sid) then fail(400, "invalid snapshot id " .. sid, "invalid_snapshot_id") end
  local snap = b.st.snapshots[sid]
  if not snap or snap.sandboxGroupId ~= g.id then fail(404, "snapshot not found", "snapshot_not_found") end
  return snap
end

local function get_snapshot(b, req)
  owner_optional(b, req)
  local snap = find_snapshot(b, req)
  if snap._deleted then fail(404, "snapshot not found", "snapshot_not_found") end
  return 200, wire.snapshot(snap)
end

local function list_snapshots(b, req)
  owner_exactly_one(b, req)
  local g = find_group(b, req.captures.gid)
  local want
  local statuses = req:query_all("status")
  if #statuses > 0 then
    want = {}
    for _, s in ipairs(statuses) do
      for one in s:gmatch("[^,]+") do
        if not loc.SNAPSHOT_STATUSES[one] then fail(400, "invalid status " .. one, "invalid_status") end
        want[one] = true
      end
    end
  end
  local recs = b.st.sorted(b.st.snapshots, function(s)
    return s.sandboxGroupId == g.id and not s._deleted and (not want or want[s.status])
  end)
  return 200, wire.page(req, "snp", "snapshot", recs, wire.snapshot, fail)
end

local function delete_snapshot(b, req)
  owner_optional(b, req)
  local snap = find_snapshot(b, req)
  if snap.status == "creating" then fail(409, "snapshot is still being captured", "snapshot_creating") end
  if not snap._deleted then
    snap._deleted = true
    b.st:save("snapshot", snap)
    b:gc_layers()
  end
  return 204
end

-- ---- groups ------------------------------------------------------------------------------------

local function list_groups(b, req)
  owner_exactly_one(b, req)
  local recs = b.st.sorted(b.st.groups, function(g) return not g._deleted end)
  return 200, wire.page(req, "sbg", "sandboxGroup", recs, wire.group, fail)
end

local function create_group(b, req)
  local body = body_json(req, true)
  local owner = body.ownerId or req:query_param("ownerId")
  if owner == nil then fail(400, "ownerId is required", "invalid_owner_id") end
  check_owner(b, owner)
  local name = field(body, "name", "string", "POST /sandbox-groups")
  if not name or name == "" then fail(400, "name is required") end
  local region = field(body, "region", "string", "POST /sandbox-groups")
  if region and region ~= "oregon" then fail(400, "unknown region " .. region) end
  local limit = field(body, "concurrencyLimit", "integer", "POST /sandbox-groups")
  if limit and (limit < 1 or limit > 1000) then fail(400, "concurrencyLimit must be 1..1000") end
  local n = 0
  for _, g in pairs(b.st.groups) do if not g._deleted then n = n + 1 end end
  if n >= 10 then fail(409, "a workspace has at most 10 sandbox groups") end
  local is_default = n == 0
  return 201, wire.group(new_group(b, name, is_default, limit))
end

local function delete_group(b, req)
  owner_optional(b, req)
  local g = find_group(b, req.captures.gid)
  if live_count(b, g.id) > 0 then fail(409, "sandbox group still has sandboxes that are not terminated") end
  if g.isDefault then fail(409, "the default sandbox group cannot be deleted") end
  g._deleted = true
  b.st:save("group", g)
  return 204
end

-- ---- control endpoint -----------------------------------------------------------------------

local function get_faults(b) return 200, b.faults:describe() end

local function put_faults(b, req)
  local raw = req.body or ""
  local spec, seed = raw, nil
  local v = json.decode(raw)
  if type(v) == "table" and (v.rules ~= nil or v.seed ~= nil) then
    spec, seed = v.rules or {}, v.seed
  end
  local ok, err = pcall(b.faults.set, b.faults, spec, seed)
  if not ok then fail(400, tostring(err)) end
  return 200, b.faults:describe()
end

local function clear_faults(b)
  b.faults:set({})
  return 204
end

local function get_journal(b, req)
  local since = tonumber(req:query_param("since") or "0") or 0
  local out = json.array()
  for _, e in ipairs(b.journal) do
    if e.seq > since then out[#out + 1] = e end
  end
  return 200, out
end

local function clear_journal(b)
  b.journal = {}
  return 204
end

local function health(b)
  return 200, { ok = true, workspace = b.workspace, version = require("moonbox.core").version }
end

-- ---- installing ------------------------------------------------------------------------------

--- routes.install(b): adds every route to b.srv.
function M.install(b)
  local srv = b.srv
  local function r(method, pattern, fn, o)
    srv:route(method, pattern, route(b, fn, o), o and o.http)
  end
  r("POST", "/v1/sandboxes", create_sandbox)
  r("GET", "/v1/sandboxes", list_sandboxes)
  r("GET", "/v1/sandboxes/:id", get_sandbox)
  r("POST", "/v1/sandboxes/:id/terminate", terminate_sandbox)
  r("POST", "/v1/sandboxes/:id/suspend", suspend_sandbox)
  r("POST", "/v1/sandboxes/:id/runs/:op/token", run_token)
  r("GET", "/v1/sandboxes/:id/execs", list_execs)
  r("GET", "/v1/sandboxes/:id/execs/:eid", get_exec)
  r("POST", "/v1/sandboxes/:id/execs/:eid/status", exec_status)
  r("GET", "/v1/sandboxes/:id/logs", logs)
  r("POST", "/v1/sandboxes/:id/files/:op/token", file_token)
  r("GET", "/v1/sandboxes/:id/files/list", files_list)
  r("POST", "/v1/sandboxes/:id/snapshots", create_snapshot)
  r("GET", "/v1/sandbox-groups", list_groups)
  r("POST", "/v1/sandbox-groups", create_group)
  r("DELETE", "/v1/sandbox-groups/:gid", delete_group)
  r("GET", "/v1/sandbox-groups/:gid/snapshots", list_snapshots)
  r("GET", "/v1/sandbox-groups/:gid/snapshots/:sid", get_snapshot)
  r("DELETE", "/v1/sandbox-groups/:gid/snapshots/:sid", delete_snapshot)
  -- data plane: authenticated by connect tokens, not the API key
  r("POST", "/proxy/:id/runs/stream", run_stream, { auth = "none" })
  r("POST", "/proxy/:id/runs/sync", run_sync, { auth = "none" })
  r("PUT", "/proxy/:id/files/upload", upload,
    { auth = "none", http = { body = "file", max_body = b.limits.max_upload } })
  r("GET", "/proxy/:id/files/download", download, { auth = "none" })
  -- control endpoint (outside /v1)
  r("GET", "/_moonbox/faults", get_faults)
  r("PUT", "/_moonbox/faults", put_faults)
  r("DELETE", "/_moonbox/faults", clear_faults)
  r("GET", "/_moonbox/journal", get_journal)
  r("DELETE", "/_moonbox/journal", clear_journal)
  r("GET", "/_moonbox/health", health)
end

return M
