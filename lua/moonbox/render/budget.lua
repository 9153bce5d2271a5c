--- moonbox.render.budget — a guard on what a run may cost: at most N sandboxes created, at most
-- S sandbox-seconds (the sum over its sandboxes of the time each has existed), so that a recipe
-- with a bug cannot create thousands of sandboxes or keep them for hours.
--
--   render.budget { sandboxes = 50, sandbox_seconds = 3600 }    -- in a recipe
--   moonbox run --max-sandboxes 50 --max-sandbox-seconds 3600 recipe.lua
--
-- A budget belongs to a run: `moonbox run` and every scheduled run attach one to their root task
-- (task context "moonbox.budget", inherited by every task spawned from it), and
-- render.budget{...} tightens the one in force (a recipe can lower a limit, never raise one the
-- command line set). Outside a run (the REPL, a spec), render.budget attaches one to the calling
-- task.
--
-- Enforcement:
--   - sandboxes: every create request counts when it is sent (a create refused for sure, a 4xx,
--     gives its place back); the create that would exceed raises budget_exceeded before anything
--     is sent, naming the budget, the count and the ids created.
--   - sandbox_seconds: a watchdog task computes when the sandboxes alive will have spent what is
--     left; at that moment it terminates every sandbox of the run still alive and cancels the
--     run's root task, whose error becomes budget_exceeded (naming the budget, the seconds
--     spent, the sandbox count and the ids terminated). Creates after that raise as well.
-- Seconds run from a sandbox's "created" event to its "terminated" event, as the client sees
-- them. Usage is kept per plan for `moonbox run --json`.
local core = require "moonbox.core"
local task = require "moonbox.task"
local events = require "moonbox.render.events"
local schema = require "moonbox.schema"
local json = require "moonbox.json"

local M = {}

local KEY = "moonbox.budget"

--- budget.clock: the time budgets count in — now() and wait(cond, seconds) (until cond is
-- broadcast or the seconds have passed). Real time, except in a dry run, whose simulated clock
-- moonbox.render.dryrun puts here.
M.clock = {
  now = function() return task.now() end,
  wait = function(cond, seconds) pcall(task.timeout, seconds, cond.wait, cond) end,
}

--- budget.terminate(id): how an exceeded budget ends a sandbox; moonbox.render.sandbox puts its
-- sandbox.terminate here when it loads (a budget only counts sandboxes that module made, and the
-- sandbox module requires this one: the reverse require would be a cycle).
M.terminate = function(id) error("budget: no sandbox module loaded to terminate " .. tostring(id), 0) end

local Budget = {}
Budget.__index = Budget

-- Checks one limit (nil: none); raises at the caller's caller's level.
local function check_limit(where, name, v, level)
  if v == nil then return nil end
  local ok
  if name == "sandboxes" then
    ok = math.type(v) == "integer"
  else
    ok = type(v) == "number" and v == v and v ~= math.huge
  end
  if not ok or v < 0 then
    error(string.format("%s: %s must be a non-negative %s, got %s", where, name,
      name == "sandboxes" and "integer" or "number of seconds", tostring(v)), level + 1)
  end
  return v
end
M.check_limit = check_limit

--- budget.new{sandboxes, sandbox_seconds} -> Budget (not attached; nil limits: none).
function M.new(limits)
  limits = limits or {}
  return setmetatable({
    max_sandboxes = limits.sandboxes, max_seconds = limits.sandbox_seconds,
    sent = 0, created = {}, order = {}, live = {}, spent = {}, -- spent: plan -> seconds of ended
    cond = core.cond(), breach = nil, count_refused = false,
  }, Budget)
end

--- budget.attach(t, b): makes b the budget of task t and every task it spawns from now on, and
-- starts watching the sandboxes they create. Returns b. Does not yield.
function M.attach(t, b)
  b.owner = t
  task.set_context(KEY, b, t)
  if not b.unobserve then
    b.unobserve = events.observe(function(event, subject, info) b:observe(event, subject, info) end)
  end
  if b.max_seconds then b:watch() end
  return b
end

--- budget.settle(b, r) -> the results in r, or raises: r is table.pack(xpcall(...)) of a run
-- under budget b. A breach wins (raised in the watchdog, it is placed where the run was when it
-- was stopped); else r's own error; else r's results. Does not yield.
function M.settle(b, r)
  if b.breach then
    local e, stopped = b.breach, r[2]
    if not r[1] and type(stopped) == "table" and stopped.where then
      e.where, e.traceback = stopped.where, stopped.traceback
    end
    error(e, 0)
  end
  if not r[1] then error(r[2], 0) end
  return table.unpack(r, 2, r.n)
end

--- budget.current([t]) -> the Budget in force for task t (default: the running one), or nil.
function M.current(t) return task.context(KEY, t) end

--- render.budget{sandboxes = N, sandbox_seconds = S} -> Budget: tightens the budget of the
-- current run (a limit already lower stays), or attaches a new one to the calling task outside a
-- run. Raises on a limit that is not a non-negative number. Does not yield.
function M.set(limits)
  local n = check_limit("render.budget", "sandboxes", limits.sandboxes, 2)
  local s = check_limit("render.budget", "sandbox_seconds", limits.sandbox_seconds, 2)
  local b = M.current()
  if not b then
    local t = task.current()
    if not t then error("render.budget: not inside a task (run the recipe with `moonbox run`)", 2) end
    return M.attach(t, M.new { sandboxes = n, sandbox_seconds = s })
  end
  if n and (not b.max_sandboxes or n < b.max_sandboxes) then b.max_sandboxes = n end
  if s and (not b.max_seconds or s < b.max_seconds) then
    b.max_seconds = s
    b:watch()
    b.cond:broadcast()
  end
  return b
