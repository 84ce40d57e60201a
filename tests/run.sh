#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs every test.
#
#   etcd      Debian's etcd-server (the registry tests and the end-to-end tests start their own
#             etcd on free loopback ports)
#   protoc    Debian's protobuf-compiler (etcd-client's and our own .proto code generation)
#
# Then: formatting, clippy with warnings as errors, every unit/integration/end-to-end test
# (cargo-nextest) and the doc tests.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "installing ${need[*]} (apt-get)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo nextest run --workspace --locked --no-fail-fast
cargo test --workspace --doc --locked
