#!/usr/bin/env bash
# bench/run.sh — runs every benchmark against a loopback server and prints one markdown table of
# ratios from this run (baselines run in the same invocation, on the same machine, back to back).
#
# Clients for each scenario: moonbox (bench/client.lua), the floor (bench/curl_loop.c: bare C
# libcurl), Node's built-in fetch (bench/client.mjs), and for sequential GETs the `curl` command
# once per request (what a shell script does). CPU is user+sys of the client process from
# /usr/bin/time; RSS is its peak resident set. Each measurement is repeated REPS times and the
# lowest CPU kept (noise only ever adds time).
#
# Environment: BUILD_DIR (default build/), SEQ_N (10000), CONC_N (1000), CLI_N (300), REPS (3).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build}
SEQ_N=${SEQ_N:-10000}
CONC_N=${CONC_N:-1000}
CLI_N=${CLI_N:-300}
REPS=${REPS:-3}
OUT=$ROOT/bench/out
mkdir -p "$OUT"

cmake --build "$BUILD" --target moonbox bench_server bench_curl_loop bench_exec_loop >/dev/null
MOONBOX=$BUILD/moonbox

portfile=$(mktemp)
"$BUILD/bench_server" "$portfile" &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$portfile"' EXIT
for _ in $(seq 50); do [ -s "$portfile" ] && break; sleep 0.1; done
URL="http://127.0.0.1:$(cat "$portfile")/x"

have_node=0
command -v node >/dev/null && have_node=1

# measure NAME CMD... -> prints "wall cpu_s rss_kb" of the best (lowest CPU) of REPS runs.
measure() {
  local best="" t
  for _ in $(seq "$REPS"); do
    t=$(mktemp)
    /usr/bin/time -f "%e %U %S %M" -o "$t" "$@" >/dev/null
    read -r wall user sys rss < "$t"
    rm -f "$t"
    cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN{printf "%.3f", u+s}')
    if [ -z "$best" ] || awk -v a="$cpu" -v b="${best#* }" 'BEGIN{exit !(a < b+0)}'; then
      best="$wall $cpu $rss"
    fi
  done
  echo "$best"
}

row() { # scenario client n "wall cpu rss" cpu_floor cpu_node
  local scen=$1 client=$2 n=$3 m=$4 floor=$5 node=$6
  read -r wall cpu rss <<< "$m"
  awk -v s="$scen" -v c="$client" -v n="$n" -v w="$wall" -v cpu="$cpu" -v rss="$rss" \
      -v f="$floor" -v nd="$node" 'BEGIN{
    us = cpu * 1e6 / n;
    rf = (f > 0) ? sprintf("%.2f×", cpu / f) : "—";
    rn = (nd > 0) ? sprintf("%.2f×", cpu / nd) : "—";
    printf "| %s | %s | %d | %.2f | %.1f | %.1f | %s | %s |\n", s, c, n, w, us, rss/1024, rf, rn }'
}

{
echo "| scenario | client | requests | wall s | CPU µs/request | peak RSS MB | CPU vs C floor | CPU vs Node |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for scen in seq conc; do
  n=$SEQ_N
  [ "$scen" = conc ] && n=$CONC_N
  label="sequential keep-alive GET"
  [ "$scen" = conc ] && label="concurrent GET"
  c=$(measure "$BUILD/bench_curl_loop" "$scen" "$n" "$URL")
  m=$(measure "$MOONBOX" run "$ROOT/bench/client.lua" "$scen" "$n" "$URL")
  nd="0 0 0"
  [ $have_node = 1 ] && nd=$(measure node "$ROOT/bench/client.mjs" "$scen" "$n" "$URL")
  cfl=$(echo "$c" | cut -d' ' -f2)
  ncpu=$(echo "$nd" | cut -d' ' -f2)
  row "$label" "moonbox" "$n" "$m" "$cfl" "$ncpu"
  row "$label" "bare C libcurl" "$n" "$c" "$cfl" "$ncpu"
  [ $have_node = 1 ] && row "$label" "Node fetch" "$n" "$nd" "$cfl" "$ncpu"
  if [ "$scen" = seq ]; then
    cl=$(measure bash -c "for i in \$(seq $CLI_N); do curl -s -o /dev/null '$URL'; done")
    row "$label" "curl command per request" "$CLI_N" "$cl" "$(awk -v c="$cfl" -v n="$n" -v m="$CLI_N" 'BEGIN{print c*m/n}')" \
        "$(awk -v c="$ncpu" -v n="$n" -v m="$CLI_N" 'BEGIN{print c*m/n}')"
  fi
done
} | tee "$OUT/http.md"

