-- `moonbox reap` (issue 12) settles every dead run, whatever one of them answers: it retries what
-- is retryable (500s on terminate included), goes on past a run whose backend is gone, reports
-- per run what it terminated and what failed, exits non-zero only while something is left, and
-- `--forget RUN` drops what a person knows is gone (after `--dry-run` shows it).
local T = require "moonbox.testing"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"
local json = require "moonbox.json"
local S = require "spec.support.store_env"

local B, home

runs.fixture(setup, teardown, function(b, h) B, home = b, h end, { args = { "--seed", "7" } })
teardown(T.async(function()
  S.shutdown()
end))

-- Starts a run of home h that makes n sandboxes, then SIGKILLs it: a dead run holding n.
local function killed_run(h, n)
  local recipe = h:recipe(string.format([[
local render = require "moonbox.render"
local fleet <close> = render.restore(nil, { count = %d, concurrency = 8 })
print("made " .. #fleet) io.stdout:flush()
require("moonbox.task").sleep(600)
]], n))
  local p = h:spawn("run", recipe)
  assert.are.equal("made " .. n, p:lines()())
  p:kill("KILL")
  p:wait()
  S.after_kill()
end

describe("moonbox reap", function()
  it("reaches 0 running in one invocation under 5% injected 500s on terminate", T.async(function()
    killed_run(home, 40)
    assert.are.equal(40, runs.count(runs.live(B)))
    -- 5% of the terminates answer 500, and — so that some certainly do — the first three.
    B:req("PUT", "/_moonbox/faults", { body = "POST /v1/sandboxes/*/terminate=500#3;POST /v1/sandboxes/*/terminate=500@0.05" })
    local r = home:moonbox("reap")
    local _, f = B:req("GET", "/_moonbox/faults")
    B:req("DELETE", "/_moonbox/faults")
    assert.are.equal(0, r.code, r.stdout .. r.stderr)
    assert.are.equal(3, f.rules[1].fired, json.encode(f))
    assert.matches("40 terminated, 0 already gone, 0 never made, 0 failed in 1 run", r.stdout)
    assert.are.same({}, runs.live(B))
    assert.is_nil(home:moonbox("ps").stdout:find("holds", 1, true))
  end))

  it("goes on past a run whose backend is gone, and --forget drops that run", T.async(function()
    -- Run 1 (oldest): its backend is destroyed after the kill, so nobody can answer for it.
    local gone_backend = L.start()
    killed_run(home:on(gone_backend), 2)
    gone_backend:destroy()
    killed_run(home, 3)
    killed_run(home, 4)
    assert.are.equal(7, runs.count(runs.live(B)))
    local r = home:moonbox("reap")
    assert.are.equal(1, r.code, r.stdout .. r.stderr) -- something is left: run 1's two
    assert.matches("run %d+: cannot reach its http://127%.0%.0%.1:%d+/v1: .-%(2 left for the next reap%)", r.stdout)
    assert.matches("3 terminated, 0 already gone, 0 never made, 0 failed", r.stdout)
    assert.matches("4 terminated, 0 already gone, 0 never made, 0 failed", r.stdout)
    assert.matches("reap: 7 terminated, 0 already gone, 0 never made, 2 failed in 3 run%(s%)", r.stdout)
    assert.are.same({}, runs.live(B))
    local dead = r.stdout:match("run (%d+): cannot reach")
    -- --forget: first what it would drop, then dropping it.
    local dry = home:moonbox("reap", "--forget", dead, "--dry-run")
    assert.are.equal(0, dry.code, dry.stderr)
    assert.are.equal(2, select(2, dry.stdout:gsub("would forget sbx%-", "")), dry.stdout)
    assert.matches("holds sbx%-", home:moonbox("ps").stdout)
    local forget = home:moonbox("reap", "--forget", dead)
    assert.are.equal(0, forget.code, forget.stderr)
    assert.matches("run " .. dead .. ": 2 forgotten", forget.stdout)
    assert.is_nil(home:moonbox("ps").stdout:find("holds", 1, true))
    local again = home:moonbox("reap")
    assert.are.equal(0, again.code, again.stdout .. again.stderr)
  end))

  it("reports a terminate that keeps failing and leaves it for the next reap", T.async(function()
    killed_run(home, 3)
    local ids = {}
    for id in pairs(runs.live(B)) do ids[#ids + 1] = id end
    table.sort(ids)
    B:req("PUT", "/_moonbox/faults", { body = "POST /v1/sandboxes/" .. ids[1] .. "/terminate=400" })
    local r = home:moonbox("reap")
    B:req("DELETE", "/_moonbox/faults")
    assert.are.equal(1, r.code, r.stdout .. r.stderr)
    assert.matches("could not settle " .. ids[1]:gsub("%-", "%%-") .. ": .*injected fault", r.stdout)
    assert.matches("2 terminated, 0 already gone, 0 never made, 1 failed", r.stdout)
    assert.are.same({ [ids[1]] = "running" }, runs.live(B))
    local again = home:moonbox("reap")
    assert.are.equal(0, again.code, again.stdout .. again.stderr)
    assert.matches("1 terminated", again.stdout)
    assert.are.same({}, runs.live(B))
  end))

  it("refuses to forget a run that is alive, and an id it does not know", T.async(function()
    local r = home:moonbox("reap", "--forget", "999999")
    assert.are.equal(1, r.code)
    assert.matches("no run 999999 in the ledger", r.stderr)
    r = home:moonbox("reap", "--forget", "x")
    assert.are.equal(2, r.code)
  end))
end)
