--- moonbox.schedule — recipes declare schedules; `moonbox schedule FILE` fires them.
--
--   local schedule = require "moonbox.schedule"
--   schedule.cron("nightly-base", "0 3 * * *", function(run) rebuild() end,
--     { overlap = "skip", catchup = "6h", jitter = "5m", timeout = "45m", pause_after_failures = 3,
--       durable = true })
--   schedule.every("heartbeat", "15m", function(run) check() end)
--   schedule.cron("fanout", "0 * * * *", work, { max_sandboxes = 50, max_sandbox_seconds = "2h" })
--   if not schedule.running() then rebuild() end   -- `moonbox run`: once, now
--
-- Registering only records the schedule (validated at once, errors name the recipe line and the
-- schedule); nothing fires unless the process is `moonbox schedule` (lua/moonbox/schedule/
-- daemon.lua), which loads the recipe, reads and writes the state and history in the state
-- dir's moonbox.db, and runs each fire as a task. See docs/schedule.md.
local duration = require "moonbox.duration"
local schema = require "moonbox.schema"
local core = require "moonbox.core"
local budget = require "moonbox.render.budget"
local cron = require "moonbox.cron"
local sclock = require "moonbox.schedule.clock"

local M = {}

-- Registered schedules, in registration order, and by name.
local registry = { list = {}, by_name = {} }
local running = false

local OVERLAP = { skip = true, buffer_one = true, cancel_other = true }

--- schedule.duration(v) -> seconds, or nil and a message; schedule.format_duration(seconds) ->
-- "1h30m". The parser shared with the rest of moonbox (lua/moonbox/duration.lua).
M.duration = duration.parse
M.format_duration = duration.format

--- schedule.check_webhook(url) -> true, or nil and why: an alert webhook must be an absolute
-- http:// or https:// URL without spaces or control characters.
function M.check_webhook(u)
  if type(u) ~= "string" then return nil, "expected a URL string, got a " .. type(u) end
  if not u:match("^https?://[^/%s]+") or u:find("[%c%s]") then
    return nil, "expected an http:// or https:// URL"
  end
  return true
end

local function where_of(level)
  local info = debug.getinfo(level + 1, "Sl")
  if not info then return "?" end
  return info.short_src .. ":" .. (info.currentline or 0)
end

-- A run's budget from the options max_sandboxes (a count) and max_sandbox_seconds (a
-- DURATION), as `moonbox run --max-sandboxes N --max-sandbox-seconds S` takes them; nil when
-- neither is given.
local function budget_opts(opts, bad, dur)
  local n = opts.max_sandboxes
  if n ~= nil and (math.type(n) ~= "integer" or n < 0) then
    bad("max_sandboxes must be a non-negative integer, got %s", tostring(n))
  end
  local secs = dur("max_sandbox_seconds", nil)
  if n == nil and secs == nil then return nil end
  return { sandboxes = n, sandbox_seconds = secs }
end

-- Runs fn(run) under a budget of its own (moonbox.render.budget), attached to the run's task:
-- a create beyond max_sandboxes raises budget_exceeded before it is sent; when the run's
-- sandboxes have existed max_sandbox_seconds in total, those still alive are terminated and
-- the run fails with the budget's error (not as a cancellation). [yields]
local function with_budget(limits, fn)
  return function(run)
    local b = budget.attach(core.current(), budget.new(limits))
    local r = table.pack(xpcall(fn, core.msgh, run))
    b:close()
    return budget.settle(b, r)
  end
end

