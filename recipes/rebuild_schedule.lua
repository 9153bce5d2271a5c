-- recipes/rebuild_schedule.lua — rebuild a named snapshot every night, verified, rolled forward.
--
-- Each rebuild starts a builder from the newest "rebuild-base" snapshot (or from nothing the
-- first time), bumps the build number stored in the image and stamps it, captures the result
-- under the same name, restores it into a verifier that runs the image's own check, and keeps
-- only the KEEP newest snapshots of the name. A failed build or verify deletes what it made:
-- the previous snapshot stays the one a restore by name gets. Nothing here touches the network.
--
--   moonbox schedule recipes/rebuild_schedule.lua     -- rebuilds at 03:00 UTC every day
--   moonbox run recipes/rebuild_schedule.lua          -- one rebuild now
local render = require "moonbox.render"
local schedule = require "moonbox.schedule"

local NAME, KEEP = "rebuild-base", 2

-- The image's own check: the build number is a positive integer and the tool runs.
local CHECK = [[test "$(cat /opt/base/build-number)" -ge 1 &&
  /opt/base/bin/base-info | grep -q '^base build ']]

local function build(sb, info)
  -- The builder starts from the previous snapshot, so its build number is there to bump.
  sb:exec([[
    set -eu
    mkdir -p /opt/base/bin
    n=$(cat /opt/base/build-number 2>/dev/null || echo 0)
    echo $((n + 1)) > /opt/base/build-number
    date -u +%Y-%m-%dT%H:%M:%SZ > /opt/base/built-at
    printf '#!/bin/sh\necho "base build $(cat /opt/base/build-number), built $(cat /opt/base/built-at)"\n' \
      > /opt/base/bin/base-info
    chmod 755 /opt/base/bin/base-info
  ]]):check()
  print(("built %s on %s (previous: %s)"):format(NAME, sb.id,
    info.previous and info.previous.id or "none"))
end

local function rebuild()
  local snap, summary = render.snapshots.rebuild(NAME, build, {
    base = render.snapshots.latest(NAME),   -- nil the first time: an empty builder
    keep = KEEP, verify = CHECK, network = "deny-all", timeout = "15m",
  })
  local d = summary.durations
  print(("%s is now %s (build %.1f s, capture %.1f s, verify %.1f s); deleted: %s"):format(
    NAME, snap.id, d.build, d.capture, d.verify,
    #summary.deleted > 0 and table.concat(summary.deleted, " ") or "none"))
  -- What any later restore by name gets:
  local check <close> = render.sandboxes.create { snapshot = NAME, network = "deny-all", lifetime = 600 }
  io.write("restored by name: ", check:exec("/opt/base/bin/base-info"):check().stdout)
end

schedule.cron("rebuild-base", "0 3 * * *", rebuild, { overlap = "skip", timeout = "20m", catchup = "6h" })

if not schedule.running() then rebuild() end
