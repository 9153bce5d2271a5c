--- moonbox.durable — a run's journal: every Render call it makes with its answer, the results of
-- its task.step calls, and the clock and randomness it reads (docs/reference/durable.md).
--
-- One journal serves three modes:
--   * "durable" (`moonbox run --durable`, `--resume ID`, a schedule's `durable = true`): the
--     journal lives in the run store (moonbox.db: SQLite or PostgreSQL, table `journal`), written
--     ahead — a call that must not run twice is recorded `started` before its request goes out,
--     and every call `done` (with the answer) after. A resumed run re-runs the recipe from the
--     top: each journaled call returns its recorded answer without touching the backend, until
--     the first call past the journal, from which it runs live.
--   * "record" (`moonbox run --record FILE`): the same journal written to a file (a cassette),
--     with the recipe's own moonbox.http requests and httpd servers besides.
--   * "replay" (`moonbox run --replay FILE`): every call answered from the cassette, with no
--     backend at all; a call the cassette does not have is a divergence.
--
-- Journals per task tree. A journal is attached to the task that runs a recipe (durable.attach:
-- the root task of `moonbox run`, or the task of one scheduled run in a `moonbox schedule` daemon,
-- which runs several runs at once in one process); it is found through the running task's
-- context (task.set_context, inherited by every task spawned below), so each run's calls go to
-- its own journal and a task outside every attached tree runs unjournaled. The hooks into
-- moonbox.task, os and math are installed while at least one journal is attached (refcounted)
-- and look the journal up per call.
--
-- Streams. Concurrent tasks interleave differently from one run to the next, so the journal is
-- not one sequence but one per task: the root task's stream is "r", the n-th task a task spawns
-- (moonbox.task's one spawn path) gets its parent's key .. "." .. n, and item i of a task.map
-- gets the map's key .. "[" .. i .. "]" whichever worker ran it; a task spawned for a call its
-- spawner waits on (api.shielded: a create, a terminate) takes its spawner's stream
-- (durable.inherit). Each stream has its own queues:
-- calls (kind "c": Render calls, steps, and the recipe's own HTTP in a cassette; strict: a call
-- that differs from the next entry is `nondeterminism`), clock reads (task.now "t", os.time "T",
-- os.clock "C") and random values (math.random "r", fresh ids "b"), which are lenient: past their
-- end they are read live.
--
-- What runs below a journaled call (the retry loop, connect-token mints, the transport) is not
-- journaled: a task is "below" while the live part of a call runs in it.
--
-- Secrets never enter a journal: connect tokens and headers are not recorded, and every entry is
-- passed through trace.redact (the API key, env values and every other registered secret become
-- "[redacted]") before it is written.
local core = require "moonbox.core"
local json = require "moonbox.json"
local trace = require "moonbox.trace"
local task = require "moonbox.task"
local strings = require "moonbox.strings"
local sys = require "moonbox.sys"

local M = {}

local CTX = "durable_journal" -- the task context key of the journal of a task's tree

-- ---- values that survive JSON -------------------------------------------------------------

--- durable.bin(s) -> s itself when it is valid UTF-8, else {b64 = base64 of s}: a byte string
-- as a JSON value. Does not yield.
local function bin(s)
  if type(s) ~= "string" or strings.utf8_valid(s) then return s end
  return { b64 = strings.base64(s) }
end
M.bin = bin

--- durable.unbin(v) -> the bytes bin(s) encoded. Does not yield.
local function unbin(v)
  if type(v) == "table" and type(v.b64) == "string" then return (strings.unbase64(v.b64)) end
  return v
end
M.unbin = unbin

-- The fields of an error that a journal keeps (what a structured error of the client carries;
-- its where and traceback are made anew where it is raised again).
local ERROR_FIELDS = { "op", "code", "status", "message", "retryable", "sandbox_id", "snapshot_id",
  "group_id", "exec_id", "path", "label", "request_id", "cause", "retry_after", "attempts", "seconds",
  "option", "suggestion", "got" }

local function error_fields(err)
  if type(err) ~= "table" then return { message = tostring(err), plain = true } end
  local out = {}
  for _, k in ipairs(ERROR_FIELDS) do
    local v = err[k]
    if type(v) == "string" or type(v) == "number" or type(v) == "boolean" then out[k] = v end
  end
  return out
end

local function rebuild_error(f)
  if f.plain then return f.message end
  local copy = {}
  for k, v in pairs(f) do copy[k] = v end
  return core.Error.new(copy)
end

-- ---- the journal ---------------------------------------------------------------------------

local Journal = {}
Journal.__index = Journal

local function queue(stream, kind)
  local q = stream[kind]
  if not q then
    q = { n = 0 }
    stream[kind] = q
  end
  return q
end

--- durable.new{mode, store, entries, workspace, on_live} -> Journal (not yet active).
-- entries: what store:load() gave (each {s, k, n, ...}); on_live(j): called once, before the
-- first call that goes live (a durable resume checks there that the sandboxes the journal holds
-- still exist: durable.lost_sandbox). Does not yield.
function M.new(opts)
  local j = setmetatable({ mode = opts.mode, store = opts.store, streams = {}, pending = {},
    on_live = opts.on_live, went_live = false, workspace = opts.workspace,
    stats = { replayed = 0, live = 0, in_flight = 0, entries = 0, steps_replayed = 0, writes = 0 } },
    Journal)
  local max_t
  for _, e in ipairs(opts.entries or {}) do
    if e.k == "t" and type(e.v) == "number" and (not max_t or e.v > max_t) then max_t = e.v end
    local s = j.streams[e.s]
    if not s then
      s = {}
      j.streams[e.s] = s
    end
    queue(s, e.k)[e.n] = e
    j.stats.entries = j.stats.entries + 1
  end
  if max_t and max_t > core.now() then j.t_shift = max_t - core.now() end
  if j.mode == "durable" and j.stats.entries == 0 then j.crash_at = M.take_crash_point() end
  return j
end

--- durable.active([t]) -> the Journal attached to task t's tree (default: the running task's),
-- or nil. Does not yield.
function M.active(t)
  return task.context(CTX, t)
end

-- The running task's data table, stream key and journal, when its work is journaled now.
local function here()
  local t = core.current()
  if not t then return nil end
  local d = core.data(t)
  if d.jkey == nil or (d.jbelow or 0) > 0 then return nil end
  local j = task.context(CTX, t)
  if not j then return nil end
  return d, d.jkey, j
end

local function stream_of(j, key)
  local s = j.streams[key]
  if not s then
    s = {}
    j.streams[key] = s
  end
  return s
end

-- Crash points for the specs. MOONBOX_DURABLE_CRASH_AT=N: the process kills itself (SIGKILL)
-- right after the journal's N-th write of this process, which is either a call's `started`
-- (the call is then in flight; only non-repeatable calls and terminates write one) or its `done`.
-- MOONBOX_DURABLE_CRASH_AT=@FILE (for a daemon, whose process runs many runs): the next fresh
-- durable run that starts, in whichever process gets FILE first (it is renamed away, atomically,
-- so only one does), kills its process right after that run's N-th journal write, N being what
-- FILE holds.
local crash_env = os.getenv("MOONBOX_DURABLE_CRASH_AT") or ""
local crash_at = math.tointeger(tonumber(crash_env))
local crash_file = crash_env:match("^@(.+)$")
-- Reads (GETs) whose `done` waits for the next write, at most: a crash loses at most these
-- answers, which a resume sends again (bench/durable.lua: at 64, a resume after 100 reads sent
-- 41 of them again; at 16, 4, while a journaled run still costs ~1.1-1.4x a plain one).
local LAZY_READS = 16
local writes = 0
-- MOONBOX_DURABLE_WRITES_FILE=PATH: when a durable journal stops, the number of those writes
-- this process made is written to PATH (how a spec learns the crash points of a run).
local writes_file = os.getenv("MOONBOX_DURABLE_WRITES_FILE")
local function report_writes(j)
  if not writes_file or writes_file == "" or j.mode ~= "durable" then return end
  local f = io.open(writes_file, "w")
  if f then
    f:write(writes, "\n")
    f:close()
  end
end

local function self_pid()
  local f = assert(io.open("/proc/self/stat"))
  local pid = math.tointeger(tonumber(f:read("a"):match("^(%d+)")))
  f:close()
  return pid
end

--- durable.take_crash_point() -> N of MOONBOX_DURABLE_CRASH_AT=@FILE when this process took the
-- file now (see above), else nil. Does not yield.
function M.take_crash_point()
  if not crash_file then return nil end
  local taken = crash_file .. ".taken-" .. self_pid()
  if not os.rename(crash_file, taken) then return nil end
  local f = io.open(taken)
  local n = f and math.tointeger(tonumber(f:read("a")))
  if f then f:close() end
  return n
end

-- Writes an entry (and the clock and random reads waiting to be written), redacted.
function Journal:put(e)
  local batch = self.pending
  self.pending = {}
  batch[#batch + 1] = e
  self.store:put(batch)
  writes = writes + 1
  self.stats.writes = self.stats.writes + 1
  local point = self.crash_at and self.stats.writes == self.crash_at and self.crash_at
    or crash_at and writes == crash_at and crash_at
  if point and self.mode == "durable" then
    io.stderr:write(string.format("moonbox: MOONBOX_DURABLE_CRASH_AT=%d: killed after writing %s %s (%s) " ..
      "of run %s\n", point, e.op or e.k, e.st or "", e.s, tostring(self.run_id)))
    io.stderr:flush()
    sys.kill(self_pid(), 9)
  end
end

--- journal:flush(): writes what waits to be written (clock and random reads, reads' answers).
-- A step flushes before its function runs: what the recipe read is durable before it acts on it.
-- [yields] on PostgreSQL.
function Journal:flush()
  if #self.pending == 0 then return end
  local batch = self.pending
  self.pending = {}
  self.store:put(batch)
end

-- A lenient read (clock, randomness): the recorded value of this stream's next read of `kind`,
-- or live() journaled.
function Journal:lenient(kind, live)
  local _, key, j = here()
  if j ~= self then return live() end
  local q = queue(stream_of(self, key), kind)
  local n = q.n + 1
  q.n = n
  local e = q[n]
  if e then return e.v end
  local v = live()
  -- A resumed run's clock goes on from the journal's last reading (another machine's monotonic
  -- clock may be behind): task.now never runs backwards across a resume.
  if kind == "t" and self.t_shift then v = v + self.t_shift end
  if self.mode ~= "replay" then
    e = { s = key, k = kind, n = n, v = v }
    q[n] = e
    self.pending[#self.pending + 1] = e
  end
  return v
end

--- journal:replaying() -> whether the running task's stream still has journaled calls ahead
-- (a sleep there is in the past, and is skipped). Does not yield.
function Journal:replaying()
  local _, key, j = here()
  if j ~= self then return false end
  -- A task that never made a call of its own (a poller beside a wait) is as far along as the
  -- task that spawned it.
  while key do
    local q = self.streams[key] and self.streams[key].c
    if q and (q.n > 0 or q[1] ~= nil) then return q[q.n + 1] ~= nil end
    key = key:match("^(.+)%.[^.]+$")
  end
  return false
end

local function summary(sig)
  if #sig > 160 then return sig:sub(1, 157) .. "..." end
  return sig
end

-- Two differing signatures cut so that each shows where they part: the first 60 bytes (the
-- operation and path) and, when they differ further on, the bytes around the first difference.
local function summaries(a, b)
  if #a <= 160 and #b <= 160 then return a, b end
  local i = 1
  while i <= #a and a:byte(i) == b:byte(i) do i = i + 1 end
  if i <= 120 then return summary(a), summary(b) end
  local function cut(s)
    local tail = s:sub(i - 30, i + 69)
    return s:sub(1, 60) .. " ..." .. tail .. (#s > i + 69 and "..." or "")
  end
  return cut(a), cut(b)
end

--- durable.nondeterminism(fields) -> raises the structured error `nondeterminism` (op
-- "durable"): the recipe asked for something other than what the journal recorded next.
local function nondeterminism(j, key, n, got, e, why)
  -- From here on the run is unwinding, not resuming: its guards' terminates must reach the
  -- backend, not be compared with a journal the recipe left (journal:call sends them live).
  j.diverged = true
  local where = core.where()
  local msg
  local shown, expected = summary(got), nil
  if e then
    shown, expected = summaries(got, e.sig)
    msg = string.format("the recipe's call at %s, %s, is not the journal's next call in this task, %s " ..
      "(made at %s): the recipe changed since the run was journaled, or depends on something the " ..
      "journal does not hold (see \"Rules of a durable recipe\")", where, shown, expected,
      tostring(e.at))
  else
    msg = string.format("the recipe's call at %s, %s, %s", where, shown, why)
  end
  error(core.Error.new { op = "durable", code = "nondeterminism", message = msg, stream = key, seq = n,
    got = shown, expected = expected, expected_at = e and e.at or nil,
    run_id = j.run_id }, 0)
end
M.nondeterminism = nondeterminism

local function below(d, fn, ...)
  d.jbelow = (d.jbelow or 0) + 1
  local r = table.pack(pcall(fn, ...))
  d.jbelow = d.jbelow - 1
  return r
end

-- The first call that goes live: on_live (a durable resume checks the sandboxes it holds).
-- Calls of other tasks that go live meanwhile wait for the check to end: sent at once, a
-- terminate would make the check find its sandbox gone (lost_sandbox).
local function going_live(j, d)
  if j.went_live == true then return end
  if j.went_live then -- another task is checking
    local checking = j.went_live
    while j.went_live == checking do checking:wait() end
    return
  end
  if not j.on_live then
    j.went_live = true
    return
  end
  local checking = core.cond()
  j.went_live = checking
  local r = below(d, j.on_live, j)
  j.went_live = true
  checking:broadcast()
  if not r[1] then error(r[2], 0) end
end

--- journal:call(c, live) -> live's results, or the recorded ones. c describes the call:
--   sig (what must match on resume: operation, method, path and a digest of the body), op,
--   encode(...) -> answer (the JSON value to keep of live's results), decode(answer) ->
--   results, repeatable (in flight at a crash: send it again), in_flight(entry) -> nil | true,
--   results... (how to find out what a call in flight at a crash did: true with its results when
--   it is found done, nil to send it again; it may raise, e.g. unknown_outcome), meta (kept in
--   the entry: the ledger intent of a create, the sandbox id of a terminate), sandbox_id, lazy
--   (a read: its `done` may wait for the next write), ahead (a repeatable call written `started`
--   before it goes out all the same: a terminate, whose sandbox a resume must not call lost).
-- Raises nondeterminism when the call differs from the journal's next one in this task, the
-- recorded error when the recorded call failed, and live's errors. [yields]
function Journal:call(c, live)
  local d, key, j = here()
  if j ~= self or (self.diverged and self.mode == "durable") then return live() end
  -- compared as it is kept: redacted (a secret registered since shows as [redacted] in both)
  c.sig = trace.redact(c.sig)
  local q = queue(stream_of(self, key), "c")
  local n = q.n + 1
  q.n = n
  local e = q[n]
  if e then
    if e.sig ~= c.sig then
      q.n = n - 1 -- not consumed: a create it holds was never reached (durable.run terminates it)
      nondeterminism(self, key, n, c.sig, e)
    end
    if e.st == "done" or e.st == "failed" then
      self.stats.replayed = self.stats.replayed + 1
      -- An answer from the journal still lets the other tasks run first, as a live call's
      -- wait would: concurrent work interleaves (and peaks) as it did when it was recorded.
      core.sleep(0)
      if e.st == "failed" then error(rebuild_error(e.a), 0) end
      return c.decode(e.a)
    elseif e.st == "interrupted" then
      -- The call was cut short by the task's cancellation or an enclosing deadline: it waits
      -- for that interruption again (the same recipe makes it again), and raises it.
      self.stats.replayed = self.stats.replayed + 1
      core.cond():wait()
    end
    -- in flight when the run stopped
    if self.mode ~= "durable" then
      nondeterminism(self, key, n, c.sig, nil, "was in flight when the recording stopped")
    end
    self.stats.in_flight = self.stats.in_flight + 1
    going_live(self, d)
    if c.in_flight then
      local r = below(d, c.in_flight, e)
      if not r[1] then
        -- interrupted while finding out: still in flight for the next resume
        if not task.is_interruption(r[2]) then
          e.st, e.a = "failed", error_fields(r[2])
          self:put(e)
        end
        error(r[2], 0)
      end
      if r[2] then
        e.st, e.a, e.t1 = "done", c.encode(table.unpack(r, 3, r.n)), core.time()
        self:put(e)
        return table.unpack(r, 3, r.n)
      end
    elseif not c.repeatable then
      local err = core.Error.new { op = c.op, code = "unknown_outcome", retryable = false,
        sandbox_id = c.sandbox_id, message = "the run stopped while this call was in flight (" ..
          summary(c.sig) .. "): it may or may not have been carried out. Check before repeating it, " ..
          "or mark the call idempotent" }
      e.st, e.a = "failed", error_fields(err)
      self:put(e)
      error(err, 0)
    end
    -- sent again, live, as the same entry
  else
    if self.mode == "replay" then
      nondeterminism(self, key, n, c.sig, nil, "is past the end of the cassette's calls in this task")
    end
    going_live(self, d)
    e = { s = key, k = "c", n = n, sig = c.sig, op = c.op, at = (core.where()), st = "started",
      meta = c.meta, t0 = core.time() }
    q[n] = e
  end
  -- Ahead: the call is in progress. Only where it matters: a repeatable call in flight at a
  -- crash is sent again, exactly as if it had never been written down — unless what it does
  -- changes what a resume expects to find (c.ahead: a terminate, after which the sandbox may be
  -- gone; journal:sandboxes() counts it gone from its `started` on).
  if not c.repeatable or c.ahead then self:put(e) end
  self.stats.live = self.stats.live + 1
  local r = below(d, live)
  e.t1 = core.time()
  if r[1] then
    e.st, e.a = "done", c.encode(table.unpack(r, 2, r.n))
    -- on_done may keep the entry open (a stream, finished by journal:finish once read) and
    -- give other results (the stream that records what is read from it)
    if c.on_done then r = table.pack(true, c.on_done(e, table.unpack(r, 2, r.n))) end
    if e.st == "done" then
      if c.lazy then
        -- a read: written with the next write (a crash before then only means reading again),
        -- or with the reads waiting once there are LAZY_READS of them. That flush is not a write
        -- the crash points count: how many reads a run makes depends on timing (the polls of a
        -- wait), and a crash point must name the same place in every run of a recipe.
        self.pending[#self.pending + 1] = e
        if #self.pending >= LAZY_READS then self:flush() end
      else
        self:put(e)
      end
    end
    return table.unpack(r, 2, r.n)
  end
  local err = r[2]
  e.st = task.is_interruption(err) and "interrupted" or "failed"
  e.a = error_fields(err)
  self:put(e)
  error(err, 0)
end

--- journal:finish(e, answer): a call whose answer came later than its return (a stream, read to
-- its end by another task) is done now. Does not yield on SQLite.
function Journal:finish(e, answer)
  e.st, e.a, e.t1 = "done", answer, core.time()
  self:put(e)
end

--- journal:peek(op) -> the running task's next call entry when it is one of op (not consumed),
-- else nil. Does not yield.
function Journal:peek(op)
  local _, key, j = here()
  if j ~= self then return nil end
  local q = self.streams[key] and self.streams[key].c
  local e = q and q[q.n + 1]
  if e and e.op == op then return e end
  return nil
end

--- journal:sandboxes() -> {sandbox_id = entry} of the sandboxes the journal says exist: created
-- (or found after a lost answer) and not terminated since — nor being terminated when the run
-- stopped (a terminate in flight may have been carried out: it is sent again). Does not yield.
function Journal:sandboxes()
  local alive = {}
  local gone = {}
  for _, s in pairs(self.streams) do
    for _, e in pairs(s.c or {}) do
      if type(e) == "table" and e.st == "done" and e.op == "sandboxes.create" and type(e.a) == "table"
        and type(e.a.v) == "table" then
        local id = e.a.v.id
        if type(id) == "string" then alive[id] = e end
      elseif type(e) == "table" and (e.st == "done" or e.st == "started") and e.op == "sandboxes.terminate"
        and e.meta and e.meta.sandbox_id then
        gone[e.meta.sandbox_id] = true
      end
    end
  end
  for id in pairs(gone) do alive[id] = nil end
  return alive
end

-- ---- hooks into moonbox.task: stream keys, the clock, sleeps, steps ----------------------------

local function on_spawn(parent, child)
  local pd = core.data(parent)
  pd = pd.jowner or pd -- a task that makes its caller's calls (durable.inherit) numbers as it
  local key = pd.jkey
  if key == nil then return end
  local n = (pd.jn or 0) + 1
  pd.jn = n
  core.data(child).jkey = key .. "." .. n
end

local function on_map()
  local t = core.current()
  local d = t and core.data(t)
  if not (d and d.jkey) then return nil end
  local n = (d.jn or 0) + 1
  d.jn = n
  return d.jkey .. ".m" .. n
end

local function on_item(map_key, i)
  local t = core.current()
  if not (t and map_key) then return end
  local d = core.data(t)
  d.jkey, d.jn = map_key .. "[" .. i .. "]", 0
end

--- durable.step(name, fn, ...) -> fn's results: task.step while the running task's tree has a
-- journal. A step that completed is not run again: its recorded results (JSON values) are
-- returned; one that failed raises its recorded error; one in flight at a crash runs again (at
-- least once). [yields]
local function step(name, fn, ...)
  local _, _, J = here()
  if not J then return fn(...) end
  local args = table.pack(...)
  return J:call({ sig = "step " .. name, op = "task.step", repeatable = true,
    encode = function(...)
      local r = table.pack(...)
      local ok, text = pcall(json.encode, { n = r.n, r = json.array { table.unpack(r, 1, r.n) } })
      if not ok then
        error(core.Error.new { op = "task.step", code = "invalid_argument", message = string.format(
          "task.step %q: its results must be JSON values (nil, booleans, numbers, strings, tables " ..
          "of them) to be journaled: %s", name, tostring(text)) }, 0)
      end
      return json.decode(text)
    end,
    decode = function(a)
      J.stats.steps_replayed = J.stats.steps_replayed + 1
      local r = a.r or {}
      for i = 1, a.n or 0 do if r[i] == json.null then r[i] = nil end end
      return table.unpack(r, 1, a.n or 0)
    end,
  }, function()
    -- The step's own work is the recipe's: what it calls is journaled in its own right, in a
    -- stream of the step's own (a step answered from the journal makes none of those calls, and
    -- the calls after it must still line up).
    J:flush()
    local d = core.data(core.current())
    local saved_below, saved_key, saved_n = d.jbelow, d.jkey, d.jn
    local q = J.streams[saved_key] and J.streams[saved_key].c
    d.jbelow, d.jkey, d.jn = 0, saved_key .. ".s" .. (q and q.n or 0), 0
    local r = table.pack(pcall(fn, table.unpack(args, 1, args.n)))
    d.jbelow, d.jkey, d.jn = saved_below, saved_key, saved_n
    if not r[1] then error(r[2], 0) end
    return table.unpack(r, 2, r.n)
  end)
end

-- The hooks are installed while at least one journal is attached (installed counts them); each
-- looks up the running task's journal, and does what it did before without one.
local saved
local installed = 0

local function install()
  installed = installed + 1
  if installed > 1 then return end
  saved = { now = task.now, sleep = task.sleep, time = os.time, clock = os.clock, date = os.date,
    random = math.random }
  local real_now, real_sleep, real_time, real_clock, real_date, real_random =
    saved.now, saved.sleep, saved.time, saved.clock, saved.date, saved.random
  local function lenient(kind, live)
    local _, _, j = here()
    if not j then return live() end
    return j:lenient(kind, live)
  end
  task.now = function() return lenient("t", real_now) end
  task.sleep = function(seconds)
    if type(seconds) ~= "number" or seconds ~= seconds or seconds < 0 then
      error("task.sleep: expected a number of seconds >= 0", 2)
    end
    -- A replay has no time to wait for; a resumed stream's journaled past neither.
    local _, _, j = here()
    if j and (j.mode == "replay" or j:replaying()) then return core.sleep(0) end
    return real_sleep(seconds)
  end
  local function journaled_time(t)
    if t ~= nil then return real_time(t) end
    return lenient("T", real_time)
  end
  rawset(os, "time", journaled_time)
  rawset(os, "clock", function() return lenient("C", real_clock) end)
  rawset(os, "date", function(fmt, t)
    if t == nil then t = journaled_time() end
    return real_date(fmt, t)
  end)
  rawset(math, "random", function(...)
    local args = table.pack(...)
    return lenient("r", function() return real_random(table.unpack(args, 1, args.n)) end)
  end)
  task.durable_hooks = { spawn = on_spawn, map = on_map, item = on_item, step = step }
end

local function uninstall()
  if installed == 0 then return end
  installed = installed - 1
  if installed > 0 then return end
  task.now, task.sleep = saved.now, saved.sleep
  rawset(os, "time", saved.time)
  rawset(os, "clock", saved.clock)
  rawset(os, "date", saved.date)
  rawset(math, "random", saved.random)
  task.durable_hooks = nil
  saved = nil
end

--- durable.attach(j [, t]): journal j journals the work of task t (default: the running one) —
-- the root of a recipe's run, stream "r" — and of every task it spawns from now on. A task tree
-- has one journal: raises when t's already has one. Does not yield.
function M.attach(j, t)
  t = t or core.current()
  if not t then error("moonbox.durable: attach outside a task", 2) end
  if task.context(CTX, t) then error("moonbox.durable: this task's tree already has a journal", 2) end
  if j.root then error("moonbox.durable: this journal is already attached", 2) end
  j.root = t
  task.set_context(CTX, j, t)
  local d = core.data(t)
  d.jkey, d.jn = "r", 0
  install()
end

--- durable.detach(j) -> the journal's stats {replayed, live, in_flight, entries, steps_replayed,
-- writes}: j no longer journals its task tree (what was waiting to be written is written; a
-- failure to write it is ignored: those are reads, read again by a resume). Does not yield on
-- SQLite.
function M.detach(j)
  if not (j and j.root) then return j and j.stats end
  if #j.pending > 0 then
    local batch = j.pending
    j.pending = {}
    pcall(j.store.put, j.store, batch)
  end
  local t = j.root
  j.root = nil
  if task.context(CTX, t) == j then task.set_context(CTX, nil, t) end
  local d = core.data(t)
  d.jkey, d.jn = nil, nil
  report_writes(j)
  uninstall()
  return j.stats
end

local started -- the journal durable.start attached (`moonbox run`'s one)

--- durable.start(j): attaches journal j to the running task (the recipe's root task) as the
-- run's one journal (durable.attach). Raises when one is started already. Does not yield.
function M.start(j)
  if started then error("moonbox.durable: a journal is already active", 2) end
  M.attach(j)
  started = j
end

--- durable.stop() -> the stats of the journal durable.start attached (durable.detach), or nil.
-- Does not yield on SQLite.
function M.stop()
  local j = started
  if not j then return nil end
  started = nil
  return M.detach(j)
end

-- ---- what the client asks of the journal ------------------------------------------------------

--- durable.fresh(make) -> make()'s value (a fresh random id), or the one the journal recorded
-- for this stream's next fresh value: ids that go into request bodies (exec markers, create
-- labels) are the same on resume and replay. Does not yield.
function M.fresh(make)
  local _, _, j = here()
  if not j then return make() end
  return j:lenient("b", make)
end

--- durable.inherit(t): task t, just spawned by the running task, which waits for it to its end
-- (api.shielded: a create, a terminate), makes its calls in the running task's stream, as the
-- running task would: it takes no stream of its own, and what it spawns is numbered in that
-- stream. So a call of the recipe's is checked against the journal where the recipe made it,
-- and the streams of the tasks the recipe spawns do not depend on how many such calls it made.
-- Does not yield.
function M.inherit(t)
  local _, _, j = here()
  local cur = j and core.current()
  if not cur then return end
  local pd = core.data(cur)
  if pd.jkey == nil then return end
  local owner = pd.jowner or pd
  owner.jn = (owner.jn or 1) - 1 -- the number on_spawn gave t, taken back
  local cd = core.data(t)
  cd.jkey, cd.jowner, cd.jbelow = pd.jkey, owner, pd.jbelow
end

--- durable.peek(op) -> the running task's next journaled call when it is one of op, else nil
-- (sandboxes.create reuses the ledger intent and label the journal recorded). Does not yield.
function M.peek(op)
  local _, _, j = here()
  return j and j:peek(op) or nil
end

--- durable.digest(s) -> a short digest of s as it would be journaled (redacted first). Does not
-- yield.
function M.digest(s)
  if s == nil then return "-" end
  return strings.digest(trace.redact(s))
end

--- durable.body_sig(v) -> the text of a request body for a call's signature: canonical JSON
-- (keys sorted), redacted, cut to 400 bytes plus a digest of the whole when longer. Does not
-- yield.
function M.body_sig(v)
  if v == nil then return "" end
  local text = trace.redact(type(v) == "string" and v or json.encode(v))
  if #text > 400 then return text:sub(1, 400) .. "...#" .. strings.digest(text) end
  return text
end

--- durable.lost_sandbox(id, e) -> raises `lost_sandbox`: the journal holds sandbox id (created
-- by entry e) but the backend says it is gone.
function M.lost_sandbox(id, e, status)
  error(core.Error.new { op = "durable", code = "lost_sandbox", sandbox_id = id, message = string.format(
    "sandbox %s, which this run created at %s, is %s: the journal says the run still holds it, so " ..
    "the run cannot go on from where it stopped (it was terminated behind the run's back, or its " ..
    "lifetime ran out)", id, tostring(e and e.at), status or "gone") }, 0)
end

--- durable.call(c, live) -> journal:call(c, live) on the running task's journal, or live()
-- with none. [yields]
function M.call(c, live)
  local _, _, j = here()
  if not j then return live() end
  return j:call(c, live)
end

return M
