#!/usr/bin/env bash
# Install the Python and JavaScript guest toolchains at the versions pinned in
# scripts/guest-toolchains/ (componentize-py from PyPI into a venv,
# @bytecodealliance/componentize-js from npm with its lockfile), under
# .guest-toolchains/ (or $FIEF_GUEST_TOOLCHAINS). Idempotent: when the
# installed pins match, it only checks and returns.
#
# Needs python3 (3.11+, with venv) and node/npm (20+). The tests' build script
# runs scripts/build-guest.sh, which refuses to build without these.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
pins="$root/scripts/guest-toolchains"
dir="${FIEF_GUEST_TOOLCHAINS:-$root/.guest-toolchains}"
mkdir -p "$dir"

stamp_of() { cat "$pins/$1" | sha256sum | cut -d' ' -f1; }

# Python: componentize-py in a venv.
py_stamp="$(stamp_of requirements.txt)"
if [ "$(cat "$dir/py.stamp" 2>/dev/null)" != "$py_stamp" ] || ! "$dir/py/bin/componentize-py" --version >/dev/null 2>&1; then
  echo "installing $(cat "$pins/requirements.txt") into $dir/py"
  rm -rf "$dir/py" "$dir/py.stamp"
  python3 -m venv "$dir/py"
  "$dir/py/bin/pip" install --quiet --disable-pip-version-check -r "$pins/requirements.txt"
  echo "$py_stamp" > "$dir/py.stamp"
fi

# JavaScript: componentize-js (and what it depends on) from the lockfile.
js_stamp="$(cat "$pins/package.json" "$pins/package-lock.json" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$dir/js.stamp" 2>/dev/null)" != "$js_stamp" ] || [ ! -x "$dir/js/node_modules/.bin/componentize-js" ]; then
  echo "installing @bytecodealliance/componentize-js (scripts/guest-toolchains/package-lock.json) into $dir/js"
  rm -rf "$dir/js" "$dir/js.stamp"
  mkdir -p "$dir/js"
  cp "$pins/package.json" "$pins/package-lock.json" "$dir/js/"
  (cd "$dir/js" && npm ci --no-audit --no-fund --loglevel=error)
  echo "$js_stamp" > "$dir/js.stamp"
fi

echo "guest toolchains: $("$dir/py/bin/componentize-py" --version), componentize-js $(node -p "require('$dir/js/node_modules/@bytecodealliance/componentize-js/package.json').version")"
