-- The request vectors listed in docs/wire.md for requests moonbox.render itself sends: paths,
-- query keys, exact JSON bodies and headers, as the backend's request journal recorded them.
-- Each runs against `moonbox local` and against a dry run (moonbox.dryrun: the same service and
-- routes on the simulated engine, over the in-memory transport, whose journal records the same
-- requests).
local T = require "moonbox.testing"
local json = require "moonbox.json"
local render = require "moonbox.render"
local L = require "spec.support.local_backend"
local D = require "spec.support.dryrun_backend"

for _, backend in ipairs({ { "moonbox local", L }, { "a dry run", D } }) do
local B

describe("against " .. backend[1] .. ":", function()
backend[2].fixture(setup, teardown, function(b) B = b end)

-- Runs fn and returns the journal entries of the requests it caused.
local function journaled(fn)
  local _, before = B:req("GET", "/_moonbox/journal")
  local mark = before[#before].seq
  fn()
  local _, entries = B:req("GET", "/_moonbox/journal", { query = { since = mark } })
  local out = {}
  for _, e in ipairs(entries) do
    if not e.path:match("^/_moonbox") then out[#out + 1] = e end
  end
  return out
end

local function query_keys(q)
  local keys = {}
  for k in (q or ""):gmatch("([^&=]+)=[^&]*") do keys[k] = (keys[k] or 0) + 1 end
  return keys
end

describe("requests moonbox.render sends (the SDKs' vectors)", function()
  it("TS 4 / Py 1: create sends the options given, camelCased, and nothing else but its label",
    T.async(function()
      local sb
      local e = journaled(function()
        sb = render.sandboxes.create { plan = "pro", lifetime = 600, network = "deny-all",
          env = { NODE_ENV = "test" }, wait = false }
      end)
      assert.are.equal("POST", e[1].method)
      assert.are.equal("/v1/sandboxes", e[1].path)
      assert.are.equal("application/json", e[1].headers["content-type"])
      assert.are.equal("Bearer <redacted>", e[1].headers.authorization)
      -- Without a name of the recipe's own, the create carries moonbox's label, by which a lost
      -- answer is reconciled.
      local label = e[1].body.name
      assert.matches("^mb%-x%x+$", label)
      assert.are.same({ ownerId = B.workspace, plan = "pro", timeoutSeconds = 600, name = label,
        networkPolicy = { default = "deny-all" }, env = { NODE_ENV = "<redacted>" } }, e[1].body)
      sb:terminate()
      -- A name of the recipe's own is sent as given, and no label.
      e = journaled(function() sb = render.sandboxes.create { name = "mine", wait = false } end)
      assert.are.same({ ownerId = B.workspace, name = "mine" }, e[1].body)
      sb:terminate()
    end))

  it("TS 1 / Py 3: list sends ownerId, limit, cursor and one status per value", T.async(function()
    local e = journaled(function()
      for _ in render.sandboxes.list { status = { "running", "creating" } } do end
    end)
    assert.are.equal("GET", e[1].method)
    assert.are.equal("/v1/sandboxes", e[1].path)
    local keys = query_keys(e[1].query)
    assert.are.same({ ownerId = 1, limit = 1, status = 2 }, keys)
  end))

  it("Py 2 and 4: get and terminate use the sandbox path", T.async(function()
    local sb = render.sandboxes.create {}
    local e = journaled(function()
      render.sandboxes.get(sb.id)
      sb:terminate()
    end)
    assert.are.same({ "GET", "/v1/sandboxes/" .. sb.id }, { e[1].method, e[1].path })
    assert.are.same({ "POST", "/v1/sandboxes/" .. sb.id .. "/terminate" }, { e[2].method, e[2].path })
    assert.is_nil(e[2].body)
  end))

  it("TS 12 / Py 5-6: exec mints a stream token with {command} and posts it with SSE headers", T.async(function()
    local sb <close> = render.sandboxes.create {}
    local e = journaled(function() sb:exec("echo hi"):check() end)
    local mint, proxy
    for _, x in ipairs(e) do
      if x.path == "/v1/sandboxes/" .. sb.id .. "/runs/stream/token" then mint = x end
      if x.path == "/proxy/" .. sb.id .. "/runs/stream" then proxy = x end
    end
    assert.are.equal("POST", mint.method)
    assert.are.same({ "command" }, (function()
      local k = {}
      for name in pairs(mint.body) do k[#k + 1] = name end
      return k
    end)())
    assert.matches("echo hi", mint.body.command)
    assert.are.equal("text/event-stream", proxy.headers.accept)
    assert.are.equal("application/json", proxy.headers["content-type"])
    assert.are.equal(json.encode(mint.body), proxy.body_json) -- the full command is sent again
  end))
end)
end)
end
