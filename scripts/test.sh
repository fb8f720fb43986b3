#!/usr/bin/env bash
# Run the whole test suite: unit tests, doctests, integration and failure
# tests (the tests package builds the guest components from source).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-wasip2 >/dev/null 2>&1 || true
# The Python and JavaScript guests need componentize-py and componentize-js
# (pinned; quick when already installed).
./scripts/install-guest-toolchains.sh
# The CLI and multi-process tests run the `fief` binary from its own target
# directory (a nested cargo there cannot wait on this one's lock). Build it
# first, so the timing-sensitive tests never share the CPUs with that build.
cargo build -p fief --bin fief --target-dir target/cli-tests
cargo test "$@"
