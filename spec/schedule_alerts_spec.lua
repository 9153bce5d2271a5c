-- Webhook alerts of `moonbox schedule`, against a real HTTP server this spec runs (moonbox's
-- httpd): failure, pause and recovery messages arrive with their fields, after the server
-- answered 500 to the first attempts (retried with backoff); no secret (the API key, the
-- webhook URL's password and query token) is in a message or a log line; and a webhook that
-- never answers, next to one on a closed port, delays no slot (each fire record is on time
-- by the test clock) while its full queue drops messages, counted in /metrics. A real daemon
-- on the test clock.
local T = require "moonbox.testing"
local json = require "moonbox.json"
local core = require "moonbox.core"
local task = require "moonbox.task"
local httpd = require "moonbox.httpd"
local SE = require "spec.support.schedule_env"

local API_KEY = "spec-api-key-0123456789"

local RECIPE = [[
local schedule = require "moonbox.schedule"
local core = require "moonbox.core"
local HOOK = os.getenv("SPEC_HOOK")
schedule.every("pauser", "10m", function()
  error(core.Error.new { op = "spec.check", code = "check_failed", sandbox_id = "srv-spec1",
    message = "the health check failed with key " .. os.getenv("RENDER_API_KEY") })
end, { pause_after_failures = 2, webhooks = { HOOK } })
local n = 0
schedule.every("flaky", "10m", function()
  n = n + 1
  if n == 1 then error("the first run fails") end
end)
]]

local function collect(srv, inject)
  local box = { got = {}, hits = 0, cond = core.cond() }
  srv:route("POST", "/hook", function(req)
    box.hits = box.hits + 1
    if box.hits <= inject then
      -- the first one says when to come back (real seconds); the next leaves it to the backoff
      return 500, "injected failure", box.hits == 1 and { ["Retry-After"] = "1" } or nil
    end
    box.got[#box.got + 1] = { body = req.body, msg = json.decode(req.body), query = req.query,
      auth = req:header("authorization"), ctype = req:header("content-type") }
    box.cond:broadcast()
    return 200, "ok"
  end)
  function box.wait(n)
    task.timeout(60, function()
      while #box.got < n do box.cond:wait() end
    end)
  end
  return box
end

local function find(got, schedule, event)
  local out = {}
  for _, g in ipairs(got) do
    if g.msg.schedule == schedule and g.msg.event == event then out[#out + 1] = g.msg end
  end
  return out
end

describe("alerts.retry_after", function()
  local alerts = require "moonbox.schedule.ops.alerts"
  it("reads delay-seconds and HTTP dates, never negative", function()
    assert.are.equal(3, alerts.retry_after("3", 1000))
    assert.are.equal(0, alerts.retry_after("-5", 1000))
    assert.are.equal(30, alerts.retry_after("Sun, 06 Nov 1994 08:49:37 GMT", 784111747))
    assert.are.equal(0, alerts.retry_after("Sun, 06 Nov 1994 08:49:37 GMT", 784111800))
    assert.is_nil(alerts.retry_after("soon", 0))
    assert.is_nil(alerts.retry_after(nil, 0))
  end)
  it("logs a webhook URL without its credentials, query or fragment", function()
    assert.are.equal("https://hooks.example:8443/services/T0/B0",
      alerts.safe_url("https://u:p@hooks.example:8443/services/T0/B0?token=x#frag"))
  end)
end)

describe("moonbox schedule alerts", function()
  local e
  after_each(T.async(function() if e then e:destroy() end e = nil end))

  it("posts failure, pause and recovery messages with their fields, retried through 500s, no secrets",
    T.async(function()
      local srv <close> = httpd.listen { port = 0 }
      local box = collect(srv, 2)
      local hook = "http://alice:SEKRETPASS@127.0.0.1:" .. srv.port .. "/hook?token=SEKRETQUERY"
      e = SE.new(RECIPE, { env = { "SPEC_HOOK=" .. hook } })
      local d = e:daemon { "--webhook", hook, "--trace-dir", e.dir .. "/traces" }
      d:wait_for("pauser: paused after 2 consecutive failures")
      d:wait_for("flaky: run %d+ ok")
      box.wait(5) -- pauser: failure, failure, paused; flaky: failure, recovered
      assert.are.equal(0, d:stop())
      assert.are.equal(5, #box.got, "one message per event, the URL given twice counted once")
      assert.are.equal(7, box.hits, "2 injected 500s, then 5 deliveries")
      local runs = {}
      for _, r in ipairs(e:runs()) do runs[r.id] = r end

      local fails = find(box.got, "pauser", "failure")
      assert.are.equal(2, #fails)
      for _, m in ipairs(fails) do
        local r = runs[m.run_id]
        assert.is_not_nil(r, "run_id names a history record")
        assert.are.equal("pauser", r.schedule)
        assert.are.equal("failed", m.outcome)
        assert.are.equal(r.slot, m.slot)
        assert.are.equal(r.slot_unix, m.slot_unix)
        assert.are.equal("cron", m.trigger)
        assert.are.equal("check_failed", m.error_code)
        assert.are.equal("spec.check", m.error_op)
        assert.are.equal("srv-spec1", m.sandbox_id)
        assert.matches("recipe.lua:%d+", m.error)
        assert.matches("[redacted]", m.error, 1, true)
        assert.are.equal(r.error, m.error, "the message quotes the recorded error")
        assert.matches("^moonbox: schedule pauser: run " .. m.run_id .. " failed %(slot ", m.text)
        assert.are.equal(e.dir .. "/traces/run-" .. m.run_id .. ".json", m.trace_file)
        assert.is_truthy(io.open(m.trace_file), "the trace file exists")
      end
      table.sort(fails, function(a, b) return a.run_id < b.run_id end)
      assert.are.equal(1, fails[1].consecutive_failures)
      assert.are.equal(2, fails[2].consecutive_failures)
      local paused = find(box.got, "pauser", "paused")
      assert.are.equal(1, #paused)
      assert.matches("paused after 2 consecutive failures %(last: run " .. fails[2].run_id, paused[1].reason)
      assert.matches("^moonbox: schedule pauser paused: ", paused[1].text)
      assert.are.equal(fails[2].run_id, paused[1].run_id)
      local ff = find(box.got, "flaky", "failure")
      assert.are.equal(1, #ff)
      assert.matches("the first run fails", ff[1].error)
      assert.is_nil(ff[1].error_code, "a plain error has no code")
      local rec = find(box.got, "flaky", "recovered")
      assert.are.equal(1, #rec)
      assert.are.equal("ok", rec[1].outcome)
      assert.is_true(rec[1].run_id > ff[1].run_id)
      assert.matches("recovered: run " .. rec[1].run_id .. " ok after 1 failure", rec[1].text)

      for _, g in ipairs(box.got) do
        assert.are.equal("application/json", g.ctype)
        assert.are.equal("token=SEKRETQUERY", g.query, "the URL is used as given")
        for _, secret in ipairs { API_KEY, "SEKRETPASS", "SEKRETQUERY" } do
          assert.is_nil(g.body:find(secret, 1, true), secret .. " in a message")
        end
      end
      local log = table.concat(d.log, "\n") .. "\n" .. d.stderr()
      assert.matches("attempt 1 failed (HTTP 500); retrying in 1s", log, 1, true)
      -- the backoff's 2 s are schedule time: 2/600 s at the test clock's 600x
      assert.matches("attempt 2 failed (HTTP 500); retrying in 0.00333s", log, 1, true)
      assert.matches("http://127.0.0.1:" .. srv.port .. "/hook:", log, 1, true)
      for _, secret in ipairs { API_KEY, "SEKRETPASS", "SEKRETQUERY", "alice" } do
        assert.is_nil(log:find(secret, 1, true), secret .. " in the daemon's log")
      end
    end))

  it("delays no slot while one webhook never answers and another's port is closed", T.async(function()
    local hang <close> = httpd.listen { port = 0 }
    local hung = 0
    hang:route("POST", "/hook", function()
      hung = hung + 1
      task.sleep(math.huge) -- accepted, never answered
    end)
    local closed = httpd.listen { port = 0 }
    local closed_url = closed.url .. "/hook"
    closed:close()
    e = SE.new([[require("moonbox.schedule").every("tick", "1m", function() error("always fails") end)]],
      { scale = 60 })
    local d = e:daemon { "--webhook", hang.url .. "/hook", "--webhook", closed_url, "--webhook-timeout", "30",
      "--webhook-queue", "2", "--listen", "0" }
    d:wait_for("tick: run %d+ failed", 6)
    local m = e:get(d, "/metrics").body
    assert.are.equal(0, d:stop())
    assert.is_true(hung >= 1, "the hanging webhook got the first message")
    local rows = e:runs("tick")
    local cron = {}
    for _, r in ipairs(rows) do if r.trigger == "cron" then cron[#cron + 1] = r end end
    assert.is_true(#cron >= 6)
    for i, r in ipairs(cron) do
      assert.are_not.equal("skipped", r.outcome, "slot " .. r.slot .. " was skipped")
      -- on time by the test clock: fired within 30 schedule seconds (0.5 s real) of its due time
      assert.is_true(r.fired_unix - r.due_unix < 30,
        string.format("slot %s fired %.1f s (schedule time) late", r.slot, r.fired_unix - r.due_unix))
      if i > 1 then assert.are.equal(60, r.slot_unix - cron[i - 1].slot_unix, "consecutive slots") end
    end
    assert.matches('moonbox_webhook_attempts_total{result="failed"} [1-9]', m)
    -- the hanging webhook: one message in its attempt, 2 waiting, the later ones dropped
    assert.matches('moonbox_webhook_queue_length [1-9]', m)
    assert.matches('moonbox_webhook_messages_total{result="dropped"} [1-9]', m)
    assert.matches('moonbox_webhook_messages_total{result="failed"} [1-9]', m)
    local log = table.concat(d.log, "\n")
    assert.matches("message%(s%) dropped: the daemon stopped", log)
  end))
end)
