#!/usr/bin/env bash
# The Apache Kafka broker the Kafka tests and benchmarks run (scripts/kafka.sh): its jars, resolved
# from Maven Central with Maven (scripts/kafka/pom.xml lists them), copied once into var/kafka/libs;
# and Spark's Kafka source (scripts/kafka/spark-pom.xml) into var/kafka/spark-jars for the Spark reader test.
# Later runs need no network. Installs Maven from Debian when it is missing.
set -euo pipefail
# shellcheck source=scripts/mvn-quiet.sh
source "$(dirname "${BASH_SOURCE[0]}")/mvn-quiet.sh"
cd "$(dirname "$0")/.."
LIBS=var/kafka/libs
SPARK_JARS=var/kafka/spark-jars
POM=scripts/kafka/pom.xml
SPARK_POM=scripts/kafka/spark-pom.xml
STAMP=$LIBS/.stamp
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$POM" ] && [ "$STAMP" -nt "$SPARK_POM" ] && [ -d "$SPARK_JARS" ]; then
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
mvn_quiet -f "$POM" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$PWD/$LIBS.tmp"
# Spark's Kafka source: only its own jars (pyspark has Spark, Scala and Hadoop)
rm -rf "$SPARK_JARS.tmp"
mvn_quiet -f "$SPARK_POM" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$PWD/$SPARK_JARS.tmp" \
    -DincludeArtifactIds=spark-sql-kafka-0-10_2.13,spark-token-provider-kafka-0-10_2.13,kafka-clients,commons-pool2
rm -rf "$LIBS" "$SPARK_JARS"
mv "$LIBS.tmp" "$LIBS"
mv "$SPARK_JARS.tmp" "$SPARK_JARS"
touch "$STAMP"
