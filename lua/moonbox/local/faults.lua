--- moonbox.local.faults — fault injection for `moonbox local` (docs/local.md, "Fault injection").
--
-- A rule matches requests by method and path and, at a given rate, makes the backend answer an
-- error status (429 with Retry-After, 500, 503, ...), drop the response of a request it has
-- nevertheless carried out (the connection closes with no reply: a create whose response was
-- lost), cut an exec's SSE stream before its terminal event, or add latency. Rules come from
-- `moonbox local --faults SPEC` and from the control endpoint `/_moonbox/faults`.
--
-- SPEC is a JSON array of rules, or the compact form `RULE;RULE;...` with
--   RULE  = MATCH "=" FAULT ["@" RATE] ["#" COUNT]
--   MATCH = "*" | METHOD " " PATH     (METHOD may be "*"; in PATH a "*" matches one segment)
--   FAULT = STATUS[":" RETRY_AFTER] | "drop" | "cut" | "edge" | "garbage" | "capture" | "latency:" MS
--         | "stall:" POINT
-- ("edge": a 403 HTML page without Render's headers, as Render's firewall answers;
-- "garbage": a 200 whose body is neither JSON nor the gzip its Content-Encoding claims, as a
-- broken proxy answers — the request is not carried out;
-- "capture": on POST .../snapshots, the capture then fails, as a full disk would make it;
-- "stall:POINT": the next operation to reach POINT (M.STALL_POINTS) stops there for good, so a
-- crash spec can SIGKILL the server at that point; its MATCH is "*", its `fired` count says it
-- got there).
-- e.g. `POST /v1/sandboxes=503@0.05;POST /v1/sandboxes=drop@0.05;*=latency:20`.
-- RATE is a probability (default 1); COUNT caps how many times the rule fires.
local json = require "moonbox.json"

local M = {}
M.__index = M

local KINDS = { status = true, drop = true, cut = true, latency = true, edge = true,
  garbage = true, capture = true, stall = true }

-- Where an operation can be stalled (moonbox.local.service calls inj:stall(point) there):
--   terminate  a sandbox's terminate, once its first write (what is in progress) is durable
--   upload     an upload whose body is spooled in <state>/tmp, before it is written inside
--   capture    a snapshot's capture, once its layer is copied and before its record says so
--   boot       a create's boot, once the sandbox's directory, cgroups and processes exist
M.STALL_POINTS = { terminate = true, upload = true, capture = true, boot = true }

local function glob_to_pattern(glob)
  local p = glob:gsub("[%^%$%(%)%%%.%[%]%+%-%?]", "%%%0"):gsub("%*", "[^/]*")
  return "^" .. p .. "$"
end

