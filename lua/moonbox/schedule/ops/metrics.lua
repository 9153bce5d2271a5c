--- moonbox.schedule.ops.metrics — the numbers of a running `moonbox schedule`, and their
-- Prometheus text exposition (version 0.0.4) for `--listen`'s /metrics.
--
-- Counters start from the store's history (every record with a final outcome, counted once at
-- start), then count the daemon's "finished" events, so moonbox_schedule_runs_total agrees with
-- `moonbox runs` for everything this daemon and its predecessors recorded. Gauges that another
-- process may change (paused, failures, next fire: `--pause`, `--resume`) are read from the
-- store at each scrape, one row per schedule; when the store does not answer, the last values
-- seen are served and moonbox_schedule_store_up says 0. Process-wide numbers (API calls,
-- 429s, live sandboxes) come from moonbox.render. Nothing here yields.
local api = require "moonbox.render.api"
local render_events = require "moonbox.render.events"

local M = {}
local Metrics = {}
Metrics.__index = Metrics

-- Final outcomes a record can have; the last-outcome state set lists each.
M.OUTCOMES = { "ok", "failed", "timeout", "cancelled", "skipped", "interrupted" }
local FINAL = {}
for _, o in ipairs(M.OUTCOMES) do FINAL[o] = true end

-- Run duration buckets, seconds (schedule time): a second to a day.
M.BUCKETS = { 1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400 }

local function new_hist()
  local b = {}
  for i = 1, #M.BUCKETS do b[i] = 0 end
  return { buckets = b, sum = 0, count = 0 }
end

local function observe(h, v)
  for i, le in ipairs(M.BUCKETS) do
    if v <= le then h.buckets[i] = h.buckets[i] + 1 end
  end
  h.sum, h.count = h.sum + v, h.count + 1
end

--- metrics.new{schedules, store, daemon} -> Metrics, its counters loaded from the store's
-- history, subscribed to the daemon's events.
function M.new(o)
  local m = setmetatable({ store = o.store, schedules = o.schedules, per = {}, live = 0,
    webhook = { delivered = 0, failed = 0, dropped = 0, attempts_ok = 0, attempts_failed = 0, queued = 0 },
    loop_running = false, store_up = 1 }, Metrics)
  for _, s in ipairs(o.schedules) do
    m.per[s.name] = { runs = {}, hist = new_hist(), active = 0 }
    for _, oc in ipairs(M.OUTCOMES) do m.per[s.name].runs[oc] = 0 end
    for _, r in ipairs(o.store:history { schedule = s.name, limit = -1 }) do
      m:record(r.schedule, r.outcome, r.started_at, r.ended_at, true)
    end
  end
  if o.daemon then
    o.daemon:subscribe(function(event, e) m:on_event(event, e) end)
  end
  m.unobserve = render_events.observe(function(event)
    if event == "created" then
      m.live = m.live + 1
    elseif event == "terminated" then
      m.live = math.max(0, m.live - 1)
    end
  end)
  return m
end

-- One history record reached outcome; initial = from the history at start (the newest record of
-- a schedule comes first there, so it sets the last outcome; later events replace it).
function Metrics:record(name, outcome, started_at, ended_at, initial)
  local p = self.per[name]
  if not p or not FINAL[outcome] then return end
  p.runs[outcome] = p.runs[outcome] + 1
  -- an interrupted run "ended" when the next daemon noticed: its duration is the outage's
  if started_at and ended_at and outcome ~= "interrupted" then
    observe(p.hist, math.max(0, ended_at - started_at))
  end
  if outcome ~= "skipped" and (not initial or p.last_outcome == nil) then
    p.last_outcome, p.last_at = outcome, ended_at
  end
end

function Metrics:on_event(event, e)
  if event == "finished" then
    self:record(e.schedule, e.outcome, e.started_at, e.ended_at, false)
    local p = self.per[e.schedule]
    if p and e.run then p.active = math.max(0, p.active - 1) end
    if p and e.failures then p.failures = e.failures end
  elseif event == "started" then
    local p = self.per[e.schedule]
    if p then p.active = p.active + 1 end
  elseif event == "next_fire" then
    local p = self.per[e.schedule]
    if p then p.next_fire = e.at end
  elseif event == "loop" then
    self.loop_running = e.running
  end
end

function Metrics:close()
  if self.unobserve then self.unobserve() end
  self.unobserve = nil
end

--- metrics:refresh() -> true, or nil and the error: reads paused, failures and next fire of each
-- schedule from the store (the other gauges are kept in memory).
function Metrics:refresh()
  local ok, err = pcall(function()
    for _, s in ipairs(self.schedules) do
      local st = self.store:state(s.name)
      local p = self.per[s.name]
      if st then
        p.paused = st.paused == 1
        p.failures = st.failures or 0
        p.next_fire = st.next_fire or p.next_fire
      end
    end
  end)
  self.store_up = ok and 1 or 0
  if ok then return true end
  return nil, err
end

