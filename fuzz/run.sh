#!/bin/sh
# fuzz/run.sh SECONDS - builds every libFuzzer target (fuzz_sse, fuzz_output_event, fuzz_cron,
# fuzz_tz, fuzz_gate, fuzz_archive_names, fuzz_starter) with clang in build-fuzz/ and fuzzes
# each for SECONDS seconds, as many at once as there are cores. Each target fuzzes a fresh
# scratch copy of its seeds, fuzz/corpus/NAME (build-fuzz/corpus-NAME), so the checked-in seeds
# are never written; crash inputs land in build-fuzz/artifacts-NAME/ and the log in
# build-fuzz/fuzz_NAME.log. Prints one "fuzz_NAME: N runs, C crashes" line per target and exits
# non-zero if any target crashed (after running all of them).
set -eu

# The targets, in the order they run; each has fuzz/fuzz_NAME.c and fuzz/corpus/NAME/.
targets="sse output_event cron tz gate archive_names starter"

usage() {
    echo "usage: fuzz/run.sh SECONDS" >&2
    exit 2
}
[ $# -eq 1 ] || usage
case $1 in '' | *[!0-9]*) usage ;; esac
seconds=$1

root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build-fuzz

cmake -S "$root/fuzz" -B "$build" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
for name in $targets; do
    cmake --build "$build" --target "fuzz_$name" >/dev/null
done

# fuzz_one NAME: fuzzes fuzz_NAME for $seconds, prints its summary line, returns 1 on a crash.
fuzz_one() {
    name=$1
    corpus=$build/corpus-$name
    artifacts=$build/artifacts-$name
    log=$build/fuzz_$name.log

    rm -rf "$corpus" "$artifacts"
    mkdir -p "$corpus" "$artifacts"
    cp "$root"/fuzz/corpus/"$name"/* "$corpus"/

    status=0
    "$build/fuzz_$name" -max_total_time="$seconds" -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "$corpus" >"$log" 2>&1 || status=$?

    # libFuzzer ends a clean run with "Done N runs in S second(s)"; a crash skips that line, so
    # fall back to the final stats and then to the last "#N" progress line.
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
    echo "fuzz_$name: $runs runs, $crashes crashes"
    [ "$crashes" -eq 0 ]
}

# As many targets at once as the machine has cores (each libFuzzer run is one process on one
# core): the same seconds per target, in a fraction of the wall time. Each target's summary
# goes to a file of its own and is printed in the targets' order once its batch is done.
jobs=$(nproc 2>/dev/null || echo 1)
failed=0
set -- $targets
while [ $# -gt 0 ]; do
    batch=
    pids=
    i=0
    while [ $# -gt 0 ] && [ "$i" -lt "$jobs" ]; do
        (fuzz_one "$1" || exit 1) >"$build/summary-$1" 2>&1 &
        pids="$pids $!"
        batch="$batch $1"
        i=$((i + 1))
        shift
    done
    for pid in $pids; do
        wait "$pid" || failed=1
    done
    for name in $batch; do
        cat "$build/summary-$name"
    done
done
exit "$failed"
