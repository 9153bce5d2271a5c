--- moonbox.schedule.ops — what makes a running `moonbox schedule` operable: the listener
-- (--listen: /healthz, /metrics, the status page at / and its small JSON API), webhook alerts
-- (--webhook and the schedules' `webhooks` option), per-run traces (--trace-dir) and the
-- control token (--control-token-file or MOONBOX_CONTROL_TOKEN) for the page's buttons.
--
-- It watches the daemon only through daemon:subscribe (events) and reads the store only through
-- its functions (state, history, ping; the ledger for what a run holds); it writes nothing but
-- what a button asks for (store:set_paused, daemon:request_trigger). metrics, alerts, traces and
-- the page live in the files next to this one.
local httpd = require "moonbox.httpd"
local json = require "moonbox.json"
local trace = require "moonbox.trace"
local ledger_mod = require "moonbox.ledger"
local clock_mod = require "moonbox.schedule.clock"
local page = require "moonbox.schedule.ops.page"
local alerts = require "moonbox.schedule.ops.alerts"
local metrics = require "moonbox.schedule.ops.metrics"
local traces = require "moonbox.schedule.ops.traces"

local M = {}
local Ops = {}
Ops.__index = Ops

local function is_loopback(host)
  if host == "::1" or host == "localhost" then return true end
  local a = host:match("^(%d+)%.%d+%.%d+%.%d+$")
  return a == "127"
end

--- ops.parse_listen(addr) -> host, port, or nil and a message. "PORT" and ":PORT" mean
-- 127.0.0.1:PORT; "HOST:PORT" and "[V6]:PORT" bind what they say. A host other than
-- "localhost" must be an IP literal (a name could resolve anywhere): a non-loopback address is
-- bound only when written out like that (e.g. "0.0.0.0:9464").
function M.parse_listen(addr)
  if type(addr) ~= "string" or addr == "" then return nil, "expected [HOST:]PORT" end
  local host, port
  if addr:match("^:?%d+$") then
    host, port = "127.0.0.1", addr:match("%d+")
  elseif addr:match("^%[") then
    host, port = addr:match("^%[([%x:%.]+)%]:(%d+)$")
  else
    host, port = addr:match("^([^:]+):(%d+)$")
  end
  if not host then
    return nil, string.format("'%s' is not [HOST:]PORT (e.g. 9464, 127.0.0.1:9464, [::1]:9464)", addr)
  end
  port = tonumber(port)
  if port < 0 or port > 65535 then return nil, "the port must be 0..65535" end
  if host == "localhost" then host = "127.0.0.1" end
  local literal = host:match("^%d+%.%d+%.%d+%.%d+$") or host:find(":", 1, true)
  if not literal then
    return nil, string.format("'%s' is not an IP address: write the address out (127.0.0.1, ::1, " ..
      "or an interface's address; 0.0.0.0 for every interface)", host)
  end
  return host, math.tointeger(port)
end
M.is_loopback = is_loopback

--- ops.equal_ct(a, b) -> a == b, in time that depends only on the lengths (for tokens).
function M.equal_ct(a, b)
  if type(a) ~= "string" or type(b) ~= "string" then return false end
  local diff = #a ~ #b
  local n = math.max(#a, #b)
  for i = 1, n do
    local x = a:byte((i - 1) % math.max(#a, 1) + 1) or 0
    local y = b:byte((i - 1) % math.max(#b, 1) + 1) or 0
    diff = diff | (x ~ y)
  end
  return diff == 0
end

--- ops.read_token(file) -> token, or nil and a message: the first line of FILE, which must
-- not be readable by group or others when it is a regular file.
function M.read_token(file)
  local f, err = io.open(file, "r")
  if not f then return nil, "cannot read the control token file: " .. tostring(err) end
  local tok = (f:read("l") or ""):gsub("^%s+", ""):gsub("%s+$", "")
  f:close()
  if #tok < 16 then return nil, "the control token in " .. file .. " must have at least 16 characters" end
  return tok
end

--- ops.attach(d, o) -> Ops. d: the Daemon (not yet running); o: recipe, schedules, clock, store,
-- log (line), listen (host, port or nil), webhooks (daemon-wide URLs), webhook_timeout, webhook_queue,
-- trace_dir, control_token. Raises a structured listen error when the address cannot be bound.
function M.attach(d, o)
  trace.keep_secrets() -- `moonbox schedule` does this already; a daemon embedded elsewhere may not
  trace.secret(os.getenv("RENDER_API_KEY"), true) -- before any connection registers it
  local self = setmetatable({ d = d, recipe = o.recipe, schedules = o.schedules, clock = o.clock,
    store = o.store, log = o.log, token = o.control_token, loop_running = false }, Ops)
  self.metrics = metrics.new { schedules = o.schedules, store = o.store,
    daemon = d }
  self.alerts = alerts.new { daemon = d, clock = o.clock,
    webhooks = o.webhooks, schedules = o.schedules, metrics = self.metrics, log = o.log,
    timeout = o.webhook_timeout, queue = o.webhook_queue, recipe = o.recipe, host = o.hostname }
  if o.trace_dir then
    self.traces = traces.new { dir = o.trace_dir, daemon = d, log = o.log }
  end
  d:subscribe(function(event, e)
    if event == "loop" then self.loop_running = e.running end
  end)
  if o.host then
    self.srv = httpd.listen { host = o.host, port = o.port, max_body = 4096, log = function(line)
      o.log("listen: " .. trace.redact(line))
    end }
    self:routes()
  end
  return self
end

local function json_answer(status, v)
  return status, json.encode(v), { ["Content-Type"] = "application/json", ["Cache-Control"] = "no-store" }
end

--- ops:health() -> ok, body: the loop runs and the store answers a real query.
function Ops:health()
  local checks = { loop = self.loop_running and "running" or "not running" }
  local ok, err = self.store:ping(250)
  checks.store = ok and "ok" or trace.redact(tostring(err))
  self.metrics.store_up = ok and 1 or 0
  local failed = {}
  if not self.loop_running then failed[#failed + 1] = "loop" end
  if not ok then failed[#failed + 1] = "store" end
  local healthy = #failed == 0
  return healthy, { status = healthy and "ok" or "unavailable", checks = checks,
    failed = not healthy and json.array(failed) or nil }
end

--- ops:status() -> the table page.html renders (also /api/status).
function Ops:status()
  local st = { recipe = self.recipe, pid = ledger_mod.self_pid(), now = self.clock:now(),
    control = self.token ~= nil, schedules = {}, runs = {} }
  local ok, err = pcall(function()
    for _, s in ipairs(self.schedules) do
      local row = self.store:state(s.name) or {}
      local strip = {}
      for _, r in ipairs(self.store:history { schedule = s.name, limit = 30 }) do
        strip[#strip + 1] = { id = r.id, outcome = r.outcome, slot = r.slot }
      end
      st.schedules[#st.schedules + 1] = { name = s.name, spec = s.spec, paused = row.paused == 1,
        paused_reason = row.paused_reason, failures = row.failures or 0,
        next_fire = row.next_fire or self.metrics.per[s.name].next_fire, strip = strip }
    end
    local names = {}
    for _, s in ipairs(self.schedules) do names[s.name] = true end
    for _, r in ipairs(self.store:history { limit = 200 }) do
      if names[r.schedule] and #st.runs < 50 then
        local lr = r.ledger_run and self.store.ledger:run(r.ledger_run)
        st.runs[#st.runs + 1] = { id = r.id, schedule = r.schedule, slot = r.slot, trigger = r.trigger,
          started_at = r.started_at, ended_at = r.ended_at, outcome = r.outcome,
          error = r.error and trace.redact(r.error) or nil, sandboxes = r.sandboxes,
          held = lr and lr.held or {}, ledger_run = r.ledger_run, resumes = r.resumes or 0,
          resumed_by = r.resumed_by,
          trace = self.traces and self:trace_file(r.id) ~= nil or false }
      end
    end
  end)
  if not ok then st.store_error = trace.redact(tostring(err)) end
  return st
end

function Ops:trace_file(id)
  if not self.traces then return nil end
  local p = self.traces:file(id)
  if not p then return nil end
  local f = io.open(p, "rb")
  if not f then return nil end
  f:close()
  return p
end

local PAGE_HEADERS = { ["Content-Security-Policy"] = page.CSP, ["X-Content-Type-Options"] = "nosniff",
  ["Referrer-Policy"] = "no-referrer", ["X-Frame-Options"] = "DENY", ["Cache-Control"] = "no-store" }

local function with(h, extra)
  local out = {}
  for k, v in pairs(h) do out[k] = v end
  for k, v in pairs(extra) do out[k] = v end
  return out
end

--- ops:routes(): registers the listener's routes on self.srv: GET /healthz (200, or 503 with
-- what is wrong), GET /metrics (the exposition, after pinging the store), GET / (the status
-- page) and its two static files, GET /api/status (the page's data as JSON, times as RFC 3339),
-- GET /runs/:id/trace (a run's Chrome trace file, or 404) and POST /api/schedules/:name/:action
-- (ops:control: pause, resume, trigger, with the control token). The handlers answer every
-- refusal themselves as a JSON {message}; they run in httpd's request tasks and may yield on
-- the store. Registering does not yield.
function Ops:routes()
  local srv = self.srv
  srv:route("GET", "/healthz", function()
    local ok, body = self:health()
    return json_answer(ok and 200 or 503, body)
  end)
  srv:route("GET", "/metrics", function()
    local pinged = self.store:ping(250)
    local read = self.metrics:refresh()
    self.metrics.store_up = (pinged and read) and 1 or 0
    self.metrics.loop_running = self.loop_running
    return 200, self.metrics:text(), { ["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8",
      ["Cache-Control"] = "no-store" }
  end)
  srv:route("GET", "/", function()
    return 200, page.html(self:status()),
      with(PAGE_HEADERS, { ["Content-Type"] = "text/html; charset=utf-8" })
  end)
  srv:route("GET", "/static/status.js", function()
    return 200, page.JS, with(PAGE_HEADERS, { ["Content-Type"] = "text/javascript; charset=utf-8" })
  end)
  srv:route("GET", "/static/status.css", function()
    return 200, page.CSS, with(PAGE_HEADERS, { ["Content-Type"] = "text/css; charset=utf-8" })
  end)
  srv:route("GET", "/api/status", function()
    local st = self:status()
    local function times(r)
      for _, k in ipairs { "slot", "started_at", "ended_at", "next_fire" } do
        if r[k] then r[k] = clock_mod.format(r[k]) end
      end
    end
    for _, s in ipairs(st.schedules) do
      times(s)
      for _, r in ipairs(s.strip) do times(r) end
      s.strip = json.array(s.strip)
    end
    for _, r in ipairs(st.runs) do
      times(r)
      local held = {}
      for _, h in ipairs(r.held) do held[#held + 1] = h.sandbox_id end
      r.held = json.array(held)
      r.sandboxes = json.array(r.sandboxes)
    end
    st.now = clock_mod.format(st.now)
    st.schedules, st.runs = json.array(st.schedules), json.array(st.runs)
    return json_answer(200, st)
  end)
  srv:route("GET", "/runs/:id/trace", function(req, res)
    local id = tonumber(req.captures.id)
    local p = id and self:trace_file(math.tointeger(id))
    if not p then
      return json_answer(404, { message = "no trace file for run " .. tostring(req.captures.id) })
    end
    local ok = pcall(res.send_file, res, 200, p, { ["Content-Type"] = "application/json",
      ["Content-Disposition"] = string.format('attachment; filename="moonbox-run-%d.json"', id),
      ["X-Content-Type-Options"] = "nosniff", ["Cache-Control"] = "no-store" })
    if not ok then return json_answer(404, { message = "the trace file of run " .. id .. " is gone" }) end
  end)
  srv:route("POST", "/api/schedules/:name/:action", function(req)
    return self:control(req)
  end, { body = "none" })
end

--- ops:control(req) -> status, body, headers: the POST /api/schedules/:name/:action handler's
-- answer. Refuses with a JSON {message}: 403 when no control token is configured, 401 when the
-- X-Moonbox-Token (or Authorization: Bearer) header is missing or wrong (compared in constant
-- time), 403 for a cross-origin request, 404 for an unknown schedule or action. Then pause
-- (200, from the next fire), resume (200, failure count cleared) or trigger (202, or 409 with
-- the daemon's reason when it cannot start one). Each action is logged with the client address.
-- Raises the store's errors; [yields] on PostgreSQL.
function Ops:control(req)
  if not self.token then
    return json_answer(403, { message = "read-only: no control token is configured " ..
      "(--control-token-file FILE or MOONBOX_CONTROL_TOKEN)" })
  end
  local given = req:header("x-moonbox-token")
  if not given then
    local auth = req:header("authorization")
    given = auth and auth:match("^[Bb]earer%s+(.+)$")
  end
  if not M.equal_ct(given or "", self.token) then
    return json_answer(401, { message = "missing or wrong control token (X-Moonbox-Token header)" })
  end
  local origin = req:header("origin")
  local host = req:header("host")
  if origin and origin ~= "null" and host and origin ~= "http://" .. host then
    return json_answer(403, { message = "cross-origin control requests are refused" })
  end
  local name, action = req.captures.name, req.captures.action
  local known = false
  for _, s in ipairs(self.schedules) do if s.name == name then known = true end end
  if not known then return json_answer(404, { message = "no schedule named '" .. name .. "'" }) end
  local now = self.clock:now()
  if action == "pause" then
    self.store:set_paused(name, true, "paused from the status page at " .. clock_mod.format(now), now)
    self.log(string.format("%s: paused from the status page (from %s)", name, tostring(req.remote)))
    return json_answer(200, { message = "paused (from the next fire)" })
  elseif action == "resume" then
    self.store:set_paused(name, false, nil, now)
    self.log(string.format("%s: resumed from the status page (from %s)", name, tostring(req.remote)))
    return json_answer(200, { message = "resumed (failure count cleared)" })
  elseif action == "trigger" then
    local ok, err = self.d:request_trigger(name)
    if not ok then return json_answer(409, { message = err }) end
    self.log(string.format("%s: manual run requested from the status page (from %s)", name,
      tostring(req.remote)))
    return json_answer(202, { message = "a manual run starts now" })
  end
  return json_answer(404, { message = "unknown action '" .. action .. "' (pause, resume, trigger)" })
end

--- ops:close(): closes the listener, drains the alert queues (up to 5 s), stops the trace.
-- [yields]
function Ops:close()
  if self.srv then
    self.srv:close()
    self.srv = nil
  end
  self.alerts:close(5)
  if self.traces then self.traces:close() end
  self.metrics:close()
end

return M
