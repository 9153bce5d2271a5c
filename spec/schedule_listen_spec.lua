-- `moonbox schedule --listen`: /metrics is valid Prometheus text (Debian's promtool checks it)
-- whose run counters equal what `moonbox runs` lists — also right after a restart, when they
-- come from the history alone —, and /healthz answers 503 naming the store while the state
-- file is moved away (the failure of a disk or a deleted file: the daemon's open connection
-- would go on writing to a file nobody can find) and 200 again once it is back. Plus the
-- listen address rules. And against a real `moonbox local` with an injected 429: the live
-- sandbox gauge, API call and 429 counters, and the sandbox a running run holds (from the
-- ledger) on the status page's data, and an env value a failed run quotes redacted from the
-- history and the log. A real daemon on the test clock; nothing here times
-- anything.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local json = require "moonbox.json"
local task = require "moonbox.task"
local SE = require "spec.support.schedule_env"
local ops = require "moonbox.schedule.ops"
local core = require "moonbox.core"
local httpd = require "moonbox.httpd"
local L = require "spec.support.local_backend"

local RECIPE = [[
local schedule = require "moonbox.schedule"
schedule.every("good", "10m", function() end)
schedule.every("bad", "10m", function() error("the check failed") end, { pause_after_failures = 3 })
schedule.every("slow", "10m", function() require("moonbox.task").sleep(1.5) end, { overlap = "skip" })
]]

-- {["name{labels}"] = value} of an exposition.
local function samples(text)
  local out = {}
  for line in text:gmatch("[^\n]+") do
    if not line:match("^#") then
      local key, v = line:match("^(%S+)%s+(%S+)$")
      if key then out[key] = tonumber(v) or v end
    end
  end
  return out
end

local OUTCOMES = { "ok", "failed", "timeout", "cancelled", "skipped", "interrupted" }

-- Counts of `moonbox runs` by schedule and outcome (final outcomes only).
local function counts(rows)
  local c = {}
  for _, r in ipairs(rows) do
    c[r.schedule] = c[r.schedule] or {}
    c[r.schedule][r.outcome] = (c[r.schedule][r.outcome] or 0) + 1
  end
  return c
end

local function counters(m, names)
  local c = {}
  for _, n in ipairs(names) do
    c[n] = {}
    for _, oc in ipairs(OUTCOMES) do
      local v = m[string.format('moonbox_schedule_runs_total{schedule="%s",outcome="%s"}', n, oc)]
      assert.is_not_nil(v, "no moonbox_schedule_runs_total for " .. n .. " " .. oc)
      c[n][oc] = v
    end
  end
  return c
end

local function same(a, b, names)
  for _, n in ipairs(names) do
    for _, oc in ipairs(OUTCOMES) do
      if (a[n] and a[n][oc] or 0) ~= (b[n] and b[n][oc] or 0) then return false end
    end
  end
  return true
end

-- Scrapes, lists, scrapes again until both scrapes agree (the daemon keeps recording), then
-- requires `moonbox runs` to say the same. Returns the last scrape's text.
local function counters_match(e, d, names)
  for _ = 1, 20 do
    local m1 = e:get(d, "/metrics")
    local runs = counts(e:runs())
    local m2 = e:get(d, "/metrics")
    local c1, c2 = counters(samples(m1.body), names), counters(samples(m2.body), names)
    if same(c1, c2, names) then
      for _, n in ipairs(names) do
        for _, oc in ipairs(OUTCOMES) do
          assert.are.equal(runs[n] and runs[n][oc] or 0, c1[n][oc],
            string.format("moonbox_schedule_runs_total{schedule=%s,outcome=%s} vs moonbox runs", n, oc))
        end
      end
      return m2.body
    end
  end
  error("the counters never held still for one `moonbox runs`")
end

local function promtool(e, text)
  local path = e:write("metrics.txt", text)
  local r = proc.run { "sh", "-c", 'promtool check metrics < "$1" 2>&1', "sh", path }
  assert.are.equal(0, r.code, "promtool check metrics:\n" .. r.stdout .. "\n" .. text)
  assert.are.equal("", r.stdout, "promtool reported:\n" .. r.stdout)
end

describe("moonbox schedule --listen", function()
  local e
  after_each(T.async(function() if e then e:destroy() end e = nil end))

  it("serves /metrics that promtool accepts, with run counters equal to `moonbox runs`", T.async(function()
    assert.is_truthy(proc.run({ "sh", "-c", "command -v promtool" }).code == 0,
      "promtool is missing: ./dev setup installs Debian's prometheus package")
    e = SE.new(RECIPE)
    local names = { "good", "bad", "slow" }
    local d = e:daemon { "--listen", "0" }
    d:wait_for("bad: paused after 3 consecutive failures")
    d:wait_for("slow: slot .* skipped")
    d:wait_for("good: run %d+ ok", 4)
    local text = counters_match(e, d, names)
    promtool(e, text)
    local m = samples(text)
    assert.are.equal(1, m["moonbox_schedule_up"])
    assert.are.equal(1, m['moonbox_schedule_paused{schedule="bad"}'])
    assert.are.equal(0, m['moonbox_schedule_paused{schedule="good"}'])
    assert.are.equal(3, m['moonbox_schedule_consecutive_failures{schedule="bad"}'])
    assert.are.equal(1, m['moonbox_schedule_last_outcome{schedule="bad",outcome="failed"}'])
    assert.are.equal(1, m['moonbox_schedule_last_outcome{schedule="good",outcome="ok"}'])
    assert.is_number(m['moonbox_schedule_next_fire_timestamp_seconds{schedule="good"}'])
    assert.is_nil(m['moonbox_schedule_next_fire_timestamp_seconds{schedule="bad"}'], "paused: no next fire")
    -- every finished run of "slow" took 1.5 real s = 900 s of schedule time: in (600, 1800]
    local n = m['moonbox_schedule_run_duration_seconds_count{schedule="slow"}']
    assert.is_true(n >= 1)
    assert.are.equal(0, m['moonbox_schedule_run_duration_seconds_bucket{schedule="slow",le="600"}'])
    assert.are.equal(n, m['moonbox_schedule_run_duration_seconds_bucket{schedule="slow",le="1800"}'])
    assert.are.equal(0, m["moonbox_sandboxes_live"])
    assert.are.equal(0, m["moonbox_api_throttled_total"])
    assert.are.equal(0, d:stop())

    -- a new daemon, 2 hours later: its counters start from the history (catch-up records too)
    d = e:daemon({ "--listen", "127.0.0.1:0" }, "2026-03-01T03:00:00Z")
    d:wait_for("good: catching up")
    counters_match(e, d, names)
    assert.are.equal(0, d:stop())
  end))

  it("answers /healthz 503 naming the store while the state file is gone, 200 once it is back",
    T.async(function()
      e = SE.new([[require("moonbox.schedule").every("quiet", "1d", function() end)]])
      local d = e:daemon { "--listen", "0" }
      d:wait_for("started: 1 schedule")
      local function health()
        local r = e:get(d, "/healthz")
        return r.status, json.decode(r.body)
      end
      -- the loop starts right after the "started" line: wait for it through /healthz itself
      local status, body
      for _ = 1, 200 do
        status, body = health()
        if status == 200 then break end
        task.sleep(0.05)
      end
      assert.are.equal(200, status, json.encode(body))
      assert.are.same({ loop = "running", store = "ok" }, body.checks)
      local db = e.dir .. "/state/moonbox/moonbox.db"
      assert(os.rename(db, db .. ".away"))
      status, body = health()
      assert.are.equal(503, status)
      assert.are.equal("unavailable", body.status)
      assert.are.same({ "store" }, body.failed)
      assert.matches("moonbox.db is missing", body.checks.store)
      local m = e:get(d, "/metrics")
      assert.matches("\nmoonbox_schedule_store_up 0\n", m.body, 1, true)
      assert(os.rename(db .. ".away", db))
      status, body = health()
      assert.are.equal(200, status, json.encode(body))
      assert.are.equal(0, d:stop())
      local f = io.open(db .. ".away")
      assert.is_nil(f, "the probe must not leave files behind")
    end))

  it("binds loopback for a bare port and a non-loopback address only when written out", function()
    assert.are.same({ "127.0.0.1", 9464 }, { ops.parse_listen("9464") })
    assert.are.same({ "127.0.0.1", 9464 }, { ops.parse_listen(":9464") })
    assert.are.same({ "127.0.0.1", 9464 }, { ops.parse_listen("localhost:9464") })
    assert.are.same({ "::1", 9464 }, { ops.parse_listen("[::1]:9464") })
    assert.are.same({ "0.0.0.0", 9464 }, { ops.parse_listen("0.0.0.0:9464") })
    local h, why = ops.parse_listen("metrics.example:9464")
    assert.is_nil(h)
    assert.matches("not an IP address", why)
    assert.is_nil((ops.parse_listen("9464x")))
    assert.is_true(ops.is_loopback("127.0.0.1"))
    assert.is_false(ops.is_loopback("0.0.0.0"))
  end)

  it("refuses --listen with a one-shot mode, and a bad address, as usage errors", T.async(function()
    e = SE.new([[require("moonbox.schedule").every("x", "1d", function() end)]])
    local r = e:moonbox { "schedule", e.recipe, "--list", "--listen", "0" }
    assert.are.equal(2, r.code)
    assert.matches("apply to the daemon", r.stderr)
    r = e:moonbox { "schedule", e.recipe, "--listen", "somewhere.example:80" }
    assert.are.equal(2, r.code)
    assert.matches("not an IP address", r.stderr)
  end))
end)

describe("moonbox schedule --listen with a real backend", function()
  local B, e
  setup(T.async(function() B = L.start { args = { "--faults", "POST /v1/sandboxes=429:1#1" } } end))
  teardown(T.async(function()
    if e then e:destroy() end
    if B then B:destroy() end
  end))

  it("counts live sandboxes, API calls and 429s, shows the sandbox a run holds, redacts env values",
    T.async(function()
    -- the run holds its sandbox until the spec answers its request to /release
    local gate <close> = httpd.listen { port = 0 }
    local release, released = core.cond(), false
    gate:route("GET", "/release", function()
      while not released do release:wait() end
      return 200, "go"
    end)
    e = SE.new([[
local schedule = require "moonbox.schedule"
local render = require "moonbox.render"
local http = require "moonbox.http"
schedule.every("holder", "10m", function()
  local secret = "env-secret-value-4242"
  local sb <close> = render.sandboxes.create { network = "deny-all", env = { SPEC_SECRET = secret } }
  print("created " .. sb.id) io.stdout:flush()
  http.request { url = os.getenv("SPEC_GATE"), timeout = 120 }
  error("the run quotes its env value " .. secret)
end, { overlap = "skip" })
]], { env = { "SPEC_GATE=" .. gate.url .. "/release", "RENDER_LOCAL_DEV_URL=" .. B.url,
      "RENDER_API_KEY=" .. B.key, "RENDER_WORKSPACE_ID=" .. B.workspace } })
    local d = e:daemon { "--listen", "0" }
    local id = d:wait_for("^created sbx%-"):match("(sbx%-%S+)")
    local m = samples(e:get(d, "/metrics").body)
    assert.are.equal(1, m["moonbox_sandboxes_live"])
    assert.are.equal(1, m["moonbox_api_throttled_total"], "the injected 429")
    assert.is_true(m['moonbox_api_calls_total{outcome="ok"}'] >= 1)
    assert.are.equal(1, m['moonbox_schedule_runs_active{schedule="holder"}'])
    local st = json.decode(e:get(d, "/api/status").body)
    local run
    for _, r in ipairs(st.runs) do if r.outcome == "running" then run = r end end
    assert.is_not_nil(run, "the running run is listed")
    assert.are.same({ id }, run.sandboxes)
    assert.are.same({ id }, run.held, "the ledger says the run still holds it")
    released = true
    release:broadcast()
    d:wait_for("holder: run %d+ failed %(sandboxes " .. id:gsub("%-", "%%-"))
    m = samples(e:get(d, "/metrics").body)
    assert.are.equal(0, m["moonbox_sandboxes_live"])
    assert.are.equal(0, m['moonbox_schedule_runs_active{schedule="holder"}'])
    assert.are.equal(0, d:stop())
    assert.are.equal(0, B:live())
    -- an env value given to a create is redacted from the history and the daemon's output
    local failed
    for _, r in ipairs(e:runs("holder")) do if r.outcome == "failed" then failed = r end end
    assert.matches("the run quotes its env value [redacted]", failed.error, 1, true)
    local out = table.concat(d.log, "\n") .. d.stderr()
    assert.matches("quotes its env value [redacted]", out, 1, true)
    assert.is_nil(out:find("env-secret-value-4242", 1, true))
  end))
end)
