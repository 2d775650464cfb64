#!/usr/bin/env bash
# The Apache Kafka broker the Kafka tests and benchmarks run (scripts/kafka.sh): its jars, resolved
# from Maven Central with Maven (scripts/kafka/pom.xml lists them), copied once into var/kafka/libs.
# Later runs need no network. Installs Maven from Debian when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
LIBS=var/kafka/libs
POM=scripts/kafka/pom.xml
STAMP=$LIBS/.stamp
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$POM" ]; then
    exit 0
fi
bash scripts/ensure-java.sh
if ! command -v mvn >/dev/null 2>&1; then
    echo "ensure-kafka: Maven not found, installing it" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq maven
fi
echo "ensure-kafka: resolving the Kafka broker jars into $LIBS" >&2
rm -rf "$LIBS.tmp"
mvn -q -B -f "$POM" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$PWD/$LIBS.tmp"
rm -rf "$LIBS"
mv "$LIBS.tmp" "$LIBS"
touch "$STAMP"
