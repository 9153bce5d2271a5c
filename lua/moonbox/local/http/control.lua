--- moonbox.local.http.control — /_moonbox: fault injection rules, the request journal, health.
-- Authenticated by the API key like /v1, and never subject to injected faults (a `*` latency
-- rule must not stop anyone from removing it).
local json = require "moonbox.json"
local route = require "moonbox.local.http.route"
local core = require "moonbox.core"

local M = {}
local fail = route.fail

--- GET /_moonbox/faults -> 200 the fault rules in force and their seed (faults:describe).
-- Raises nothing. Does not yield.
function M.get_faults(backend) return 200, backend.faults:describe() end

--- PUT /_moonbox/faults -> 200 the new rules (as GET answers). The body is {rules, seed} as JSON,
-- or the rules in the --faults text form; they replace the rules in force. Raises invalid with
-- the parser's message for rules that do not parse. Does not yield.
function M.put_faults(backend, req)
  local raw = req.body or ""
  local spec, seed = raw, nil
  local v = route.decode(raw)
  if type(v) == "table" and (v.rules ~= nil or v.seed ~= nil) then
    spec, seed = v.rules or {}, v.seed
  end
  local ok, err = pcall(backend.faults.set, backend.faults, spec, seed)
  if not ok then fail("invalid", tostring(err)) end
  return 200, backend.faults:describe()
end

--- DELETE /_moonbox/faults -> 204: no rule in force any more. Does not yield.
function M.clear_faults(backend)
  backend.faults:set({})
  return 204
end

--- GET /_moonbox/journal?since=N -> 200 the journal's entries after sequence N (default 0).
-- Raises invalid for a since that is not a non-negative integer. Does not yield.
function M.get_journal(backend, req)
  return 200, backend.journal:since(route.query_int(req, "since", 0, 0, math.maxinteger))
end

--- DELETE /_moonbox/journal -> 204: the journal is emptied. Does not yield.
function M.clear_journal(backend)
  backend.journal:clear()
  return 204
end

-- The free-space part of both health answers (backend:disk_health()).
local function disk_of(h)
  local function part(p)
    return p and { sizeBytes = p.size, freeBytes = p.avail, reserveBytes = p.reserve, low = p.low }
  end
  return { ok = h.ok, sandboxDisk = part(h.sandboxes), stateDir = part(h.state),
    problems = json.array(h.problems) }
end

--- GET /healthz (no key) -> 200 {ok = true, ready = true, disk}, or 503 {ok = false, ...} while
-- the start's recovery runs (ready = false) or when the sandbox disk or the state directory's
-- filesystem is low on space (disk.problems says which). disk: {sandboxDisk = {sizeBytes,
-- freeBytes, low}, stateDir = {sizeBytes, freeBytes, reserveBytes, low}, problems}. Raises
-- nothing. Does not yield.
function M.healthz(backend)
  local d = disk_of(backend:disk_health())
  return { ok = d.ok and backend.ready or false, ready = backend.ready or false, disk = d }
end

--- GET /_moonbox/health -> 200 {ok, ready, workspace, version, sandboxes, problems, disk, tokens}:
-- sandboxes is whether the start-up check found this machine able to run sandboxes, problems what
-- it found missing; ok is false when the disk is low (disk as /healthz's); tokens {spent,
-- slowestUseSeconds (the longest a spent token waited from mint to use), lifetimeSeconds}. While the start's
-- recovery runs, 503 with Retry-After: 1 and ready = false (/v1 answers 503 then too). Raises
-- nothing. Does not yield.
function M.health(backend)
  local d = disk_of(backend:disk_health())
  local body = { ok = d.ok and backend.ready or false, ready = backend.ready or false,
    workspace = backend.workspace, version = core.version,
    sandboxes = backend.check and backend.check.ok or false,
    problems = json.array(backend.check and backend.check.problems or {}), disk = d }
  local use = backend.svc and backend.svc.token_use
  if use then
    body.tokens = { spent = use.spent, slowestUseSeconds = math.floor(use.slowest * 1000 + 0.5) / 1000,
      lifetimeSeconds = backend.svc.limits.token_ttl }
  end
  if not backend.ready then
    body.message = "moonbox local is starting: it is recovering what its previous run left"
    return 503, body, { ["Retry-After"] = "1" }
  end
  return 200, body
end

--- control.install(control): registers the routes above through control(method, pattern,
-- handler) (moonbox.local.http: API key, no injected faults).
function M.install(control)
  control("GET", "/_moonbox/faults", M.get_faults)
  control("PUT", "/_moonbox/faults", M.put_faults)
  control("DELETE", "/_moonbox/faults", M.clear_faults)
  control("GET", "/_moonbox/journal", M.get_journal)
  control("DELETE", "/_moonbox/journal", M.clear_journal)
  control("GET", "/_moonbox/health", M.health)
end

return M
