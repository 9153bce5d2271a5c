--- moonbox.render.fleet — render.restore: many sandboxes from one snapshot, and nothing left
-- running whatever happens (docs/reference/render.md, "Fan-out restore").
--
--   local fleet <close> = render.restore(snap, { count = 8, concurrency = 4, network = "deny-all",
--                                                 policy = "all_or_nothing" })
--   local out = task.map(fleet, function(sb, i) return sb:exec(...):check().stdout end)
--
-- Every create settles before any cleanup starts (no "first rejection wins" that leaks the
-- others). A fleet is an array of Sandboxes (so task.map and ipairs work on it) and a `<close>`
-- guard over all of them: closing it terminates every member concurrently unless fleet:keep().
local api = require "moonbox.render.api"
local sandbox = require "moonbox.render.sandbox"
local snapshots = require "moonbox.render.snapshots"
local task = require "moonbox.task"
local core = require "moonbox.core"
local guard = require "moonbox.guard"
local schema = require "moonbox.schema"

local M = {}
local Fleet = {}
local fleet_methods = {}
Fleet.__index = function(_, k) return fleet_methods[k] end
Fleet.__name = "moonbox.render.Fleet"

local function terminate_all(sandboxes, concurrency)
  local failures = {}
  if #sandboxes == 0 then return failures end
  task.map(sandboxes, function(sb)
    local ok, err = pcall(sb.terminate, sb)
    if not ok then failures[#failures + 1] = { id = sb.id, label = "terminate " .. sb.id, error = err } end
  end, { concurrency = concurrency or 16 })
  return failures
end

local function describe_failures(failures) return guard.describe(failures, "id") end

Fleet.__close = function(fleet, err)
  if rawget(fleet, "_kept") then return end
  local failures = terminate_all(fleet, rawget(fleet, "_concurrency"))
  rawset(fleet, "_terminated", true)
  if #failures == 0 then return end
  if err ~= nil then
    guard.attach(err, failures) -- kept beside what an inner guard attached
    io.stderr:write("moonbox: while unwinding ", tostring(err), ", terminating the fleet failed for ",
      describe_failures(failures), "\n")
    return
  end
  error(core.Error.new { op = "fleet:close", code = "cleanup_failed", failures = failures,
    message = "could not terminate every sandbox of the fleet: " .. describe_failures(failures) }, 0)
end

--- fleet:keep() -> fleet: closing it will no longer terminate its sandboxes.
function fleet_methods.keep(fleet)
  rawset(fleet, "_kept", true)
  for _, sb in ipairs(fleet) do sb:keep() end
  return fleet
end

--- fleet:terminate(): terminates every member now (concurrently); raises cleanup_failed
-- listing the ids that could not be terminated. [yields]
function fleet_methods.terminate(fleet)
  local failures = terminate_all(fleet, rawget(fleet, "_concurrency"))
  if #failures > 0 then
    error(core.Error.new { op = "fleet:terminate", code = "cleanup_failed", failures = failures,
      message = "could not terminate: " .. describe_failures(failures) }, 2)
  end
end

--- fleet:ids() -> array of the members' sandbox ids.
function fleet_methods.ids(fleet)
  local out = {}
  for i, sb in ipairs(fleet) do out[i] = sb.id end
  return out
end

local POLICIES = { all_or_nothing = true, best_effort = true }
-- render.restore's own options and every option of render.sandboxes.create but snapshot (the
-- first argument) and wait (restore's to decide: it creates without waiting, then waits for
-- each sandbox).
local RESTORE_OPTIONS = {
  count = { type = "integer", default = 1, doc = "how many sandboxes" },
  concurrency = { type = "integer", default = 4, doc = "the most creates in flight (an adaptive window)" },
  policy = { type = { "string", "table" }, default = "all_or_nothing",
    doc = "\"all_or_nothing\", \"best_effort\" or {quorum = k}: what a failure means" },
}
for k, v in pairs(sandbox.CREATE_OPTIONS) do
  if k ~= "wait" and k ~= "snapshot" then RESTORE_OPTIONS[k] = v end
