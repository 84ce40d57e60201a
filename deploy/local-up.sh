#!/usr/bin/env bash
# Runs `switchyard up` from source on a fresh Debian machine: installs protoc (needed to build)
# when missing, builds the release binary, and starts the gateway, an in-memory registry and
# simulated workers. Extra arguments go to `switchyard up` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v protoc >/dev/null 2>&1; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "installing protobuf-compiler (apt-get)" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends protobuf-compiler
fi
exec cargo run --release --locked -p switchyard -- up "$@"
