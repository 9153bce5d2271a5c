#!/usr/bin/env bash
# bench/schedule.sh — `moonbox schedule` on the real clock: how late fires are, and what the
# daemon costs while it waits.
#
#   1. lateness: schedule.every("x", 1, ...) for ~20 fires; lateness = fired_at - slot from
#      `moonbox runs --json` (goal: p50 and max <= 100 ms);
#   2. idle CPU: a daemon whose only schedule fires hourly, utime+stime from /proc/PID/stat
#      before and after 60 s of waiting (goal: <= 10 ms).
# Each part uses a fresh state dir. Usage: bench/schedule.sh [IDLE_SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MOONBOX_BIN:-build/moonbox}
IDLE=${1:-60}
dir=$(mktemp -d /tmp/moonbox-bench-schedule.XXXXXX)
trap 'rm -rf "$dir"' EXIT
export HOME=$dir XDG_STATE_HOME=$dir/state RENDER_LOCAL_DEV_URL=http://127.0.0.1:9 RENDER_API_KEY=unused
unset MOONBOX_TEST_CLOCK

cat >"$dir/every.lua" <<'LUA'
require("moonbox.schedule").every("x", 1, function() end)
LUA
"$BIN" schedule "$dir/every.lua" >"$dir/every.log" &
pid=$!
sleep 21.5
kill -TERM "$pid"
wait "$pid"
"$BIN" runs x --json --limit 0 >"$dir/runs.json"
lua5.4 - "$dir/runs.json" <<'LUA'
local cjson = require "cjson"
local f = io.open(arg[1]); local rows = cjson.decode(f:read("a")); f:close()
local late = {}
for _, r in ipairs(rows) do
  if r.fired_unix ~= cjson.null then late[#late + 1] = (r.fired_unix - r.slot_unix) * 1000 end
end
table.sort(late)
print(string.format("fire lateness over %d fires: p50 %.2f ms, max %.2f ms (goal <= 100 ms)",
  #late, late[(#late + 1) // 2], late[#late]))
LUA

cat >"$dir/idle.lua" <<'LUA'
require("moonbox.schedule").every("hourly", "1h", function() end)
LUA
XDG_STATE_HOME=$dir/state2 "$BIN" schedule "$dir/idle.lua" >"$dir/idle.log" &
pid=$!
sleep 2 # let it start (loading Lua, opening the database)
ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
before=$(ticks "$pid")
sleep "$IDLE"
after=$(ticks "$pid")
kill -TERM "$pid"
wait "$pid"
hz=$(getconf CLK_TCK)
echo "idle CPU over ${IDLE} s: $(( (after - before) * 1000 / hz )) ms (utime+stime; resolution $(( 1000 / hz )) ms; goal <= 10 ms)"
