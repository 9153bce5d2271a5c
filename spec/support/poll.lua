--- spec/support/poll.lua — waiting for a state of another process that sends no event (a server
-- coming up, a process going away, a file appearing): poll a condition with a deadline. Specs
-- use it only where nothing can be awaited; the deadline is generous and never a timing bound.
local task = require "moonbox.task"

local M = {}

--- poll.wait(seconds, cond, what) -> cond()'s first true value, asked every 50 ms; raises
-- "waited <seconds> s for <what>" (what: a string, or a function called then, so it can say
-- what was seen last) at the caller's level once seconds have passed. [yields]
function M.wait(seconds, cond, what)
  local deadline = task.now() + seconds
  while true do
    local v = cond()
    if v then return v end
    if task.now() > deadline then
      error("waited " .. seconds .. " s for " .. (type(what) == "function" and what() or tostring(what)), 2)
    end
    task.sleep(0.05)
  end
end

return M
