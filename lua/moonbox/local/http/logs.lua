--- moonbox.local.http.logs — GET /v1/sandboxes/:id/logs: a sandbox's log and lifecycle events
-- as SSE, following until it ends (or not, with follow=false).
local json = require "moonbox.json"
local ids = require "moonbox.ids"
local route = require "moonbox.local.http.route"

local M = {}
local fail = route.fail

function M.logs(b, req, ctx, res)
  local rec = b.svc:find_sandbox(req.captures.id)
  local since = req:query_param("since")
  local since_t = since and ids.parse_iso(since)
  if since and not since_t then fail("invalid", "since must be an RFC 3339 timestamp") end
  local follow = req:query_param("follow") ~= "false"
  local exec_id = req:query_param("execId")
  local w = res:stream(200, route.stream_headers(ctx, { ["Content-Type"] = "text/event-stream; charset=utf-8",
    ["Cache-Control"] = "no-cache", ["render-request-id"] = ctx.rid }))
  local cond = b.svc:log_cond(rec.id)
  local seen = 0 -- events carry increasing numbers; the oldest may have been dropped meanwhile
  local ok = pcall(function()
    while true do
      local list = b.svc:log_events(rec)
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
      cond:wait()
    end
  end)
  if ok then w:close() end
  return nil
end

function M.install(r)
  r("GET", "/v1/sandboxes/:id/logs", M.logs)
end

return M
