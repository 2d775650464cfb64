#!/usr/bin/env bash
# cdcd has two C modules (cdcd/lake/landing/_rows.c, cdcd/wal/_entries.c), built by `pip install`: it needs a C compiler and the
# headers of the Python that builds the venv. Install Debian's gcc and python3-dev when missing.
set -euo pipefail
PYTHON="${1:-python3}"
has_headers() {
    "$PYTHON" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}
if command -v cc >/dev/null 2>&1 && has_headers; then
    exit 0
fi
echo "ensure-cc: no C compiler or no Python.h for $PYTHON, installing gcc and python3-dev" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc libc6-dev python3-dev
if ! has_headers; then
    echo "ensure-cc: $PYTHON still has no Python.h (a Python not from Debian: install its headers)" >&2
    exit 1
fi
