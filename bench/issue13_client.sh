#!/usr/bin/env bash
# bench/issue13_client.sh — the client-side figures of issue 13, each against its baseline in
# the same run: CPU per keep-alive GET against the bare C libcurl loop (sequential and 64 in
# flight) and the connections each needed (counted by bench_server); the exec output path alone
# (bench_server's /_exec stream) and end to end through moonbox local against the host pipe; the
# waits against the backend's own times; and start-up against lua5.4. CPU is perf stat's
# task-clock (mean of REPS runs), which is steadier than /usr/bin/time's 10 ms ticks. The GET
# rows run the clients in turn (A B C A B C ...) for ROUNDS rounds and give the lowest and the
# median of the rounds, as other work on the machine only ever adds to a figure; beside them the
# user-mode instructions per GET, which load does not change: perf's instructions:u where the
# CPU counts them, else valgrind's (callgrind); either as the difference of a 3,000 and a 1,000
# GET run over 2,000, so that start-up cancels out.
#
# Environment: BUILD_DIR (default build/), BASE_DIR (a build of an older commit, measured the
# same way for "before" rows; its lua/ is BASE_LUA, default BASE_DIR/../lua), N (10000), REPS (5),
# ROUNDS (3), IR (1; 0 leaves the instruction counts out).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build}
N=${N:-10000}
REPS=${REPS:-5}
ROUNDS=${ROUNDS:-3}
IR=${IR:-1}
cd "$ROOT"
cmake --build "$BUILD" --target moonbox bench_server bench_curl_loop >/dev/null

portfile=$(mktemp)
"$BUILD/bench_server" "$portfile" &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$portfile"' EXIT
for _ in $(seq 50); do [ -s "$portfile" ] && break; sleep 0.1; done
BASE_URL="http://127.0.0.1:$(cat "$portfile")"
URL="$BASE_URL/x"

# cpu_ms CMD... -> mean task-clock in ms over REPS runs
cpu_ms() {
  perf stat -r "$REPS" -x, -e task-clock "$@" 2>&1 >/dev/null | awk -F, '/task-clock/ {printf "%.1f", $1}'
}
# user_ir CMD... -> user-mode instructions of one run of CMD
if perf stat -x, -e instructions:u true 2>&1 | grep -q '^[0-9]'; then
  user_ir() { perf stat -x, -e instructions:u "$@" 2>&1 >/dev/null | awk -F, '/instructions/ {print $1}'; }
elif command -v valgrind >/dev/null; then
  # through `env` (the "before" rows) too: the children are counted, and summed
  user_ir() { valgrind --tool=callgrind --trace-children=yes --callgrind-out-file=/dev/null "$@" 2>&1 >/dev/null | awk '/Collected/ {n += $4} END {print n}'; }
else
  IR=0