end

--- render.restore(snapshot, opts) -> Fleet. Creates opts.count (default 1) sandboxes from
-- snapshot (a Snapshot, an id or a name; nil: empty sandboxes), at most opts.concurrency
-- (default 4) at a time, each with the create options in opts (network, plan, env, lifetime,
-- ...), waiting until each runs (wait_timeout). Options are checked first (moonbox.schema).
-- opts.policy decides what a failure means, once every create has settled:
--   "all_or_nothing" (default): any failure terminates every sibling and raises one error
--     (code "restore_failed") whose `outcomes` lists each create ({index, id} or {index, error});
--   "best_effort": returns the sandboxes that run; fleet.failures lists the others;
--   { quorum = k }: like best_effort when at least k run, else like all_or_nothing.
-- A create whose answer was lost (unknown_outcome) counts as a failure; its sandbox may exist
-- and has no id here — the error says so. Cleanup failures never replace the error; they are
-- attached as err.cleanup_errors. [yields]
function M.restore(snapshot, opts)
  opts = opts or {}
  local count = opts.count or 1
  local concurrency = opts.concurrency or 4
  local policy = opts.policy or "all_or_nothing"
  local quorum
  if type(policy) == "table" then
    quorum = policy.quorum
    if math.type(quorum) ~= "integer" or quorum < 1 or quorum > count then
      error("render.restore: policy.quorum must be an integer between 1 and count (" .. count .. ")", 2)
    end
  elseif not POLICIES[policy] then
    error("render.restore: policy must be \"all_or_nothing\", \"best_effort\" or {quorum = k}", 2)
  end
  if math.type(count) ~= "integer" or count < 1 then
    error("render.restore: count must be a positive integer", 2)
  end
  local create_opts = {}
  for k, v in pairs(opts) do
    if k ~= "count" and k ~= "concurrency" and k ~= "policy" then create_opts[k] = v end
  end
  create_opts.snapshot = snapshot

  create_opts.wait = false
  local wait_timeout = schema.seconds(opts.wait_timeout) or 120

  -- Every create settles: each worker catches its own failure, so none cancels the others. A
  -- sandbox is recorded the moment its create answers, before waiting for it to run, so a
  -- cancellation at any point still knows every id to terminate.
  -- The window adapts (AIMD) to 429s; the group's concurrencyLimit (the most non-terminated
  -- sandboxes it allows) bounds it.
  local limit = math.min(concurrency, count)
  local gid = opts.group or (type(snapshot) == "table" and snapshot.sandbox_group_id)
  if type(gid) == "table" then gid = gid.id end
  if gid and limit > 1 then
    local okg, gerr = pcall(function() -- a failed look leaves the window as it is
      for g in snapshots.groups.list() do
        local cap = g.id == gid and tonumber(g.concurrency_limit)
        if cap and cap >= 1 and cap < limit then limit = math.floor(cap) end
      end
    end)
    if not okg and task.is_interruption(gerr) then error(gerr, 0) end
  end
  local win <close> = task.window(limit, "render.restore")
  local outcomes = {}
  local next_i, stop_err = 1, nil
  local ok_scope, scope_err = pcall(task.scope, function(s)
    for _ = 1, limit do
      s:spawn(function()
        while next_i <= count and not stop_err do
          win:acquire()
          if next_i > count or stop_err then
            win:release(false)
            break
          end
          local i = next_i
          next_i = next_i + 1
          local o = { index = i }
          outcomes[i] = o
          local ok, res = pcall(sandbox.create, create_opts)
          if ok then
            o.sandbox, o.id = res, res.id
            local ok2, werr = pcall(res.wait_running, res, { timeout = wait_timeout })
            if not ok2 then o.error = werr end
          else
            o.error = res
          end
          win:release(o.error == nil)
          if o.error and api.is_interruption(o.error) then stop_err = stop_err or o.error end
        end
      end)
    end
  end)
  if not ok_scope then stop_err = stop_err or scope_err end
  if stop_err then
    -- Cancelled (or the scope failed): nothing this call created may outlive it.
    local made = {}
    for i = 1, count do
      local o = outcomes[i]
      if o and o.sandbox then made[#made + 1] = o.sandbox end
    end
    local cleanup = terminate_all(made, concurrency)
    guard.attach(stop_err, cleanup)
    error(stop_err, 0)
  end

  local fleet = setmetatable({ _concurrency = concurrency, failures = {}, min_window = win.min_size }, Fleet)
  for i = 1, count do
    local o = outcomes[i]
    if o and o.sandbox and not o.error then
      fleet[#fleet + 1] = o.sandbox
    else
      fleet.failures[#fleet.failures + 1] = o or { index = i, error = "did not settle" }
    end
  end
  local nfail = #fleet.failures
  -- Sandboxes that exist but never ran are terminated whatever the policy.
  local broken = {}
  for _, f in ipairs(fleet.failures) do
    if f.sandbox then broken[#broken + 1] = f.sandbox end
  end
  local acceptable = nfail == 0 or policy == "best_effort" or (quorum and #fleet >= quorum)
  if acceptable then
    local bad = terminate_all(broken, concurrency)
    if #bad > 0 then fleet.cleanup_errors = bad end
    return fleet
  end

  local all = {}
  for _, sb in ipairs(fleet) do all[#all + 1] = sb end
  for _, sb in ipairs(broken) do all[#all + 1] = sb end
  local cleanup = terminate_all(all, concurrency)
  local lines = {}
  for i = 1, count do
    local o = outcomes[i] or { index = i }
    if o.sandbox and not o.error then
      lines[#lines + 1] = string.format("#%d %s (terminated)", i, o.id)
    else
      local e = o.error
      local what = tostring(e)
      if type(e) == "table" and e.code == "unknown_outcome" then
        what = what .. " — a sandbox may exist without an id here (the ledger keeps the create for " ..
          "`moonbox reap`, which finds it by its label)"
      end
      lines[#lines + 1] = string.format("#%d failed: %s", i, what)
    end
  end
  local need = quorum and ("at least " .. quorum) or "all " .. count
  local outcome_list = {}
  for i = 1, count do
    local o = outcomes[i] or { index = i }
    outcome_list[i] = { index = i, id = o.id, error = o.error }
  end
  error(core.Error.new { op = "render.restore", code = "restore_failed",
    message = string.format("%d of %d restores failed (needed %s to run): %s", nfail, count, need,
      table.concat(lines, "; ")),
    outcomes = outcome_list, cleanup_errors = #cleanup > 0 and cleanup or nil,
    snapshot_id = type(snapshot) == "table" and snapshot.id or nil }, 2)
end

-- ---- the declared calls (moonbox.schema) -------------------------------------------------------

M.SCHEMA = {
  ["render.restore"] = { summary = "creates many sandboxes from one snapshot, and nothing left running",
    args = { { name = "snapshot", type = { "string", "Snapshot" }, optional = true },
      { name = "opts", type = "table", optional = true } },
    options = RESTORE_OPTIONS, returns = "Fleet", yields = true },
  ["fleet:keep"] = { summary = "closing the fleet no longer terminates its sandboxes", returns = "Fleet" },
  ["fleet:terminate"] = { summary = "terminates every member now (concurrently)", yields = true },
  ["fleet:ids"] = { summary = "the members' sandbox ids", returns = "string[]" },
}
schema.declare(M.SCHEMA)

M.restore = schema.wrap("render.restore", M.restore)
for _, k in ipairs { "keep", "terminate", "ids" } do
  fleet_methods[k] = schema.wrap("fleet:" .. k, fleet_methods[k])
end

M.Fleet = Fleet
return M
