#!/usr/bin/env bash
# Kafka Connect standalone and Debezium's own JDBC sink connector, for the test that proves cdcd's
# topics are what Debezium's consumers expect (tests/test_kafka_debezium_jdbc.py):
#   - Kafka Connect (connect-runtime, connect-json; scripts/kafka/connect-pom.xml), the broker's
#     Kafka version, resolved from Maven Central with Maven into var/kafka/connect-libs;
#   - io.debezium:debezium-connector-jdbc (its plugin tar.gz, which bundles its dependencies and the
#     PostgreSQL JDBC driver) into var/kafka/connect-plugins/debezium-connector-jdbc; the drivers of
#     other databases, which the test never loads, are left out.
# Once; later runs need no network. Run by `make install` and by the test's fixture.
set -euo pipefail
# shellcheck source=scripts/mvn-quiet.sh
source "$(dirname "${BASH_SOURCE[0]}")/mvn-quiet.sh"
cd "$(dirname "$0")/.."
JDBC_VERSION=3.6.0.Final
LIBS=var/kafka/connect-libs
PLUGINS=var/kafka/connect-plugins
POM=scripts/kafka/connect-pom.xml
STAMP=$PLUGINS/.stamp-$JDBC_VERSION
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$POM" ] && [ -d "$LIBS" ]; then
    exit 0
fi
bash scripts/ensure-java.sh
if ! command -v mvn >/dev/null 2>&1; then
    echo "ensure-kafka-connect: Maven not found, installing it" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq maven
fi
echo "ensure-kafka-connect: resolving Kafka Connect into $LIBS, debezium-connector-jdbc $JDBC_VERSION into $PLUGINS" >&2
rm -rf "$LIBS.tmp" "$PLUGINS.tmp"
mvn_quiet -f "$POM" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$PWD/$LIBS.tmp"
mkdir -p "$PLUGINS.tmp"
mvn_quiet dependency:copy -Dartifact="io.debezium:debezium-connector-jdbc:$JDBC_VERSION:tar.gz:plugin" \
    -DoutputDirectory="$PWD/$PLUGINS.tmp"
tar -xzf "$PLUGINS.tmp/debezium-connector-jdbc-$JDBC_VERSION-plugin.tar.gz" -C "$PLUGINS.tmp" \
    --exclude='*/ojdbc*.jar' --exclude='*/mssql-jdbc-*.jar' --exclude='*/mysql-connector-*.jar' \
    --exclude='*/mariadb-java-client-*.jar'
rm -f "$PLUGINS.tmp/debezium-connector-jdbc-$JDBC_VERSION-plugin.tar.gz"
rm -rf "$LIBS" "$PLUGINS"
mv "$LIBS.tmp" "$LIBS"
mv "$PLUGINS.tmp" "$PLUGINS"
touch "$STAMP"
