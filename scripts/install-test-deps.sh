#!/usr/bin/env bash
# Install what the test suite needs, or stop at once saying what to run.
# `./scripts/test.sh` runs this first; so does CI (through test.sh).
#
#   - the `wasm32-wasip2` rustup target (the guests are built from source);
#   - componentize-py and componentize-js at their pinned versions
#     (scripts/install-guest-toolchains.sh; needs Python 3.11+ with venv and
#     Node 20+, which this script checks but does not install);
#   - Schemathesis at its pinned version, in a venv under .test-tools/
#     (scripts/install-test-tools.sh; tests/all/schemathesis.rs runs it
#     against a live node);
#   - Debian packages: `chromium` and `chromium-driver` (the dashboard's browser
#     test, tests/all/dashboard.rs: /usr/bin/chromium, chromedriver on PATH),
#     `postgresql` (a server on 127.0.0.1:5432, user postgres, trust auth, for
#     the arbiter's tests; and the server binaries initdb and pg_ctl, with
#     which tests/all/chaos.rs runs a server of its own), `stress-ng` (a test
#     loads the CPUs with it), `etcd-server` (/usr/bin/etcd: the etcd
#     arbiter's tests, tests/all/arbiter_etcd.rs, run real etcd clusters of
#     their own on free ports; the package also starts a system etcd on
#     2379/2380, which the tests never use).
#
# Idempotent, and quick when everything is present: it only checks. It runs
# `apt-get update` only when a package must be installed. apt needs root: it
# uses sudo when not root, and without either it prints the command to run
# and exits 1 before changing anything.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "install-test-deps: $*"; }
die() { echo "install-test-deps: $*" >&2; exit 1; }

# --- what is missing -------------------------------------------------------

rustup_target_missing=false
if ! command -v rustup >/dev/null 2>&1; then
  die "rustup is not on PATH: install Rust with rustup (https://rustup.rs), then rerun"
fi
rustup target list --installed | grep -qx wasm32-wasip2 || rustup_target_missing=true

