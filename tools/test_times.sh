#!/usr/bin/env bash
# Wall time of the test loops on N cores (default 2, pinned with taskset), for docs/testing.md and
# docs/dev/0010-test-layout.md: the development loop (-m "not slow"), each group, and the whole
# suite in one process and with -n 3. Needs PostgreSQL and PgBouncer (as .ci/run installs them).
# Usage: bash tools/test_times.sh [fast|groups|whole|whole-n3|file:PATH ...]   (default: fast groups)
# Each run's --durations=0 output goes to $OUT/<name>.txt (or /tmp/mdb-test-times).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp/mdb-test-times}
mkdir -p "$out"
cores=${CORES:-2}
pin=(taskset -c "0-$((cores - 1))")
echo "machine: $(nproc) cores, pinned to $cores; load before: $(cut -d' ' -f1-3 /proc/loadavg)"

run() {  # NAME ARGS...: one pytest run, timed, its durations kept
    local name=$1; shift
    local started=$SECONDS
    # CPU of the whole process tree too: on a shared machine it varies far less than the wall time.
    /usr/bin/time -f "%U %S" -o "$out/$name.cpu" "${pin[@]}" .venv/bin/python -m pytest -q -p no:cacheprovider --durations=0 "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    local cpu; cpu=$(awk '{printf "%.0f", $1 + $2}' "$out/$name.cpu")
    echo "== $name: $((SECONDS - started)) s wall, $cpu s CPU, rc=$rc, load after $(cut -d' ' -f1-3 /proc/loadavg): pytest $*"
    tail -1 "$out/$name.txt"
    # Where it went: the sums of the --durations lines by phase (fixture setup is most of what
    # support.templates cut; the call phase is the tests' own work).
    awk '$2 ~ /^(setup|call|teardown)$/ && $1 ~ /s$/ {t[$2] += $1; n[$2]++}
         END {printf "   phases: setup %.0f s (%d), call %.0f s (%d), teardown %.0f s (%d)\n", t["setup"], n["setup"], t["call"], n["call"], t["teardown"], n["teardown"]}' "$out/$name.txt"
}

wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=(fast groups)
for w in "${wanted[@]}"; do
    case $w in
    fast) run fast -m "not slow" ;;
    file:*) run "file-$(basename "${w#file:}" .py)" "${w#file:}" ;;
    groups) for g in unit postgres faults cli; do run "group-$g" "tests/$g"; done ;;
    whole) run whole ;;
    whole-n3) run whole-n3 -n 3 ;;
    *) echo "unknown run $w" >&2 ;;
    esac
done
