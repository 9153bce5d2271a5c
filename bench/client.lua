-- bench/client.lua MODE N URL — moonbox doing what curl_loop does: `seq` makes N sequential
-- GETs (keep-alive), `conc` starts N GETs at once, each in its own task, `conc64` makes N GETs
-- from 64 tasks that each make their share one after the other (64 in flight).
local task = require "moonbox.task"
local http = require "moonbox.http"

local mode, n, url = arg[1], tonumber(arg[2]), arg[3]
local ok, bytes = 0, 0
if mode == "seq" then
  for _ = 1, n do
    local r = http.request { url = url }
    if r.status == 200 then ok = ok + 1 end
    bytes = bytes + #r.body
  end
elseif mode == "conc64" then
  local tasks, next_i = {}, 0
  for i = 1, 64 do
    tasks[i] = task.spawn(function()
      while next_i < n do
        next_i = next_i + 1
        local r = http.request { url = url }
        if r.status == 200 then ok = ok + 1 end
        bytes = bytes + #r.body
      end
    end)
  end
  for i = 1, 64 do task.join(tasks[i]) end
else
  local tasks = {}
  for i = 1, n do
    tasks[i] = task.spawn(http.request, { url = url })
  end
  for i = 1, n do
    local r = task.join(tasks[i])
    if r.status == 200 then ok = ok + 1 end
    bytes = bytes + #r.body
  end
end
print(string.format("%d ok of %d, %d bytes", ok, n, bytes))
if ok ~= n then os.exit(1) end