# Guest toolchains: the interpreters are prerequisites, not installed here
# (Debian 12's nodejs is 18, too old; install Node 20+ from nodejs.org or
# NodeSource).
python_ok() { python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
node_ok() { node -e 'process.exit(+process.versions.node.split(".")[0] < 20 ? 1 : 0)' 2>/dev/null; }
python_ok || die "the Python and JavaScript guests need Python 3.11+ as python3 (found: $(python3 --version 2>&1 || echo none))"
node_ok || die "the JavaScript guests need Node 20+ with npm as node (found: $(node --version 2>&1 || echo none))"
command -v npm >/dev/null 2>&1 || die "the JavaScript guests need npm (with Node 20+)"

packages=()
# `python3 -m venv` needs ensurepip, which Debian ships in python3-venv.
python3 -c 'import ensurepip' 2>/dev/null || packages+=(python3-venv)
[ -x /usr/bin/chromium ] || packages+=(chromium)
command -v chromedriver >/dev/null 2>&1 || packages+=(chromium-driver)
command -v stress-ng >/dev/null 2>&1 || packages+=(stress-ng)
[ -x /usr/bin/etcd ] || packages+=(etcd-server)
pg_server_bin() {
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
    || { command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; }
}
pg_ok() { psql -h 127.0.0.1 -p 5432 -U postgres -w -tAc 'select 1' >/dev/null 2>&1; }
pg_listening() { pg_isready -h 127.0.0.1 -p 5432 -q >/dev/null 2>&1; }
postgres_installed_now=false
if ! pg_server_bin || ! command -v psql >/dev/null 2>&1 || ! command -v pg_ctlcluster >/dev/null 2>&1; then
  # Unless a server answers already (then only the binaries are missing),
  # this is a fresh install, whose cluster is configured below.
  pg_ok || postgres_installed_now=true
  packages+=(postgresql)
fi

# --- root for apt ----------------------------------------------------------

if [ "$(id -u)" = 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo)
else
  as_root=(none)
fi
root_cmd() {
  [ "${as_root[0]:-}" = none ] && return 1
  "${as_root[@]}" "$@"
}

# --- install ---------------------------------------------------------------

# Before changing anything: stop if apt is needed and cannot run.
if [ ${#packages[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 \
    || die "missing: ${packages[*]} (Debian package names); this is not a Debian-like system, install their equivalents, then rerun"
  if [ "${as_root[0]:-}" = none ]; then
    die "missing Debian packages: ${packages[*]}. Run, as root (or with sudo):
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y ${packages[*]}
then rerun."
  fi
fi

if $rustup_target_missing; then
  say "adding the rustup target wasm32-wasip2"
  rustup target add wasm32-wasip2
fi

if [ ${#packages[@]} -gt 0 ]; then
  say "installing ${packages[*]} (apt-get)"
  root_cmd apt-get update -qq
  root_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
  [ -x /usr/bin/chromium ] || die "/usr/bin/chromium is still missing after installing chromium"
  command -v chromedriver >/dev/null 2>&1 || die "chromedriver is still not on PATH after installing chromium-driver"
  command -v stress-ng >/dev/null 2>&1 || die "stress-ng is still not on PATH after installing it"
  [ -x /usr/bin/etcd ] || die "/usr/bin/etcd is still missing after installing etcd-server"
  pg_server_bin || die "initdb and pg_ctl are still missing after installing postgresql"
fi

# --- PostgreSQL on 127.0.0.1:5432, user postgres, trust auth ---------------

# The Debian cluster on port 5432 ("<version> <name>"), if there is one.
cluster="$(pg_lsclusters -h 2>/dev/null | awk '$3 == 5432 { print $1, $2; exit }' || true)"
hba=""
if [ -n "$cluster" ]; then
  read -r version name <<<"$cluster"
  hba="/etc/postgresql/$version/$name/pg_hba.conf"
fi
trust_lines='local all all trust
host all all 127.0.0.1/32 trust
host all all ::1/128 trust'
wait_for_pg() { for _ in $(seq 1 30); do pg_ok && return 0; sleep 1; done; return 1; }

if $postgres_installed_now && [ -n "$cluster" ]; then
  # The cluster the package just made: trust local connections, as the tests
  # expect (user postgres, no password). An existing server's authentication
  # is left alone (see the message below).
  say "configuring trust authentication in $hba"
  root_cmd sed -i 's/^\(local\|host\).*/# &/' "$hba"
  printf '# scripts/install-test-deps.sh: trust, for the tests\n%s\n' "$trust_lines" \
    | root_cmd tee -a "$hba" >/dev/null
  root_cmd pg_ctlcluster --skip-systemctl-redirect "$version" "$name" reload 2>/dev/null || true
  pg_listening && wait_for_pg || true
fi

if ! pg_ok && ! pg_listening && [ -n "$cluster" ]; then
  start=(pg_ctlcluster --skip-systemctl-redirect "$version" "$name" start)
  if [ "${as_root[0]:-}" = none ]; then
    die "PostgreSQL is stopped. Run, as root: ${start[*]}
then rerun."
  fi
  say "starting PostgreSQL: ${start[*]}"
  root_cmd "${start[@]}"
  wait_for_pg || true
fi

if ! pg_ok; then
  if pg_listening; then
    if [ -n "$hba" ]; then
      fix="sed -i '1i ${trust_lines//$'\n'/\\n}' $hba && pg_ctlcluster --skip-systemctl-redirect $cluster reload"
    else
      fix="add these lines first in the server's pg_hba.conf, then reload it:
$trust_lines"
    fi
    die "PostgreSQL answers on 127.0.0.1:5432 but not to user postgres without a password; the tests need trust auth. Run, as root:
    $fix
then rerun."
  elif [ -n "$cluster" ]; then
    die "PostgreSQL did not come up on 127.0.0.1:5432; see /var/log/postgresql/postgresql-${cluster// /-}.log"
  else
    die "no PostgreSQL server on 127.0.0.1:5432 and no Debian cluster on that port: run one there (user postgres, trust auth), e.g. with apt-get install postgresql"
  fi
fi

# --- guest toolchains (Python and JavaScript key modules) -----------------

./scripts/install-guest-toolchains.sh

# --- test tools (Schemathesis, from PyPI) -----------------------------------

./scripts/install-test-tools.sh

say "ok: wasm32-wasip2, guest toolchains, schemathesis, chromium $(/usr/bin/chromium --version 2>/dev/null | awk '{print $2}'), chromedriver, stress-ng, etcd $(/usr/bin/etcd --version 2>/dev/null | awk 'NR == 1 {print $3}'), PostgreSQL on 127.0.0.1:5432"
