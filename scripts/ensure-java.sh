#!/usr/bin/env bash
# Spark (the lake sink) needs Java 17. Install Debian's headless JRE when no Java 17+ is found.
set -euo pipefail
java_major() {
    java -version 2>&1 | awk -F'"' '/version/ {split($2, v, "."); print (v[1] == "1" ? v[2] : v[1]); exit}'
}
if command -v java >/dev/null 2>&1 && [ "$(java_major)" -ge 17 ] 2>/dev/null; then
    exit 0
fi
echo "ensure-java: no Java 17 found, installing openjdk-17-jre-headless" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openjdk-17-jre-headless
