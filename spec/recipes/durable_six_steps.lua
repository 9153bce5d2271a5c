--- spec/recipes/durable_six_steps.lua — the durable recipe spec/durable_crash_spec.lua SIGKILLs
-- at seeded points and resumes (issue 25's first "Done when"). Six steps, each a few Render calls:
--   1. restore three sandboxes from the snapshot SNAPSHOT (a fleet: a `<close>` guard);
--   2. exec in each (concurrently): `echo x >> /root/count`, the counter of that sandbox;
--   3. upload a file into the first;
--   4. capture a snapshot of the first (named, so a capture in flight at a crash is found again);
--   5. restore it and verify the tree: the uploaded file and the counter, as in the first;
--   6. clean up: every sandbox terminated (explicitly here, and by the guards on any error), the
--      captured snapshot deleted.
-- Usage: moonbox run --durable durable_six_steps.lua SNAPSHOT TAG
-- An exec that a crash left in flight is `unknown_outcome` on resume (it may or may not have run):
-- it is caught, and said on a line `unknown_outcome: exec <i> in <sandbox id>`. The last line
-- says what the run found: `six steps done: counts=C1,C2,C3 unknown=I,... verify=C upload=ok`.
local render = require "moonbox.render"
local task = require "moonbox.task"

local snapshot_id, tag = ...
assert(snapshot_id and tag, "usage: durable_six_steps.lua SNAPSHOT TAG")
local CONTENT = "uploaded by durable_six_steps, run " .. tag .. "\n"
local OPTS = { network = "deny-all", lifetime = 600 }

-- the counter of a sandbox: how many lines its execs appended
local function count(sb)
  local _, n = sb:read("/root/count"):gsub("\n", "")
  return n
end

-- 1. restore three sandboxes
local fleet <close> = render.restore(snapshot_id, { count = 3, concurrency = 3, network = OPTS.network,
  lifetime = OPTS.lifetime })
for i, sb in ipairs(fleet) do print(string.format("sandbox %d: %s", i, sb.id)) end

-- 2. exec in each
local unknown = {}
task.map(fleet, function(sb, i)
  local ok, err = pcall(function() return sb:exec("echo x >> /root/count"):check() end)
  if ok then return end
  if type(err) == "table" and err.code == "unknown_outcome" then
    unknown[#unknown + 1] = i
    print(string.format("unknown_outcome: exec %d in %s", i, tostring(err.sandbox_id or sb.id)))
    return
  end
  error(err, 0)
end, { concurrency = 3 })
table.sort(unknown)

-- 3. upload a file
fleet[1]:write("/root/upload.txt", CONTENT)

-- 4. capture a snapshot
local snap = fleet[1]:snapshot { name = "six-steps-" .. tag }

-- 5. restore it and verify the tree
local counts = {}
for i, sb in ipairs(fleet) do counts[i] = count(sb) end
do
  local copy <close> = render.sandboxes.create { snapshot = snap, network = OPTS.network,
    lifetime = OPTS.lifetime }
  print(string.format("restored %s from %s", copy.id, snap.id))
  local got = copy:read("/root/upload.txt")
  if got ~= CONTENT then
    error(string.format("the restored %s holds %q as /root/upload.txt, not %q", copy.id, got, CONTENT))
  end
  local copied = count(copy)
  if copied ~= counts[1] then
    error(string.format("the restored %s counts %d, its source %s %d", copy.id, copied, fleet[1].id,
      counts[1]))
  end
  -- 6. clean up (the guards would too, on any error)
  copy:terminate()
end
fleet:terminate()
snap:delete()

print(string.format("six steps done: counts=%s unknown=%s verify=%d upload=ok", table.concat(counts, ","),
  #unknown > 0 and table.concat(unknown, ",") or "-", counts[1]))
