--- moonbox.schedule.ops.traces — `moonbox schedule --trace-dir DIR`: a Chrome trace per run.
--
-- moonbox.trace writes one file at a time for the whole process. A run that starts while no
-- trace is on starts DIR/run-ID.json; runs that start while it is on (runs of other schedules,
-- overlapping) join that file; the trace stops when the last run in it ends. Each run's file is
-- remembered in DIR/index.tsv ("run id<TAB>file name", appended), so the status page finds it
-- after a restart. Nothing here yields.
local sys = require "moonbox.sys"
local trace = require "moonbox.trace"

local M = {}
local Traces = {}
Traces.__index = Traces

--- traces.new{dir, daemon, log} -> Traces (DIR is created 0700 when missing).
function M.new(o)
  sys.mkdir_p(o.dir, tonumber("700", 8))
  local t = setmetatable({ dir = o.dir, log = o.log or function() end, by_run = {}, members = 0 }, Traces)
  local f = io.open(o.dir .. "/index.tsv", "r")
  if f then
    for line in f:lines() do
      local id, name = line:match("^(%d+)\t([%w%._%-]+)$")
      if id then t.by_run[tonumber(id)] = name end
    end
    f:close()
  end
  if o.daemon then o.daemon:subscribe(function(event, e) t:on_event(event, e) end) end
  return t
end

function Traces:on_event(event, e)
  if event == "started" then
    local run = e.run
    if not trace.enabled() then
      local name = string.format("run-%d.json", run.id)
      local ok, err = pcall(trace.start, self.dir .. "/" .. name,
        { name = string.format("moonbox schedule: %s run %d", e.schedule, run.id) })
      if not ok then
        self.log("trace: cannot start " .. self.dir .. "/" .. name .. ": " .. tostring(err))
        return
      end
      self.current, self.members = name, 0
    elseif not self.current then
      return -- someone else's trace (not ours to share)
    end
    self.members = self.members + 1
    run.trace = self.dir .. "/" .. self.current
    run.trace_name = self.current
    self.by_run[run.id] = self.current
    local f = io.open(self.dir .. "/index.tsv", "a")
    if f then
      f:write(run.id, "\t", self.current, "\n")
      f:close()
    end
  elseif event == "finished" and e.run and e.run.trace_name and self.current == e.run.trace_name then
    self.members = self.members - 1
    if self.members <= 0 then
      trace.stop()
      self.current = nil
    end
  end
end

--- traces:file(run_id) -> the path of the run's trace file, or nil.
function Traces:file(run_id)
  local name = self.by_run[run_id]
  if not name then return nil end
  return self.dir .. "/" .. name
end

function Traces:close()
  if self.current then
    trace.stop()
    self.current = nil
  end
end

return M
