#!/usr/bin/env bash
# The benchmark run for the lent 16-core machine (no network, no PostgreSQL): installs mdb from the
# wheels tools/device_wheels.sh downloaded (carry .device/wheels), then runs the sections the wave-3
# issues measure there, each under its own time limit, every table with its same-run baseline.
# Usage: bash tools/device_bench.sh [SECTION ...]   (default: all below, in this order)
# A section named again runs again (its output then <section>-2, -3, ...): rounds interleave.
# Each section's full output goes to /tmp/mdb-device-bench/<section>.txt and its table here; with
# $OUT set (the device tool), every output is also appended to $OUT/device-bench.log as it ends:
# one file, because the tool brings back at most eight.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=/tmp/mdb-device-bench
mkdir -p "$out"
log=${OUT:+$OUT/device-bench.log}
declare -A seen=()
bash tools/device_wheels.sh install >"$out/install.txt" 2>&1 || { cat "$out/install.txt"; exit 1; }
py=.device/venv/bin/python
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%d GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"

section() {  # NAME SECONDS ARGS...: one bench.py run, bounded
    local name=$1 limit=$2; shift 2
    seen[$name]=$(( ${seen[$name]:-0} + 1 ))
    [ "${seen[$name]}" -eq 1 ] || name="$name-${seen[$name]}"
    local started=$SECONDS
    timeout "$limit" "$py" tools/bench.py "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    echo "== $name ($((SECONDS - started)) s, rc=$rc): tools/bench.py $*"
    [ -z "$log" ] || { echo "===== $name ($((SECONDS - started)) s, rc=$rc): tools/bench.py $*"; cat "$out/$name.txt"; } >>"$log"
    sed -n '/mdb benchmarks/,$p' "$out/$name.txt" | grep -v '^[┏┡└━]' | cut -c1-230
    [ "$rc" -eq 0 ] || tail -5 "$out/$name.txt"
}

wanted=("$@")
[ ${#wanted[@]} -gt 0 ] || wanted=(workers reshard briefcase briefcase_async scale impact refresh_scale)
fraction=${MDB_BENCH_FRACTION:-0.3}  # the per-request sections' rounds, shortened to fit the lent time
for w in "${wanted[@]}"; do
    case $w in
    workers) section workers 300 reshard --workers "${WORKERS:-1,2,4,8}" --shards 4:8 ;;
    reshard) section reshard 240 reshard ;;
    briefcase) MDB_BENCH_FRACTION=$fraction section briefcase 120 briefcase ;;
    briefcase_async) MDB_BENCH_FRACTION=$fraction section briefcase_async 120 briefcase --async ;;
    scale) MDB_BENCH_FRACTION=$fraction MDB_BENCH_SCALE_SIZES=${MDB_BENCH_SCALE_SIZES:-128} section scale 150 scale ;;
    impact-[0-9]*)  # issue 31, one size: impact-100000
        section "$w" "${IMPACT_LIMIT:-240}" reshard_impact --n "${w#impact-}" --procs 4 ;;
    impact)  # issue 31: 10k and 100k (IMPACT_N: others, e.g. "10000 100000 1000000"), then the end of a 100k reshard alone
        for n in ${IMPACT_N:-10000 100000}; do
            section "impact-$n" "${IMPACT_LIMIT:-240}" reshard_impact --n "$n" --procs 4
        done
        section impact-settled 120 reshard_impact --n 100000 --procs 4 --settled --quick ;;
    refresh_scale) section refresh_scale 300 refresh_scale ;;
    profile)  # issue 34: Python calls and client CPU per routed read and per fan-out shard (not in the default list)
        for args in "--backend pg" "--backend pg --write" "--backend sqlite"; do
            timeout 120 "$py" tools/profile_session.py $args --top 0 2>&1 | head -1
        done
        timeout 180 "$py" tools/profile_fanout.py --shards 64 --rounds 3 --n 10 2>&1 | grep -E '^fan-out' ;;
    *) echo "unknown section $w" >&2 ;;
    esac
done
