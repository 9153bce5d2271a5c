-- bench/client.lua MODE N URL — moonbox doing what curl_loop does: `seq` makes N sequential
-- GETs (keep-alive), `conc` starts N GETs at once, each in its own task.
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
