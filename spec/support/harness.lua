--- spec/support/harness.lua — a seeded, randomized concurrency and fault harness against a real
-- `moonbox local` (in the spirit of Jepsen and FoundationDB's simulation). It starts the server as
-- a process, drives it over real HTTP with random mixes of create, restore (filesystem and
-- runtime snapshots), exec (writing random files, deleting some), upload, download, capture,
-- snapshot delete and terminate, a few at a time, and SIGKILLs and restarts the server on the
-- same state directory at seeded points: between rounds, or after a seeded delay while a round's
-- operations are in flight. It keeps its own model of what must be true (each sandbox's tree
-- under /root/h and each snapshot's captured tree: path, size, sha256 of every file it wrote) and
-- checks invariants after every round and every restart, by asking the API and by looking at
-- the host (the state dir's sandboxes/, layers/ and tmp/, /proc, the cgroup hierarchies,
-- /proc/self/mountinfo). Used by spec/local_harness_spec.lua (short, CI) and bench/integrity.lua
-- (long).
--
-- What a seed fixes: every random number the harness draws comes from its own generator
-- (splitmix64) seeded with the seed, in a fixed order: the plan (the number of operations per
-- round, each operation's kind roll, target roll and argument seed, its start delay inside the
-- round, and which rounds end in a kill and after what delay) is drawn up front, before anything
-- runs; file names, sizes and contents come from each operation's own argument seed. What a seed
-- does not fix: the kernel's and the server's timing (how far a capture, a terminate or an
-- upload got when the SIGKILL lands, which of two concurrent requests the server takes first,
-- whether a kill lands before or after an operation's answer). A target is chosen as "the n-th
-- eligible object" from the model; while the outcomes of the operations are the same, a replay
-- runs the same operations on the same objects in the same rounds with the same kill points.
-- When an outcome differs (a capture killed before it finished in one run and after in another),
-- the runs diverge from that point on, in targets only: the kinds, arguments and kill points
-- stay those of the seed.
local core = require "moonbox.core"
local task = require "moonbox.task"
local proc = require "moonbox.proc"
local http = require "moonbox.http"
local json = require "moonbox.json"
local L = require "spec.support.local_backend"
local files = require "spec.support.files"
local hash = require("moonbox.local.engine.host").hash

local M = {}

-- ---- the generator --------------------------------------------------------------------------

local Rng = {}
Rng.__index = Rng

--- M.rng(seed) -> a splitmix64 generator: r:next() (64-bit integer), r:int(lo, hi),
-- r:float() in [0, 1), r:chance(p), r:pick(list).
function M.rng(seed)
  return setmetatable({ s = math.tointeger(seed) or 0 }, Rng)
end

function Rng:next()
  self.s = self.s + 0x9E3779B97F4A7C15
  local z = self.s
  z = (z ~ (z >> 30)) * 0xBF58476D1CE4E5B9
  z = (z ~ (z >> 27)) * 0x94D049BB133111EB
  return z ~ (z >> 31)
end

function Rng:int(lo, hi) return lo + ((self:next() >> 1) % (hi - lo + 1)) end
function Rng:float() return (self:next() >> 11) / 9007199254740992.0 end
function Rng:chance(p) return self:float() < p end
function Rng:pick(list) return list[self:int(1, #list)] end

-- ---- operation kinds ------------------------------------------------------------------------

M.KINDS = { "create", "restore", "exec", "upload", "download", "capture", "delete", "terminate" }
local WEIGHTS = { create = 8, restore = 12, exec = 20, upload = 10, download = 8, capture = 16, delete = 9,
  terminate = 14 }
local MAX_LIVE = 6      -- sandboxes running at once: a create beyond it becomes a terminate
local MAX_SNAPS = 10    -- available snapshots: a capture beyond it becomes a delete
local ROOT = "/root/h"  -- where every file the harness writes lives, inside each sandbox

local function roll_kind(roll)
  local total = 0
  for _, k in ipairs(M.KINDS) do total = total + WEIGHTS[k] end
  local x = roll % total
  for _, k in ipairs(M.KINDS) do
    if x < WEIGHTS[k] then return k end
    x = x - WEIGHTS[k]
  end
end

-- The server's crash point (its fault injection's stall:POINT) each kind can be killed at.
local STALL_POINT = { create = "boot", restore = "boot", upload = "upload", capture = "capture",
  terminate = "terminate" }

--- M.plan(seed, opts) -> rounds: what the seed fixes, drawn before anything runs. opts: ops
-- (operations), kills, concurrency (most operations per round). Each round is
-- { ops = { {n, kind, target, arg, delay}... }, kill = nil | { during = seconds | false,
-- create_at_open, point = nil | a crash point (its operation held there, then the kill) } }.
function M.plan(seed, opts)
  local r = M.rng(seed)
  local rounds, n = {}, 0
  while n < opts.ops do
    local size = math.min(r:int(1, opts.concurrency), opts.ops - n)
    local round = { ops = {} }
    for _ = 1, size do
      n = n + 1
      round.ops[#round.ops + 1] = { n = n, kind = roll_kind(r:next() >> 1), target = r:next() >> 1,
        arg = r:next(), delay = r:int(0, 150) / 1000 }
    end
    rounds[#rounds + 1] = round
  end
  -- Kills: distinct rounds (never the first, so there is something to kill), 60% of them while
  -- the round's operations run (5 to 605 ms after it starts, most early: operations take
  -- 50-500 ms), the rest after the round ended.
  local kills = math.min(opts.kills, #rounds - 1)
  local chosen = {}
  while kills > 0 do
    local i = r:int(2, #rounds)
    if not chosen[i] then
      chosen[i] = true
      kills = kills - 1
      local kill = { during = r:chance(0.6) and (5 + math.floor(r:float() ^ 2 * 600)) / 1000 or false,
        create_at_open = r:chance(0.7) }
      -- Three in five of the kills that can land at a crash point of one of the round's operations do: the
      -- server's stall fault (moonbox.local.faults) holds the operation there, then the SIGKILL.
      local points = {}
      for _, op in ipairs(rounds[i].ops) do
        if STALL_POINT[op.kind] then points[#points + 1] = STALL_POINT[op.kind] end
      end
      if #points > 0 and r:chance(0.6) then kill.point = r:pick(points) end
      rounds[i].kill = kill
    end
  end
  return rounds
end

-- ---- content --------------------------------------------------------------------------------

-- The bytes of a file written by exec: `yes TOKEN | head -c SIZE` inside, the same here.
local function yes_content(token, size)
  local line = token .. "\n"
  return line:rep(size // #line + 1):sub(1, size)
end

-- The bytes of an upload: a block of the generator's bytes, repeated up to size.
local function upload_content(r, size)
  local parts = {}
  for i = 1, math.min(size, 65536) // 8 + 1 do parts[i] = string.pack("<i8", r:next()) end
  local block = table.concat(parts)
  return block:rep(size // #block + 1):sub(1, size)
end

local function sha256(content)
  local res = proc.run { "sha256sum", input = content }
  return assert(res.stdout:match("^(%x+)"), "sha256sum: " .. res.stderr)
end

local function copy_tree(t)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  return c
end

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks)
  return ks
end

-- A list of what differs between two trees ({path = {size, sha}}), "" when none.
local function tree_diff(want, got)
  local out = {}
  for _, p in ipairs(sorted_keys(want)) do
    local w, g = want[p], got[p]
    if not g then out[#out + 1] = "missing " .. p .. " (" .. w.size .. " bytes)"
    elseif g.size ~= w.size or g.sha ~= w.sha then
      out[#out + 1] = string.format("%s is %d bytes %s, wrote %d bytes %s", p, g.size, g.sha:sub(1, 12), w.size,
        w.sha:sub(1, 12))
    end
  end
  for _, p in ipairs(sorted_keys(got)) do
    if not want[p] then out[#out + 1] = "unexpected " .. p end
  end
  if #out > 8 then
    local n = #out
    for i = #out, 9, -1 do out[i] = nil end
    out[#out + 1] = "... " .. (n - 8) .. " more"
  end
  return table.concat(out, "; ")
end

-- ---- the harness ----------------------------------------------------------------------------

local H = {}
H.__index = H

--- M.new(opts) -> harness. opts: seed, ops, kills, concurrency (default 3), log (function(line),
-- default print), keep_log (path: write the operation log there too), sample_every (verify one
-- available snapshot by restoring it after every this many rounds; default 2), big_uploads
-- (allow uploads of 8-24 MB; default true), stop_after (an operation number: end the run at the
-- first round after it, with the same plan: replays the start of a long run), progress
-- (function(line): progress and violations as they happen).
function M.new(opts)
  local self = setmetatable({
    seed = math.tointeger(opts.seed) or error("harness: seed must be an integer"),
    ops = opts.ops or 200, kills = opts.kills or 5, concurrency = opts.concurrency or 3,
    print = opts.log or print, sample_every = opts.sample_every or 2,
    big_uploads = opts.big_uploads ~= false, progress = opts.progress, stop_after = opts.stop_after,
    sandboxes = {}, snapshots = {}, order = { sandboxes = {}, snapshots = {} },
    oplog = {}, violations = {}, counts = { kills = 0, restarts = 0, lost = 0, checks = 0, verified = 0,
      at_point = {} },
    by_kind = {}, epoch = 0, round = 0, seen = {},
  }, H)
  for _, k in ipairs(M.KINDS) do self.by_kind[k] = 0 end
  return self
end

function H:log(line)
  local s = string.format("[%7.2f r%d] %s", core.now() - (self.t0 or core.now()), self.round, line)
  self.oplog[#self.oplog + 1] = s
  if self.verbose then self.print(s) end
end

--- h:violation(name, detail[, key]): records that invariant name does not hold. With a key (the
-- object it is about), a fact seen again later is counted once (the log says it again).
function H:violation(name, detail, key)
  if key then
    local k = name .. " " .. key
    if self.seen[k] then return self:log("(again) " .. name .. ": " .. detail) end
    self.seen[k] = true
  end
  local v = { name = name, detail = detail, round = self.round, epoch = self.epoch }
  self.violations[#self.violations + 1] = v
  self:log("VIOLATION " .. name .. ": " .. detail)
  -- a long run says it at once, not only at its end
  if self.progress then self.progress(string.format("  VIOLATION %s (round %d, server %d): %s", name, self.round,
    self.epoch, detail:sub(1, 600))) end
end

-- ---- the server -----------------------------------------------------------------------------

-- Starts `moonbox local` on the state dir (a fresh one the first time) on self.port (0 the first
-- time: the kernel picks, later starts reuse it so a client can send the moment it opens).
-- Returns once the process is spawned; h:await_port() waits for the first answer. [yields]
function H:spawn()
  if not self.state then
    self.state = proc.run({ "mktemp", "-d", "/tmp/moonbox-harness.XXXXXX" }).stdout:gsub("%s+$", "")
    self.server_log = self.state .. ".log"
    self.tag = hash(self.state)
  end
  local argv = { L.BIN, "local", "--port", tostring(self.port or 0), "--state", self.state, "--api-key", L.KEY,
    "--workspace", L.WORKSPACE, stderr = { file = self.server_log, append = true } }
  self.p = proc.spawn(argv)
  self.epoch = self.epoch + 1
  local p = self.p
  self.lines_task = task.spawn(function()
    local lines = p:lines("stdout")
    for line in lines do
      local url = line:match("^RENDER_LOCAL_DEV_URL=(.*)$")
      if url then self.printed_url = url end
    end
  end)
end

-- The first start: waits for the printed address (the port is the kernel's choice). [yields]
function H:start_first()
  self:spawn()
  local deadline = core.now() + 120
  while not self.printed_url do
    if core.now() > deadline then error("moonbox local did not print its address; see " .. self.server_log) end
    if task.result(self.lines_task) ~= nil and not self.printed_url then
      error("moonbox local exited before printing its address; see " .. self.server_log)
    end
    task.sleep(0.01)
  end
  self.url = self.printed_url
  self.port = tonumber(self.url:match(":(%d+)$"))
end

function H:kill()
  self.p:kill("KILL")
  self.p:wait()
  pcall(task.join, self.lines_task)
  self.counts.kills = self.counts.kills + 1
end

--- h:close(): SIGTERM, wait, and (keep = false) remove the state directory. [yields]
function H:close(keep)
  if self.p then
    pcall(self.p.kill, self.p, "TERM")
    pcall(self.p.wait, self.p)
    if self.lines_task then pcall(task.join, self.lines_task) end
  end
  -- The sandbox disk (a loop device) goes with the server's SIGTERM; a server that could not
  -- unmount it must not leave it, nor the loop device, behind whatever the outcome.
  if self.state and proc.run({ "mountpoint", "-q", self.state .. "/sandboxes" }).code == 0 then
    proc.run { "umount", "-l", self.state .. "/sandboxes" }
  end
  if not keep and self.state then
    proc.run { "rm", "-rf", "--one-file-system", self.state }
    os.remove(self.server_log)
  end
end

-- ---- requests -------------------------------------------------------------------------------

-- One API request: status, decoded body, headers; or nil and the transport error (the server
-- died under it). A 503 with Retry-After (a server still recovering) is waited out, as a client
-- would; nothing else is retried. [yields]
function H:req(method, path, opts)
  opts = opts or {}
  local headers = { Accept = "application/json", Authorization = "Bearer " .. L.KEY }
  local body = opts.body
  if type(body) == "table" then
    body = json.encode(body)
    headers["Content-Type"] = "application/json"
  end
  local url = self.url .. path .. L.encode_query(opts.query)
  local deadline = core.now() + 120
  while true do
    local ok, r = pcall(http.request, { method = method, url = url, headers = headers, body = body,
      timeout = opts.timeout or 90, no_resend = method ~= "GET" or nil })
    if not ok then return nil, r end
    local decoded = r.body
    if (r.headers["content-type"] or ""):find("json", 1, true) then
      local dok, d = pcall(json.decode, r.body)
      if dok then decoded = d end
    end
    local after = tonumber(r.headers["retry-after"] or "")
    if r.status == 503 and after and core.now() < deadline then
      task.sleep(math.min(after, 1))
    else
      return r.status, decoded, r.headers
    end
  end
end

local function describe_answer(status, body)
  if not status then return "no answer (" .. tostring(type(body) == "table" and body.message or body) .. ")" end
  local b = type(body) == "table" and json.encode(body) or tostring(body)
  return status .. " " .. b:sub(1, 300)
end

-- Runs a command in a sandbox through a stream token: {code, stdout, stderr} or nil, why. [yields]
function H:exec(id, command)
  local status, tok = self:req("POST", "/v1/sandboxes/" .. id .. "/runs/stream/token", { body = { command = command } })
  if status ~= 201 then return nil, "exec token: " .. describe_answer(status, tok) end
  local ok, res = pcall(function()
    local resp <close> = http.stream { method = "POST", url = tok.uri, body = json.encode({ command = command }),
      headers = { Authorization = "Bearer " .. tok.token, Accept = "text/event-stream",
        ["Content-Type"] = "application/json" }, timeout = 120, no_resend = true }
    local out = { stdout = {}, stderr = {} }
    if resp.status ~= 200 then return { http = resp.status, stderr = resp:read() or "" } end
    while true do
      local ev = resp:read_event()
      if not ev then break end
      local d = json.decode(ev.data)
      if ev.event == "output" then table.insert(out[d.stream], d.data)
      elseif ev.event == "exit" then out.code = d.exit_code end
    end
    out.stdout, out.stderr = table.concat(out.stdout), table.concat(out.stderr)
    return out
  end)
  if not ok then return nil, "exec stream: " .. tostring(type(res) == "table" and res.message or res) end
  if res.http then return nil, "exec stream answered " .. res.http .. ": " .. res.stderr end
  if res.code == nil then return nil, "exec stream ended without an exit event" end
  return res
end

-- A file token's URI and token. [yields]
function H:file_token(id, op, path)
  local status, tok = self:req("POST", "/v1/sandboxes/" .. id .. "/files/" .. op .. "/token",
    { query = { path = path } })
  if status ~= 201 then return nil, op .. " token: " .. describe_answer(status, tok) end
  return tok
end

-- GET a sandbox's record: the record, or nil and why. [yields]
function H:get_sandbox(id)
  local status, sb = self:req("GET", "/v1/sandboxes/" .. id)
  if status ~= 200 then return nil, describe_answer(status, sb) end
  return sb
end

-- Waits for a booting sandbox to leave creating: its record. [yields]
function H:settle(id)
  local deadline = core.now() + 90
  while true do
    local sb, why = self:get_sandbox(id)
    if not sb then return nil, why end
    if sb.status ~= "creating" or core.now() > deadline then return sb end
    task.sleep(0.05)
  end
end

function H:snap_path(sid)
  return "/v1/sandbox-groups/" .. self.group .. "/snapshots/" .. sid
end

-- Every page of a listing. [yields]
function H:list_all(path, query, field)
  local out, cursor = {}, nil
  repeat
    local q = { limit = 100, cursor = cursor }
    for k, v in pairs(query or {}) do q[k] = v end
    local status, page = self:req("GET", path, { query = q })
    if status ~= 200 then return nil, describe_answer(status, page) end
    for _, item in ipairs(page) do out[#out + 1] = item[field] or item end
    cursor = page[#page] and page[#page].cursor
  until #page < 100
  return out
end

-- ---- the model ------------------------------------------------------------------------------
-- sandboxes[id] = { id, status = "running" | "terminated" | "dead" (errored by a restart or a
--   failure) | "unsure" (an operation on it failed: its tree is no longer known), tree,
--   lowers = {snapshot ids...} (restored from: the layer chain it holds), epoch }
-- snapshots[id] = { id, source, kind, tree, layers = {snapshot ids: its own first}, status =
--   "available" | "failed" | "deleted" }

function H:add_sandbox(id, tree, lowers)
  local sb = { id = id, status = "running", tree = tree or {}, lowers = lowers or {}, epoch = self.epoch }
  self.sandboxes[id] = sb
  self.order.sandboxes[#self.order.sandboxes + 1] = id
  return sb
end

function H:add_snapshot(id, source, kind, status)
  local sb = self.sandboxes[source]
  local layers = { id }
  for _, l in ipairs(sb.lowers) do layers[#layers + 1] = l end
  local snap = { id = id, source = source, kind = kind, tree = copy_tree(sb.tree), layers = layers, status = status }
  self.snapshots[id] = snap
  self.order.snapshots[#self.order.snapshots + 1] = id
  return snap
end

-- Eligible objects, in the order they were made (a seed's targets are indexes into these).
function H:running(busy)
  local out = {}
  for _, id in ipairs(self.order.sandboxes) do
    local sb = self.sandboxes[id]
    if sb.status == "running" and not (busy and busy[id]) then out[#out + 1] = sb end
  end
  return out
end

function H:available(busy)
  local out = {}
  for _, id in ipairs(self.order.snapshots) do
    local s = self.snapshots[id]
    if s.status == "available" and not (busy and busy[id]) then out[#out + 1] = s end
  end
  return out
end

-- ---- checking a tree ------------------------------------------------------------------------

local LIST_SH = [[
if cd /root/h 2>/dev/null; then
  find . -type f -print0 | sort -z | xargs -0 -r sha256sum
  echo ==
  find . -type f -printf '%s %P\n'
else
  echo ==
fi
]]

-- The tree under /root/h of a running sandbox as its own sha256sum sees it, or nil and why.
function H:read_tree(id)
  local r, why = self:exec(id, LIST_SH)
  if not r then return nil, why end
  if r.code ~= 0 then return nil, "listing exited " .. r.code .. ": " .. r.stderr end
  local sums, sizes = r.stdout:match("^(.-)==\n(.*)$")
  if not sums then return nil, "listing printed " .. r.stdout:sub(1, 200) end
  local tree = {}
  for sha, path in sums:gmatch("(%x+)  %./([^\n]+)\n") do tree[path] = { sha = sha } end
  for size, path in sizes:gmatch("(%d+) ([^\n]+)\n") do
    tree[path] = tree[path] or { sha = "?" }
    tree[path].size = tonumber(size)
  end
  for _, e in pairs(tree) do e.size = e.size or -1 end
  return tree
end

-- ---- operations -----------------------------------------------------------------------------
-- Each returns nothing; it logs what it did and what came back, updates the model and records a
-- violation where an answer contradicts it. ctx = { op, rng (its own, from its argument seed),
-- lost = function() -> true when a kill may have taken the answer }.

local Ops = {}

local function create_body(extra)
  local b = { ownerId = L.WORKSPACE, networkPolicy = { default = "deny-all" }, plan = "1c-2g" }
  for k, v in pairs(extra or {}) do b[k] = v end
  return b
end

-- Sends a create (restore when snap is given) and waits for it to run; verifies a restore's tree.
function H:do_create(ctx, snap)
  local status, sb = self:req("POST", "/v1/sandboxes", { body = create_body(snap and { snapshotId = snap.id }) })
  if status ~= 201 then
    if ctx.lost() then return self:log(ctx.name .. ": " .. describe_answer(status, sb) .. " (a kill)") end
    -- A delete of the snapshot in the same round may land first: 409 while it is deleting,
    -- 404 once it is gone. Either is the truth.
    if snap and (status == 409 or status == 404) and ctx.deleting[snap.id] then
      return self:log(ctx.name .. ": " .. status .. ", its snapshot was being deleted")
    end
    return self:violation(snap and "restore-refused" or "unexpected-answer",
      ctx.name .. (snap and (" of " .. snap.id) or "") .. " answered " .. describe_answer(status, sb), snap and snap.id)
  end
  local id = sb.id
  ctx.made = id
  local model = self:add_sandbox(id, snap and copy_tree(snap.tree) or {}, snap and snap.layers or {})
  model.dev = snap and snap.kind == "runtime" and snap.id or nil
  local rec, why = self:settle(id)
  if not rec then
    model.status = "unsure"
    if ctx.lost() then return self:log(ctx.name .. " " .. id .. ": " .. why .. " (a kill)") end
    return self:violation("unexpected-answer", ctx.name .. " " .. id .. ": " .. why)
  end
  if rec.status ~= "running" then
    model.status = "dead"
    if ctx.lost() then return self:log(ctx.name .. " " .. id .. " became " .. rec.status .. " (a kill)") end
    local _, logs = self:req("GET", "/v1/sandboxes/" .. id .. "/logs", { query = { follow = "false" }, timeout = 10 })
    return self:violation(ctx.errored or (snap and "restore-errored" or "create-errored"), string.format(
      "%s %s got 201 then became %s%s; its log: %s", ctx.name, id, rec.status,
      snap and (" (snapshot " .. snap.id .. ")") or "", tostring(logs):gsub("%s+", " "):sub(-400)))
  end
  self:log(ctx.name .. " -> " .. id .. (snap and (" from " .. snap.id .. " (" .. snap.kind .. ")") or ""))
  if snap then self:verify_tree(ctx, model, snap) end
end

-- The restored sandbox model's tree must be its snapshot's, exactly.
function H:verify_tree(ctx, model, snap)
  local tree, why = self:read_tree(model.id)
  if not tree then
    model.status = "unsure"
    if ctx.lost() then return self:log("listing " .. model.id .. ": " .. why .. " (a kill)") end
    return self:violation("unexpected-answer", "listing restored " .. model.id .. ": " .. why)
  end
  self.counts.verified = self.counts.verified + 1
  local d = tree_diff(snap.tree, tree)
  if d ~= "" then
    model.tree = tree
    return self:violation("snapshot-tree", string.format("snapshot %s (%s, captured from %s) restored into %s: %s",
      snap.id, snap.kind, snap.source, model.id, d))
  end
  local n = 0
  for _ in pairs(tree) do n = n + 1 end
  self:log(string.format("  %s holds %s's %d files exactly", model.id, snap.id, n))
end

function Ops.create(self, ctx) return self:do_create(ctx, nil) end

function Ops.restore(self, ctx, snap) return self:do_create(ctx, snap) end

function Ops.exec(self, ctx, sb)
  local r = ctx.rng
  local script, names = { "set -e", "mkdir -p " .. ROOT, "cd " .. ROOT }, {}
  local existing = sorted_keys(sb.tree)
  local dels = {}
  for _, p in ipairs(existing) do
    if r:chance(0.25) then dels[#dels + 1] = p end
  end
  if #dels > 0 then script[#script + 1] = "rm -f -- " .. table.concat(dels, " ") end
  local writes = {}
  for i = 1, r:int(1, 4) do
    local dir = r:chance(0.3) and ("d" .. r:int(1, 3) .. "/") or ""
    local name = string.format("%sx%d_%d", dir, ctx.op.n, i)
    local size = r:chance(0.1) and r:int(1000000, 3000000) or r:chance(0.2) and 0 or r:int(1, 200000)
    local token = string.format("%016x", r:next())
    if dir ~= "" then script[#script + 1] = "mkdir -p " .. dir end
    script[#script + 1] = string.format("yes %s | head -c %d > %s", token, size, name)
    writes[#writes + 1] = { name = name, size = size, token = token }
    names[#names + 1] = name .. ":" .. size
  end
  sb.status = "busy-exec"
  local res, why = self:exec(sb.id, table.concat(script, "\n"))
  if not res or res.code ~= 0 then
    sb.status = "unsure"
    local what = why or ("exited " .. res.code .. ": " .. res.stderr)
    if ctx.lost() then return self:log(ctx.name .. " " .. sb.id .. ": " .. what .. " (a kill)") end
    return self:violation("unexpected-answer", ctx.name .. " in " .. sb.id .. ": " .. what)
  end
  for _, p in ipairs(dels) do sb.tree[p] = nil end
  for _, w in ipairs(writes) do
    sb.tree[w.name] = { size = w.size, sha = sha256(yes_content(w.token, w.size)) }
  end
  sb.status = "running"
  self:log(string.format("%s %s: wrote %s; removed %d", ctx.name, sb.id, table.concat(names, " "), #dels))
end

function Ops.upload(self, ctx, sb)
  local r = ctx.rng
  local size = (self.big_uploads and r:chance(0.15)) and r:int(8000000, 24000000) or r:int(0, 400000)
  local name = string.format("u%d", ctx.op.n)
  local content = upload_content(r, size)
  sb.status = "busy-upload"
  local tok, why = self:file_token(sb.id, "upload", ROOT .. "/" .. name)
  local ok, res
  if tok then
    ok, res = pcall(http.request, { method = "PUT", url = tok.uri, body = content, timeout = 120, no_resend = true,
      headers = { Authorization = "Bearer " .. tok.token, ["Content-Type"] = "application/octet-stream" } })
    if not ok then why = "upload: " .. tostring(type(res) == "table" and res.message or res)
    elseif res.status ~= 204 and res.status ~= 200 and res.status ~= 201 then
      why = "upload answered " .. res.status .. ": " .. tostring(res.body):sub(1, 300)
    else why = nil end
  end
  if why then
    sb.status = "unsure"
    if ctx.lost() then return self:log(ctx.name .. " " .. sb.id .. " " .. size .. " bytes: " .. why .. " (a kill)") end
    return self:violation("unexpected-answer", ctx.name .. " to " .. sb.id .. ": " .. why)
  end
  sb.tree[name] = { size = size, sha = sha256(content) }
  sb.status = "running"
  self:log(string.format("%s %s: %s (%d bytes)", ctx.name, sb.id, name, size))
end

function Ops.download(self, ctx, sb)
  local paths = sorted_keys(sb.tree)
  if #paths == 0 then return self:log(ctx.name .. " " .. sb.id .. ": nothing written yet") end
  local path = paths[ctx.rng:int(1, #paths)]
  local want = sb.tree[path]
  sb.status = "busy-download"
  local tok, why = self:file_token(sb.id, "download", ROOT .. "/" .. path)
  local ok, res
  if tok then
    ok, res = pcall(http.request, { method = "GET", url = tok.uri, timeout = 120,
      headers = { Authorization = "Bearer " .. tok.token } })
    if not ok then why = "download: " .. tostring(type(res) == "table" and res.message or res)
    elseif res.status ~= 200 then why = "download answered " .. res.status .. ": " .. tostring(res.body):sub(1, 300) end
  end
  sb.status = "running"
  if why then
    sb.status = "unsure"
    if ctx.lost() then return self:log(ctx.name .. " " .. sb.id .. ": " .. why .. " (a kill)") end
    return self:violation("unexpected-answer", ctx.name .. " from " .. sb.id .. ": " .. why)
  end
  local sha = sha256(res.body)
  if #res.body ~= want.size or sha ~= want.sha then
    return self:violation("download", string.format("%s %s:%s: got %d bytes %s, wrote %d bytes %s", ctx.name, sb.id,
      path, #res.body, sha:sub(1, 12), want.size, want.sha:sub(1, 12)))
  end
  self:log(string.format("%s %s: %s (%d bytes) as written", ctx.name, sb.id, path, want.size))
end

function Ops.capture(self, ctx, sb)
  local kind = ctx.rng:chance(0.3) and "runtime" or "filesystem"
  sb.status = "busy-capture"
  ctx.capturing = sb.id
  local status, snap = self:req("POST", "/v1/sandboxes/" .. sb.id .. "/snapshots", { body = { kind = kind } })
  if status ~= 202 then
    sb.status = "running"
    if ctx.lost() then return self:log(ctx.name .. " " .. sb.id .. ": " .. describe_answer(status, snap) .. " (a kill)") end
    return self:violation("unexpected-answer", ctx.name .. " of " .. sb.id .. ": " .. describe_answer(status, snap))
  end
  local model = self:add_snapshot(snap.id, sb.id, kind, "creating")
  local deadline = core.now() + 120
  local rec, why
  repeat
    local st, s = self:req("GET", self:snap_path(snap.id), { query = { ownerId = L.WORKSPACE } })
    if st ~= 200 then why = describe_answer(st, s) break end
    rec = s
    if rec.status == "creating" then task.sleep(0.05) end
  until rec.status ~= "creating" or core.now() > deadline
  if why or rec.status ~= "available" then
    model.status = why and "creating" or rec.status -- resolved after the restart
    if ctx.lost() then
      sb.status = "running"
      return self:log(ctx.name .. " " .. sb.id .. " -> " .. snap.id .. ": " .. (why or rec.status) .. " (a kill)")
    end
    model.status = "failed"
    sb.status = "running"
    return self:violation("capture-failed", string.format("%s of %s -> %s: %s %s", ctx.name, sb.id, snap.id,
      why or rec.status, rec and json.encode(rec.error) or ""))
  end
  model.status = "available"
  sb.status = "running"
  local n = 0
  for _ in pairs(model.tree) do n = n + 1 end
  self:log(string.format("%s %s -> %s (%s, %d files, sizeBytes %s)", ctx.name, sb.id, snap.id, kind, n,
    tostring(rec.sizeBytes)))
end

function Ops.delete(self, ctx, snap)
  ctx.deleting[snap.id] = true
  local status, body = self:req("DELETE", self:snap_path(snap.id), { query = { ownerId = L.WORKSPACE } })
  if status ~= 204 then
    if ctx.lost() then return self:log(ctx.name .. " " .. snap.id .. ": " .. describe_answer(status, body) .. " (a kill)") end
    return self:violation("unexpected-answer", ctx.name .. " " .. snap.id .. ": " .. describe_answer(status, body))
  end
  snap.status = "deleted"
  self:log(ctx.name .. " " .. snap.id)
end

function Ops.terminate(self, ctx, sb)
  sb.status = "terminating"
  local status, body = self:req("POST", "/v1/sandboxes/" .. sb.id .. "/terminate")
  if not status or status >= 300 then
    if ctx.lost() then return self:log(ctx.name .. " " .. sb.id .. ": " .. describe_answer(status, body) .. " (a kill)") end
    sb.status = "unsure"
    return self:violation("unexpected-answer", ctx.name .. " " .. sb.id .. ": " .. describe_answer(status, body))
  end
  sb.status = "terminated"
  self:log(ctx.name .. " " .. sb.id)
end

-- Chooses what an operation of the plan does given the model now (a kind with no possible
-- target becomes a create; caps keep the population bounded). Returns fn, target, kind.
function H:choose(op, busy)
  local kind = op.kind
  local live = self:running()
  local free = self:running(busy)
  local avail = self:available()
  if kind == "create" and #live >= MAX_LIVE then kind = "terminate" end
  if kind == "capture" and #avail >= MAX_SNAPS then kind = "delete" end
  if (kind == "restore" or kind == "delete") and #self:available(kind == "delete" and busy or nil) == 0 then
    kind = #free > 0 and "capture" or "create"
  end
  if kind == "restore" and #live >= MAX_LIVE then kind = #free > 0 and "terminate" or "delete" end
  if kind ~= "create" and kind ~= "restore" and kind ~= "delete" and #free == 0 then
    kind = #live >= MAX_LIVE and "delete" or "create"
    if kind == "delete" and #self:available(busy) == 0 then kind = "none" end
  end
  if kind == "create" or kind == "none" then return kind, nil end
  if kind == "restore" then return kind, avail[op.target % #avail + 1] end
  if kind == "delete" then
    local cands = self:available(busy)
    return kind, cands[op.target % #cands + 1]
  end
  return kind, free[op.target % #free + 1]
end

-- ---- invariants -----------------------------------------------------------------------------

local listdir = require("spec.support.files").listdir

-- A file's content, nil when it is gone or unreadable (a process that ended while /proc was read).
local function slurp(path)
  local ok, s = pcall(require("spec.support.files").read, path)
  return ok and s or nil
end

-- The host's view now, read from the state dir, /proc, the cgroup hierarchies and the mount
-- table: { sandboxes = set of sandbox directories (sbx-...) in sandboxes/ (the sandbox disk's
-- mount: each a btrfs subvolume), strays = list of anything else in sandboxes/ but the disk's
-- spool, spool = list (sandboxes/.spool), layers = list, tmp = list, cgroups = set of ids with a
-- cgroup under the state dir's tag, keepers = set of ids a moonbox-sandbox process of this state
-- dir serves, helpers = list of such processes that name no sandbox, roots = set of ids with a
-- root mount point in /run/moonbox/roots, mounts = {id = mount point} and mounts_other = list:
-- mounts under the state dir (the sandbox disk itself aside) or the roots directory }.
function H:host_view()
  local state, tag = self.state, self.tag
  local view = { sandboxes = {}, strays = {}, spool = {}, layers = listdir(state .. "/layers"),
    tmp = listdir(state .. "/tmp"), cgroups = {}, keepers = {}, helpers = {}, roots = {}, mounts = {},
    mounts_other = {} }
  for _, name in ipairs(listdir(state .. "/sandboxes")) do
    if name:match("^sbx%-") then view.sandboxes[name] = true
    elseif name ~= ".spool" then view.strays[#view.strays + 1] = name end
  end
  view.spool = listdir(state .. "/sandboxes/.spool")
  local cg_dirs = { "/sys/fs/cgroup/moonbox/" .. tag }
  for _, c in ipairs(listdir("/sys/fs/cgroup")) do cg_dirs[#cg_dirs + 1] = "/sys/fs/cgroup/" .. c .. "/moonbox/" .. tag end
  for _, d in ipairs(cg_dirs) do
    for _, name in ipairs(listdir(d)) do
      if name:match("^sbx%-") then view.cgroups[name] = true end
    end
  end
  local me = tostring(self.p and self.p.pid or -1)
  for _, pid in ipairs(listdir("/proc")) do
    if pid:match("^%d+$") and pid ~= me then
      local cmd = slurp("/proc/" .. pid .. "/cmdline")
      if cmd and cmd:find(state .. "/", 1, true) and cmd:find("moonbox-sandbox", 1, true) then
        local id = cmd:match("%z%-%-id=(sbx%-[%w]+)")
        if id then view.keepers[id] = true
        else view.helpers[#view.helpers + 1] = pid .. " " .. cmd:gsub("%z", " "):sub(1, 200) end
      end
    end
  end
  for _, name in ipairs(listdir("/run/moonbox/roots")) do
    local id = name:sub(#tag + 2)
    if name:sub(1, #tag + 1) == tag .. "-" then view.roots[id] = true end
  end
  local disk = state .. "/sandboxes"
  for line in (slurp("/proc/self/mountinfo") or ""):gmatch("[^\n]+") do
    local mp = line:match("^%S+ %S+ %S+ %S+ (%S+)")
    if mp and mp ~= disk and (mp:sub(1, #state + 1) == state .. "/" or mp:find("/run/moonbox/roots/" .. tag .. "-", 1,
      true) == 1) then
      local id = mp:match("(sbx%-[%w]+)")
      if id then view.mounts[id] = mp else view.mounts_other[#view.mounts_other + 1] = mp end
    end
  end
  return view
end

-- The record status of a sandbox: from the model when it is sure, else asked. [yields]
function H:live_record(id, cache)
  if cache[id] ~= nil then return cache[id] end
  local sb, why = self:get_sandbox(id)
  local live = sb and ({ creating = true, running = true, suspending = true, suspended = true, resuming = true })[sb.status]
  cache[id] = sb and (live and "live" or sb.status) or ("unknown (" .. tostring(why) .. ")")
  return cache[id]
end

--- h:check(when): every invariant that must hold with nothing in flight. [yields]
function H:check(when)
  self.counts.checks = self.counts.checks + 1
  local view = self:host_view()
  local cache = {}
  -- 1. Host objects of a sandbox exist only while its record is live.
  local kinds = { { "sandboxes", "a subvolume in sandboxes/" }, { "cgroups", "a cgroup" },
    { "keepers", "a keeper process" }, { "mounts", "a mount" }, { "roots", "a root mount point" } }
  for _, k in ipairs(kinds) do
    for _, id in ipairs(sorted_keys(view[k[1]])) do
      local st = self:live_record(id, cache)
      if st ~= "live" then
        self:violation("terminated-clean", string.format("%s: sandbox %s is %s but has %s (%s)", when, id, st, k[2],
          k[1] == "mounts" and view.mounts[id] or id), id .. " " .. k[1])
      end
    end
  end
  -- 1b. Nothing else: no stray entry in sandboxes/, no helper process of this state dir that
  -- serves no sandbox, no mount under the state dir but the sandbox disk, and nothing spooled
  -- once every request has its answer (the server removes a spool as the request ends: a
  -- moment's grace).
  local function leftovers(v)
    local out = {}
    for _, n in ipairs(v.strays) do out[#out + 1] = "sandboxes/" .. n end
    for _, n in ipairs(v.spool) do out[#out + 1] = "sandboxes/.spool/" .. n end
    for _, n in ipairs(v.tmp) do out[#out + 1] = "tmp/" .. n end
    for _, n in ipairs(v.mounts_other) do out[#out + 1] = "a mount at " .. n end
    for _, n in ipairs(v.helpers) do out[#out + 1] = "process " .. n end
    return out
  end
  local left = leftovers(view)
  local deadline = core.now() + 3
  while #left > 0 and core.now() < deadline do
    task.sleep(0.1)
    left = leftovers(self:host_view())
  end
  if #left > 0 then
    self:violation("leftover", when .. ": " .. table.concat(left, ", "), table.concat(left, ","))
  end
  -- 2. Records match the model: what the model knows as running is, and has its directory;
  -- what it knows as terminated is terminated.
  -- A terminated record is looked at once per server life (after a restart, again): a run
  -- of thousands of operations would otherwise ask for every sandbox it ever ended each round.
  for _, id in ipairs(self.order.sandboxes) do
    local sb = self.sandboxes[id]
    if sb.status == "running" or (sb.status == "terminated" and sb.confirmed ~= self.epoch) then
      local rec, why = self:get_sandbox(id)
      if rec and rec.status == "terminated" and sb.status == "terminated" then sb.confirmed = self.epoch end
      if not rec then
        self:violation("record", when .. ": GET " .. id .. ": " .. why)
      elseif rec.status ~= sb.status then
        self:violation("record", string.format("%s: %s is %s, the harness saw it %s", when, id, rec.status, sb.status))
        if rec.status ~= "running" then sb.status = rec.status == "terminated" and "terminated" or "dead" end
      elseif sb.status == "running" and not view.sandboxes[id] then
        self:violation("record", when .. ": running sandbox " .. id .. " has no directory in sandboxes/")
      end
    end
  end
  self:check_layers(when, view)
  return view
end

-- 3. Layers: every available snapshot's chain is on disk; nothing is that no record needs (a
-- snapshot that failed may keep its layer a moment: the collector runs after its record says
-- failed; it must be gone within 5 s).
function H:check_layers(when, view)
  local snaps, why = self:list_all("/v1/sandbox-groups/" .. self.group .. "/snapshots", { ownerId = L.WORKSPACE },
    "snapshot")
  if not snaps then return self:violation("record", when .. ": listing snapshots: " .. why) end
  local listed = {}
  for _, s in ipairs(snaps) do listed[s.id] = s end
  local needed, dev = {}, {}
  for _, id in ipairs(self.order.snapshots) do
    local s = self.snapshots[id]
    local rec = listed[id]
    if (s.status == "available" or s.status == "lost") and not (rec and rec.status == "available") then
      self:violation("record", string.format("%s: snapshot %s is %s, the harness saw it available", when, id,
        rec and rec.status or "not listed"))
      s.status = rec and rec.status or "deleted" -- said once: from now on the model follows the server
    end
    if s.status == "available" or s.status == "lost" then
      for _, l in ipairs(s.layers) do needed[l] = true end
      if s.kind == "runtime" then dev[id] = true end
    elseif s.status == "deleted" and rec then
      self:violation("record", when .. ": deleted snapshot " .. id .. " is still listed (" .. rec.status .. ")")
    end
  end
  for _, id in ipairs(self.order.sandboxes) do
    local sb = self.sandboxes[id]
    if sb.status == "running" or sb.status == "unsure" then
      for _, l in ipairs(sb.lowers) do needed[l] = true end
      if sb.dev then dev[sb.dev] = true end -- restored from a runtime snapshot: it boots from its /dev records
    end
  end
  local present = {}
  for _, name in ipairs(view.layers) do present[name] = true end
  for l in pairs(needed) do
    if not present[l] then
      self:violation("layers-present", when .. ": layer " .. l .. " is needed but gone", l)
      -- restores of the snapshots that need it are refused from now on: leave them out
      for _, id in ipairs(self.order.snapshots) do
        local s = self.snapshots[id]
        if s.status == "available" then
          for _, x in ipairs(s.layers) do if x == l then s.status = "lost" end end
        end
      end
    end
  end
  -- Each available snapshot's own layer has the manifest its capture wrote, a runtime one its
  -- /dev records.
  for _, id in ipairs(self.order.snapshots) do
    local s = self.snapshots[id]
    if s.status == "available" and present[id] then
      if not present[id .. ".manifest"] then
        self:violation("layers-present", when .. ": available snapshot " .. id .. " has no manifest", id .. ".manifest")
      end
      if s.kind == "runtime" and not present[id .. ".dev"] then
        self:violation("layers-present", when .. ": available runtime snapshot " .. id .. " has no /dev records",
          id .. ".dev")
      end
    end
  end
  local function orphans(names)
    local out = {}
    for _, name in ipairs(names) do
      local id, suffix = name:match("^(snp%-[%w]+)(.*)$")
      local ok = id and ((suffix == "" and needed[id]) or (suffix == ".dev" and dev[id])
        or (suffix ~= "" and suffix ~= ".dev" and suffix ~= ".partial" and needed[id]))
      -- a layer of a sandbox still unsure (its lowers) is covered above; anything else is not
      if not ok then out[#out + 1] = name end
    end
    return out
  end
  local left = orphans(view.layers)
  if #left > 0 then
    local failed_only = true
    for _, name in ipairs(left) do
      local id = name:match("^(snp%-[%w]+)")
      if not (id and listed[id] and listed[id].status == "failed") then failed_only = false end
    end
    if failed_only then
      local deadline = core.now() + 5
      while #left > 0 and core.now() < deadline do
        task.sleep(0.1)
        left = orphans(self:host_view().layers)
      end
    end
    if #left > 0 then
      self:violation("layers-orphan", when .. ": layers no record needs: " .. table.concat(left, ", "))
    end
  end
end

-- ---- a kill and a restart -------------------------------------------------------------------

-- Restarts on the same state dir and port, probing the port from the moment the process runs:
-- the first answer must not list any sandbox of the killed server as running; a create sent
-- then (when the plan says so) must run; <state>/tmp must be empty once the server answers.
function H:restart(kill)
  local before = {}
  for id, sb in pairs(self.sandboxes) do -- what may be live in the records
    if sb.status ~= "terminated" and sb.status ~= "dead" then before[id] = sb end
  end
  self:spawn()
  self.url = "http://127.0.0.1:" .. self.port
  self.counts.restarts = self.counts.restarts + 1
  local deadline = core.now() + 120
  local first, status, page
  while true do
    local ok, r = pcall(http.request, { method = "GET", url = self.url .. "/v1/sandboxes?limit=100",
      headers = { Authorization = "Bearer " .. L.KEY, Accept = "application/json" }, timeout = 30, fresh_connect = true })
    if ok and r.status ~= 503 then
      first, status = r, r.status
      break
    end
    if core.now() > deadline then
      error("the restarted server did not answer in 120 s (epoch " .. self.epoch .. "); see " .. self.server_log)
    end
    if task.result(self.lines_task) ~= nil and not ok then
      error("the restarted server exited; see " .. self.server_log)
    end
    task.sleep(ok and 0.02 or 0.002)
  end
  -- A create the moment the port answers (it must not be killed by a recovery still running).
  local create_task, at_open
  if kill.create_at_open then
    create_task = task.spawn(function()
      local ctx = { name = "create (at port open)", lost = function() return false end, deleting = {},
        errored = "recovered-before-serving" }
      self.by_kind.create = self.by_kind.create + 1
      self:do_create(ctx, nil)
      if ctx.made then
        self:log("  (sent the moment the port answered)")
        at_open = ctx.made
      end
    end)
  end
  page = status == 200 and json.decode(first.body) or nil
  if not page then
    self:violation("unexpected-answer", "the first listing after restart answered " .. tostring(status))
  else
    for _, item in ipairs(page) do
      local sb = item.sandbox or item
      -- Everything listed before any create of this server was the killed server's.
      if sb.status ~= "errored" and sb.status ~= "terminated" then
        self:violation("recovered-before-serving", string.format(
          "the first answer after restart %d lists %s (killed with the server) as %s", self.epoch, sb.id, sb.status))
      end
    end
  end
  -- Nothing spooled survives the restart: tmp/ and the sandbox disk's spool are empty once the
  -- server answers (what the create sent at port open spools is none: a JSON body).
  local v = self:host_view()
  local spooled = {}
  for _, n in ipairs(v.tmp) do spooled[#spooled + 1] = "tmp/" .. n end
  for _, n in ipairs(v.spool) do spooled[#spooled + 1] = "sandboxes/.spool/" .. n end
  if #spooled > 0 then
    self:violation("spool-survives", string.format("after restart %d, <state> holds %s", self.epoch,
      table.concat(spooled, ", ")))
  end
  if create_task then task.join(create_task) end
  -- Resolve what the kill left unknown, by looking.
  local live_now = {}
  for id, sb in pairs(before) do
    local rec, why = self:get_sandbox(id)
    if not rec then
      self:violation("record", "after restart " .. self.epoch .. ": GET " .. id .. ": " .. why)
      sb.status = "dead"
    elseif rec.status == "terminated" then sb.status = "terminated"
    elseif rec.status == "errored" then sb.status = "dead"
    else
      live_now[#live_now + 1] = id .. " " .. rec.status
      sb.status = "dead"
    end
  end
  if #live_now > 0 then
    table.sort(live_now)
    self:violation("recovered-before-serving", "after restart " .. self.epoch ..
      ", sandboxes of the killed server still say " .. table.concat(live_now, ", "))
  end
  local snaps = self:list_all("/v1/sandbox-groups/" .. self.group .. "/snapshots", { ownerId = L.WORKSPACE },
    "snapshot") or {}
  local listed = {}
  for _, s in ipairs(snaps) do listed[s.id] = s end
  for _, s in ipairs(snaps) do
    -- a capture whose 202 the kill took: the sandbox it was of was busy capturing
    if not self.snapshots[s.id] and self.sandboxes[s.sourceSandboxId] and kill.capturing[s.sourceSandboxId] then
      local m = self:add_snapshot(s.id, s.sourceSandboxId, s.kind or "filesystem", "creating")
      self:log("found " .. s.id .. " of " .. s.sourceSandboxId .. " (its answer was lost): " .. s.status)
      m.status = "creating"
    elseif not self.snapshots[s.id] then
      self:violation("record", "after restart " .. self.epoch .. ": snapshot " .. s.id .. " of " ..
        tostring(s.sourceSandboxId) .. " that no capture asked for")
    end
  end
  for _, id in ipairs(self.order.snapshots) do
    local m = self.snapshots[id]
    local rec = listed[id]
    if m.status == "creating" or m.status == "deleting" then
      if not rec then m.status = "deleted"
      elseif rec.status == "creating" then
        self:violation("record", "after restart " .. self.epoch .. ": snapshot " .. id .. " still says creating")
        m.status = "failed"
      else m.status = rec.status end
      self:log("resolved " .. id .. ": " .. m.status)
    elseif m.status == "available" and kill.deleting[id] then
      if not rec then m.status = "deleted" end
      self:log("resolved delete of " .. id .. ": " .. (rec and "still there" or "deleted"))
    elseif m.status == "available" and not rec then
      self:violation("record", "after restart " .. self.epoch .. ": available snapshot " .. id .. " is gone")
      m.status = "deleted"
    end
  end
  -- The create sent at port open ran: the recovery must not have killed it since.
  if at_open and self.sandboxes[at_open].status == "running" then
    local rec = self:get_sandbox(at_open)
    if rec and rec.status ~= "running" then
      self:violation("recovered-before-serving", string.format("%s, created the moment restart %d's port " ..
        "answered, ran, then became %s", at_open, self.epoch, rec.status))
      self.sandboxes[at_open].status = "dead"
    end
  end
  self:check("after restart " .. self.epoch)
end

-- The last invariant: with the server stopped (SIGTERM), `moonbox local --check` reads every
-- layer of every available snapshot in full and finds each as its manifest says. [yields]
function H:fsck()
  self.p:kill("TERM")
  self.p:wait()
  pcall(task.join, self.lines_task)
  local r = proc.run { L.BIN, "local", "--check", "--state", self.state }
  local out = (r.stdout .. r.stderr):gsub("%s+$", "")
  local last = out:match("([^\n]*)$")
  self.counts.fsck = tonumber(last:match("^(%d+) snapshots? checked")) or 0
  self:log("moonbox local --check: " .. last)
  if r.code ~= 0 then
    local bad = {}
    for line in out:gmatch("[^\n]+") do
      if not line:match(" ok: ") then bad[#bad + 1] = line end
    end
    return self:violation("fsck", "moonbox local --check exited " .. tostring(r.code) .. ": " .. table.concat(bad, "; "))
  end
  local want = 0
  for _, s in pairs(self.snapshots) do
    if s.status == "available" or s.status == "lost" then want = want + 1 end
  end
  if self.counts.fsck ~= want then
    self:violation("fsck", string.format("moonbox local --check found %d available snapshots, the harness %d",
      self.counts.fsck, want))
  end
end

-- ---- the run --------------------------------------------------------------------------------

-- Verifies one available snapshot (chosen by r) by restoring it, then terminates the copy.
function H:sample(r, why)
  local avail = self:available()
  if #avail == 0 then return end
  local snap = avail[r:int(1, #avail)]
  local ctx = { name = "verify " .. why, lost = function() return false end, deleting = {} }
  self:do_create(ctx, snap)
  if ctx.made and self.sandboxes[ctx.made].status ~= "terminated" then
    local st = self:req("POST", "/v1/sandboxes/" .. ctx.made .. "/terminate")
    if st and st < 300 then self.sandboxes[ctx.made].status = "terminated" end
  end
end

-- One round: its operations as concurrent tasks; with kill.during, a SIGKILL after that delay.
function H:run_round(round)
  local busy, tasks = {}, {}
  local killed = false
  local kill_ctx = { capturing = {}, deleting = {} }
  local point = round.kill and round.kill.point
  if point then
    local st, body = self:req("PUT", "/_moonbox/faults", { body = "*=stall:" .. point .. "#1" })
    if st ~= 200 then
      self:violation("unexpected-answer", "PUT /_moonbox/faults stall:" .. point .. ": " .. describe_answer(st, body))
      point = nil
    end
  end
  local done = 0
  for _, op in ipairs(round.ops) do
    local kind, target = self:choose(op, busy)
    if kind == "none" then
      self:log(string.format("#%d %s: nothing to do it on", op.n, op.kind))
    else
      if target and kind ~= "restore" then busy[target.id] = true end
      self.by_kind[kind] = self.by_kind[kind] + 1
      local ctx = { op = op, rng = M.rng(op.arg), name = string.format("#%d %s", op.n, kind),
        lost = function() return killed end, deleting = kill_ctx.deleting }
      if kind == "capture" then kill_ctx.capturing[target.id] = true end
      if kind == "delete" then kill_ctx.deleting[target.id] = true end
      tasks[#tasks + 1] = task.spawn(function()
        task.sleep(op.delay)
        local ok, err = pcall(Ops[kind], self, ctx, target)
        done = done + 1
        if not ok then error(err, 0) end
      end)
    end
  end
  local killer
  if point then
    -- The kill at a crash point: once an operation is held there (the rule fired), or once
    -- every other operation of the round has ended without one getting there.
    killer = task.spawn(function()
      local fired = false
      while done < #tasks do
        local st, body = self:req("GET", "/_moonbox/faults")
        local rule = st == 200 and type(body) == "table" and body.rules and body.rules[1]
        if rule and (rule.fired or 0) > 0 then
          fired = true
          break
        end
        task.sleep(0.02)
      end
      killed = true
      if fired then
        self.counts.at_point[point] = (self.counts.at_point[point] or 0) + 1
        self:log("SIGKILL the server (an operation held at its crash point " .. point .. ")")
      else
        self:log("SIGKILL the server (after the round: no operation reached " .. point .. ")")
      end
      self:kill()
    end)
  elseif round.kill and round.kill.during then
    killer = task.spawn(function()
      task.sleep(round.kill.during)
      killed = true
      self:log(string.format("SIGKILL the server (%.3f s into the round)", round.kill.during))
      self:kill()
    end)
  end
  for _, t in ipairs(tasks) do
    local ok, err = pcall(task.join, t)
    if not ok then self:violation("harness-error", tostring(err)) end
  end
  if killer then task.join(killer) end
  if round.kill and not round.kill.during and not point then
    killed = true
    self:log("SIGKILL the server (after the round)")
    self:kill()
  end
  -- Sandboxes left mid-operation without a kill: the operation failed (already a violation).
  for _, sb in pairs(self.sandboxes) do
    if sb.status:match("^busy") then sb.status = killed and "dead" or "unsure" end
    if sb.status == "terminating" and not killed then sb.status = "unsure" end
  end
  if killed then
    self:restart({ capturing = kill_ctx.capturing, deleting = kill_ctx.deleting,
      create_at_open = round.kill.create_at_open })
  else
    self:check("after round " .. self.round)
  end
end

--- h:run() -> report: runs the plan, then verifies every available snapshot and checks once
-- more. report = { seed, ops, by_kind, kills, restarts, violations = {...}, wall, verified,
-- checks }. [yields]
function H:run()
  self.t0 = core.now()
  local rounds = M.plan(self.seed, { ops = self.ops, kills = self.kills, concurrency = self.concurrency })
  local sample_rng = M.rng(self.seed ~ 0x5A5A5A5A)
  self:start_first()
  -- The default group: from a first sandbox (counted as a create of round 0).
  self.by_kind.create = self.by_kind.create + 1
  self:do_create({ name = "#0 create", lost = function() return false end, deleting = {} }, nil)
  local first = self.order.sandboxes[1]
  local rec = assert(first and self:get_sandbox(first), "the first create failed: see the log")
  self.group = rec.sandboxGroupId
  for i, round in ipairs(rounds) do
    if self.stop_after and round.ops[1].n > self.stop_after then break end
    self.round = i
    self:run_round(round)
    if self.progress and (round.ops[#round.ops].n // 500) ~= ((round.ops[1].n - 1) // 500) then
      self.progress(string.format("  %d operations, %d kills, %d violations, %.0f s", round.ops[#round.ops].n,
        self.counts.kills, #self.violations, core.now() - self.t0))
    end
    if self.sample_every > 0 and i % self.sample_every == 0 then self:sample(sample_rng, "(sample)") end
  end
  -- The end: every available snapshot restores to its tree.
  self.round = #rounds + 1
  for _, snap in ipairs(self:available()) do
    local ctx = { name = "verify (end) " .. snap.id, lost = function() return false end, deleting = {} }
    self:do_create(ctx, snap)
    if ctx.made then
      local st = self:req("POST", "/v1/sandboxes/" .. ctx.made .. "/terminate")
      if st and st < 300 then self.sandboxes[ctx.made].status = "terminated" end
    end
  end
  self:check("at the end")
  self:fsck()
  local n = 0
  for _, k in ipairs(M.KINDS) do n = n + self.by_kind[k] end
  return { seed = self.seed, ops = n, by_kind = self.by_kind, kills = self.counts.kills,
    restarts = self.counts.restarts, violations = self.violations, wall = core.now() - self.t0,
    verified = self.counts.verified, checks = self.counts.checks, rounds = #rounds, fsck = self.counts.fsck,
    at_point = self.counts.at_point }
end

--- M.summary(report) -> text: the figures, and each invariant violated with how often.
function M.summary(rep)
  local kinds = {}
  for _, k in ipairs(M.KINDS) do kinds[#kinds + 1] = k .. " " .. rep.by_kind[k] end
  local by = {}
  for _, v in ipairs(rep.violations) do by[v.name] = (by[v.name] or 0) + 1 end
  local names = {}
  for _, k in ipairs(sorted_keys(by)) do names[#names + 1] = k .. " x" .. by[k] end
  local points = {}
  for _, k in ipairs(sorted_keys(rep.at_point or {})) do points[#points + 1] = k .. " " .. rep.at_point[k] end
  return string.format("seed %d: %d operations in %d rounds (%s), %d kills (at crash points: %s), %d restores " ..
    "verified, %d checks, %d snapshots fsck'd, %d violations%s, %.1f s", rep.seed, rep.ops, rep.rounds,
    table.concat(kinds, ", "), rep.kills, #points > 0 and table.concat(points, ", ") or "none", rep.verified,
    rep.checks, rep.fsck or 0, #rep.violations, #names > 0 and (" (" .. table.concat(names, ", ") .. ")") or "",
    rep.wall)
end

--- h:dump(): the seed, how to replay it, the violations and the full operation log. -> text
function H:dump()
  local out = { string.format("seed %d (replay: MOONBOX_HARNESS_SEED=%d); server log: %s; state: %s", self.seed,
    self.seed, tostring(self.server_log), tostring(self.state)) }
  for _, v in ipairs(self.violations) do
    out[#out + 1] = string.format("  violation %s (round %d, server %d): %s", v.name, v.round, v.epoch, v.detail)
  end
  out[#out + 1] = "operation log:"
  for _, line in ipairs(self.oplog) do out[#out + 1] = "  " .. line end
  return table.concat(out, "\n")
end

M.files = files
return M
