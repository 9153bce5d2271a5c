--- spec/support/durable.lua — what the durable-run specs share (docs/reference/durable.md):
-- a seed of their own (printed, and replayed by MOONBOX_SPEC_SEED), crash points stratified over
-- a run's journal writes, `moonbox run --durable` / `--resume` processes with extra env, a base
-- snapshot to restore from, the creates a run made as the backend's request journal shows them,
-- and the check that nothing is left running.
local proc = require "moonbox.proc"
local json = require "moonbox.json"
local L = require "spec.support.local_backend"
local runs = require "spec.support.runs"

local M = {}

--- durable.seed(name) -> the seed of spec `name`: MOONBOX_SPEC_SEED when it is set, else a
-- fresh one; printed on stderr either way, with how to replay it.
function M.seed(name)
  local given = math.tointeger(tonumber(os.getenv("MOONBOX_SPEC_SEED") or ""))
  local seed = given
  if not seed then
    local f = assert(io.open("/dev/urandom", "rb"))
    local b = f:read(4)
    f:close()
    seed = (string.unpack("<I4", b) % 1000000) + 1
  end
  io.stderr:write(string.format("spec: %s: seed %d (%s; MOONBOX_SPEC_SEED=%d replays it)\n", name, seed,
    given and "from MOONBOX_SPEC_SEED" or "fresh", seed))
  return seed
end

--- durable.crash_points(seed, total, n) -> n crash points in [1, total], one in each n-th of
-- it (stratum i is [floor((i-1)·total/n) + 1, floor(i·total/n)], the point uniform in it from
-- the seed's generator), ascending: spread over the whole run, never past its end. With a
-- total below n a stratum may be empty: it takes its lower bound (points then repeat). Raises
-- when total < 1.
function M.crash_points(seed, total, n)
  assert(math.type(total) == "integer" and total >= 1, "crash_points: no journal writes to crash at")
  local rng = math.random
  math.randomseed(seed)
  local out = {}
  for i = 1, n do
    local lo, hi = math.min((i - 1) * total // n + 1, total), i * total // n
    out[i] = rng(lo, math.max(lo, hi))
  end
  return out
end

--- durable.argv(home, env, args...) -> the argv of `moonbox ARGS...` of home (spec.support.runs)
-- with env's NAME=VALUE assignments added.
function M.argv(home, env, ...)
  local argv = home:argv({ ... })
  for i, a in ipairs(argv) do
    if a == L.BIN then
      local names = {}
      for k in pairs(env or {}) do names[#names + 1] = k end
      table.sort(names)
      for j, k in ipairs(names) do table.insert(argv, i + j - 1, k .. "=" .. env[k]) end
      break
    end
  end
  return argv
end

--- durable.moonbox(home, env, args...) -> {code, signal, stdout, stderr} of one moonbox command
-- of home with env's variables besides, run to its end (300 s at most). [yields]
function M.moonbox(home, env, ...)
  local argv = M.argv(home, env, ...)
  argv.timeout = 300
  return proc.run(argv)
end

--- durable.read_number(path) -> the integer a file holds, or nil.
function M.read_number(path)
  local f = io.open(path)
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return math.tointeger(tonumber((s:gsub("%s+$", ""))))
end

--- durable.base_snapshot(b, name) -> the id of an available filesystem snapshot on backend b of
-- a sandbox in which /root/count exists, empty (the counter the recipes' execs append to); the
-- sandbox it was captured from is terminated. [yields]
function M.base_snapshot(b, name)
  local sb = b:create { name = name, networkPolicy = { default = "deny-all" } }
  local r = b:exec(sb.id, ": > /root/count && echo made")
  assert(r.code == 0 and r.stdout == "made\n", "making /root/count in " .. sb.id .. " failed: " .. json.encode(r))
  local snap = b:settled(b:snapshot(sb.id))
  assert(snap.status == "available", "the base snapshot of " .. sb.id .. " is " .. tostring(snap.status))
  local s = b:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  assert(s == 204, "terminating " .. sb.id .. ": " .. tostring(s))
  return snap.id
end

--- durable.creates(b, since, run_id) -> {label = {answered = n, sent = n}} of the sandbox creates
-- (POST /v1/sandboxes) the backend received after journal seq since that carry a label of
-- ledger run run_id (mb-<intent>-<run_id>): how many times each logical create was sent, and
-- how many of those the backend answered 201. [yields]
function M.creates(b, since, run_id)
  local out = {}
  for _, e in ipairs(runs.requests(b, since, "POST", "/v1/sandboxes")) do
    local label = type(e.body) == "table" and e.body.name
    if type(label) == "string" and label:match("^mb%-%d+%-" .. run_id .. "$") then
      local c = out[label] or { answered = 0, sent = 0 }
      out[label] = c
      c.sent = c.sent + 1
      if e.status == 201 then c.answered = c.answered + 1 end
    end
  end
  return out
end

--- durable.check_nothing_left(b, home, what, mark): raises, naming what, unless the backend
-- lists no live sandbox, `moonbox ps` of home holds nothing and shows no run at all (none alive,
-- none resumable): runs.check_clean and more. [yields]
function M.check_nothing_left(b, home, what, mark)
  runs.check_clean(b, home, what, mark)
  local ps = home:moonbox("ps")
  if ps.stdout:find("run %d+") then error(what .. ": moonbox ps still shows a run:\n" .. ps.stdout, 2) end
end

--- durable.PRELUDE: what the recipes of the specs that crash at a named point start with:
-- die_if(point) SIGKILLs the recipe's own process when env CRASH names that point.
M.PRELUDE = [[
local render = require "moonbox.render"
local task = require "moonbox.task"
local sys = require "moonbox.sys"
local function die_if(point)
  if os.getenv("CRASH") ~= point then return end
  local f = io.open("/proc/self/stat")
  local pid = math.tointeger(tonumber(f:read("a"):match("^(%d+)")))
  f:close()
  sys.kill(pid, 9)
end
]]

return M
