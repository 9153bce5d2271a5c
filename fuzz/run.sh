#!/bin/sh
# fuzz/run.sh SECONDS - builds fuzz_sse with clang in build-fuzz/ and fuzzes the SSE parser for
# SECONDS seconds. It fuzzes a fresh scratch copy of fuzz/corpus/sse (build-fuzz/corpus-sse), so
# the checked-in seeds are never written; crash inputs land in build-fuzz/artifacts-sse/.
# Prints "fuzz_sse: N runs, C crashes" last and exits non-zero if anything crashed.
set -eu

usage() {
    echo "usage: fuzz/run.sh SECONDS" >&2
    exit 2
}
[ $# -eq 1 ] || usage
case $1 in '' | *[!0-9]*) usage ;; esac
seconds=$1

root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build-fuzz
corpus=$build/corpus-sse
artifacts=$build/artifacts-sse
log=$build/fuzz_sse.log

cmake -S "$root/fuzz" -B "$build" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" --target fuzz_sse >/dev/null

rm -rf "$corpus" "$artifacts"
mkdir -p "$corpus" "$artifacts"
cp "$root"/fuzz/corpus/sse/* "$corpus"/

status=0
"$build/fuzz_sse" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "$corpus" >"$log" 2>&1 || status=$?

# libFuzzer ends a clean run with "Done N runs in S second(s)"; a crash skips that line, so fall
# back to the final stats and then to the last "#N" progress line.
runs=$(sed -n 's/^Done \([0-9][0-9]*\) runs.*/\1/p' "$log" | tail -n 1)
[ -n "$runs" ] || runs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9][0-9]*\).*/\1/p' "$log" | tail -n 1)
[ -n "$runs" ] || runs=$(sed -n 's/^#\([0-9][0-9]*\).*/\1/p' "$log" | tail -n 1)
[ -n "$runs" ] || runs=0
crashes=$(find "$artifacts" -type f | wc -l | tr -d ' ')
if [ "$status" -ne 0 ] && [ "$crashes" -eq 0 ]; then
    crashes=1 # died without writing an input, e.g. killed or a libFuzzer setup error
fi
if [ "$crashes" -ne 0 ]; then
    tail -n 40 "$log" >&2
    ls "$artifacts" >&2
fi
echo "fuzz_sse: $runs runs, $crashes crashes"
[ "$crashes" -eq 0 ]
