#!/usr/bin/env bash
# The metrics tests run `promtool check metrics` on scrapes of a node and a daemon and
# `promtool check rules` on config/prometheus-alerts.yml: install Debian's prometheus package
# (it ships promtool) when promtool is missing. Idempotent; exits non-zero if it cannot.
set -uo pipefail
if command -v promtool >/dev/null 2>&1; then
    exit 0
fi
echo "ensure-promtool: installing prometheus (for promtool)" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq || true
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus || {
    echo "ensure-promtool: could not install prometheus" >&2
    exit 1
}
command -v promtool >/dev/null 2>&1
