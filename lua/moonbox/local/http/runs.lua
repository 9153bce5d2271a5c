--- moonbox.local.http.runs — execs: minting run tokens, exec records, and the data-plane runs
-- the tokens open (POST /proxy/:id/runs/stream as SSE, /runs/sync as one JSON answer).
local task = require "moonbox.task"
local core = require "moonbox.core"
local json = require "moonbox.json"
local utf8_cut = require("moonbox.strings").utf8_cut
local route = require "moonbox.local.http.route"
local wire = require "moonbox.local.wire"

local M = {}
local fail, field = route.fail, route.field

-- Bytes of exec output held between the command's pipes and the client's connection. When the
-- client reads slowly, the stream's own buffer fills, then this queue, then the pipes: the
-- command waits for the client, and the backend holds at most this much for it.
local QUEUE_MAX = 256 * 1024

--- POST /v1/sandboxes/:id/runs/:op/token -> 201 {executionId, token, uri, method, expiresAt}.
function M.token(b, req)
  route.owner_optional(b, req)
  local op = req.captures.op
  if op ~= "stream" and op ~= "sync" then fail("invalid", "operation must be stream or sync, got "
    .. tostring(op)) end
  local base = require("moonbox.local.http.public").base(b, req)
  local rec = b.svc:find_sandbox(req.captures.id)
  local body = route.body_json(req, false) or {}
  local command = field(body, "command", "string", "run token")
  local e, token, expires = b.svc:mint_run(rec, op, command)
  return 201, {
    executionId = e.id, token = token, method = "POST", expiresAt = require("moonbox.ids").iso(expires),
    uri = string.format("%s/proxy/%s/runs/%s", base, rec.id, op),
  }
end

--- GET /v1/sandboxes/:id/execs -> 200 page.
function M.list(b, req)
  route.owner_optional(b, req)
  local rec = b.svc:find_sandbox(req.captures.id)
  return 200, wire.page(req, "exe", "execution", function(after, limit)
    return b.svc:list_execs(rec, after, limit)
  end, wire.exec)
end

--- GET /v1/sandboxes/:id/execs/:eid -> 200 execution.
function M.get(b, req)
  route.owner_optional(b, req)
  return 200, wire.exec(b.svc:find_exec(b.svc:find_sandbox(req.captures.id), req.captures.eid))
end

--- POST /v1/sandboxes/:id/execs/:eid/status -> 200 (records a client-reported exit code).
function M.status(b, req)
  route.owner_optional(b, req)
  local e = b.svc:find_exec(b.svc:find_sandbox(req.captures.id), req.captures.eid)
  local body = route.body_json(req, true)
  local code = field(body, "exitCode", "integer", "exec status", -2147483648, 2147483647)
  if code == nil then fail("invalid", "exitCode is required") end
  b.svc:finish_exec(e, code)
  local out = wire.exec(e)
  out.execId, out.id, out.userId = e.id, nil, nil
  return 200, out
end

-- Splits s into the longest prefix of whole UTF-8 sequences and the (up to 3) trailing bytes of
-- a sequence that continues in the next chunk (moonbox.strings.utf8_cut, the one boundary rule).
local function utf8_split(s)
  local n = utf8_cut(s)
  return s:sub(1, n), s:sub(n + 1)
end

--- POST /proxy/:id/runs/stream -> 200 text/event-stream: output events, then exit (or error).
-- The command belongs to the sandbox: a client that goes away leaves it running.
function M.stream(b, req, ctx, res)
  local rec, info = b.svc:check_token(route.bearer(req), req.captures.id, "runs/stream")
  local body = route.body_json(req, false) or {}
  local command = field(body, "command", "string", "run") or ""
  local h = b.svc:start_run(rec, command)
  local _, cut = b.faults:decide(req.method, req.path, { cut = true })
  local w = res:stream(200, { ["Content-Type"] = "text/event-stream", ["Cache-Control"] = "no-cache",
    ["render-request-id"] = ctx.rid })
  -- An SSE comment at once: an HTTP/2 proxy in front (nginx) holds a streamed answer's headers
  -- until its first body byte, which for a silent command could be minutes away.
  w:write(": started\n\n")
  -- queue[head .. tail] waits to be sent; qbytes counts its output bytes
  local queue, head, tail, qbytes, cond, done_streams = {}, 1, 0, 0, core.cond(), 0
  local code, exited
  local function enqueue(item)
    tail = tail + 1
    queue[tail] = item
    cond:broadcast()
  end
  local function push(stream, data)
    b.svc:emit(rec.id, "log", { stream = stream, data = data, execId = info.exec })
    qbytes = qbytes + #data
    enqueue({ stream = stream, data = data })
  end
  local helpers = {}
  for _, s in ipairs({ "stdout", "stderr" }) do
    helpers[#helpers + 1] = task.spawn(function()
      local carry = ""
      while true do
        while qbytes > QUEUE_MAX do cond:wait() end
        local chunk = h:read(s)
        if not chunk then break end
        local whole
        whole, carry = utf8_split(carry .. chunk)
        if whole ~= "" then push(s, whole) end
      end
      if carry ~= "" then push(s, carry) end
      done_streams = done_streams + 1
      cond:broadcast()
    end)
  end
  helpers[#helpers + 1] = task.spawn(function()
    code = h:wait()
    exited = true
    cond:broadcast()
  end)
  helpers[#helpers + 1] = task.spawn(function()
    while true do
      task.sleep(b.svc.limits.keepalive)
      enqueue({ keepalive = true })
    end
  end)
  local function send_all()
    while head <= tail do
      local item = queue[head]
      queue[head] = nil
      head = head + 1
      if item.keepalive then
        w:comment("keep-alive")
      else
        qbytes = qbytes - #item.data
        cond:broadcast()
        w:sse_output(item.stream, item.data) -- w:sse("output", json.encode{stream, data}), in one C pass
      end
    end
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
      elseif head > tail then
        cond:wait()
      end
    end
    send_all()
    while not exited do cond:wait() end
  end)
  for _, t in ipairs(helpers) do task.cancel(t) end
  if not exited or done_streams < 2 then h:detach() end
  b.svc:end_run(rec)
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

--- POST /proxy/:id/runs/sync -> 200 {stdout, stderr, exit_code[, truncated]}. At most
-- limits.sync_output_max bytes per stream (1 MiB); truncated = true says more was dropped.
function M.sync(b, req)
  local rec, info = b.svc:check_token(route.bearer(req), req.captures.id, "runs/sync")
  local body = route.body_json(req, false) or {}
  local command = field(body, "command", "string", "run") or ""
  local r = b.svc:run_sync(rec, info, command)
  local out = { stdout = json.utf8_clean(r.stdout), stderr = json.utf8_clean(r.stderr),
    exit_code = r.exit_code }
  if r.truncated then out.truncated = true end
  return 200, out
end

function M.install(r, data)
  r("POST", "/v1/sandboxes/:id/runs/:op/token", M.token)
  r("GET", "/v1/sandboxes/:id/execs", M.list)
  r("GET", "/v1/sandboxes/:id/execs/:eid", M.get)
  r("POST", "/v1/sandboxes/:id/execs/:eid/status", M.status)
  data("POST", "/proxy/:id/runs/stream", M.stream, "runs/stream")
  data("POST", "/proxy/:id/runs/sync", M.sync, "runs/sync")
end

return M
