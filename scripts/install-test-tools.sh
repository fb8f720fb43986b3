#!/usr/bin/env bash
# Install the Python tools the test suite runs, at the versions pinned in
# scripts/test-tools/requirements.txt (Schemathesis and its dependencies,
# from PyPI), into a venv under .test-tools/schemathesis (or
# $FIEF_TEST_TOOLS/schemathesis). Idempotent: when the installed pins match,
# it only checks and returns. tests/all/schemathesis.rs runs
# .test-tools/schemathesis/bin/schemathesis and fails, naming this script,
# when it is missing.
#
# Needs python3 (3.9+) with venv; scripts/install-test-deps.sh (which runs
# this) checks for both.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pins="$root/scripts/test-tools/requirements.txt"
dir="${FIEF_TEST_TOOLS:-$root/.test-tools}"
mkdir -p "$dir"

stamp="$(sha256sum < "$pins" | cut -d' ' -f1)"
venv="$dir/schemathesis"
if [ "$(cat "$dir/schemathesis.stamp" 2>/dev/null)" != "$stamp" ] || ! "$venv/bin/schemathesis" --version >/dev/null 2>&1; then
  echo "installing $(grep -i '^schemathesis==' "$pins") (scripts/test-tools/requirements.txt) into $venv"
  rm -rf "$venv" "$dir/schemathesis.stamp"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$pins"
  "$venv/bin/pip" check --disable-pip-version-check >/dev/null
  echo "$stamp" > "$dir/schemathesis.stamp"
fi
echo "test tools: $("$venv/bin/schemathesis" --version)"