-- Validates the options shared by cron and every; returns the schedule's fields. Raises a plain
-- error "FILE:LINE: schedule.KIND: schedule 'NAME': ..." at the recipe's call.
local function check_opts(kind, name, where, opts)
  local function bad(fmt, ...)
    error(string.format("%s: schedule.%s: schedule '%s': " .. fmt, where, kind, tostring(name), ...), 0)
  end
  if type(name) ~= "string" or not name:match("^[%w][%w%._%-]*$") then
    error(string.format("%s: schedule.%s: the name must be a string of letters, digits, '.', '_' and '-' " ..
      "(starting with a letter or digit), got %s", where, kind,
          type(name) == "string" and ("'" .. name .. "'")
      or type(name)), 0)
  end
  if registry.by_name[name] then
    bad("a schedule with this name is already registered (at %s); names must be unique",
        registry.by_name[name].where)
  end
  if opts == nil then opts = {} end
  if type(opts) ~= "table" then bad("options must be a table, got a %s", type(opts)) end
  if kind == "every" and opts.tz ~= nil then bad("tz applies to schedule.cron only") end
  -- Unknown or mistyped options: a structured invalid_option (moonbox.schema) naming the schedule.
  local ok, err = pcall(schema.check, "schedule." .. kind, opts)
  if not ok then
    if type(err) == "table" then
      err.schedule = name
      err.message = string.format("schedule '%s': %s", name, tostring(err.message))
    end
    error(err, 0)
  end
  local s = { name = name, where = where, overlap = opts.overlap or "skip" }
  if not OVERLAP[s.overlap] then
    bad("overlap must be \"skip\", \"buffer_one\" or \"cancel_other\", got %s",
      type(opts.overlap) == "string" and ("\"" .. opts.overlap .. "\"") or tostring(opts.overlap))
  end
  local function dur(key, default)
    local v = opts[key]
    if v == nil then return default end
    local d, msg = M.duration(v)
    if not d then bad("%s: %s", key, msg) end
    return d
  end
  if opts.catchup == false then
    s.catchup = false
  else
    s.catchup = dur("catchup", 86400)
  end
  s.jitter = dur("jitter", 0)
  s.timeout = dur("timeout", nil)
  if s.timeout == 0 then bad("timeout must be more than 0 (leave it out for none)") end
  local n = opts.pause_after_failures
  if n ~= nil and (math.type(n) ~= "integer" or n < 1) then
    bad("pause_after_failures must be an integer >= 1, got %s", tostring(n))
  end
  s.pause_after_failures = n
  local hooks = opts.webhooks
  if hooks ~= nil then
    if type(hooks) == "string" then hooks = { hooks } end
    if type(hooks) ~= "table" then
      bad("webhooks must be a URL or an array of URLs, got a %s", type(hooks))
    end
    local list = {}
    for i, u in ipairs(hooks) do
      local okurl, why = M.check_webhook(u)
      if not okurl then bad("webhooks[%d]: %s", i, why) end
      list[i] = u
    end
    for k in pairs(hooks) do
      if math.type(k) ~= "integer" or k < 1 or k > #list then bad("webhooks must be an array of URLs") end
    end
    s.webhooks = list
  end
  s.budget = budget_opts(opts, bad, dur)
  s.durable = opts.durable == true
  return s, bad
end

