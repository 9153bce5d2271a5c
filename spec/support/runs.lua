--- spec/support/runs.lua — running `moonbox run`, `moonbox ps` and `moonbox reap` as a user
-- would, in a home directory of their own, against a real `moonbox local` (a URL one started by
-- spec/support/local_backend.lua, or the embedded one of that home), and reading what they say.
local proc = require "moonbox.proc"
local json = require "moonbox.json"
local task = require "moonbox.task"
local L = require "spec.support.local_backend"

local M = {}

--- runs.TIMES: how many times the lifecycle specs repeat each repro: 20 (issue 12). A sanitized
-- build (./dev test --asan) is there to check the C underneath for memory errors, which a few
-- repetitions exercise as well as twenty; it runs 5, and the specs print that they did.
M.TIMES = require("moonbox.build").sanitized and 5 or 20
if M.TIMES ~= 20 then
  io.stderr:write("spec: sanitized build: each lifecycle repro runs ", M.TIMES, " times (20 in the plain build)\n")
end

local Home = {}
Home.__index = Home

--- runs.home(backend) -> a fresh home: its moonbox state (ledger, embedded backend) lives under
-- it. With backend (from local_backend.start) the commands point at it through
-- RENDER_LOCAL_DEV_URL; without, they use the embedded local backend of that home. [yields]
function M.home(backend)
  local dir = proc.run({ "mktemp", "-d", "/tmp/moonbox-runs-spec.XXXXXX" }).stdout:gsub("%s+$", "")
  -- store: MOONBOX_DATABASE_URL of a fresh database when the spec runs on PostgreSQL
  return setmetatable({ dir = dir, B = backend, n = 0, store = require("spec.support.store_env").vars() },
    Home)
end

