"""Load truth across gateway replicas (issue 17 item 1): the same simulated workers and the same
live workload, sent through G = 1, 2 and 4 replicas round robin (as a Service spreads
connections), compared on TTFT p99 and cache hit rate. Each G gets a fresh `switchyard up
--gateways 4` (same seeds, cold caches) so only the number of replicas the client uses differs.
Figures in docs/BENCHMARKS.md.

Usage: python3 tests/python/fleet_spread.py [--workers 8] [--speedup 10] [--speed 4]
       [--limit 300] [--rounds 1] [--replicas 1,2,4] [--binary target/debug/switchyard]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


def start_up(binary: str, workers: int, speedup: float) -> tuple[subprocess.Popen, list[str]]:
    up = subprocess.Popen(
        [binary, "up", "--workers", str(workers), "--gateways", "4", "--speedup", str(speedup),
         "--http", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in up.stdout:
        try:
            ready = json.loads(line)
        except ValueError:
            continue
        if ready.get("event") == "ready":
            return up, ready["gateways"]
    up.kill()
    sys.exit("switchyard up ended before its ready line")


def replay(binary: str, urls: list[str], args, out: str, name: str) -> dict:
    command = [binary, "replay", "mooncake", "--speed", str(args.speed), "--limit",
               str(args.limit), "--endpoint", urls[0], "--out", out, "--name", name]
    if len(urls) > 1:
        command += ["--spread-over", ",".join(urls[1:])]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, f"{name}.json")) as report:
        return json.load(report)["runs"][0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--speed", type=float, default=4.0)
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--binary", default="target/debug/switchyard")
    args = parser.parse_args()
    counts = [int(g) for g in args.replicas.split(",")]
    print("round,replicas,completed,failed,ttft_p50_ms,ttft_p99_ms,cache_hit_rate,load1")
    with tempfile.TemporaryDirectory() as out:
        for round_ in range(args.rounds):
            for g in counts:
                up, gateways = start_up(args.binary, args.workers, args.speedup)
                try:
                    run = replay(args.binary, gateways[:g], args, out, f"g{g}-{round_}")
                finally:
                    up.terminate()
                    up.wait(timeout=60)
                load1 = os.getloadavg()[0]
                ttft = run["ttft_ms"]
                print(f"{round_},{g},{run['requests_completed']},{run['requests_failed']},"
                      f"{ttft['p50']:.1f},{ttft['p99']:.1f},{run['cache_hit_rate']:.4f},"
                      f"{load1:.1f}", flush=True)


if __name__ == "__main__":
    main()
