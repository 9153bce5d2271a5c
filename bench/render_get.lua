-- bench/render_get.lua N URL KEY WORKSPACE SANDBOX — N sequential render.sandboxes.get calls:
-- the client's per-call overhead (request building, JSON decoding, typed result) on top of HTTP.
local render = require "moonbox.render"
local n, url, key, ws, id = tonumber(arg[1]), arg[2], arg[3], arg[4], arg[5]
render.connect { backend = url, api_key = key, workspace = ws }
local ok = 0
for _ = 1, n do
  if render.sandboxes.get(id).status == "running" then ok = ok + 1 end
end
print(ok .. " ok of " .. n)
if ok ~= n then os.exit(1) end
