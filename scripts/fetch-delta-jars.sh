#!/usr/bin/env bash
# Fetch the Delta Lake jars and Hadoop's s3a ones (hadoop-aws, the AWS SDK bundle) for Spark from Maven Central once, into the venv (<venv>/jars), with the
# Ivy that pyspark ships (checksums verified). Sessions load them from there: no resolution at run time.
# Usage: scripts/fetch-delta-jars.sh [PYTHON]   (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
mapfile -t lines < <("$PY" -m cdcd.lake.spark)
dest="${lines[0]}"
ivy_jar=$(ls "$("$PY" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')"/jars/ivy-*.jar | head -n1)
mkdir -p "$dest"
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
for line in "${lines[@]:1}"; do
    read -r org artifact version <<<"$line"
    target="$dest/${org}_${artifact}-${version}.jar"
    if [ -s "$target" ]; then
        continue
    fi
    echo "fetch-delta-jars: $org:$artifact:$version -> $dest" >&2
    java -jar "$ivy_jar" -dependency "$org" "$artifact" "$version" -notransitive -types jar \
        -cache "$cache" -retrieve "$dest/[organisation]_[artifact]-[revision].[ext]" >"$cache/ivy.log" 2>&1 || {
        cat "$cache/ivy.log" >&2
        echo "fetch-delta-jars: could not fetch $org:$artifact:$version from Maven Central" >&2
        exit 1
    }
    [ -s "$target" ] || { echo "fetch-delta-jars: $target missing after retrieve" >&2; exit 1; }
done