# Startup: `moonbox run` of an empty recipe, against `lua5.4` running an empty chunk.
startup() { # CMD... -> mean wall ms over 50 runs
  local t0 t1
  t0=$(date +%s%N)
  for _ in $(seq 50); do "$@" >/dev/null; done
  t1=$(date +%s%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", (b-a)/50/1e6}'
}
mb=$(startup "$MOONBOX" run "$ROOT/bench/empty.lua")
lu=$(startup lua5.4 "$ROOT/bench/empty.lua")
tr=$(startup /bin/true)
{
echo
echo "| startup | mean wall ms (50 runs) |"
echo "|---|---:|"
echo "| moonbox run bench/empty.lua | $mb |"
echo "| lua5.4 bench/empty.lua | $lu |"
echo "| /bin/true (process start floor) | $tr |"
} | tee -a "$OUT/http.md"

# The Render client's per-call overhead: render.sandboxes.get against moonbox local, vs the same
# GET from the bare C loop and from Node's fetch (all sequential, keep-alive, same backend).
if [ "$(id -u)" -eq 0 ]; then
  RN=${RENDER_N:-2000}
  lstate=$(mktemp -d)
  "$MOONBOX" local --quiet --port 0 --state "$lstate" --api-key rnd_bench --workspace tea-cph1rs3idesc73a2b2mg > "$lstate/out" &
  lpid=$!
  for _ in $(seq 100); do grep -q RENDER_WORKSPACE_ID "$lstate/out" 2>/dev/null && break; sleep 0.1; done
  LURL=$(sed -n 's/^RENDER_LOCAL_DEV_URL=//p' "$lstate/out")
  SID=$(curl -s -H 'Authorization: Bearer rnd_bench' -d '{"ownerId":"tea-cph1rs3idesc73a2b2mg"}' "$LURL/v1/sandboxes" | sed 's/.*"id":"\(sbx-[0-9a-v]*\)".*/\1/')
  sleep 1
  GURL="$LURL/v1/sandboxes/$SID"
  c=$(BENCH_AUTH="Bearer rnd_bench" measure "$BUILD/bench_curl_loop" seq "$RN" "$GURL")
  m=$(measure "$MOONBOX" run "$ROOT/bench/render_get.lua" "$RN" "$LURL" rnd_bench tea-cph1rs3idesc73a2b2mg "$SID")
  nd="0 0 0"
  [ $have_node = 1 ] && nd=$(BENCH_AUTH="Bearer rnd_bench" measure node "$ROOT/bench/client.mjs" seq "$RN" "$GURL")
  cfl=$(echo "$c" | cut -d' ' -f2)
  ncpu=$(echo "$nd" | cut -d' ' -f2)
  {
  echo
  echo "| scenario | client | requests | wall s | CPU µs/request | peak RSS MB | CPU vs C floor | CPU vs Node |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|"
  row "GET /v1/sandboxes/{id}" "moonbox render.sandboxes.get" "$RN" "$m" "$cfl" "$ncpu"
  row "GET /v1/sandboxes/{id}" "bare C libcurl" "$RN" "$c" "$cfl" "$ncpu"
  [ $have_node = 1 ] && row "GET /v1/sandboxes/{id}" "Node fetch" "$RN" "$nd" "$cfl" "$ncpu"
  } | tee -a "$OUT/http.md"
  # A no-op exec: mint + SSE run, end to end.
  EN=${EXEC_N:-300}
  c=$(measure "$BUILD/bench_exec_loop" "$EN" "$LURL" "$SID" rnd_bench)
  m=$(measure "$MOONBOX" run "$ROOT/bench/render_exec.lua" "$EN" "$LURL" rnd_bench tea-cph1rs3idesc73a2b2mg "$SID")
  nd="0 0 0"
  [ $have_node = 1 ] && nd=$(measure node "$ROOT/bench/exec.mjs" "$EN" "$LURL" "$SID" rnd_bench)
  cfl=$(echo "$c" | cut -d' ' -f2)
  ncpu=$(echo "$nd" | cut -d' ' -f2)
  {
  row "no-op exec (mint + SSE run)" "moonbox sb:exec" "$EN" "$m" "$cfl" "$ncpu"
  row "no-op exec (mint + SSE run)" "bare C libcurl" "$EN" "$c" "$cfl" "$ncpu"
  [ $have_node = 1 ] && row "no-op exec (mint + SSE run)" "Node fetch" "$EN" "$nd" "$cfl" "$ncpu"
  } | tee -a "$OUT/http.md"
  curl -s -o /dev/null -H 'Authorization: Bearer rnd_bench' -X POST "$LURL/v1/sandboxes/$SID/terminate"
  kill "$lpid"; wait "$lpid" 2>/dev/null || true
  rm -rf "$lstate"
fi
