#!/usr/bin/env bash
# The `cdcd top` tests drive the live view in a tmux pane (send-keys, capture-pane): install Debian's
# tmux when it is missing. Idempotent; exits non-zero if it cannot.
set -uo pipefail
if command -v tmux >/dev/null 2>&1; then
    exit 0
fi
echo "ensure-tmux: installing tmux (for the cdcd top tests)" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq || true
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends tmux || {
    echo "ensure-tmux: could not install tmux" >&2
    exit 1
}
command -v tmux >/dev/null 2>&1
