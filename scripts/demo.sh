#!/usr/bin/env bash
# Run the main job: build the counter example and the `fief` binary, then start
# a node with the embedded arbiter and the counter module deployed.
# Stop it with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-wasip2 >/dev/null 2>&1 || true
cargo build --release --target wasm32-wasip2 -p counter
cargo build --release -p fief
exec target/release/fief node --deploy counter=target/wasm32-wasip2/release/counter.wasm "$@"
