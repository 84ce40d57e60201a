#!/usr/bin/env bash
# Idle fleet cost: `switchyard up --workers N` left idle, the process CPU and the load reports its
# gateway received over a window, with the default heartbeat (1 s with pushes on) against the
# 100 ms interval it had before, alternated twice. Usage: B=target/release/switchyard N=300 benches/fleet/idle_heartbeat.sh
B=${B:-target/debug/switchyard}; N=${N:-300}; WIN=${WIN:-20}
run() { label=$1; shift
  port=$((18500 + RANDOM % 1000))
  $B up --workers $N --http 127.0.0.1:$port "$@" > /tmp/idle_$label.log 2>&1 &
  pid=$!
  for i in $(seq 1 600); do curl -sf http://127.0.0.1:$port/v1/models >/dev/null && break; sleep 0.5; done
  sleep 20
  hz=$(getconf CLK_TCK)
  c0=$(awk '{sub(/^.*\) /,""); print $12+$13}' /proc/$pid/stat); r0=$(curl -s http://127.0.0.1:$port/metrics | awk '/^switchyard_load_reports_total/{print $2}')
  sleep $WIN
  c1=$(awk '{sub(/^.*\) /,""); print $12+$13}' /proc/$pid/stat); r1=$(curl -s http://127.0.0.1:$port/metrics | awk '/^switchyard_load_reports_total/{print $2}')
  echo "$label workers=$N window=${WIN}s cpu=$(echo "scale=2; ($c1-$c0)/$hz" | bc)s reports=$(echo "$r1-$r0" | bc) load=$(cut -d' ' -f1 /proc/loadavg)"
  kill $pid; wait $pid 2>/dev/null
}
run heartbeat-default
run interval-100ms --load-interval-ms 100
run heartbeat-default-2
run interval-100ms-2 --load-interval-ms 100
