--- moonbox.local.http.runs — execs: minting run tokens, exec records, and the data-plane runs
-- the tokens open (POST /proxy/:id/runs/stream as SSE, /runs/sync as one JSON answer).
local task = require "moonbox.task"
local json = require "moonbox.json"
local route = require "moonbox.local.http.route"
local wire = require "moonbox.local.wire"
local public = require "moonbox.local.http.public"
local ids = require "moonbox.ids"

local M = {}
local fail, field = route.fail, route.field

-- Bytes of exec output held between the command's pipes and the client's connection. When the
-- client reads slowly, the stream's own buffer fills, then this queue, then the pipes: the
-- command waits for the client, and the backend holds at most this much for it.
local QUEUE_MAX = 256 * 1024

--- POST /v1/sandboxes/:id/runs/:op/token {command} -> 201 {executionId, token, uri, method,
-- expiresAt}: op is stream or sync; the exec record exists from now on and the token opens
-- /proxy/:id/runs/:op once. Raises invalid (op, command), not_found (sandbox, terminated),
-- conflict (errored), unavailable (a boot that does not finish). [yields] (it wakes a
-- suspended sandbox and waits out a boot).
function M.token(backend, req)
  route.owner_optional(backend, req)
  local op = req.captures.op
  if op ~= "stream" and op ~= "sync" then fail("invalid", "operation must be stream or sync, got "
    .. tostring(op)) end
  local base = public.base(backend, req)
  local rec = backend.svc:find_sandbox(req.captures.id)
  local body = route.body_json(req, false) or {}
  local command = field(body, "command", "string", "run token")
  local e, token, expires = backend.svc:mint_run(rec, op, command)
  return 201, {
    executionId = e.id, token = token, method = "POST", expiresAt = ids.iso(expires),
    uri = string.format("%s/proxy/%s/runs/%s", base, rec.id, op),
  }
end

--- GET /v1/sandboxes/:id/execs?cursor&limit -> 200 page of exec records, newest first. Raises
-- not_found, invalid (cursor). Does not yield.
function M.list(backend, req)
  route.owner_optional(backend, req)
  local rec = backend.svc:find_sandbox(req.captures.id)
  return 200, wire.page(req, "exe", "execution", function(after, limit)
    return backend.svc:list_execs(rec, after, limit)
  end, wire.exec)
end

--- GET /v1/sandboxes/:id/execs/:eid -> 200 execution. Raises not_found. Does not yield.
function M.get(backend, req)
  route.owner_optional(backend, req)
  return 200, wire.exec(backend.svc:find_exec(backend.svc:find_sandbox(req.captures.id), req.captures.eid))
end

--- POST /v1/sandboxes/:id/execs/:eid/status {exitCode} -> 200 the exec record: records a
-- client-reported exit code. Raises not_found, invalid (exitCode missing or not a 32-bit
-- integer). Does not yield.
function M.status(backend, req)
  route.owner_optional(backend, req)
  local e = backend.svc:find_exec(backend.svc:find_sandbox(req.captures.id), req.captures.eid)
  local body = route.body_json(req, true)
  local code = field(body, "exitCode", "integer", "exec status", -2147483648, 2147483647)
  if code == nil then fail("invalid", "exitCode is required") end
  backend.svc:finish_exec(e, code)
  local out = wire.exec(e)
  out.execId, out.id, out.userId = e.id, nil, nil
  return 200, out
end

--- POST /proxy/:id/runs/stream {command} (bearer: a stream run token) -> 200 text/event-stream,
-- answered through res (returns nil): output events {stream, data} (UTF-8 never cut inside a
-- character), keep-alive comments, then exit {exit_code}. The command belongs to the sandbox:
-- a client that goes away leaves it running; a slow one makes it wait (QUEUE_MAX). Raises,
-- before the stream starts, unauthorized / forbidden / not_found (the token) and internal when
-- the command cannot start; an injected cut ends the stream without exit. [yields] until the
-- command ends or the client leaves.
function M.stream(backend, req, ctx, res)
  local rec, info = backend.svc:check_token(route.bearer(req), req.captures.id, "runs/stream")
  local body = route.body_json(req, false) or {}
  local command = field(body, "command", "string", "run") or ""
  -- queue[head .. tail] waits to be sent; qbytes counts its output bytes. The run's readers
  -- fill it (and wait while it holds QUEUE_MAX), this task empties it onto the wire.
  local queue, head, tail, qbytes = {}, 1, 0, 0
  local run
  local function enqueue(item)
    tail = tail + 1
    queue[tail] = item
    run.cond:broadcast()
  end
  run = backend.svc:run(rec, info, command, function(stream, data)
    while qbytes > QUEUE_MAX do run.cond:wait() end
    qbytes = qbytes + #data
    enqueue({ stream = stream, data = data })
  end, req.intent) -- the client's structured command, on an in-memory request only (http.memory)
  local _, cut = backend.faults:decide(req.method, req.path, { cut = true })
  local w = res:stream(200, { ["Content-Type"] = "text/event-stream", ["Cache-Control"] = "no-cache",
    ["render-request-id"] = ctx.rid })
  -- An SSE comment at once: an HTTP/2 proxy in front (nginx) holds a streamed answer's headers
  -- until its first body byte, which for a silent command could be minutes away.
  w:write(": started\n\n")
  local keepalive = task.spawn(function()
    while true do
      task.sleep(backend.svc.limits.keepalive)
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
        run.cond:broadcast()
        w:sse_output(item.stream, item.data) -- w:sse("output", json.encode{stream, data}), in one C pass
      end
    end
  end
  local wok, code = pcall(function()
    while not run:output_ended() do
      send_all()
      if head > tail then run:wait_change() end
    end
    send_all()
    return run:exit_code()
  end)
  task.cancel(keepalive)
  run:close()
  if not wok then
    if task.is_cancelled(code) then error(code, 0) end
    return nil -- the client went away (or the engine lost the command); it goes on under the engine
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

--- POST /proxy/:id/runs/sync {command} (bearer: a sync run token) -> 200 {stdout, stderr,
-- exit_code[, truncated]} once the command ended. At most limits.sync_output_max bytes per
-- stream (1 MiB); truncated = true says more was dropped. Raises unauthorized / forbidden /
-- not_found (the token), internal when the command cannot start. [yields] until it ends.
function M.sync(backend, req)
  local rec, info = backend.svc:check_token(route.bearer(req), req.captures.id, "runs/sync")
  local body = route.body_json(req, false) or {}
  local command = field(body, "command", "string", "run") or ""
  local result = backend.svc:run_sync(rec, info, command, req.intent) -- req.intent: see M.stream
  local out = { stdout = json.utf8_clean(result.stdout), stderr = json.utf8_clean(result.stderr),
    exit_code = result.exit_code }
  if result.truncated then out.truncated = true end
  return 200, out
end

--- runs.install(api, data): registers the control-plane routes through api and the data-plane
-- ones (token-authenticated, with their scope) through data(method, pattern, handler, scope).
function M.install(api, data)
  api("POST", "/v1/sandboxes/:id/runs/:op/token", M.token)
  api("GET", "/v1/sandboxes/:id/execs", M.list)
  api("GET", "/v1/sandboxes/:id/execs/:eid", M.get)
  api("POST", "/v1/sandboxes/:id/execs/:eid/status", M.status)
  data("POST", "/proxy/:id/runs/stream", M.stream, "runs/stream")
  data("POST", "/proxy/:id/runs/sync", M.sync, "runs/sync")
end

return M
