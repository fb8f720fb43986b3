#!/usr/bin/env bash
# Run the whole suite (./scripts/test.sh) several times in a row, some runs
# with one core kept busy by another process, and report every failing
# test of every run: the flake hunt of docs/testing.md ("Flakes").
#
#   scripts/flake-hunt.sh [RUNS] [LOADED]   # default 6 runs, the last 3 loaded
#
# A loaded run keeps one core busy with `stress-ng --cpu 1` (installed by
# scripts/install-test-deps.sh) for its whole length. Each run's output goes
# to target/flake-hunt/run-N.log; the summary (run, load, seconds, passed,
# failed, the failing tests) to target/flake-hunt/summary.txt. Exits 1 if
# any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-6}"
loaded="${2:-3}"
out=target/flake-hunt
mkdir -p "$out"
: > "$out/summary.txt"
failed_runs=0
for run in $(seq 1 "$runs"); do
  load=none
  stress=
  if [ "$run" -gt $((runs - loaded)) ]; then
    load="stress-ng --cpu 1"
    stress-ng --cpu 1 --timeout 0 --quiet &
    stress=$!
  fi
  started=$(date +%s)
  ./scripts/test.sh > "$out/run-$run.log" 2>&1
  status=$?
  seconds=$(( $(date +%s) - started ))
  [ -n "$stress" ] && { kill "$stress" 2>/dev/null; wait "$stress" 2>/dev/null; }
  passed=$(grep -o '[0-9]* passed' "$out/run-$run.log" | awk '{s+=$1} END {print s+0}')
  failed=$(grep -o '[0-9]* failed' "$out/run-$run.log" | awk '{s+=$1} END {print s+0}')
  failing=$(grep -E '^test .* \.\.\. FAILED$' "$out/run-$run.log" | sed 's/^test \(.*\) \.\.\. FAILED$/\1/' | tr '\n' ' ')
  line="run $run, load: $load, ${seconds}s, exit $status, $passed passed, $failed failed${failing:+: $failing}"
  echo "$line" | tee -a "$out/summary.txt"
  [ "$status" -ne 0 ] && failed_runs=$((failed_runs + 1))
done
echo "$failed_runs of $runs runs failed" | tee -a "$out/summary.txt"
[ "$failed_runs" -eq 0 ]
