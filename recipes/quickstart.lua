-- recipes/quickstart.lua — the whole life of a sandbox, start to finish.
--
-- Creates a sandbox (network deny-all), runs commands in it, uploads and downloads a file,
-- captures a filesystem snapshot, restores three sandboxes from it concurrently, and leaves
-- nothing running: every sandbox is a <close> guard, and the snapshot is deleted at the end.
-- With no RENDER_API_KEY it runs against the embedded local backend (real sandboxes on this
-- machine); with one, against Render's cloud.
--
--   moonbox run recipes/quickstart.lua
local render = require "moonbox.render"
local task = require "moonbox.task"

local started = task.now()
local sb <close> = render.sandboxes.create { network = "deny-all", lifetime = 600 }
print(("created %s (%s) in %.0f ms"):format(sb.id, sb.plan, (task.now() - started) * 1000))

-- argv tables are quoted safely; env values travel as a file, never in command text
-- (an env value is a secret: traces, journals and cassettes show it as [redacted])
local r = sb:exec({ "sh", "-c", 'echo "hello from $(hostname); GREETER has ${#GREETER} characters"' },
  { env = { GREETER = "moonbox" } }):check()
io.write("exec: ", r.stdout)

sb:write("work/input.txt", "3\n1\n2\n")
-- A dry run (moonbox run --dry-run) runs no command: say what `sort` leaves behind.
render.dry_run.on_download("/work/sorted%.txt$", "1\n2\n3\n")
sb:exec("sort -n work/input.txt > work/sorted.txt"):check()
io.write("download: ", (sb:read("work/sorted.txt"):gsub("\n", " ")), "\n")

sb:exec("mkdir -p /opt/app && echo 'built at step 1' > /opt/app/artifact"):check()
local snap = sb:snapshot { kind = "filesystem", name = "quickstart" }
print(("snapshot %s is %s (%d bytes)"):format(snap.id, snap.status, snap.size_bytes or 0))

-- three restores at once; each is terminated when its task's scope ends
local outputs = task.map({ 1, 2, 3 }, function(i)
  local copy <close> = render.sandboxes.create { snapshot = snap, network = "deny-all", lifetime = 600 }
  return ("%d: %s"):format(i, copy:exec("cat /opt/app/artifact"):check().stdout:gsub("\n", ""))
end, { concurrency = 3 })
for _, line in ipairs(outputs) do print("restored " .. line) end

snap:delete()
print(("done in %.2f s; every sandbox is terminated as its scope closes"):format(task.now() - started))