--- Validates one rule table and fills in its defaults; raises with a message naming the rule.
local function normalize(rule, i)
  local where = "fault rule " .. i
  if type(rule) ~= "table" then error(where .. ": expected an object", 0) end
  local match = rule.match or "*"
  if type(match) ~= "string" then error(where .. ": 'match' must be a string", 0) end
  local method, path = "*", "*"
  if match ~= "*" then
    method, path = match:match("^(%S+)%s+(%S+)$")
    if not method then error(where .. ": 'match' must be \"*\" or \"METHOD /path\", got " .. match, 0) end
  end
  local kind = rule.fault
  if not KINDS[kind] then
    error(where .. ": 'fault' must be status, drop, cut, edge, garbage, capture, stall or latency, got " ..
      tostring(kind), 0)
  end
  -- JSON numbers arrive as floats; the integral ones are integers here.
  local function int(v) return type(v) == "number" and math.tointeger(v) or v end
  rule.status, rule.count, rule.retry_after = int(rule.status), int(rule.count), int(rule.retry_after)
  local r = {
    match = match, method = method:upper(), path = path,
    pattern = path ~= "*" and glob_to_pattern(path) or nil,
    fault = kind, rate = rule.rate or 1, count = rule.count,
    status = rule.status, retry_after = rule.retry_after, latency_ms = rule.latency_ms,
    point = rule.point, fired = 0,
  }
  if type(r.rate) ~= "number" or r.rate < 0 or r.rate > 1 then error(where .. ": 'rate' must be 0..1", 0) end
  if kind == "status" and (math.type(r.status) ~= "integer" or r.status < 400 or r.status > 599) then
    error(where .. ": 'status' must be an HTTP error status (400..599)", 0)
  end
  if kind == "latency" and (type(r.latency_ms) ~= "number" or r.latency_ms < 0) then
    error(where .. ": 'latency_ms' must be a number >= 0", 0)
  end
  if kind == "stall" then
    if not M.STALL_POINTS[r.point] then
      local known = {}
      for p in pairs(M.STALL_POINTS) do known[#known + 1] = p end
      table.sort(known)
      error(where .. ": 'point' must be one of " .. table.concat(known, ", ") .. ", got " ..
        tostring(r.point), 0)
    end
    if match ~= "*" then
      error(where .. ": a stall rule's 'match' is \"*\" (it names a point, not a request)", 0)
    end
  end
  if r.status == 429 and r.retry_after == nil then r.retry_after = 1 end
  return r
end

--- Parses the compact form into rule tables.
local function parse_compact(spec)
  local rules = {}
  for part in spec:gmatch("[^;]+") do
    part = part:match("^%s*(.-)%s*$")
    if part ~= "" then
      local match, fault = part:match("^(.-)%s*=%s*(.+)$")
      if not match then error("fault rule '" .. part .. "': expected MATCH=FAULT", 0) end
      local count = fault:match("#(%d+)$")
      fault = fault:gsub("#%d+$", "")
      local rate = fault:match("@([%d%.]+)$")
      fault = fault:gsub("@[%d%.]+$", "")
      local rule = { match = match, rate = tonumber(rate), count = tonumber(count) }
      local st, ra = fault:match("^(%d%d%d):?(%d*)$")
      if st then
        rule.fault, rule.status, rule.retry_after = "status", math.tointeger(tonumber(st)), tonumber(ra)
      elseif fault == "drop" or fault == "cut" or fault == "edge" or fault == "garbage"
          or fault == "capture" then
        rule.fault = fault
      elseif fault:match("^stall:") then
        rule.fault, rule.point = "stall", fault:match("^stall:(.*)$")
      elseif fault:match("^latency:%d+$") then
        rule.fault, rule.latency_ms = "latency", tonumber(fault:match("%d+"))
      else
        error("fault rule '" .. part .. "': unknown fault '" .. fault .. "'", 0)
      end
      rules[#rules + 1] = rule
    end
  end
  return rules
end

--- faults.parse(spec) -> array of rules. spec is a JSON array (string or already decoded) or
-- the compact form. Raises a message naming the bad rule.
function M.parse(spec)
  if spec == nil or spec == "" then return {} end
  local list = spec
  if type(spec) == "string" then
    if spec:match("^%s*%[") then
      local v, err = json.decode(spec)
      if not v then error("faults: invalid JSON: " .. err, 0) end
      list = v
    else
      list = parse_compact(spec)
    end
  end
  if type(list) ~= "table" then error("faults: expected a list of rules", 0) end
  local out = {}
  for i, r in ipairs(list) do out[i] = normalize(r, i) end
  return out
end

--- faults.new(spec, seed) -> a fault injector.
function M.new(spec, seed)
  local self = setmetatable({ rules = M.parse(spec), seed = seed }, M)
  self:reseed(seed)
  return self
end

function M:reseed(seed)
  self.seed = seed or os.time()
  self.rng = math.random -- the global generator, seeded for reproducible runs
  math.randomseed(self.seed)
end

function M:set(spec, seed)
  self.rules = M.parse(spec)
  if seed then self:reseed(seed) end
end

local function matches(rule, method, path)
  if rule.method ~= "*" and rule.method ~= method then return false end
  if rule.pattern and not path:match(rule.pattern) then return false end
  return true
end

local function fires(self, rule)
  if rule.count and rule.fired >= rule.count then return false end
  if rule.rate < 1 and self.rng() >= rule.rate then return false end
  rule.fired = rule.fired + 1
  return true
end

--- inj:decide(method, path, kinds) -> latency_ms, fault_rule_or_nil. Sums the latency of every
-- matching latency rule that fires, and returns the first other matching rule (of the kinds
-- in the set `kinds`, default status/drop) that fires.
function M:decide(method, path, kinds)
  kinds = kinds or { status = true, drop = true, edge = true, garbage = true }
  local latency, chosen = 0, nil
  for _, rule in ipairs(self.rules) do
    if matches(rule, method, path) then
      if rule.fault == "latency" then
        if fires(self, rule) then latency = latency + rule.latency_ms end
      elseif not chosen and kinds[rule.fault] and fires(self, rule) then
        chosen = rule
      end
    end
  end
  return latency, chosen
end

--- inj:stall(point) -> the stall rule that fires at point (a name of M.STALL_POINTS), or nil.
-- Does not yield: the caller stops there (moonbox.local.service).
function M:stall(point)
  for _, rule in ipairs(self.rules) do
    if rule.fault == "stall" and rule.point == point and fires(self, rule) then return rule end
  end
  return nil
end

--- inj:describe() -> the rules with how often each fired, for the control endpoint.
function M:describe()
  local out = json.array()
  for _, r in ipairs(self.rules) do
    out[#out + 1] = {
      match = r.match, fault = r.fault, rate = r.rate, count = r.count, status = r.status,
      retry_after = r.retry_after, latency_ms = r.latency_ms, point = r.point, fired = r.fired,
    }
  end
  return { rules = out, seed = self.seed }
end

return M