local function register(s, fn, bad)
  if type(fn) ~= "function" then bad("expected a function to run, got a %s", type(fn)) end
  s.fn = s.budget and with_budget(s.budget, fn) or fn
  registry.list[#registry.list + 1] = s
  registry.by_name[s.name] = s
  return s
end

--- schedule.cron(name, expr, fn, opts) -> the schedule (a table; fields are read-only facts).
-- Fires fn(run) at every minute that the five-field cron expression `expr` matches in time
-- zone opts.tz (default "UTC"; see docs/reference/cron.md). opts: overlap ("skip" default,
-- "buffer_one", "cancel_other"), catchup (DURATION or false; default "1d"), jitter (DURATION,
-- default 0), timeout (DURATION, none by default), pause_after_failures (integer), tz,
-- max_sandboxes (integer) and max_sandbox_seconds (DURATION): each run's budget, as
-- `moonbox run --max-sandboxes/--max-sandbox-seconds` (moonbox.render.budget), durable
-- (boolean, default false: each run is a durable run, journaled in the run store and resumed
-- by a daemon when the daemon running it dies; docs/schedule.md). Raises
-- a plain error with the recipe's file:line and the schedule's name for any bad argument, a
-- bad expression (naming the field) or an unknown zone. Does not yield.
function M.cron(name, expr, fn, opts)
  local where = where_of(2)
  local tz = type(opts) == "table" and opts.tz or nil
  local s, bad = check_opts("cron", name, where, opts)
  if type(expr) ~= "string" then bad("expected a cron expression string, got a %s", type(expr)) end
  local pok, c = pcall(cron.parse, expr)
  if not pok then bad("%s", type(c) == "table" and tostring(c.message) or tostring(c)) end
  if tz ~= nil then
    if type(tz) ~= "string" then bad("tz must be a zone name like \"Europe/Berlin\", got a %s", type(tz)) end
    local zok, zerr = pcall(cron.zone, tz)
    if not zok then bad("tz: %s", type(zerr) == "table" and tostring(zerr.message) or tostring(zerr)) end
  end
  s.kind, s.expr, s.tz, s.cron = "cron", expr, tz or "UTC", c
  s.spec = "cron " .. tostring(c) .. (tz and tz ~= "UTC" and (" " .. tz) or "")
  return register(s, fn, bad)
end

--- schedule.every(name, interval, fn, opts) -> the schedule. Fires fn(run) every `interval`
-- (a DURATION > 0), at the multiples of it since 1970-01-01T00:00:00Z ("15m" fires at :00,
-- :15, :30, :45 UTC), so the slots are the same across restarts. opts as for schedule.cron,
-- without tz. Raises like schedule.cron. Does not yield.
function M.every(name, interval, fn, opts)
  local where = where_of(2)
  local s, bad = check_opts("every", name, where, opts)
  if type(opts) == "table" and opts.tz ~= nil then bad("tz applies to schedule.cron only") end
  local iv, msg = M.duration(interval)
  if not iv then bad("interval: %s", msg) end
  if iv <= 0 then bad("the interval must be more than 0") end
  if s.jitter >= iv then
    bad("jitter (%s) must be shorter than the interval (%s)", M.format_duration(s.jitter),
        M.format_duration(iv))
  end
  s.kind, s.interval = "every", iv
  s.spec = "every " .. M.format_duration(iv)
  return register(s, fn, bad)
end

--- schedule.running() -> true inside `moonbox schedule` (any of its modes), false otherwise
-- (`moonbox run`, the REPL, specs). A recipe does its one-off work only when it is false.
function M.running() return running end

--- schedule.list() -> array of the registered schedules, in registration order.
function M.list()
  return table.move(registry.list, 1, #registry.list, 1, {})
end

--- schedule.get(name) -> the registered schedule of that name, or nil.
function M.get(name) return registry.by_name[name] end

--- schedule.next_after(s, t) -> the first slot of schedule s strictly after time t (seconds
-- since the epoch), or nil when there is none (a cron expression that never matches again).
function M.next_after(s, t)
  if s.kind == "every" then
    local n = math.floor(t / s.interval) + 1
    local slot = n * s.interval
    if slot <= t then slot = slot + s.interval end -- float rounding
    return slot
  end
  return s.cron:next(math.floor(t), s.tz)
end

--- schedule.format_slot(s, t) -> t as RFC 3339 text (in the schedule's zone for a cron one).
function M.format_slot(s, t)
  if s.kind == "cron" and s.tz ~= "UTC" then
    local ok, txt = pcall(cron.format, t, s.tz)
    if ok then return txt end
  end
  return sclock.format(t)
end

-- ---- the declared calls (moonbox.schema) -------------------------------------------------------

local function schedule_options(with_tz)
  local o = {
    overlap = { type = "string", enum = { "skip", "buffer_one", "cancel_other" }, default = "skip",
      doc = "what a fire does while the previous run is still active" },
    catchup = { type = { "seconds", "boolean" }, default = "1d",
      doc = "after downtime the latest missed slot runs once if it is at most this old; false: never" },
    jitter = { type = "seconds", default = 0,
      doc = "each fire waits a random delay in [0, jitter) after its slot" },
    timeout = { type = "seconds", kind = "deadline",
      doc = "the longest a run takes: its task is cancelled at start + timeout (outcome timeout)" },
    pause_after_failures = { type = "integer",
      doc = "after N consecutive failed/timeout runs the schedule is paused until --resume" },
    webhooks = { type = { "string", "table" }, doc = "a URL or an array of http(s) URLs that get alerts" },
    max_sandboxes = { type = "integer", doc = "each run may send at most N sandbox creates (its budget)" },
    max_sandbox_seconds = { type = "seconds",
      doc = "each run's sandboxes may exist this long in total (its budget)" },
    durable = { type = "boolean", default = false,
      doc = "each run is a durable run: journaled, and resumed by a daemon if its daemon dies" },
  }
  if with_tz then
    o.tz = { type = "string", default = "UTC", doc = "the zone of the cron expression (an IANA name)" }
  end
  return o
end

local NAME = { name = "name", type = "string" }
local FN = { name = "fn", type = "function" }
local OPTS = { name = "opts", type = "table", optional = true }

M.SCHEMA = {
  ["schedule.cron"] = { summary = "fires fn(run) at every minute a cron expression matches",
    args = { NAME, { name = "expr", type = "string" }, FN, OPTS }, options = schedule_options(true),
    returns = "table" },
  ["schedule.every"] = { summary = "fires fn(run) every interval, at its multiples since the epoch",
    args = { NAME, { name = "interval", type = "seconds" }, FN, OPTS }, options = schedule_options(false),
    returns = "table" },
  ["schedule.running"] = { summary = "true inside `moonbox schedule`, false otherwise", returns = "boolean" },
  ["schedule.list"] = { summary = "the registered schedules, in registration order", returns = "table[]" },
  ["schedule.get"] = { summary = "the registered schedule of that name, or nil", args = { NAME },
    returns = "table?" },
  ["schedule.next_after"] = { summary = "the first slot of a schedule strictly after time t",
    args = { { name = "s", type = "table" }, { name = "t", type = "number" } }, returns = "number?" },
  ["schedule.format_slot"] = { summary = "a slot as RFC 3339 text (in a cron schedule's zone)",
    args = { { name = "s", type = "table" }, { name = "t", type = "number" } }, returns = "string" },
  ["schedule.duration"] = { summary = "a duration's seconds, or nil and a message",
    args = { { name = "v", type = "any", optional = true } }, returns = "number?, string?" },
  ["schedule.format_duration"] = { summary = "seconds as a duration (\"1h30m\")",
    args = { { name = "seconds", type = "number" } }, returns = "string" },
  ["schedule.check_webhook"] = { summary = "true, or nil and why a URL cannot be an alert webhook",
    args = { { name = "url", type = "any", optional = true } }, returns = "boolean?, string?" },
}
schema.declare(M.SCHEMA)

for _, k in ipairs { "get", "next_after", "format_slot", "format_duration" } do
  M[k] = schema.wrap("schedule." .. k, M[k])
end

-- For `moonbox schedule` (and specs): marks the process as the scheduler; clears the registry.
function M._set_running(v) running = v and true or false end
function M._reset() registry = { list = {}, by_name = {} } end

return M
