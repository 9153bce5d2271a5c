--- moonbox.schedule.ops.alerts — webhook alerts of `moonbox schedule`: a failed run, a pause
-- after N failures, a recovery (the first ok run after failures).
--
-- Each webhook URL has its own delivery task and its own bounded queue (QUEUE messages, or
-- --webhook-queue), so a
-- webhook that fails, answers slowly or never answers holds up only its own messages: the
-- daemon's subscriber only formats the message and appends it (never waits), and when a queue
-- is full the new message is dropped and counted. A delivery POSTs the JSON with a timeout per
-- attempt; a transport failure, a 408, 429 or 5xx answer is retried with exponential backoff
-- (1 s, 2 s, 4 s, ... up to 5 min; seconds of the schedule clock, so the test clock shortens
-- them), or after the server's Retry-After when it sent one (capped at 5 min, real seconds);
-- after ATTEMPTS attempts, or any other 4xx, the message is counted failed and logged.
--
-- Secrets: messages and log lines pass through moonbox.trace.redact (the API key and every env
-- value given to moonbox.render are registered there; the daemon keeps them for its whole life),
-- and a webhook URL is logged only as scheme://host[:port]/path — never its credentials or
-- query, where Slack-style tokens live.
local task = require "moonbox.task"
local http = require "moonbox.http"
local json = require "moonbox.json"
local core = require "moonbox.core"
local trace = require "moonbox.trace"
local clock_mod = require "moonbox.schedule.clock"

local M = {}
local Alerts = {}
Alerts.__index = Alerts

M.QUEUE = 100
M.ATTEMPTS = 6
M.MAX_WAIT = 300

--- alerts.safe_url(url) -> the URL without userinfo, query and fragment (for logs).
function M.safe_url(u)
  local scheme, rest = u:match("^(%a[%w+.-]*)://(.*)$")
  if not scheme then return "(a webhook URL)" end
  local authority, path = rest:match("^([^/?#]*)([^?#]*)")
  authority = authority:gsub("^.*@", "")
  return scheme .. "://" .. authority .. path
end

local MONTHS = { Jan = 1, Feb = 2, Mar = 3, Apr = 4, May = 5, Jun = 6, Jul = 7, Aug = 8, Sep = 9, Oct = 10,
  Nov = 11, Dec = 12 }

--- alerts.retry_after(value, now) -> seconds to wait, or nil: the Retry-After header's value,
-- delay-seconds or an HTTP date.
function M.retry_after(v, now)
  if not v then return nil end
  local n = tonumber(v)
  if n then return math.max(0, n) end
  -- IMF-fixdate, the form HTTP/1.1 requires: "Sun, 06 Nov 1994 08:49:37 GMT"
  local d, mon, y, hh, mm, ss = v:match("^%a+, (%d%d) (%a%a%a) (%d%d%d%d) (%d%d):(%d%d):(%d%d) GMT$")
  local m = mon and MONTHS[mon]
  if not m then return nil end
  y, m, d = tonumber(y), m, tonumber(d)
  -- days from the civil date (proleptic Gregorian), no os.time (that is local time)
  y = m <= 2 and y - 1 or y
  local era = y // 400
  local yoe = y - era * 400
  local doy = (153 * (m + (m > 2 and -3 or 9)) + 2) // 5 + d - 1
  local doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
  local days = era * 146097 + doe - 719468
  local at = days * 86400 + tonumber(hh) * 3600 + tonumber(mm) * 60 + tonumber(ss)
  return math.max(0, at - now)
end

