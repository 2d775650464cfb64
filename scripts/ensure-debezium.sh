#!/usr/bin/env bash
# Debezium Server (its PostgreSQL connector and Kafka sink) for `make bench-kafka`, the side-by-side
# benchmark against cdcd: the distribution tar.gz resolved from Maven Central with Maven and unpacked
# once into var/debezium/debezium-server (the Cassandra connectors, which the benchmark never
# loads, are left out). Later runs need no network.
# 2.7 is the newest line whose distribution is published there as a tar.gz (3.x is not).
set -euo pipefail
# shellcheck source=scripts/mvn-quiet.sh
source "$(dirname "${BASH_SOURCE[0]}")/mvn-quiet.sh"
cd "$(dirname "$0")/.."
VERSION=2.7.3.Final
DIR=var/debezium
STAMP=$DIR/.stamp-$VERSION
if [ -f "$STAMP" ] && [ -x "$DIR/debezium-server/run.sh" ]; then
    exit 0
fi
bash scripts/ensure-java.sh
if ! command -v mvn >/dev/null 2>&1; then
    echo "ensure-debezium: Maven not found, installing it" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq maven
fi
echo "ensure-debezium: resolving io.debezium:debezium-server-dist:$VERSION (tar.gz) into $DIR" >&2
rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp"
mvn_quiet dependency:copy -Dartifact="io.debezium:debezium-server-dist:$VERSION:tar.gz" \
    -DoutputDirectory="$PWD/$DIR.tmp"
tar -xzf "$DIR.tmp/debezium-server-dist-$VERSION.tar.gz" -C "$DIR.tmp" --exclude='debezium-server/connectors/*'
rm -f "$DIR.tmp/debezium-server-dist-$VERSION.tar.gz"
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
touch "$STAMP"
