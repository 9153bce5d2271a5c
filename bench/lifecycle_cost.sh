#!/usr/bin/env bash
# bench/lifecycle_cost.sh — where the host CPU of a sandbox life goes: bench/lifecycles.lua under
# a machine-wide `perf record`, then the samples by command name (the backend `moonbox`, the
# helpers `moonbox-sandbox`, the sandbox's `bash`/`true`, `slirp4netns`, `bwrap` of the floor).
# Other processes on the machine show up as their own names; read only the rows above. For one
# backend's own processes, attach `perf record -g -p PID` to the pid the bench prints on stderr
# (perf follows the children it starts from then on).
# Run: sudo bench/lifecycle_cost.sh [N] [NETWORK]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${1:-200}
NET=${2:-allow-all}
OUT=$ROOT/bench/out
mkdir -p "$OUT"
perf record -a -F 999 -o "$OUT/lifecycles.perf" -- "$ROOT/build/moonbox" run "$ROOT/bench/lifecycles.lua" "$N" "$NET" 2>/dev/null \
  | grep '^|'
perf report -i "$OUT/lifecycles.perf" --sort comm --stdio 2>/dev/null | grep -v '^#' | grep '%' | head -15
