#!/usr/bin/env bash
# cdcd's Python packages into a venv. Usage: scripts/install-python.sh VENV [locked|latest]
#   locked (make install): exactly the versions and hashes in requirements.lock, nothing else resolved; then cdcd
#     itself, editable, built with the lock's setuptools (no build isolation: that would fetch an unpinned one).
#   latest (make test-latest): the newest versions pyproject.toml's ranges allow, then what differs from the lock.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:?usage: scripts/install-python.sh VENV [locked|latest]}"
MODE="${2:-locked}"
# setuptools tells every editable install that it is one, in a boxed notice: cdcd is installed editable on purpose.
export PYTHONWARNINGS="ignore:Editable installation"
PIP=("$VENV/bin/pip" --quiet --disable-pip-version-check --no-input)
case "$MODE" in
    locked)
        "${PIP[@]}" install --require-hashes --no-deps -r requirements.lock
        "${PIP[@]}" install --no-deps --no-build-isolation -e .
        "${PIP[@]}" check
        ;;
    latest)
        "${PIP[@]}" install --upgrade --upgrade-strategy eager 'setuptools>=77' wheel
        "${PIP[@]}" install --upgrade --upgrade-strategy eager --no-build-isolation -e '.[dev]'
        "$VENV/bin/pip" --disable-pip-version-check freeze --exclude-editable | sort > "$VENV/latest-versions.txt"
        grep -E '^[A-Za-z0-9._-]+==' requirements.lock | sed -E 's/ .*//; s/ *\\$//' | sort -u > "$VENV/locked-versions.txt"
        echo "install-python: newer than requirements.lock (lock -> latest):"
        # Names compared case- and separator-insensitively, as pip does.
        norm() { tr 'A-Z_.' 'a-z--' | sed -E 's/==/ /'; }
        join <(norm < "$VENV/locked-versions.txt" | sort -k1,1) <(norm < "$VENV/latest-versions.txt" | sort -k1,1) \
            | awk '$2 != $3 { printf "  %s %s -> %s\n", $1, $2, $3; n++ } END { if (!n) print "  (nothing)" }'
        ;;
    *)
        echo "install-python: unknown mode '$MODE' (locked or latest)" >&2
        exit 2
        ;;
esac
