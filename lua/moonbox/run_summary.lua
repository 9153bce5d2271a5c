--- moonbox.run_summary — what `moonbox run --json` prints: one JSON object on the last line of
-- stdout. `moonbox run --dry-run --json` carries the same facts under the same keys (cli.lua
-- hands this summary's fields to the dry run's report), plus the dry run's own.
--
--   {"recipe":"r.lua","outcome":"ok"|"failed"|"interrupted","exit_code":0,"duration_s":1.23,
--    "dry_run":false,"backend":"http://127.0.0.1:8120/v1","api_calls":12,
--    "sandboxes":{"created":[ids],"terminated":[ids],"kept":[ids],"leaked":[ids],"failed_creates":n},
--    "sandbox_seconds":s,"sandbox_seconds_by_plan":{"1c-2g":s,...},
--    "budget":{"sandboxes":n|null,"sandbox_seconds":s|null,"exceeded":"sandboxes"|"sandbox_seconds"|null},
--    "errors":[{"message":..., "code":..., "op":..., "sandbox_id":..., "request_id":...}]}
--
-- "leaked" lists sandboxes this run created and neither terminated nor kept (with
-- render.sandboxes.create's `<close>` guards that only happens when a cleanup failed or the
-- process was forced out); `moonbox reap` terminates them. Messages pass through the trace's
-- secret filter, so no API key or env value appears.
local json = require "moonbox.json"
local render = require "moonbox.render"
local trace = require "moonbox.trace"

local M = {}
local Summary = {}
Summary.__index = Summary

--- run_summary.start() -> Summary collecting render's sandbox events from now on.
function M.start()
  local s = setmetatable({ created = {}, order = {}, terminated = {}, kept = {}, failed_creates = 0 },
    Summary)
  s.unobserve = render.observe(function(event, subject)
    if event == "created" then
      if not s.created[subject.id] then s.order[#s.order + 1] = subject.id end
      s.created[subject.id] = true
    elseif event == "terminated" then
      s.terminated[subject] = true
    elseif event == "kept" then
      s.kept[subject.id] = true
    elseif event == "create_failed" then
      s.failed_creates = s.failed_creates + 1
    end
  end)
  return s
end

local function error_entry(e)
  if type(e) == "table" then
    local msg = e.message
    if msg == nil then
      local ok, str = pcall(tostring, e)
      msg = ok and str or "(error object)"
    end
    return { message = msg, code = e.code, op = e.op, status = e.status, sandbox_id = e.sandbox_id,
      snapshot_id = e.snapshot_id, request_id = e.request_id, budget = e.budget }
  end
  return { message = tostring(e) }
end

local function ms(x) return math.floor(x * 1000 + 0.5) / 1000 end

--- s:fields{recipe, exit_code, error, duration_s, budget} -> the summary as a table (the keys
-- above; JSON arrays and objects marked for moonbox.json). budget: the run's Budget
-- (moonbox.render.budget), whose usage gives the sandbox-seconds (simulated ones in a dry run).
-- Stops observing the run's events. Raises nothing; does not yield.
function Summary:fields(info)
  if self.unobserve then self.unobserve() end
  self.unobserve = nil
  local created, terminated, kept, leaked = {}, {}, {}, {}
  for _, id in ipairs(self.order) do
    created[#created + 1] = id
    if self.terminated[id] then
      terminated[#terminated + 1] = id
    elseif self.kept[id] then
      kept[#kept + 1] = id
    else
      leaked[#leaked + 1] = id
    end
  end
  local errors = {}
  if info.error ~= nil then
    errors[1] = error_entry(info.error)
    for _, c in ipairs(type(info.error) == "table" and info.error.cleanup_errors or {}) do
      local e = error_entry(c.error)
      e.sandbox_id = e.sandbox_id or c.id
      errors[#errors + 1] = e
    end
  end
  local code = info.exit_code
  local b = info.budget
  local usage = b and b:usage()
  local by_plan = json.object {}
  for plan, secs in pairs(usage and usage.by_plan or {}) do by_plan[plan] = ms(secs) end
  local api = package.loaded["moonbox.render.api"]
  local conn = render.current_connection()
  return {
    recipe = info.recipe,
    outcome = code == 0 and "ok" or (code == 130 or code == 143) and "interrupted" or "failed",
    exit_code = code,
    duration_s = math.floor(info.duration_s * 1000 + 0.5) / 1000,
    dry_run = info.dry_run == true,
    backend = conn and conn.base or nil,
    api_calls = api and api.calls_made or 0,
    sandboxes = { created = json.array(created), terminated = json.array(terminated),
      kept = json.array(kept), leaked = json.array(leaked), failed_creates = self.failed_creates },
    errors = json.array(errors),
    sandbox_seconds = usage and ms(usage.sandbox_seconds) or 0,
    sandbox_seconds_by_plan = by_plan,
    budget = b and b:report() or nil,
  }
end

--- s:finish{recipe, exit_code, error, duration_s, budget} -> the JSON line of s:fields (without
-- newline), secrets redacted. Raises nothing; does not yield.
function Summary:finish(info)
  return trace.redact(json.encode(self:fields(info)))
end

return M
