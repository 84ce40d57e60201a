#!/usr/bin/env bash
# Soak: `switchyard up` (gateway + 4 simulated workers) under mixed load — streamed and plain
# chats, one stream in ten abandoned by its client, multi-turn sessions — for SOAK_SECS seconds
# (default 1800 = 30 min), sampling the process's RSS and open fds (/proc) and the gateway's
# in-flight gauge. It fails on a lost request, a 5xx, memory that keeps growing after the
# warm-up, descriptors that do not come back to the baseline, or in-flight requests left over.
# See tests/soak.rs for the exact bounds and docs/BENCHMARKS.md for measured figures.
#
#   bash tests/soak.sh                 # 30 min
#   SOAK_SECS=180 bash tests/soak.sh   # the test command's 3-min run
#   SOAK_CLIENTS=16 bash tests/soak.sh # more load (default 8 clients)
#
# Run with cargo test, not nextest: the test outlives nextest's slow-test limit on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
export SOAK_SECS="${SOAK_SECS:-1800}"
cargo test --locked -p switchyard --test soak -- --ignored --nocapture
