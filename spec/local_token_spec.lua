-- The attacker's spec of moonbox local's connect tokens (issue 23, item 3): a token opens its
-- data-plane endpoint once. The command of a run comes from the data-plane body, so a token
-- that worked twice would let whoever saw it (a log, a proxy, a shared terminal) run anything in
-- the sandbox until it expires. A second use, one after the other or at the same moment, is
-- refused 403 before its body is read and runs nothing; a use the gate refuses (another
-- sandbox) does not spend it.
local T = require "moonbox.testing"
local task = require "moonbox.task"
local http = require "moonbox.http"
local json = require "moonbox.json"
local L = require "spec.support.local_backend"

local B, sb

setup(T.async(function()
  B = L.start()
  sb = B:create()
end))
teardown(T.async(function()
  if B then B:destroy() end
end))

local function mint(kind, body, query)
  local s, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/" .. kind .. "/token", { body = body, query = query })
  assert.are.equal(201, s, json.encode(tok))
  return tok
end

local function run(tok, command)
  return http.request { method = "POST", url = tok.uri, body = json.encode { command = command },
    headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/json" } }
end

-- Whether the file exists in the sandbox (through a fresh token of its own).
local function exists(path)
  local r = B:exec(sb.id, "test -e " .. path .. " && echo yes || echo no")
  return r.stdout == "yes\n"
end

local function refused_as_used(r, what)
  assert.are.equal(403, r.status, what .. ": " .. tostring(r.body))
  assert.matches("used already", json.decode(r.body).message, 1, true)
end

describe("a connect token opens its endpoint once", function()
  it("a sync run token: the second use is 403 and its command never runs", T.async(function()
    local tok = mint("runs/sync", { command = "echo one" })
    local first = run(tok, "echo one")
    assert.are.equal(200, first.status, first.body)
    assert.are.equal("one\n", json.decode(first.body).stdout)
    refused_as_used(run(tok, "touch /root/second-sync; echo two"), "second use")
    assert.is_false(exists("/root/second-sync"), "the second use's command ran")
  end))

  it("a stream run token: the second use is 403 and its command never runs", T.async(function()
    local tok = mint("runs/stream", { command = "echo one" })
    local first = run(tok, "echo one")
    assert.are.equal(200, first.status, first.body)
    assert.matches("exit", first.body)
    refused_as_used(run(tok, "touch /root/second-stream"), "second use")
    assert.is_false(exists("/root/second-stream"), "the second use's command ran")
  end))

  it("two uses at the same moment: exactly one runs", T.async(function()
    local tok = mint("runs/sync", { command = "true" })
    local uses = {}
    for i = 1, 8 do
      uses[i] = function() return run(tok, "mkdir -p /root/race; touch /root/race/" .. i).status end
    end
    local statuses = task.all(uses)
    table.sort(statuses)
    assert.are.same({ 200, 403, 403, 403, 403, 403, 403, 403 }, statuses)
    local r = B:exec(sb.id, "ls /root/race | wc -l")
    assert.are.equal("1\n", r.stdout)
  end))

  it("an upload token writes once; a download token reads once", T.async(function()
    local up = mint("files/upload", nil, { path = "/root/once.txt" })
    local function put(body)
      return http.request { method = "PUT", url = up.uri, body = body,
        headers = { Authorization = "Bearer " .. up.token, ["Content-Type"] = "application/octet-stream" } }
    end
    assert.are.equal(204, put("first").status)
    refused_as_used(put("second"), "second upload")
    local down = mint("files/download", nil, { path = "/root/once.txt" })
    local function get()
      return http.request { url = down.uri, headers = { Authorization = "Bearer " .. down.token } }
    end
    local g = get()
    assert.are.equal(200, g.status)
    assert.are.equal("first", g.body)
    refused_as_used(get(), "second download")
  end))

  it("a use refused for another sandbox does not spend it", T.async(function()
    local other = B:create()
    local tok = mint("runs/sync", { command = "echo mine" })
    local i, j = tok.uri:find(sb.id, 1, true)
    local elsewhere = { token = tok.token, uri = tok.uri:sub(1, i - 1) .. other.id .. tok.uri:sub(j + 1) }
    assert.are.equal(403, run(elsewhere, "echo theirs").status)
    local r = run(tok, "echo mine")
    assert.are.equal(200, r.status, r.body)
    assert.are.equal("mine\n", json.decode(r.body).stdout)
    B:req("POST", "/v1/sandboxes/" .. other.id .. "/terminate")
  end))
end)
