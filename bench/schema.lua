-- bench/schema.lua — what checking a call against its declared schema costs (moonbox.schema),
-- against baselines in the same run: the set lookup a hand-written check does (every key in a
-- table of known names, what moonbox did before the schema), and a bare Lua call. CPU time from
-- os.clock, the best of three rounds of `budget` seconds each.
-- Run: build/moonbox run bench/schema.lua [SECONDS_PER_ROW]
local schema = require "moonbox.schema"
require "moonbox.render"
require "moonbox.task"

local budget = tonumber(arg and arg[1]) or 0.3

-- Calls fn() until `budget` CPU seconds pass, three times; returns the best calls per second.
local function rate(fn)
  local best = 0
  for _ = 1, 3 do
    local n, t0 = 0, os.clock()
    repeat
      for _ = 1, 64 do fn() end
      n = n + 64
    until os.clock() - t0 >= budget
    best = math.max(best, n / (os.clock() - t0))
  end
  return best
end

-- The hand-written check: every key of opts in the set known (names only, no types).
local function keys_only(opts, known)
  for k in pairs(opts) do
    if not known[k] then error("unknown option " .. tostring(k)) end
  end
  return opts
end

local function known_of(name)
  local set = {}
  for k in pairs(schema.get(name).options) do set[k] = true end
  return set
end

local create = { network = "deny-all", plan = "1c-2g", lifetime = 600, env = { A = "1" }, wait = false }
local request = { method = "GET", url = "http://127.0.0.1:1/", timeout = 5, headers = {},
  connect_timeout = 2, max_body = 1024 }
require("moonbox.http_schema")
local known_create, known_request = known_of("render.sandboxes.create"), known_of("http.request")
local bare = function(x) return x end
local wrapped = schema.wrap("task.sleep", bare)

local rows = {
  { "render.sandboxes.create, 5 options", function() schema.check("render.sandboxes.create", create) end,
    "key set only", function() keys_only(create, known_create) end },
  { "http.request, 6 options", function() schema.check("http.request", request) end,
    "key set only", function() keys_only(request, known_request) end },
  { "a wrapped one-argument call (task.sleep's check)", function() wrapped(1) end,
    "the bare call", function() bare(1) end },
}

print("| check | calls/s | baseline | baseline calls/s | µs per check | cost vs baseline |")
print("|---|---:|---|---:|---:|---:|")
for _, r in ipairs(rows) do
  local a, b = rate(r[2]), rate(r[4])
  print(string.format("| %s | %.0f | %s | %.0f | %.2f | %.1f× |", r[1], a, r[3], b, 1e6 / a, b / a))
end