--- alerts.new{daemon, clock, webhooks (daemon-wide), schedules, metrics, log, timeout, queue} -> Alerts,
-- subscribed to the daemon's events.
function M.new(o)
  local a = setmetatable({ clock = o.clock, log = o.log or function() end, metrics = o.metrics,
    timeout = o.timeout or 10, daemon_hooks = o.webhooks or {}, by_schedule = {}, sinks = {},
    recipe = o.recipe, host = o.host, queue_max = o.queue or M.QUEUE }, Alerts)
  for _, s in ipairs(o.schedules) do
    local list, seen = {}, {}
    for _, u in ipairs(a.daemon_hooks) do
      if not seen[u] then list[#list + 1], seen[u] = u, true end
    end
    for _, u in ipairs(s.webhooks or {}) do
      if not seen[u] then list[#list + 1], seen[u] = u, true end
    end
    a.by_schedule[s.name] = list
  end
  if o.daemon then o.daemon:subscribe(function(event, e) a:on_event(event, e) end) end
  return a
end

local function outcome_text(e)
  if e.outcome == "timeout" then return "timed out" end
  return e.outcome
end

--- alerts:message(kind, e) -> the JSON-able message of an event: "failure", "paused",
-- "recovered". Redacted.
function Alerts:message(kind, e)
  local run = e.run or {}
  local slot_text = e.slot and clock_mod.format(e.slot) or nil
  local text
  if kind == "failure" then
    text = string.format("moonbox: schedule %s: run %d %s (slot %s): %s", e.schedule, e.id, outcome_text(e),
      slot_text, e.message or "")
  elseif kind == "paused" then
    text = string.format("moonbox: schedule %s paused: %s", e.schedule, e.reason)
  else
    text = string.format("moonbox: schedule %s recovered: run %d ok after %d failure(s) (slot %s)",
      e.schedule, e.id, e.failures_before or 0, slot_text)
  end
  local err = e.error or run.error or {}
  local m = {
    text = text,
    event = kind,
    schedule = e.schedule,
    run_id = e.id or run.id,
    slot = slot_text,
    slot_unix = e.slot or run.slot,
    trigger = e.trigger or run.trigger,
    outcome = e.outcome or run.outcome,
    error = e.message or (kind == "paused" and run.message) or nil,
    error_code = err.code,
    error_op = err.op,
    sandbox_id = err.sandbox_id,
    request_id = err.request_id,
    sandboxes = e.sandboxes and json.array(e.sandboxes) or nil,
    ledger_run = e.ledger_run or run.ledger_run,
    trace_file = run.trace,
    consecutive_failures = e.failures,
    reason = e.reason,
    recipe = self.recipe,
    host = self.host,
    at = clock_mod.format(self.clock:now()),
  }
  return m
end

function Alerts:on_event(event, e)
  local kind
  if event == "finished" and e.run then
    if e.outcome == "failed" or e.outcome == "timeout" then
      kind = "failure"
    elseif e.outcome == "ok" and (e.failures_before or 0) > 0 then
      kind = "recovered"
    end
  elseif event == "paused" then
    kind = "paused"
    e.id = e.run and e.run.id
  end
  if not kind then return end
  local hooks = self.by_schedule[e.schedule]
  if not hooks or #hooks == 0 then return end
  local body = trace.redact(json.encode(self:message(kind, e)))
  for _, u in ipairs(hooks) do self:enqueue(u, body) end
end

function Alerts:enqueue(u, body)
  local sink = self.sinks[u]
  if not sink then
    sink = { url = u, safe = M.safe_url(u), queue = {}, wake = core.cond() }
    self.sinks[u] = sink
    sink.task = task.spawn(self.deliver_loop, self, sink)
  end
  local w = self.metrics and self.metrics.webhook
  if self.closing or #sink.queue >= self.queue_max then
    if w then w.dropped = w.dropped + 1 end
    self.log(string.format("alerts: %s: message dropped (%s)", sink.safe,
      self.closing and "the daemon is stopping" or ("the queue of " .. self.queue_max .. " is full")))
    return
  end
  sink.queue[#sink.queue + 1] = body
  if w then w.queued = w.queued + 1 end
  sink.wake:signal()
end

-- One attempt: true when delivered, else false, retryable, why, retry_after.
function Alerts:attempt(sink, body)
  local ok, r = pcall(http.request, { method = "POST", url = sink.url, body = body,
    headers = { ["Content-Type"] = "application/json", ["User-Agent"] = "moonbox/" .. core.version },
    timeout = self.timeout, connect_timeout = math.min(self.timeout, 10), fresh_connect = true })
  if not ok then
    if task.is_cancelled(r) then error(r, 0) end
    local code = type(r) == "table" and r.code or "error"
    return false, true, "transport failure (" .. tostring(code) .. ")"
  end
  if r.status >= 200 and r.status < 300 then return true end
  local again = r.status == 408 or r.status == 429 or r.status >= 500
  return false, again, "HTTP " .. r.status, M.retry_after(r.headers["retry-after"], core.time())
end

--- The body of sink's delivery task (one per webhook URL, spawned by enqueue): sends the
-- queued bodies in order, one at a time, each up to M.ATTEMPTS times while the failure is
-- retryable (transport failure, 408, 429, 5xx), waiting Retry-After (capped at M.MAX_WAIT) or
-- an exponential backoff between attempts; a message that still fails is logged (by sink.safe,
-- the URL without secrets) and dropped. Counts into metrics.webhook. Sleeps on sink.wake while
-- the queue is empty and returns once it is empty and the alerts are closing. Raises only a
-- cancellation (close cancels it after its grace). [yields]
function Alerts:deliver_loop(sink)
  local w = self.metrics and self.metrics.webhook or { queued = 0, delivered = 0, failed = 0,
    attempts_ok = 0, attempts_failed = 0, dropped = 0 }
  while true do
    while #sink.queue == 0 do
      if self.closing then return end
      sink.wake:wait()
    end
    local body = sink.queue[1]
    local done, why = false, nil
    for attempt = 1, M.ATTEMPTS do
      local ok, again, reason, after = self:attempt(sink, body)
      if ok then
        w.attempts_ok = w.attempts_ok + 1
        done = true
        break
      end
      w.attempts_failed = w.attempts_failed + 1
      why = reason
      if not again or attempt == M.ATTEMPTS then break end
      local wait
      if after then
        wait = math.min(after, M.MAX_WAIT)
      else
        wait = self.clock:real_seconds(math.min(2 ^ (attempt - 1), M.MAX_WAIT))
      end
      self.log(string.format("alerts: %s: attempt %d failed (%s); retrying in %.3gs", sink.safe, attempt,
        reason, wait))
      task.sleep(wait)
    end
    table.remove(sink.queue, 1)
    w.queued = math.max(0, w.queued - 1)
    if done then
      w.delivered = w.delivered + 1
    else
      w.failed = w.failed + 1
      self.log(string.format("alerts: %s: message not delivered: %s", sink.safe, why))
    end
  end
end

--- alerts:close(grace): stops taking messages, lets the queues drain for up to grace seconds
-- (real), then cancels the deliveries; what is left is counted dropped. [yields]
function Alerts:close(grace)
  self.closing = true
  local tasks = {}
  for _, sink in pairs(self.sinks) do
    sink.wake:signal()
    tasks[#tasks + 1] = sink
  end
  if #tasks == 0 then return end
  pcall(task.timeout, grace or 5, function()
    for _, sink in ipairs(tasks) do task.join(sink.task) end
  end)
  local w = self.metrics and self.metrics.webhook
  for _, sink in ipairs(tasks) do
    if task.result(sink.task) == nil then
      task.cancel(sink.task)
      pcall(task.join, sink.task)
    end
    if #sink.queue > 0 then
      if w then
        w.dropped = w.dropped + #sink.queue
        w.queued = math.max(0, w.queued - #sink.queue)
      end
      self.log(string.format("alerts: %s: %d message(s) dropped: the daemon stopped", sink.safe, #sink.queue))
      sink.queue = {}
    end
  end
end

return M
