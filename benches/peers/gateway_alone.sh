#!/usr/bin/env bash
# Switchyard's gateway alone, beside the SGLang router: etcd, two `switchyard worker` processes
# and `switchyard gateway`, each its own process with a pid file in its own RUN_DIR, so the
# peers' overhead.sh reports each process's CPU (compare.sh overhead runs `switchyard up`, one
# process, whose figure includes the simulated workers); then the SGLang router's probes again.
# Usage (from the repo root, peers installed): flock /tmp/peers.lock benches/peers/gateway_alone.sh
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
P=${PEERS:-$HERE/../../../shared/peers}
. "$P/env.sh"
SY_BIN=${SY_BIN:-$HERE/../../target/release/switchyard}
GW_ARGS=${GW_ARGS:-}
export RUN_DIR=/tmp/sysplit; rm -rf $RUN_DIR; mkdir -p $RUN_DIR
E=127.0.0.1:23379
start_bg etcd etcd --data-dir $RUN_DIR/etcd --listen-client-urls http://$E --advertise-client-urls http://$E \
  --listen-peer-urls http://127.0.0.1:23380 --initial-advertise-peer-urls http://127.0.0.1:23380 \
  --initial-cluster default=http://127.0.0.1:23380
sleep 2
export SWITCHYARD_LOG=warn
for i in 1 2; do
  start_bg worker$i "$SY_BIN" worker --etcd http://$E --cluster split --id w$i --listen 127.0.0.1:2460$i \
    --metrics-listen 127.0.0.1:2470$i --model "$MODEL_NAME" --block-size 64 --kv-blocks 16384 --speedup 10000
done
start_bg gateway "$SY_BIN" gateway --etcd http://$E --cluster split --http 127.0.0.1:8100 --tokenizer "$MODEL_DIR" \
  --policy kv --max-concurrent-requests 4096 --max-queued-requests 65536 $GW_ARGS
wait_http "http://127.0.0.1:8100/v1/models" 90 "$MODEL_NAME"
sleep 3
U=http://127.0.0.1:8100
"$P/overhead.sh" sysplit_short "$U" 32 15
STREAM=1 "$P/overhead.sh" sysplit_stream "$U" 32 15
PROMPT_WORDS=1500 "$P/overhead.sh" sysplit_3ktok "$U" 32 15
for f in gateway worker1 worker2 etcd; do kill $(cat $RUN_DIR/$f.pid) 2>/dev/null; done
sleep 2
export RUN_DIR=$PEERS_DIR/run
"$P/sglang_down.sh" >/dev/null 2>&1; NUM_BACKENDS=2 POLICY=cache_aware "$P/sglang_up.sh" >/dev/null
"$P/overhead.sh" sgl_ca_short http://127.0.0.1:$SGL_ROUTER_PORT 32 15
PROMPT_WORDS=1500 "$P/overhead.sh" sgl_ca_3ktok http://127.0.0.1:$SGL_ROUTER_PORT 32 15
"$P/sglang_down.sh" >/dev/null 2>&1; "$P/infra_down.sh" >/dev/null 2>&1
echo SPLIT_DONE
