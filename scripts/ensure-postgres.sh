#!/usr/bin/env bash
# make bench-pg (and its smoke test) compares cdcd with PostgreSQL's logical decoding on this
# machine: install Debian's postgresql when its server binaries are missing. Best effort: the
# smoke test skips with the reason if PostgreSQL still cannot be found.
set -uo pipefail
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    exit 0
fi
echo "ensure-postgres: installing postgresql postgresql-contrib" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq || true
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql postgresql-contrib || {
    echo "ensure-postgres: could not install postgresql (bench-pg will be skipped)" >&2
}
exit 0
