-- The status page of `moonbox schedule --listen`, in a real browser: headless Chromium (Debian's
-- chromium, driven by chromium-driver over WebDriver with moonbox's HTTP client) loads it from
-- a running daemon with history; the rendered DOM (after the page's script ran) lists the
-- schedules and the failed run's error as text (the markup in it escaped, no element made of
-- it), links each run's trace, which downloads as Chrome trace JSON; a screenshot goes to
-- build/ops/status-page.png. With a control token the pause button, clicked in the browser
-- after typing the token, pauses the schedule (the store says so), and a trigger request starts
-- a manual run in the daemon. Without one the page has no
-- buttons and control requests are refused; a wrong token, none, or another origin too.
local T = require "moonbox.testing"
local proc = require "moonbox.proc"
local json = require "moonbox.json"
local http = require "moonbox.http"
local SE = require "spec.support.schedule_env"
local WD = require "spec.support.webdriver"
local L = require "spec.support.local_backend"

local TOKEN = "spec-control-token-7f3a9c2e"

local RECIPE = [[
local schedule = require "moonbox.schedule"
schedule.every("nightly", "10m", function() end)
schedule.every("broken", "10m", function()
  error("deploy failed: <img src=x id=injected> & \"quoted\"")
end, { pause_after_failures = 2 })
]]

local function post(url, headers)
  return http.request { method = "POST", url = url, headers = headers, timeout = 30 }
end

describe("moonbox schedule status page", function()
  local e, browser
  after_each(T.async(function()
    if browser then browser:close() end
    browser = nil
    if e then e:destroy() end
    e = nil
  end))

  it("renders schedules, history and errors in Chromium, and its pause button pauses", T.async(function()
    e = SE.new(RECIPE)
    local tokfile = e:write("token", TOKEN .. "\n", "600")
    local d = e:daemon { "--listen", "0", "--trace-dir", e.dir .. "/traces", "--control-token-file", tokfile }
    d:wait_for("broken: paused after 2 consecutive failures")
    d:wait_for("nightly: run %d+ ok", 2)

    -- the HTTP side: headers, and control refused without the right token or from elsewhere
    local page = e:get(d, "/")
    assert.are.equal(200, page.status)
    assert.matches("default-src 'none'", page.headers["content-security-policy"], 1, true)
    assert.matches("script-src 'self'", page.headers["content-security-policy"], 1, true)
    assert.are.equal("nosniff", page.headers["x-content-type-options"])
    local ctl = d.url .. "/api/schedules/nightly/pause"
    assert.are.equal(401, post(ctl).status)
    assert.are.equal(401, post(ctl, { ["X-Moonbox-Token"] = TOKEN .. "x" }).status)
    assert.are.equal(401, post(ctl, { Cookie = "token=" .. TOKEN }).status, "a cookie is no token")
    assert.are.equal(403, post(ctl, { ["X-Moonbox-Token"] = TOKEN, Origin = "http://evil.example" }).status)

    local bdir = proc.run({ "mktemp", "-d", "/tmp/moonbox-ops-browser.XXXXXX" }).stdout:gsub("%s+$", "")
    local ok, err = pcall(function()
      browser = WD.start(bdir)
      browser:go(d.url .. "/")
      browser:until_true("return document.body.getAttribute('data-ready') === '1'", "the page's script ran")
      local names = browser:eval([[return Array.from(document.querySelectorAll('#schedules tr[data-schedule]'))
        .map(function (r) { return r.querySelector('td.name').textContent; });]])
      assert.are.same({ "nightly", "broken" }, names)
      local errors = browser:eval([[return Array.from(document.querySelectorAll('#runs tr.failed td.error'))
        .map(function (td) { return td.textContent; });]])
      assert.are.equal(2, #errors)
      for _, t in ipairs(errors) do
        assert.matches('recipe.lua:4: deploy failed: <img src=x id=injected> & "quoted"', t, 1, true)
      end
      assert.is_true(browser:eval("return document.getElementById('injected') === null"),
        "the error's markup became an element")
      local dom = browser:source()
      assert.matches("deploy failed: &lt;img src=x id=injected&gt; &amp;", dom, 1, true)
      assert.matches("paused after 2 consecutive failures", dom, 1, true)
      local strip = browser:eval([[return document.querySelectorAll(
        '#schedules tr[data-schedule="broken"] .strip .cell.failed').length;]])
      assert.are.equal(2, strip)

      -- a run's trace downloads as Chrome trace JSON
      local href = browser:eval([[var a = document.querySelector('#runs tr.ok a[download]');
        return a ? a.getAttribute('href') : null;]])
      assert.matches("^/runs/%d+/trace$", href)
      local tr = e:get(d, href)
      assert.are.equal(200, tr.status)
      assert.matches("^attachment", tr.headers["content-disposition"])
      local body = tr.body:gsub("%s+$", "")
      if body:sub(-1) ~= "]" then body = body .. "]" end -- a trace still being written
      local events = json.decode(body)
      assert.is_true(#events >= 1)
      assert.are.equal("process_name", events[1].name)

      local builddir = os.getenv("MOONBOX_BUILD_DIR") or L.BIN:match("^(.*)/[^/]+$")
      proc.run { "mkdir", "-p", builddir .. "/ops" }
      browser:screenshot(builddir .. "/ops/status-page.png")

      -- pause "nightly" with the browser: type the token, click its pause button
      browser:type("#token", TOKEN)
      browser:click('button[data-action="pause"][data-schedule="nightly"]')
      browser:until_true([[var r = document.getElementById('result');
        return r.textContent.indexOf('nightly: paused') === 0;]], "the pause answer")
      browser:until_true([[return document.querySelector(
        'button[data-action="resume"][data-schedule="nightly"]') !== null;]], "the page refreshed")
      browser:screenshot(builddir .. "/ops/status-page-paused.png")
    end)
    if browser then browser:close() end
    browser = nil
    proc.run { "rm", "-rf", bdir }
    if not ok then error(err, 0) end

    d:wait_for("nightly: paused from the status page")
    local list = e:moonbox { "schedule", e.recipe, "--list" }
    assert.are.equal(0, list.code, list.stderr)
    assert.matches("nightly%s.-paused %(paused from the status page", list.stdout)
    d:wait_for("nightly: slot .* passed while paused")
    -- trigger (the page's third button; here as a script would, with a bearer token)
    local tr = post(d.url .. "/api/schedules/broken/trigger", { Authorization = "Bearer " .. TOKEN })
    assert.are.equal(202, tr.status, tr.body)
    d:wait_for("broken: run %d+ started %(slot [^,]+, manual%)")
    d:wait_for("broken: run %d+ failed", 3)
    assert.are.equal(404, post(d.url .. "/api/schedules/nope/pause", { ["X-Moonbox-Token"] = TOKEN }).status)
    assert.are.equal(0, d:stop())
    local manual = 0
    for _, r in ipairs(e:runs("broken")) do if r.trigger == "manual" then manual = manual + 1 end end
    assert.are.equal(1, manual)
  end))

  it("is read-only without a control token", T.async(function()
    e = SE.new(RECIPE)
    local d = e:daemon { "--listen", "0" }
    d:wait_for("nightly: run %d+ ok")
    local page = e:get(d, "/")
    assert.are.equal(200, page.status)
    assert.is_nil(page.body:find("<button", 1, true))
    assert.is_nil(page.body:find('id="token"', 1, true))
    local r = post(d.url .. "/api/schedules/nightly/pause", { ["X-Moonbox-Token"] = TOKEN })
    assert.are.equal(403, r.status)
    assert.matches("read%-only", json.decode(r.body).message)
    assert.are.equal(0, d:stop())
  end))
end)
