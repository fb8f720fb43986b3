#!/usr/bin/env bash
# Run the main job: build the counter examples and the `fief` binary, then
# start a node with the embedded arbiter and two modules deployed:
# `counter` (its count in memory, gone with its process) and `stored`
# (examples/stored-counter, its count in durable storage, kept in the
# embedded store under .fief/demo/ across restarts of the node).
# Stop it with Ctrl-C; extra arguments go to `fief node`.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-wasip2 >/dev/null 2>&1 || true
cargo build --release --target wasm32-wasip2 -p counter -p stored-counter
cargo build --release -p fief
wasm=target/wasm32-wasip2/release
exec target/release/fief node --data-dir "${FIEF_DATA_DIR:-.fief/demo}" \
    --deploy counter="$wasm/counter.wasm" \
    --deploy stored="$wasm/stored_counter.wasm" "$@"
