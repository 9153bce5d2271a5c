#!/usr/bin/env bash
# bench/isolation.sh — the cost of the sandbox hardening (user namespaces, idmapped layers,
# seccomp, cgroup limits, slirp4netns) against the backend just before it, in one run:
# builds commit OLD (default 044bb2f, bubblewrap + moonbox-nsexec, the host's root as base) in
# a temporary worktree, then runs bench/isolation.lua against the old and the new `moonbox
# local` alternately ROUNDS times (noise hits both alike) and prints the median of each figure
# and the new/old ratio. Needs root (both backends run real sandboxes).
# Environment: BUILD_DIR (default build/), OLD (commit), ROUNDS (3), N (30 creates / execs).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD_DIR:-$ROOT/build}
OLD=${OLD:-044bb2f}
ROUNDS=${ROUNDS:-3}
N=${N:-30}
OUT=$ROOT/bench/out
mkdir -p "$OUT"
OLDTREE=$BUILD/isolation-old-$OLD
if [ ! -x "$OLDTREE/build/moonbox" ]; then
  rm -rf "$OLDTREE"
  git -C "$ROOT" worktree add --detach "$OLDTREE" "$OLD" >/dev/null
  cmake -S "$OLDTREE" -B "$OLDTREE/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$OLDTREE/build" -j"$(nproc)" --target moonbox moonbox-nsexec >/dev/null
fi
cmake --build "$BUILD" --target moonbox moonbox-sandbox >/dev/null
results=$OUT/isolation.txt
: > "$results"
for r in $(seq "$ROUNDS"); do
  for which in old new; do
    bin=$BUILD/moonbox
    [ "$which" = old ] && bin=$OLDTREE/build/moonbox
    MOONBOX_BIN=$bin "$BUILD/moonbox" run "$ROOT/bench/isolation.lua" "$which" "$N" | tee -a "$results"
  done
done
awk '
  { for (i = 2; i <= NF; i++) { split($i, kv, "="); v[$1, kv[1], ++n[$1, kv[1]]] = kv[2]; keys[kv[1]] = 1 } }
  function median(w, k,    c, i, j, t, a) {
    c = n[w, k]; for (i = 1; i <= c; i++) a[i] = v[w, k, i]
    for (i = 1; i <= c; i++) for (j = i + 1; j <= c; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return a[int((c + 1) / 2)]
  }
  END {
    print "| figure | before hardening | hardened | ratio |"
    print "|---|---|---|---|"
    for (k in keys) { o = median("old", k); h = median("new", k)
      printf "| %s | %.1f ms | %.1f ms | %.2f× |\n", k, o, h, h / o }
  }' "$results"