-- Label values: backslash, double quote and line feed escaped (the text format's rules).
local function lv(v)
  return (tostring(v):gsub("[\\\"\n]", { ["\\"] = "\\\\", ['"'] = '\\"', ["\n"] = "\\n" }))
end

local function num(v)
  if v == math.huge then return "+Inf" end
  if math.type(v) == "integer" then return tostring(v) end
  if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return string.format("%d", v) end
  return string.format("%.17g", v)
end

--- metrics:text() -> the exposition (text/plain; version=0.0.4). Call refresh() first.
-- Formats what refresh() read; raises nothing and does not yield.
function Metrics:text()
  local out = {}
  local function family(name, kind, help, samples)
    out[#out + 1] = "# HELP " .. name .. " " .. help
    out[#out + 1] = "# TYPE " .. name .. " " .. kind
    for _, smp in ipairs(samples) do out[#out + 1] = smp end
  end
  local function each(fn)
    local list = {}
    for _, s in ipairs(self.schedules) do
      for _, line in ipairs(fn(s.name, self.per[s.name]) or {}) do list[#list + 1] = line end
    end
    return list
  end
  -- A family of one sample per schedule: value(p) -> a number, or nil for no sample.
  local function per_schedule(name, kind, help, value)
    family(name, kind, help, each(function(n, p)
      local v = value(p)
      if v ~= nil then return { string.format('%s{schedule="%s"} %s', name, lv(n), num(v)) } end
    end))
  end
  -- A family of one sample per schedule and outcome: value(p, outcome) -> an integer, or nil.
  local function per_outcome(name, kind, help, value)
    family(name, kind, help, each(function(n, p)
      local l = {}
      for _, oc in ipairs(M.OUTCOMES) do
        local v = value(p, oc)
        if v ~= nil then
          l[#l + 1] = string.format('%s{schedule="%s",outcome="%s"} %d', name, lv(n), oc, v)
        end
      end
      return l
    end))
  end
  family("moonbox_schedule_up", "gauge", "1 while the fire loop runs.",
    { "moonbox_schedule_up " .. (self.loop_running and 1 or 0) })
  family("moonbox_schedule_store_up", "gauge", "1 when the state store answered the last query.",
    { "moonbox_schedule_store_up " .. self.store_up })
  per_schedule("moonbox_schedule_next_fire_timestamp_seconds", "gauge",
    "When the schedule fires next (slot plus jitter), seconds since the epoch; absent while unknown.",
    function(p) return not p.paused and p.next_fire or nil end)
  per_outcome("moonbox_schedule_last_outcome", "gauge",
    "1 for the outcome of the schedule's last finished run (skips excluded), 0 for the others.",
    function(p, oc)
      if p.last_outcome and oc ~= "skipped" then return p.last_outcome == oc and 1 or 0 end
    end)
  per_schedule("moonbox_schedule_last_run_timestamp_seconds", "gauge",
    "When the schedule's last finished run ended, seconds since the epoch.",
    function(p) return p.last_at end)
  per_outcome("moonbox_schedule_runs_total", "counter",
    "History records by final outcome (as `moonbox runs` lists them; skipped slots included).",
    function(p, oc) return p.runs[oc] end)
  family("moonbox_schedule_run_duration_seconds", "histogram",
    "Run durations from start to end, seconds of schedule time.",
    each(function(n, p)
      local l = {}
      for i, le in ipairs(M.BUCKETS) do
        l[#l + 1] = string.format('moonbox_schedule_run_duration_seconds_bucket{schedule="%s",le="%s"} %d',
          lv(n), num(le), p.hist.buckets[i])
      end
      l[#l + 1] = string.format('moonbox_schedule_run_duration_seconds_bucket{schedule="%s",le="+Inf"} %d',
        lv(n), p.hist.count)
      l[#l + 1] = string.format('moonbox_schedule_run_duration_seconds_sum{schedule="%s"} %s', lv(n),
        num(p.hist.sum))
      l[#l + 1] = string.format('moonbox_schedule_run_duration_seconds_count{schedule="%s"} %d', lv(n),
        p.hist.count)
      return l
    end))
  per_schedule("moonbox_schedule_consecutive_failures", "gauge",
    "Failed or timed-out runs since the last ok one (what pause_after_failures counts).",
    function(p) return p.failures or 0 end)
  per_schedule("moonbox_schedule_paused", "gauge", "1 while the schedule is paused.",
    function(p) return p.paused and 1 or 0 end)
  per_schedule("moonbox_schedule_runs_active", "gauge", "Runs of the schedule in progress now.",
    function(p) return p.active end)
  family("moonbox_sandboxes_live", "gauge",
    "Sandboxes this process created and has not terminated (kept ones included).",
    { "moonbox_sandboxes_live " .. self.live })
  local calls = {}
  local keys = {}
  for k in pairs(api.outcomes) do keys[#keys + 1] = k end
  table.sort(keys)
  if not api.outcomes.ok then calls[#calls + 1] = 'moonbox_api_calls_total{outcome="ok"} 0' end
  for _, k in ipairs(keys) do
    calls[#calls + 1] = string.format('moonbox_api_calls_total{outcome="%s"} %d', lv(k), api.outcomes[k])
  end
  family("moonbox_api_calls_total", "counter",
    "Render API calls this process finished, by outcome: ok, or the failed call's error code.", calls)
  family("moonbox_api_throttled_total", "counter",
    "429 (rate limited) answers this process got from the API, each attempt counted.",
    { "moonbox_api_throttled_total " .. api.throttled })
  local w = self.webhook
  family("moonbox_webhook_messages_total", "counter",
    "Alert messages by result: delivered, failed (every attempt failed), dropped (queue full or " ..
      "daemon stopping).",
    { 'moonbox_webhook_messages_total{result="delivered"} ' .. w.delivered,
      'moonbox_webhook_messages_total{result="failed"} ' .. w.failed,
      'moonbox_webhook_messages_total{result="dropped"} ' .. w.dropped })
  family("moonbox_webhook_attempts_total", "counter", "Webhook POSTs by result (ok: a 2xx answer).",
    { 'moonbox_webhook_attempts_total{result="ok"} ' .. w.attempts_ok,
      'moonbox_webhook_attempts_total{result="failed"} ' .. w.attempts_failed })
  family("moonbox_webhook_queue_length", "gauge", "Alert messages waiting for delivery.",
    { "moonbox_webhook_queue_length " .. w.queued })
  out[#out + 1] = ""
  return table.concat(out, "\n")
end

return M