--- runs.fixture(setup, teardown, ready, opts): the preamble of the specs that run moonbox
-- commands against one real `moonbox local`: through the spec's own busted setup and teardown
-- (pass them: a support module does not see a spec's environment), setup starts a backend
-- (local_backend.fixture, moonbox.render left alone; opts as for local_backend.start) and a
-- fresh home pointed at it and hands both to ready(B, home); teardown destroys the home, then
-- the backend.
function M.fixture(setup, teardown, ready, opts)
  local o = { render = false }
  for k, v in pairs(opts or {}) do o[k] = v end
  L.fixture(setup, teardown, function(b)
    local h = M.home(b)
    ready(b, h)
    return function() h:destroy() end
  end, o)
end

--- runs.check_clean(B, home, what, mark): after a run that began at journal seq mark, waits for
-- the backend to finish what it still works on (a client gone is no reason for it to stop), then
-- raises, naming what, unless it lists no live sandbox and `moonbox ps` of home succeeds
-- holding nothing. [yields]
function M.check_clean(b, home, what, mark)
  M.settled(b, mark)
  local live = M.live(b)
  if next(live) then error(what .. ": sandboxes left running: " .. json.encode(live), 2) end
  local ps = home:moonbox("ps")
  if ps.code ~= 0 then error(what .. ": moonbox ps exited " .. tostring(ps.code) .. ": " .. ps.stderr, 2) end
  if ps.stdout:find("holds", 1, true) then error(what .. ": moonbox ps still holds:\n" .. ps.stdout, 2) end
end

--- runs.repeat_failing(b, home, t) -> how many creates the backend answered over all runs: the
-- loop of the lifecycle repros. t.times times: sets the backend's faults to t.faults, calls
-- t.run() (-> {code, stdout, stderr} of one moonbox command), clears the faults, and raises
-- unless that run exited 1 with stderr matching the pattern t.failure, t.check(r, what) (when
-- given) passes, and check_clean finds nothing left. t.label names a run in errors ("run").
-- [yields]
function M.repeat_failing(b, home, t)
  local answered = 0
  for i = 1, t.times do
    local mark = M.last_seq(b)
    b:faults(t.faults)
    local r = t.run()
    b:faults("")
    local what = string.format("%s %d of %d: %s", t.label or "run", i, t.times, r.stderr)
    if r.code ~= 1 then error(what .. ": exited " .. tostring(r.code) .. ", not 1\n" .. r.stdout, 2) end
    if not r.stderr:find(t.failure) then error(what .. ": stderr does not match " .. t.failure, 2) end
    if t.check then t.check(r, what) end
    M.check_clean(b, home, what, mark)
    answered = answered + M.creates_answered(b, mark) -- once settled: the creates it finished too
  end
  return answered
end

--- runs.sibling_fails(n, after, work) -> the text of a recipe whose task.map of n items has
-- its first item fail with error("x") — at the recipe's line 4 — `after` seconds in, while every
-- other item runs the Lua statement(s) work: the lifecycle repros' cancellation.
function M.sibling_fails(n, after, work)
  local items = {}
  for i = 1, n do items[i] = i end
  return string.format([[
local render = require "moonbox.render"
local task = require "moonbox.task"
task.map({ %s }, function(i)
  if i == 1 then task.sleep(%s) error("x") end
  %s
end)
]], table.concat(items, ", "), after, work)
end

--- runs.creates_answered(b, mark) -> how many sandbox creates (POST /v1/sandboxes) the backend
-- answered 201 after journal seq mark. [yields]
function M.creates_answered(b, mark)
  local n = 0
  for _, e in ipairs(M.requests(b, mark, "POST", "/v1/sandboxes")) do
    if e.status == 201 then n = n + 1 end
  end
  return n
end

--- home:on(backend) -> the same home (same ledger, same recipes directory) with its commands
-- pointed at another backend.
function Home:on(backend)
  return setmetatable({ dir = self.dir, B = backend, n = self.n + 1000, store = self.store }, Home)
end

--- home:state_dir() -> the embedded backend's state dir of this home.
function Home:state_dir() return self.dir .. "/.local/state/moonbox/local" end

--- runs.images() -> where the local backend's base images are cached for this process (the
-- backend's own rule, moonbox.local.image.dir). A home of its own must not move that cache:
-- building an image takes minutes.
M.images = require("moonbox.local.image").dir

--- home:argv(args) -> argv of `env ... moonbox ARGS...` for this home.
function Home:argv(args)
  local argv = { "env", "-u", "RENDER_API_KEY", "-u", "RENDER_LOCAL_DEV_URL", "-u", "RENDER_USE_LOCAL_DEV",
    "-u", "RENDER_WORKSPACE_ID", "HOME=" .. self.dir, "XDG_STATE_HOME=", "MOONBOX_IMAGES=" .. M.images() }
  if self.B then
    for _, kv in ipairs { "RENDER_API_KEY=" .. self.B.key, "RENDER_WORKSPACE_ID=" .. self.B.workspace,
      "RENDER_LOCAL_DEV_URL=" .. self.B.url } do
      argv[#argv + 1] = kv
    end
  end
  for _, kv in ipairs(self.store or {}) do argv[#argv + 1] = kv end
  argv[#argv + 1] = L.BIN
  for _, a in ipairs(args) do argv[#argv + 1] = a end
  return argv
end

--- home:recipe(text) -> the path of a new recipe file holding text.
function Home:recipe(text)
  self.n = self.n + 1
  local path = string.format("%s/recipe-%d.lua", self.dir, self.n)
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  return path
end

--- home:moonbox(args...) -> {code, stdout, stderr}: runs one moonbox command to its end. [yields]
function Home:moonbox(...)
  return proc.run(self:argv({ ... }))
end

--- home:spawn(args...) -> Process: starts one moonbox command (stdout and stderr piped). [yields]
function Home:spawn(...)
  local argv = self:argv({ ... })
  argv.stdout, argv.stderr = "pipe", "pipe"
  return proc.spawn(argv)
end

--- home:destroy(): removes the home (after stopping nothing: its processes must be gone). [yields]
function Home:destroy()
  L.remove_tree(self.dir)
end

--- runs.ps_sandboxes(text) -> {id = status} of every sandbox `moonbox ps` says a dead run holds
-- and its backend lists (a lost create's label resolved to its sandbox included), and the
-- number of held entries it could not check.
function M.ps_sandboxes(text)
  local out, unchecked, entries = {}, 0, 0
  for line in text:gmatch("[^\n]+") do
    if line:match("^  holds ") then
      entries = entries + 1
      local id, state = line:match("^  holds (sbx%-%w+) %(intent %d+%)  (%S+)")
      if not id then
        id, state = line:match("^  holds unknown create %S+ %(answer lost; intent %d+%)  is (sbx%-%w+) (%S+)")
      end
      if id and state ~= "gone" then
        out[id] = state
      elseif not line:match("  gone %(") and not line:match("no sandbox carries its label") then
        unchecked = unchecked + 1
      end
    end
  end
  return out, unchecked, entries
end

--- runs.live(c_or_backend) -> {id = status} of every sandbox the backend lists as not
-- terminated. Accepts a local_backend (its req) or a render Conn. [yields]
function M.live(b)
  local out, cursor = {}, nil
  local api = require "moonbox.render.api"
  repeat
    local page
    if b.req then
      local status
      status, page = b:req("GET", "/v1/sandboxes", { query = { limit = 100, cursor = cursor } })
      assert(status == 200, "listing sandboxes failed: " .. tostring(status))
    else
      page = api.call(b, "sandboxes.list", "GET", "/sandboxes", { query = { ownerId = b.workspace, limit = 100,
        cursor = cursor } })
    end
    for _, e in ipairs(page) do out[e.sandbox.id] = e.sandbox.status end
    cursor = page[#page] and page[#page].cursor
  until #page < 100
  return out
end

--- runs.fanout(kind, t) -> the text of a recipe that fans out to t.n sandboxes (20) and execs
-- `echo` in each: kind "task.map" (t.n creates, t.concurrency at a time (8), each then t.execs
-- execs (1)) or "render.restore" (a fleet of t.n made 8 at a time, then one exec in each,
-- t.exec_concurrency at a time (8)): what the SIGKILL repros kill at random points.
function M.fanout(kind, t)
  t = t or {}
  if kind == "task.map" then
    return string.format([[
local render = require "moonbox.render"
local task = require "moonbox.task"
local items = {}
for i = 1, %d do items[i] = i end
task.map(items, function(i)
  local sb <close> = render.sandboxes.create {}
  for _ = 1, %d do sb:exec("echo " .. i):check() end
end, { concurrency = %d })
]], t.n or 20, t.execs or 1, t.concurrency or 8)
  end
  assert(kind == "render.restore", "no fan-out recipe of kind " .. tostring(kind))
  return string.format([[
local render = require "moonbox.render"
local task = require "moonbox.task"
local fleet <close> = render.restore(nil, { count = %d, concurrency = 8 })
task.map(fleet, function(sb, i) sb:exec("echo " .. i):check() end, { concurrency = %d })
]], t.n or 20, t.exec_concurrency or 8)
end

--- runs.keys(set) -> the keys of set, sorted.
function M.keys(set)
  local out = {}
  for k in pairs(set) do out[#out + 1] = k end
  table.sort(out)
  return out
end

--- runs.count(set) -> number of keys.
function M.count(set)
  local n = 0
  for _ in pairs(set) do n = n + 1 end
  return n
end

--- runs.journal(b, since) -> the backend's journal entries after seq `since` (b: a local_backend,
-- or {url, key} of an embedded one), leaving out the control endpoint's own (/_moonbox). [yields]
function M.journal(b, since)
  local http = require "moonbox.http"
  local r = http.request { url = b.url .. "/_moonbox/journal?since=" .. (since or 0),
    headers = { Authorization = "Bearer " .. b.key } }
  assert(r.status == 200, "journal: " .. r.status)
  local out = {}
  for _, e in ipairs(json.decode(r.body)) do
    if not e.path:match("^/_moonbox") then out[#out + 1] = e end
  end
  return out
end

--- runs.requests(b, since, method, path) -> the journal entries (runs.journal) after seq
-- since whose method and path are those, oldest first. [yields]
function M.requests(b, since, method, path)
  local out = {}
  for _, e in ipairs(M.journal(b, since)) do
    if e.method == method and e.path == path then out[#out + 1] = e end
  end
  return out
end

--- runs.settled(b, since): waits until the backend has answered every request it received after
-- `since` (a client killed mid-request leaves the backend finishing it). Polls: the backend has
-- no event for it; at most 60 s. [yields]
function M.settled(b, since)
  for _ = 1, 600 do
    local pending = false
    for _, e in ipairs(M.journal(b, since)) do
      if e.status == nil then pending = true end
    end
    if not pending then return end
    task.sleep(0.1)
  end
  error("the backend still had requests in progress after 60 s")
end

--- runs.until_requests(b, since, n, p): waits until the backend has received n requests after
-- `since` or process p has ended; returns whether p is still running. [yields]
function M.until_requests(b, since, n, p)
  local interval = 0.002
  while true do
    if not p:kill(0) then return false end
    if #M.journal(b, since) >= n then return true end
    task.sleep(interval)
    interval = math.min(interval * 2, 0.02)
  end
end

--- runs.last_seq(b) -> the seq of the backend's newest journal entry (0 when empty). [yields]
function M.last_seq(b)
  local http = require "moonbox.http"
  local r = http.request { url = b.url .. "/_moonbox/journal?since=0", headers = { Authorization = "Bearer " .. b.key } }
  local j = json.decode(r.body)
  return #j > 0 and j[#j].seq or 0
end

return M
