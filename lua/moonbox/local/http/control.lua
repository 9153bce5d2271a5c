--- moonbox.local.http.control — /_moonbox: fault injection rules, the request journal, health.
-- Authenticated by the API key like /v1, and never subject to injected faults (a `*` latency
-- rule must not stop anyone from removing it).
local json = require "moonbox.json"
local route = require "moonbox.local.http.route"

local M = {}
local fail = route.fail

function M.get_faults(b) return 200, b.faults:describe() end

function M.put_faults(b, req)
  local raw = req.body or ""
  local spec, seed = raw, nil
  local v = route.decode(raw)
  if type(v) == "table" and (v.rules ~= nil or v.seed ~= nil) then
    spec, seed = v.rules or {}, v.seed
  end
  local ok, err = pcall(b.faults.set, b.faults, spec, seed)
  if not ok then fail("invalid", tostring(err)) end
  return 200, b.faults:describe()
end

function M.clear_faults(b)
  b.faults:set({})
  return 204
end

function M.get_journal(b, req)
  return 200, b.journal:since(route.query_int(req, "since", 0, 0, math.maxinteger))
end

function M.clear_journal(b)
  b.journal:clear()
  return 204
end

function M.health(b)
  return 200, { ok = true, workspace = b.workspace, version = require("moonbox.core").version,
    sandboxes = b.check and b.check.ok or false, problems = json.array(b.check and b.check.problems or {}) }
end

function M.install(r)
  r("GET", "/_moonbox/faults", M.get_faults)
  r("PUT", "/_moonbox/faults", M.put_faults)
  r("DELETE", "/_moonbox/faults", M.clear_faults)
  r("GET", "/_moonbox/journal", M.get_journal)
  r("DELETE", "/_moonbox/journal", M.clear_journal)
  r("GET", "/_moonbox/health", M.health)
end

return M