end

local function ids_text(list, max)
  max = max or 10
  if #list == 0 then return "none" end
  local shown = table.concat(list, ", ", 1, math.min(#list, max))
  return #list > max and (shown .. string.format(", ... (%d in all)", #list)) or shown
end

local function budget_error(fields)
  fields.op = fields.op or "render.budget"
  fields.code = "budget_exceeded"
  return core.Error.new(fields)
end

--- b:before_create(): called by render.sandboxes.create before it sends anything: raises
-- budget_exceeded when the run's budget is spent, else counts the create. Does not yield.
function Budget:before_create()
  if self.breach then error(self.breach, 0) end
  if self.max_sandboxes and self.sent >= self.max_sandboxes then
    self.count_refused = true
    error(budget_error { message = string.format(
      "this run's budget of %d sandbox%s is spent (created: %s); " ..
      "the create was not sent", self.max_sandboxes, self.max_sandboxes == 1 and "" or "es", ids_text(
        self.order)),
      budget = "sandboxes", limit = self.max_sandboxes, count = self.sent }, 0)
  end
  self.sent = self.sent + 1
end

--- b:create_refused(): a create that was refused for sure gives its place back.
function Budget:create_refused()
  if self.sent > 0 then self.sent = self.sent - 1 end
end

function Budget:observe(event, subject)
  if event == "created" and subject and not self.created[subject.id] then
    self.created[subject.id] = true
    self.order[#self.order + 1] = subject.id
    self.live[subject.id] = { t0 = M.clock.now(), plan = subject.plan or "default" }
    self.cond:broadcast()
  elseif event == "terminated" and self.live[subject] then
    local l = self.live[subject]
    self.live[subject] = nil
    self.spent[l.plan] = (self.spent[l.plan] or 0) + (M.clock.now() - l.t0)
    self.cond:broadcast()
  end
end

--- b:usage() -> {sandboxes = creates sent, created = {ids}, live = n, sandbox_seconds = total,
-- by_plan = {plan = seconds}} as of now. Does not yield.
function Budget:usage()
  local now, by_plan, total, live = M.clock.now(), {}, 0, 0
  for plan, s in pairs(self.spent) do by_plan[plan] = s end
  for _, l in pairs(self.live) do
    by_plan[l.plan] = (by_plan[l.plan] or 0) + (now - l.t0)
    live = live + 1
  end
  for _, s in pairs(by_plan) do total = total + s end
  return { sandboxes = self.sent, created = self.order, live = live, sandbox_seconds = total,
    by_plan = by_plan }
end

-- Starts the sandbox-seconds watchdog (once).
function Budget:watch()
  if self.watchdog or not self.owner then return end
  self.watchdog = task.spawn(function()
    while not self.breach do
      local u = self:usage()
      if u.sandbox_seconds >= self.max_seconds then
        self:exceeded(u)
        return
      end
      local eta = u.live > 0 and (self.max_seconds - u.sandbox_seconds) / u.live or nil
      if eta then
        M.clock.wait(self.cond, eta)
      else
        self.cond:wait()
      end
    end
  end)
end

-- The seconds are spent: terminate what is alive, fail the run.
function Budget:exceeded(u)
  local alive = {}
  for id in pairs(self.live) do alive[#alive + 1] = id end
  table.sort(alive)
  self.breach = budget_error { message = string.format("this run's budget of %g sandbox-seconds is spent " ..
    "(%.1f s over %d sandbox%s); terminated the %d still running: %s", self.max_seconds, u.sandbox_seconds,
    #self.order, #self.order == 1 and "" or "es", #alive, ids_text(alive)),
    budget = "sandbox_seconds", limit = self.max_seconds, count = #self.order, sandbox_ids = alive }
  local jobs = {}
  for _, id in ipairs(alive) do
    jobs[#jobs + 1] = function() return pcall(M.terminate, id) end
  end
  if #jobs > 0 then task.all(jobs) end
  if self.owner then task.cancel(self.owner) end
end

--- b:report() -> {sandboxes = n|null, sandbox_seconds = s|null, exceeded = name|null}: the
-- "budget" object of `moonbox run --json` and of its dry run. exceeded names the limit that
-- refused something in this run: "sandbox_seconds" once the watchdog stopped it, "sandboxes"
-- once a create was refused for the count (even when the recipe caught that error), else null.
-- Does not yield.
function Budget:report()
  local null = json.null
  return { sandboxes = self.max_sandboxes or null, sandbox_seconds = self.max_seconds or null,
    exceeded = self.breach and self.breach.budget or self.count_refused and "sandboxes" or null }
end

--- b:close(): stops watching (the run ended). Does not yield.
function Budget:close()
  if self.unobserve then self.unobserve() end
  self.unobserve = nil
  if self.watchdog and not task.result(self.watchdog) then task.cancel(self.watchdog) end
end

M.SCHEMA = {
  ["render.budget"] = { summary = "limits what the current run may create and keep",
    args = { { name = "opts", type = "table" } }, options = {
      sandboxes = { type = "integer", doc = "the most sandbox creates the run may send" },
      sandbox_seconds = { type = "number",
        doc = "the most sandbox-seconds (the sum of the time each sandbox existed) the run may spend" },
    }, returns = "table" },
}
schema.declare(M.SCHEMA)
M.set = schema.wrap("render.budget", M.set)

M.Budget = Budget
return M
