--- moonbox.render.events — the life events of the sandboxes this process makes, for whoever
-- watches them (the trace, the progress line, `moonbox run --json`, the REPL).
--
-- Observers are called synchronously, in registration-independent order, and must not wait;
-- one that raises is dropped with a message on stderr, so a broken observer cannot break the
-- recipe that is being observed.
local M = {}

local observers = {}

--- events.observe(fn) -> unsubscribe(): fn(event, subject, info) is called for each sandbox
-- life event: "creating" (subject nil, info.name, info.snapshot_id), "created" (the Sandbox),
-- "running" (the Sandbox), "create_failed" (subject nil, info.error), "terminated" (the
-- sandbox id), "kept" (the Sandbox). Does not yield.
function M.observe(fn)
  if type(fn) ~= "function" then error("render.observe: expected a function", 2) end
  local key = {}
  observers[key] = fn
  return function() observers[key] = nil end
end

--- events.emit(event, subject, info): tells every observer. Does not yield; never raises.
function M.emit(event, subject, info)
  if next(observers) == nil then return end
  for key, fn in pairs(observers) do
    local ok, err = pcall(fn, event, subject, info or {})
    if not ok then
      observers[key] = nil
      io.stderr:write("moonbox.render: an observer failed and was removed: " .. tostring(err) .. "\n")
    end
  end
end

return M
