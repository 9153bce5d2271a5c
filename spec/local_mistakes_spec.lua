-- The attacker's spec of client mistakes (issue 23, item 4): an upload to a path the sandbox
-- cannot hold (a name too long, a path too deep, a device, a read-only file system) and a
-- create with an env value the kernel cannot pass (a NUL) are the client's mistakes: a 4xx
-- with an error code and a message naming no host path, never a 500, and nothing created.
local T = require "moonbox.testing"
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

local function clean_4xx(what, status, raw)
  assert(status >= 400 and status < 500, what .. ": expected a 4xx, got " .. status .. " " .. raw)
  local body = json.decode(raw)
  assert(type(body) == "table", what .. ": the error body is not an object: " .. raw)
  assert.is_string(body.message, what .. ": " .. raw)
  assert.is_string(body.code, what .. ": no error code: " .. raw)
  assert.is_nil(raw:find(B.state, 1, true), what .. ": names the state directory: " .. raw)
  assert.is_nil(raw:find("/tmp/", 1, true), what .. ": names a host temp path: " .. raw)
  assert(#raw < 1200, what .. ": the answer repeats the whole path back (" .. #raw .. " bytes)")
  return body
end

local function upload(path)
  local s, tok = B:req("POST", "/v1/sandboxes/" .. sb.id .. "/files/upload/token", { query = { path = path } })
  -- A path the kernel can never hold is refused when the token is asked for; any other
  -- mistake when the bytes arrive. Either way the answer is the 4xx checked below.
  if s ~= 201 then return s, json.encode(tok) end
  local up = http.request { method = "PUT", url = tok.uri, body = "x",
    headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/octet-stream" } }
  return up.status, up.body
end

describe("client mistakes are 4xx with a code, never 500", function()
  for _, case in ipairs {
    { "a name longer than 255 bytes", "/root/" .. ("n"):rep(300), "path_too_long" },
    { "a path longer than 4096 bytes", "/root/" .. ("d/"):rep(2100) .. "f", "path_too_long" },
    { "a device (/dev/null)", "/dev/null", "not_regular_file" },
    { "a read-only file system (/sys)", "/sys/kernel/moonbox", "read_only_path" },
    { "a read-only file system (/proc)", "/proc/sys/moonbox", nil },
  } do
    it("an upload to " .. case[1], T.async(function()
      local status, raw = upload(case[2])
      local body = clean_4xx(case[1], status, raw)
      if case[3] then assert.are.equal(case[3], body.code, raw) end
    end))
  end

  it("a create with a NUL in an env value: 400, no sandbox made", T.async(function()
    local _, before = B:req("GET", "/v1/sandboxes", { query = { ownerId = B.workspace } })
    for _, env in ipairs { { A = "a\0b" }, { A = "\0" } } do
      local r = http.request { method = "POST", url = B.url .. "/v1/sandboxes",
        body = json.encode { ownerId = B.workspace, env = env },
        headers = { Authorization = "Bearer " .. L.KEY, ["Content-Type"] = "application/json" } }
      local body = clean_4xx("NUL in env", r.status, r.body)
      assert.matches("env", body.message)
    end
    local _, after = B:req("GET", "/v1/sandboxes", { query = { ownerId = B.workspace } })
    assert.are.equal(#before, #after)
  end))
end)
