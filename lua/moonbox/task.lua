--- moonbox.task — tasks: concurrent functions on the one event loop.
--
-- A task is a coroutine the scheduler resumes when what it waits for is ready. Every moonbox
-- call that waits (HTTP, sleep, exec, join, ...) parks only the calling task; everything else
-- keeps running. Cancellation is an error (code "cancelled") raised where the task waits, so
-- `<close>` variables and pcall handlers unwind normally and may themselves wait.
--
-- Functions marked [yields] must be called from inside a task (a `moonbox run` recipe body is
-- one); calling them elsewhere raises an error that says so.
local core = require "moonbox.core"
local schema = require "moonbox.schema"

local M = {}

local Task = core.Task
local methods = {}
Task.__index = function(t, k)
  if k == "id" then return core.id(t) end
  if k == "name" then return core.data(t).name end
  if k == "status" then return core.status(t) end
  return methods[k]
end
Task.__newindex = function(t, k, v)
  if k == "name" then
    core.data(t).name = v
  else
    error("task: cannot set field '" .. tostring(k) .. "' of a Task", 2)
  end
end
Task.__close = function(t) core.cancel(t) end

local pack, unpack = table.pack, table.unpack

-- Every task moonbox.task starts goes through here, so a trace (moonbox.trace) gets one span
-- per task, named after the function it runs (`label`, else `fn`).
local function plain_spawn(label, fn, ...)
  local tr = package.loaded["moonbox.trace"]
  if not (tr and tr.on) then return core.spawn(fn, ...) end
  local info = debug.getinfo(label or fn, "S")
  local name = "task " .. info.short_src .. ":" .. info.linedefined
  return core.spawn(function(...)
    local t0, id = tr.now_us(), core.id(core.current())
    local _span <close> = setmetatable({}, { __close = function(_, err)
      local cancelled = type(err) == "table" and core.Error.is(err) and err.code == "cancelled"
      local status = err == nil and "ok" or cancelled and "cancelled" or "failed"
      tr.task_span(id, name, t0, status)
    end })
    return fn(...)
  end, ...)
end

-- With a journal active (moonbox.durable), every task gets its stream key from its parent here.
local function spawn(label, fn, ...)
  local hooks = M.durable_hooks
  if not hooks then return plain_spawn(label, fn, ...) end
  local parent = core.current()
  local t = plain_spawn(label, fn, ...)
  if parent then hooks.spawn(parent, t) end
  return t
end

--- Re-raises a finished task's error in the caller, keeping the child's traceback.
local function reraise(t, err)
  local data = core.data(t)
  local tb = (rawequal(data.tb_err, err) and data.tb) or (type(err) == "table" and err.traceback)
  if tb then
    core.set_traceback(err, tb .. "\n  (in " .. (data.chain or ("task " .. core.id(t))) .. ")")
  end
  error(err, 0)
end

local function is_code(err, code)
  return type(err) == "table" and core.Error.is(err) and err.code == code
end

--- task.is_cancelled(err) -> boolean: whether err is the error cancellation raises.
function M.is_cancelled(err) return is_code(err, "cancelled") end

--- task.is_timeout(err) -> boolean: whether err came from task.timeout expiring.
function M.is_timeout(err) return is_code(err, "timeout") end

--- task.is_interruption(err) -> boolean: whether err is the calling task's cancellation or the
-- expiry of an enclosing task.timeout (code "deadline", or "timeout" from op "task.timeout"),
-- which every layer lets pass untouched. A transfer's own timeout (op "http.request") is not one.
function M.is_interruption(err)
  if type(err) ~= "table" then return false end
  return M.is_cancelled(err) or err.code == "deadline" or (err.code == "timeout" and err.op == "task.timeout")
end

--- task.spawn(fn, ...) -> Task. Starts fn(...) as a new task; it first runs when the caller
-- next waits. Raises if fn is not a function. Does not yield. A task that fails and that
-- nothing joins is reported on stderr with its traceback (and fails `moonbox run`).
function M.spawn(fn, ...)
  if type(fn) ~= "function" then
    error("task.spawn: expected a function, got " .. type(fn), 2)
  end
  return spawn(nil, fn, ...)
end

--- task.current() -> Task|nil: the running task.
M.current = core.current

