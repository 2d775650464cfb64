#!/usr/bin/env bash
# The S3-compatible server for the object-store tests and `make run-cluster`: MinIO, built from source
# with Go's own module tooling (the Go module proxy serves it; no binary downloads) into the venv.
# The version is pinned; a second run with the binary in place does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
MINIO_MODULE="github.com/minio/minio"
MINIO_VERSION="v0.0.0-20260212201848-7aac2a2c5b7c"
BIN_DIR="${VENV:-.venv}/bin"
STAMP="$BIN_DIR/.minio-$MINIO_VERSION"

mkdir -p "$BIN_DIR"
# CI starts a build early in the background; `make install` then waits for it here instead of
# building twice.
exec 9>"$BIN_DIR/.minio-build.lock"
flock 9
if [ -x "$BIN_DIR/minio" ] && [ -e "$STAMP" ]; then
    exit 0
fi
GO="$(command -v go || true)"
[ -n "$GO" ] || { [ -x /usr/local/go/bin/go ] && GO=/usr/local/go/bin/go; }
if [ -z "$GO" ]; then
    echo "ensure-minio: no Go toolchain found (need go >= 1.21 on PATH or in /usr/local/go)" >&2
    exit 1
fi
echo "ensure-minio: building $MINIO_MODULE@$MINIO_VERSION (a few minutes, once)" >&2
# GOTOOLCHAIN=auto fetches the Go release MinIO's go.mod asks for through the same module proxy.
GOBIN="$(cd "$BIN_DIR" && pwd)" GOTOOLCHAIN=auto GOFLAGS="-trimpath" CGO_ENABLED=0 \
    "$GO" install "$MINIO_MODULE@$MINIO_VERSION"
rm -f "$BIN_DIR"/.minio-*
touch "$STAMP"
