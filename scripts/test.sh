#!/usr/bin/env bash
# Run the whole test suite: unit tests, doctests, integration and failure
# tests (the tests package builds the guest components from source).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-wasip2 >/dev/null 2>&1 || true
cargo test "$@"