--- task.set_context(key, value [, t]): sets a context value on task t (default: the running
-- one). Tasks t spawns from then on inherit its whole context; setting a key later changes
-- neither its parent's nor the children already spawned (copy on write). Does not yield.
function M.set_context(key, value, t)
  t = t or core.current()
  if not t then error("task.set_context: not inside a task", 2) end
  local d = core.data(t)
  local ctx = {}
  for k, v in pairs(d.ctx or {}) do ctx[k] = v end
  ctx[key] = value
  d.ctx = ctx
end

--- task.context(key [, t]) -> the value of key in task t's context (default: the running
-- task's), inherited from the task that spawned it; nil outside a task. Does not yield.
function M.context(key, t)
  t = t or core.current()
  if not t then return nil end
  local ctx = core.data(t).ctx
  return ctx and ctx[key]
end

--- task.join(t) -> results of t's function. Waits for t to finish; re-raises its error with
-- its original traceback. [yields]
function M.join(t)
  local r = pack(core.join(t))
  if r[1] then return unpack(r, 2, r.n) end
  return reraise(t, r[2])
end

--- task.result(t) -> nil while running; else true, results... or false, err. Does not yield.
M.result = core.result

--- task.cancel(t): asks t to stop; it raises a "cancelled" error where it waits. Does not
-- wait for t to unwind (join it for that).
function M.cancel(t) core.cancel(t) end

--- task.sleep(seconds): waits that long; 0 lets every other ready task run first. [yields]
M.sleep = core.sleep

--- task.yield(): lets every other ready task run, then continues. [yields]
function M.yield() return core.sleep(0) end

--- task.remaining() -> seconds|nil: what the nearest enclosing task.timeout still allows.
M.remaining = core.remaining

--- task.now() -> seconds on the loop's monotonic clock.
M.now = core.now

--- task.timeout(seconds, fn, ...) -> results of fn(...). Runs fn with a deadline: when it
-- expires, fn's pending wait raises, fn unwinds, and task.timeout raises an error with code
-- "timeout". Nested timeouts get the smaller of their own budget and what encloses them.
-- [yields]
function M.timeout(seconds, fn, ...)
  if type(seconds) ~= "number" or seconds ~= seconds or seconds < 0 then
    error("task.timeout: expected seconds >= 0, got " .. tostring(seconds), 2)
  end
  if type(fn) ~= "function" then error("task.timeout: expected a function", 2) end
  local me = core.current()
  local level = core.deadline_push(seconds)
  local r = pack(xpcall(fn, core.msgh, ...))
  core.deadline_pop(level)
  if r[1] then return unpack(r, 2, r.n) end
  local err = r[2]
  if is_code(err, "deadline") and err.level == level and err.task_id == core.id(me) then
    error(core.Error.new {
      op = "task.timeout", code = "timeout", retryable = true, seconds = seconds,
      message = string.format("timed out after %g s", seconds),
      traceback = err.traceback,
    }, 0)
  end
  error(err, 0)
end

-- ---- scopes --------------------------------------------------------------------------------

local Scope = {}
Scope.__index = Scope

