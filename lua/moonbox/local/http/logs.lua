--- moonbox.local.http.logs — GET /v1/sandboxes/:id/logs: a sandbox's log and lifecycle events
-- as SSE, following until it ends (or not, with follow=false). An event is written the moment
-- the service records it (svc:emit wakes the followers), so a client waiting for a status
-- (render's wait_running) learns it at once. A follower with nothing to say sends a keep-alive
-- comment every KEEPALIVE seconds, as Render's streams do: libmicrohttpd notices a client that
-- left only when something is written to it, and the follower is then freed.
local json = require "moonbox.json"
local task = require "moonbox.task"
local ids = require "moonbox.ids"
local route = require "moonbox.local.http.route"

local M = {}
local fail = route.fail
local KEEPALIVE = 15

--- GET /v1/sandboxes/:id/logs?since=T&follow=false&execId=E -> 200 text/event-stream, answered
-- through res (returns nil): the sandbox's log and lifecycle events (since T, only exec E's
-- log lines when given), then, unless follow=false, every new one until the sandbox is
-- terminated or errored, with a keep-alive comment after KEEPALIVE quiet seconds. Raises, before
-- the stream starts, not_found (sandbox) and invalid (a since that is not RFC 3339); a client
-- that goes away ends it quietly. [yields] for as long as it follows.
function M.logs(backend, req, ctx, res)
  local rec = backend.svc:find_sandbox(req.captures.id)
  local since = req:query_param("since")
  local since_t = since and ids.parse_iso(since)
  if since and not since_t then fail("invalid", "since must be an RFC 3339 timestamp") end
  local follow = req:query_param("follow") ~= "false"
  local exec_id = req:query_param("execId")
  local w = res:stream(200, route.stream_headers(ctx, { ["Content-Type"] = "text/event-stream; charset=utf-8",
    ["Cache-Control"] = "no-cache", ["render-request-id"] = ctx.rid }))
  -- Answered: the journal says so now, not when the follower ends (which, for a client that
  -- went away, is only at the next event or keep-alive). A follower is not work in progress.
  ctx.entry.status = 200
  local cond = backend.svc:log_cond(rec.id)
  local seen = 0 -- events carry increasing numbers; the oldest may have been dropped meanwhile
  local ok = pcall(function()
    while true do
      local list = backend.svc:log_events(rec)
      local finished = false
      local first = 1
      while first <= #list and list[first].n <= seen do first = first + 1 end
      for i = first, #list do
        local ev = list[i]
        seen = ev.n
        local keep = (not since_t or ev.t >= since_t) and (ev.event ~= "log" or not exec_id
          or ev.data.execId == exec_id)
        if keep then w:sse(ev.event, json.encode(ev.data)) end
        if ev.event == "lifecycle" and (ev.data.type == "terminated" or ev.data.type == "errored") then
          finished = true
        end
      end
      if finished or not follow then break end
      local woke, err = pcall(task.timeout, KEEPALIVE, cond.wait, cond)
      if not woke then
        if not (type(err) == "table" and err.op == "task.timeout") then error(err, 0) end
        w:comment("keep-alive")
      end
    end
  end)
  if ok then w:close() end
  return nil
end

--- logs.install(api): registers the route above through api(method, pattern, handler).
function M.install(api)
  api("GET", "/v1/sandboxes/:id/logs", M.logs)
end

return M
