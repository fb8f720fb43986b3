#!/usr/bin/env bash
# Fief's HTTP API beside a minimal hyper server, both driven by wrk on this
# machine in the same run (issue 17: "HTTP call, loopback, 32 connections,
# with an external load generator: ≥ 0.8× a minimal hyper server that answers
# the same request with a fixed body"). Prints requests/s for each, the
# ratio and the load average; docs/benchmarks.md records the runs.
#
#   ./scripts/bench-http.sh            # 32 connections, 64 keys, 10 s each
#   CONNS=64 DURATION=20s ./scripts/bench-http.sh
#
# Builds the release `fief` binary, the counter example and the
# `hyper_fixed` example of fief-benches; installs wrk (Debian package, with
# sudo when not root) if it is missing. Ports 18080/18081 must be free.
set -euo pipefail
cd "$(dirname "$0")/.."

CONNS=${CONNS:-32}
KEYS=${KEYS:-64}
DURATION=${DURATION:-10s}
THREADS=${THREADS:-2}
FIEF_ADDR=127.0.0.1:18080
HYPER_ADDR=127.0.0.1:18081

if ! command -v wrk >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y wrk >/dev/null
  elif command -v sudo >/dev/null 2>&1; then sudo apt-get install -y wrk >/dev/null
  else echo "bench-http: wrk is missing: run 'apt-get install wrk' as root" >&2; exit 1
  fi
fi

cargo build --release -q -p fief
cargo build --release -q --target wasm32-wasip2 -p counter
cargo build --release -q -p fief-benches --example hyper_fixed

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# Each wrk thread walks the keys round robin: every request is a call to
# `counter`'s `incr` on one of KEYS live keys (the hyper server answers the
# same request with a fixed body).
cat > "$work/call.lua" <<LUA
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/v1/keys/counter/k" .. (n % $KEYS) .. "/call", nil, "incr")
end
LUA

wait_port() {
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/${1%:*}/${1#*:}") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "bench-http: nothing listens on $1" >&2
  return 1
}

# wrk's requests/s for one server: a 2 s warm-up (every key live), then the run.
measure() {
  wrk -t"$THREADS" -c"$CONNS" -d2s -s "$work/call.lua" "http://$1" >/dev/null
  wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" --latency -s "$work/call.lua" "http://$1" > "$work/$2.txt"
  awk '/Requests\/sec/ {print $2}' "$work/$2.txt"
}

target/release/examples/hyper_fixed "$HYPER_ADDR" > "$work/hyper.log" 2>&1 &
pids+=($!)
wait_port "$HYPER_ADDR"
hyper=$(measure "$HYPER_ADDR" hyper)
kill "${pids[-1]}"; wait "${pids[-1]}" 2>/dev/null || true

target/release/fief node --listen "$FIEF_ADDR" --no-compile-cache \
  --deploy counter=target/wasm32-wasip2/release/counter.wasm > "$work/fief.log" 2>&1 &
pids+=($!)
wait_port "$FIEF_ADDR"
# The node takes its partitions after its first renewal: wait for a call.
for _ in $(seq 1 100); do
  target/release/fief call --node "http://$FIEF_ADDR" counter k0 get >/dev/null 2>&1 && break
  sleep 0.1
done
fief=$(measure "$FIEF_ADDR" fief)

echo "wrk -t$THREADS -c$CONNS -d$DURATION, $KEYS keys; load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf '  %-12s %12s req/s   p50 %s  p99 %s\n' hyper "$hyper" \
  "$(awk '$1=="50%" {print $2}' "$work/hyper.txt")" "$(awk '$1=="99%" {print $2}' "$work/hyper.txt")"
printf '  %-12s %12s req/s   p50 %s  p99 %s\n' fief "$fief" \
  "$(awk '$1=="50%" {print $2}' "$work/fief.txt")" "$(awk '$1=="99%" {print $2}' "$work/fief.txt")"
awk -v f="$fief" -v h="$hyper" 'BEGIN { printf "  ratio        %11.2fx (target >= 0.8x)\n", f / h }'
if grep -q '^  Non-2xx' "$work/fief.txt"; then
  echo "bench-http: some of Fief's answers were not 2xx:" >&2
  grep -A1 'Non-2xx\|Socket errors' "$work/fief.txt" >&2
  exit 1
fi