--- scope:spawn(fn, ...) -> Task: a child of the scope; the scope waits for it, and its failure
-- cancels the siblings and the scope's body, then the scope re-raises that failure.
function Scope:spawn(fn, ...)
  if type(fn) ~= "function" then error("scope:spawn: expected a function", 2) end
  if self.closed then error("scope:spawn: the scope has already finished", 2) end
  local scope = self
  local t = spawn(fn, function(...)
    local r = pack(xpcall(fn, core.msgh, ...))
    if not r[1] then scope:_fail(r[2], core.current()) end
    if r[1] then return unpack(r, 2, r.n) end
    error(r[2], 0)
  end, ...)
  core.observe(t)
  self.children[#self.children + 1] = t
  return t
end

--- scope:cancel(): cancels every child and the scope's body.
function Scope:cancel()
  self.cancelled = true
  for _, c in ipairs(self.children) do core.cancel(c) end
  if self.in_body and self.owner then core.cancel(self.owner) end
end

function Scope:_fail(err, child)
  if self.failure == nil and not (M.is_cancelled(err) and self.cancelled) then
    self.failure = { err = err, task = child }
    for _, c in ipairs(self.children) do
      if c ~= child then core.cancel(c) end
    end
    if self.in_body and self.owner then
      self.cancelled_body = true
      core.cancel(self.owner)
    end
  end
end

--- task.scope(fn) -> results of fn(scope). Structured concurrency: fn spawns children with
-- scope:spawn; task.scope returns only when all of them have finished. The first failure
-- (of fn or of a child) cancels the rest and is re-raised once everything has unwound.
-- [yields]
function M.scope(fn)
  local owner = core.current()
  if not owner then error("task.scope: not inside a task", 2) end
  local s = setmetatable({ children = {}, owner = owner, in_body = true }, Scope)
  local r = pack(xpcall(fn, core.msgh, s))
  s.in_body = false
  if not r[1] then
    local err = r[2]
    if not (s.cancelled_body and M.is_cancelled(err)) and s.failure == nil then
      s.failure = { err = err }
    end
    for _, c in ipairs(s.children) do core.cancel(c) end
  end
  -- Wait for every child, even if we are cancelled meanwhile (then re-raise that at the end).
  local outer_cancel
  local i = 1
  while i <= #s.children do
    local c = s.children[i]
    local ok, err = pcall(core.join, c)
    if not ok then
      outer_cancel = outer_cancel or err
      s:cancel()
    else
      i = i + 1
    end
  end
  s.closed = true
  if s.failure then
    local f = s.failure
    if f.task then return reraise(f.task, f.err) end
    error(f.err, 0)
  end
  if outer_cancel then error(outer_cancel, 0) end
  return unpack(r, 2, r.n)
end

-- ---- combinators ----------------------------------------------------------------------------

local function as_thunk(item, i, where)
  if type(item) == "function" then return item end
  if getmetatable(item) == Task then return function() return M.join(item) end end
  error(where .. ": item " .. i .. " is a " .. type(item) .. ", expected a function or a Task", 3)
end

--- task.all(list) -> array of first results. Runs every function (or joins every Task) in
-- the list concurrently; the first failure cancels the others and is re-raised. [yields]
function M.all(list)
  local out = {}
  local thunks = {}
  for i, item in ipairs(list) do thunks[i] = as_thunk(item, i, "task.all") end
  M.scope(function(s)
    for i, th in ipairs(thunks) do
      s:spawn(function() out[i] = th() end)
    end
  end)
  return out
end

--- task.all_settled(list) -> array of outcomes {ok=true, value=v, values={...}} or
-- {ok=false, error=err}, one per item, in order. Never raises for an item's failure and never
-- drops one; waits for all. [yields]
function M.all_settled(list)
  local tasks = {}
  for i, item in ipairs(list) do
    local th = as_thunk(item, i, "task.all_settled")
    tasks[i] = spawn(nil, th)
  end
  local out = {}
  local cancelled
  for i, t in ipairs(tasks) do
    local ok, cerr = pcall(core.join, t)
    while not ok do -- we were cancelled: pass it on, but still collect every outcome
      cancelled = cancelled or cerr
      for _, o in ipairs(tasks) do core.cancel(o) end
      ok, cerr = pcall(core.join, t)
    end
    local r = pack(core.result(t))
    if r[1] then
      out[i] = { ok = true, value = r[2], values = pack(unpack(r, 2, r.n)) }
    else
      out[i] = { ok = false, error = r[2] }
    end
  end
  if cancelled then error(cancelled, 0) end
  return out
end

--- task.race(list) -> value, index: the first item to finish wins; the others are cancelled
-- and waited for. If the winner failed, its error is raised. [yields]
function M.race(list)
  local done = core.cond()
  local winner
  local tasks = {}
  for i, item in ipairs(list) do
    local th = as_thunk(item, i, "task.race")
    tasks[i] = spawn(th, function()
      local r = pack(xpcall(th, core.msgh))
      if not winner then
        winner = i
        done:signal()
      end
      if r[1] then return unpack(r, 2, r.n) end
      error(r[2], 0)
    end)
    core.observe(tasks[i])
  end
  if #tasks == 0 then error("task.race: empty list", 2) end
  local ok, err = pcall(function()
    while not winner do done:wait() end
  end)
  for j, t in ipairs(tasks) do
    if j ~= winner then core.cancel(t) end
  end
  for _, t in ipairs(tasks) do
    while not pcall(core.join, t) do end
  end
  if not ok then error(err, 0) end
  local r = pack(core.result(tasks[winner]))
  if not r[1] then return reraise(tasks[winner], r[2]) end
  return r[2], winner
end

--- task.map(items, fn, opts|concurrency) -> results, stats. Calls fn(item, i) for every item
-- with at most `concurrency` (default 8) calls in flight; results[i] is the first value of call
-- i. The first failure cancels the rest and is re-raised. items may be an array or anything
-- with __len/__index (a fleet). The limit is an adaptive window (task.window) unless
-- opts.adaptive is false: when the work reports congestion (a 429 from Render's API does, via
-- task.congested) the window halves and pauses for Retry-After, then grows by one per finished
-- item back up to `concurrency`. stats: peak (most calls in flight), min_window. [yields]
function M.map(items, fn, opts)
  if type(fn) ~= "function" then error("task.map: expected a function as argument 2", 2) end
  local limit = 8
  if type(opts) == "number" then
    limit = opts
    opts = {}
  elseif type(opts) == "table" then
    limit = opts.concurrency or limit
  else
    opts = {}
  end
  if type(limit) ~= "number" or limit < 1 or limit % 1 ~= 0 then
    error("task.map: concurrency must be a positive integer, got " .. tostring(limit), 2)
  end
  local n = #items
  local out = {}
  local next_i = 1
  local in_flight, peak = 0, 0
  local win, own = opts.window, nil
  if win == nil and opts.adaptive ~= false and limit > 1 then
    win = M.window(limit, opts.name or "task.map")
    own = win
  end
  local _close <close> = own
  -- a journal (moonbox.durable) keys item i's work by the map and i, whichever worker runs it
  local hooks = M.durable_hooks
  local map_key = hooks and hooks.map()
  M.scope(function(s)
    for _ = 1, math.min(limit, n) do
      s:spawn(function()
        while next_i <= n do
          if win then
            win:acquire()
            if next_i > n then
              win:release(false)
              break
            end
          end
          local i = next_i
          next_i = next_i + 1
          in_flight = in_flight + 1
          if in_flight > peak then peak = in_flight end
          if map_key then hooks.item(map_key, i) end
          local ok, v = xpcall(fn, core.msgh, items[i], i)
          in_flight = in_flight - 1
          if win then win:release(ok) end
          if not ok then error(v, 0) end
          out[i] = v
        end
      end)
    end
  end)
  return out, { peak = peak, min_window = win and win.min_size or limit }
end

--- task.step(name, fn, ...) -> fn(...)'s results. Outside a durable run (moonbox.durable) it is
-- fn(...). In one, it is the recipe's own side effect, journaled: a step that completed before a
-- crash is not run again on resume (its recorded results come back; they must be JSON values),
-- a step in flight at the crash runs again. name tells steps apart in the journal. [yields] as
-- fn does.
function M.step(name, fn, ...)
  local hooks = M.durable_hooks
  if hooks then return hooks.step(name, fn, ...) end
  return fn(...)
end

-- ---- adaptive windows (AIMD) -----------------------------------------------------------------

local Window = {}
Window.__index = Window
local windows = setmetatable({}, { __mode = "k" }) -- the open windows, told of congestion

--- task.window(limit, name) -> Window: an adaptive concurrency limit (AIMD, as TCP's congestion
-- window). w:acquire() waits for a slot [yields]; w:release(ok) frees it, growing the window by
-- one (up to `limit`) when ok. Congestion anywhere in the process (task.congested) halves every
-- open window — once per window of requests, not once per throttled request — and holds new
-- acquisitions until Retry-After has passed. w:set_limit(n) lowers or raises the upper bound;
-- w:close() (also `<close>`) detaches it. Sizes are reported to moonbox.trace as the counter
-- "concurrency <name>".
function M.window(limit, name)
  if type(limit) ~= "number" or limit < 1 or limit % 1 ~= 0 then
    error("task.window: limit must be a positive integer, got " .. tostring(limit), 2)
  end
  local w = setmetatable({ limit = limit, size = limit, min_size = limit, in_flight = 0,
    cond = core.cond(), hold_until = 0, last_cut = -math.huge, name = name or "window" }, Window)
  windows[w] = true
  w:_report()
  return w
end

function Window:_report()
  local tr = package.loaded["moonbox.trace"]
  if tr and tr.on then tr.counter("concurrency " .. self.name, { window = self.size }) end
end

function Window:acquire()
  while true do
    local now = core.now()
    if now < self.hold_until then
      core.sleep(self.hold_until - now)
    elseif self.in_flight < self.size then
      self.in_flight = self.in_flight + 1
      return
    else
      self.cond:wait()
    end
  end
end

function Window:release(ok)
  self.in_flight = self.in_flight - 1
  if ok and self.size < self.limit then
    self.size = self.size + 1
    self:_report()
  end
  self.cond:broadcast()
end

function Window:set_limit(n)
  self.limit = math.max(1, n)
  if self.size > self.limit then
    self.size = self.limit
    self:_report()
  end
  if self.size < self.min_size then self.min_size = self.size end
end

--- Halves the window (not below 1) unless it was cut less than `epoch` seconds ago, and holds
-- acquisitions for retry_after seconds.
function Window:congested(retry_after, epoch)
  local now = core.now()
  if retry_after and retry_after > 0 then
    self.hold_until = math.max(self.hold_until, now + retry_after)
  end
  if now - self.last_cut < (epoch or 0) then return end
  self.last_cut = now
  local size = math.max(1, self.size // 2)
  if size ~= self.size then
    self.size = size
    if size < self.min_size then self.min_size = size end
    self:_report()
  end
end

function Window:close() windows[self] = nil end
Window.__close = Window.close

--- task.congested(retry_after): tells every open window that the shared resource is overloaded
-- (moonbox.render calls it on each 429). A burst of throttled answers within `retry_after` (or
-- 0.2 s) of a cut counts once.
function M.congested(retry_after)
  local epoch = math.max(tonumber(retry_after) or 0, 0.2)
  for w in pairs(windows) do w:congested(tonumber(retry_after), epoch) end
end

-- ---- semaphores ------------------------------------------------------------------------------

local Semaphore = {}
Semaphore.__index = Semaphore

--- task.semaphore(n) -> Semaphore with n permits; waiters are served first come, first served.
function M.semaphore(n)
  if type(n) ~= "number" or n < 0 or n % 1 ~= 0 then
    error("task.semaphore: expected a count >= 0, got " .. tostring(n), 2)
  end
  return setmetatable({ permits = n, handoff = 0, cond = core.cond() }, Semaphore)
end

--- sem:acquire(): takes a permit, waiting while none is free. [yields]
function Semaphore:acquire()
  if self.permits > 0 and self.cond:waiting() == 0 then
    self.permits = self.permits - 1
    return
  end
  -- release() hands its permit straight to the longest waiter, so nobody can overtake it.
  repeat
    self.cond:wait()
  until self.handoff > 0
  self.handoff = self.handoff - 1
end

--- sem:release(): returns a permit, handing it to the longest waiter if there is one.
function Semaphore:release()
  if self.cond:signal() then
    self.handoff = self.handoff + 1
  else
    self.permits = self.permits + 1
  end
end

--- sem:with(fn, ...) -> results of fn(...), holding a permit for the call (released however fn
-- ends). [yields]
function Semaphore:with(fn, ...)
  self:acquire()
  local r = pack(xpcall(fn, core.msgh, ...))
  self:release()
  if r[1] then return unpack(r, 2, r.n) end
  error(r[2], 0)
end

-- ---- running ---------------------------------------------------------------------------------

--- task.run(fn, ...) -> results of fn: runs fn as a task and drives the event loop until it
-- finishes (re-raising its error). For programs and tests outside `moonbox run`; cannot be
-- called from inside a task.
M.run = core.run

--- Methods of Task objects: t:join(), t:cancel(), t:result(), t.id, t.name, t.status.
methods.join = M.join
methods.cancel = M.cancel
methods.result = M.result

-- ---- the declared calls (moonbox.schema) -------------------------------------------------------

local FN = { name = "fn", type = "function" }
local TASK = { name = "t", type = "Task" }
local LIST = { name = "list", type = "table" }
local ERR = { name = "err", type = "any", optional = true }

M.SCHEMA = {
  ["task.spawn"] = { summary = "starts fn(...) as a new task", args = { FN }, returns = "Task" },
  ["task.current"] = { summary = "the running task, or nil", returns = "Task?" },
  ["task.set_context"] = { summary = "sets a context value on a task (inherited by the tasks it spawns)",
    args = { { name = "key", type = "string" }, { name = "value", type = "any", optional = true },
      { name = "t", type = "Task", optional = true } } },
  ["task.context"] = { summary = "a value of a task's context, or nil",
    args = { { name = "key", type = "string" }, { name = "t", type = "Task", optional = true } },
      returns = "any" },
  ["task.join"] = { summary = "waits for a task and returns its results (or re-raises its error)",
    args = { TASK }, returns = "any", yields = true },
  ["task.result"] = { summary = "nil while running; else true, results or false, err", args = { TASK },
    returns = "boolean?, any" },
  ["task.cancel"] = { summary = "asks a task to stop (it raises cancelled where it waits)", args = { TASK } },
  ["task.sleep"] = { summary = "waits that many seconds", args = { { name = "seconds", type = "number" } },
    yields = true },
  ["task.yield"] = { summary = "lets every other ready task run, then continues", yields = true },
  ["task.remaining"] = { summary = "what the nearest enclosing task.timeout still allows, or nil",
    returns = "number?" },
  ["task.now"] = { summary = "seconds on the loop's monotonic clock", returns = "number" },
  ["task.timeout"] = { summary = "runs fn(...) with a deadline; raises timeout when it expires",
    args = { { name = "seconds", type = "number" }, FN }, returns = "any", yields = true },
  ["task.scope"] = { summary = "runs fn(scope); waits for every child; the first failure cancels the rest",
    args = { FN }, returns = "any", yields = true },
  ["task.all"] = { summary = "runs functions (or joins tasks) concurrently; their first results in order",
    args = { LIST }, returns = "any[]", yields = true },
  ["task.all_settled"] = { summary = "waits for every item; an outcome per item, none dropped",
    args = { LIST }, returns = "table[]", yields = true },
  ["task.race"] = { summary = "the first item to finish wins; the others are cancelled",
    args = { LIST }, returns = "any, integer", yields = true },
  ["task.map"] = { summary = "fn(item, i) for every item, a bounded number in flight",
    args = { { name = "items", type = "table" }, FN, { name = "opts", type = { "table", "integer" },
      optional = true } },
    options = {
      concurrency = { type = "integer", default = 8, doc = "the most calls in flight" },
      adaptive = { type = "boolean", default = true,
        doc = "false: a fixed limit; else an adaptive window that halves on congestion (a 429)" },
      window = { type = "table", doc = "a task.window to share with other work" },
      name = { type = "string", default = "task.map", doc = "the window's name in a trace" },
    }, returns = "any[], table", yields = true },
  ["task.step"] = { summary = "a journaled side effect of a durable run: not run again on resume",
    args = { { name = "name", type = "string" }, FN }, returns = "any", yields = true },
  ["task.window"] = { summary = "an adaptive concurrency limit (AIMD)",
    args = { { name = "limit", type = "integer" }, { name = "name", type = "string", optional = true } },
    returns = "table" },
  ["task.congested"] = { summary = "tells every open window that the shared resource is overloaded",
    args = { { name = "retry_after", type = { "number", "string" }, optional = true } } },
  ["task.semaphore"] = { summary = "a semaphore with n permits (first come, first served)",
    args = { { name = "n", type = "integer" } }, returns = "table" },
  ["task.run"] = { summary = "runs fn as a task and drives the event loop until it finishes",
    args = { FN }, returns = "any" },
  ["task.is_cancelled"] = { summary = "whether err is a cancellation", args = { ERR }, returns = "boolean" },
  ["task.is_timeout"] = { summary = "whether err is a timeout", args = { ERR }, returns = "boolean" },
  ["task.is_interruption"] = { summary = "whether err is the caller's cancellation or an enclosing deadline",
    args = { ERR }, returns = "boolean" },
}
schema.declare(M.SCHEMA)

for _, k in ipairs { "spawn", "set_context", "context", "join", "result", "cancel", "sleep", "timeout",
  "scope", "step",
  "all", "all_settled", "race", "map", "window", "congested", "semaphore", "run" } do
  M[k] = schema.wrap("task." .. k, M[k])
end

M.Task = Task
return M
