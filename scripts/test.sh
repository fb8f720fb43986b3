#!/usr/bin/env bash
# Run the whole test suite: unit tests, doctests, integration and failure
# tests (the tests package builds the guest components from source, and the
# `fief` binary the CLI and multi-process tests run, in the same build).
set -euo pipefail
cd "$(dirname "$0")/.."
# What the tests need: the wasm32-wasip2 target, the Python and JavaScript
# guest toolchains, Chromium and chromedriver, PostgreSQL on 127.0.0.1:5432,
# stress-ng. Installs what is missing (apt needs root or sudo), or stops
# saying what to run; quick when everything is present.
./scripts/install-test-deps.sh
cargo test "$@"