fi
# ir_per_get MODE CMD... -> user-mode instructions per GET of CMD MODE
ir_per_get() {
  local mode=$1 a b
  shift
  a=$(user_ir "$@" "$mode" 1000 "$URL")
  b=$(user_ir "$@" "$mode" 3000 "$URL")
  echo $(((b - a) / 2000))
}
# stats "v1 v2 ..." -> "min median"
stats() { tr ' ' '\n' <<< "$1" | sort -n | awk '{v[NR] = $1} END {printf "%s %s", v[1], (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }
# conns CMD... -> connections one run of CMD opened (the count is reset first)
conns() {
  curl -s "$BASE_URL/_conns" >/dev/null
  "$@" >/dev/null
  curl -s "$BASE_URL/_conns"
}

clients=("bare C libcurl|$BUILD/bench_curl_loop" "moonbox|$BUILD/moonbox run bench/client.lua")
if [ -n "${BASE_DIR:-}" ]; then
  clients+=("moonbox before|env MOONBOX_LUA_DIR=${BASE_LUA:-$BASE_DIR/../lua} $BASE_DIR/moonbox run bench/client.lua")
fi

echo "| scenario | client | CPU ms for $N GETs, each round | lowest / median µs per GET | vs bare C, lowest / median | user instructions per GET | vs bare C | connections |"
echo "|---|---|---|---:|---:|---:|---:|---:|"
for mode in seq conc64; do
  declare -A runs=()
  for _ in $(seq "$ROUNDS"); do
    for c in "${clients[@]}"; do
      read -r -a cmd <<< "${c#*|}"
      runs[${c%%|*}]+="$(cpu_ms "${cmd[@]}" "$mode" "$N" "$URL") "
    done
  done
  floor="" floor_ir=""
  for c in "${clients[@]}"; do
    name=${c%%|*}
    read -r -a cmd <<< "${c#*|}"
    read -r lo med <<< "$(stats "${runs[$name]% }")"
    ir="-"
    [ "$IR" = 1 ] && ir=$(ir_per_get "$mode" "${cmd[@]}")
    n_conns=$(conns "${cmd[@]}" "$mode" "$N" "$URL")
    [ -z "$floor" ] && floor="$lo $med" floor_ir=$ir
    awk -v m="$mode" -v c="$name" -v all="${runs[$name]% }" -v lo="$lo" -v med="$med" -v f="$floor" \
      -v n="$N" -v ir="$ir" -v fir="$floor_ir" -v k="$n_conns" 'BEGIN {
      split(f, fl, " ")
      gsub(" ", " / ", all)
      printf "| %s | %s | %s | %.1f / %.1f | %.2f× / %.2f× | %s | %s | %d |\n",
        (m == "seq" ? "sequential keep-alive GET" : "64 in flight"), c, all, lo * 1000 / n, med * 1000 / n,
        lo / fl[1], med / fl[2], ir, (ir == "-" ? "-" : sprintf("%.2f×", ir / fir)), k }'
  done
  unset runs
done

echo
echo "| exec output, client alone (bench_server /_exec, 700 MiB) | result |"
echo "|---|---|"
for mode in output event; do
  echo "| moonbox, $mode | $("$BUILD/moonbox" run bench/exec_stream.lua "$BASE_URL" 700 "$mode") |"
done
t0=$(date +%s%N)
curl -s "$BASE_URL/_exec?mib=700" -o /dev/null
t1=$(date +%s%N)
awk -v a="$t0" -v b="$t1" 'BEGIN { printf "| curl into /dev/null | %.0f MB/s |\n", 700 * 1048576 / ((b - a) / 1e9) / 1e6 }'

echo
echo "| start-up | task-clock ms (perf stat -r 30) |"
echo "|---|---:|"
echo "| moonbox run bench/empty.lua | $(REPS=30 cpu_ms "$BUILD/moonbox" run bench/empty.lua) |"
if [ -n "${BASE_DIR:-}" ]; then
  echo "| moonbox run bench/empty.lua, before | $(REPS=30 cpu_ms env MOONBOX_LUA_DIR="${BASE_LUA:-$BASE_DIR/../lua}" "$BASE_DIR/moonbox" run bench/empty.lua) |"
fi
echo "| lua5.4 -e '' | $(REPS=30 cpu_ms lua5.4 -e '') |"
loop() { local t0 t1; t0=$(date +%s%N); for _ in $(seq 100); do "$@" >/dev/null; done; t1=$(date +%s%N); awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", (b - a) / 100 / 1e6 }'; }
echo "| wall, 100 runs from bash: moonbox / lua5.4 | $(loop "$BUILD/moonbox" run bench/empty.lua) / $(loop lua5.4 -e '') ms |"
echo "| shared libraries loaded by the binary | $(ldd "$BUILD/moonbox" | wc -l) |"

if [ "$(id -u)" -eq 0 ]; then
  echo
  echo "| exec output end to end (moonbox local, 700 MiB) | speed | |"
  echo "|---|---:|---|"
  "$BUILD/moonbox" run bench/exec_output.lua 700 2>/dev/null | grep '^|'
  echo
  echo "| wait | backend's own (p50) | recipe sees (p50) | ratio |"
  echo "|---|---:|---:|---:|"
  "$BUILD/moonbox" run bench/waits.lua 30 2>/dev/null | grep '^|'
fi
