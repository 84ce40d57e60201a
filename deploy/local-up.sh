#!/usr/bin/env bash
# Runs `switchyard up` from source on a fresh Debian machine: installs what the build needs
# (deploy/build-deps.sh: protoc and the well-known .proto files) when missing, builds the release
# binary, and starts the gateway, an in-memory registry and simulated workers. Extra arguments go
# to `switchyard up` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/build-deps.sh build
exec cargo run --release --locked -p switchyard -- up "$@"
