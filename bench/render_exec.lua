-- bench/render_exec.lua N URL KEY WORKSPACE SANDBOX — N no-op execs through sb:exec: the
-- client's whole exec path (token mint, SSE stream, result object, exec wrapper text).
local render = require "moonbox.render"
local n, url, key, ws, id = tonumber(arg[1]), arg[2], arg[3], arg[4], arg[5]
render.connect { backend = url, api_key = key, workspace = ws }
local sb = render.sandboxes.get(id)
local ok = 0
for _ = 1, n do
  if sb:exec("true").code == 0 then ok = ok + 1 end
end
print(ok .. " ok of " .. n)
if ok ~= n then os.exit(1) end
