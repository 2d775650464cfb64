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
        "$VENV/bin/python" - <<'PY'
"""What differs from requirements.lock: the lock's line for this interpreter (its markers evaluated) against what
pip installed."""
import re
from importlib.metadata import distributions

from packaging.markers import Marker
from packaging.utils import canonicalize_name

locked = {}
for line in open("requirements.lock"):
    m = re.match(r"^([A-Za-z0-9._-]+)==([^ ;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$", line.rstrip("\n"))
    if m and (m.group(3) is None or Marker(m.group(3)).evaluate()):
        locked[canonicalize_name(m.group(1))] = m.group(2)
installed = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}
changed = sorted((n, v, installed[n]) for n, v in locked.items() if n in installed and installed[n] != v)
added = sorted(set(installed) - set(locked) - {"cdcd", "pip"})
print("install-python: against requirements.lock:")
for n, old, new in changed:
    print(f"  {n} {old} -> {new}")
for n in added:
    print(f"  {n} {installed[n]} (not in the lock)")
if not changed and not added:
    print("  the same versions")
PY
        ;;
    *)
        echo "install-python: unknown mode '$MODE' (locked or latest)" >&2
        exit 2
        ;;
esac
