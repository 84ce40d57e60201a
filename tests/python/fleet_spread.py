"""Load truth across gateway replicas (issue 17 item 1): the same simulated workers and the same
live workload, sent through G = 1, 2 and 4 replicas round robin (as a Service spreads
connections), compared on TTFT p99 and cache hit rate. Each G gets a fresh `switchyard up
--gateways 4` (same seeds, cold caches) so only the number of replicas the client uses differs.
`--push-ms 0,5` runs every cell with workers pushing load reports on change (5 ms) and without
(0: the 100 ms interval only), interleaved, so both see the same machine. Figures in
docs/BENCHMARKS.md.

Workloads: `mooncake` (the conversation trace at its arrival times, `--speed`, `--limit`) or
`agentx` (closed-loop agent sessions with `x-session-id`, `--concurrency` live sessions, from
the Weka traces' sessions of at most `--max-session-requests` requests whose prompts stay under
`--max-prompt-tokens`, written to a temporary trace file).

Usage: python3 tests/python/fleet_spread.py [--workload mooncake|agentx] [--workers 8]
       [--speedup 10] [--speed 4] [--limit 300] [--concurrency 8] [--sessions N]
       [--max-session-requests 20] [--max-prompt-tokens 60000] [--time-scale 0.02]
       [--rounds 1] [--replicas 1,2,4] [--push-ms default] [--binary target/debug/switchyard]
"""

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

AGENTX_TRACE = "../shared/data/agentx/weka_kv_cache_tester/dev_120.jsonl.gz"


def start_up(binary: str, args, push_ms: str) -> tuple[subprocess.Popen, list[str]]:
    command = [binary, "up", "--workers", str(args.workers), "--gateways", "4", "--speedup",
               str(args.speedup), "--http", "127.0.0.1:0"]
    if args.workload == "agentx":
        command += ["--max-context", str(args.max_prompt_tokens + 32_768)]
    if push_ms != "default":
        command += ["--load-push-min-ms", push_ms]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in up.stdout:
        try:
            ready = json.loads(line)
        except ValueError:
            continue
        if ready.get("event") == "ready":
            return up, ready["gateways"]
    up.kill()
    sys.exit("switchyard up ended before its ready line")


def load_reports(gateway: str) -> float | None:
    """Load reports gateway 0 has received (its `switchyard_load_reports_total`)."""
    base = gateway.removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("switchyard_load_reports_total"):
            return float(line.split()[-1])
    return None


def session_requests(requests: list) -> tuple[int, int]:
    """A session's request count and its largest prompt, sub-agents included."""
    count, largest = 0, 0
    for request in requests:
        if request.get("type") == "subagent":
            c, l = session_requests(request.get("requests", []))
            count, largest = count + c, max(largest, l)
        else:
            count, largest = count + 1, max(largest, request.get("in", 0))
    return count, largest


def agentx_trace(args, out: str) -> str:
    """The sessions of the default trace small enough for one cell, as their own trace file."""
    path = os.path.join(out, "sessions.jsonl")
    kept = requests = 0
    with gzip.open(AGENTX_TRACE, "rt") as source, open(path, "w") as sink:
        for line in source:
            count, largest = session_requests(json.loads(line)["requests"])
            if count <= args.max_session_requests and largest <= args.max_prompt_tokens:
                sink.write(line)
                kept += 1
                requests += count
    if kept == 0:
        sys.exit("no session of the trace fits --max-session-requests/--max-prompt-tokens")
    print(f"# agentx: {kept} sessions, {requests} requests from {AGENTX_TRACE}", flush=True)
    return path


def replay(binary: str, urls: list[str], args, out: str, name: str, trace: str | None) -> dict:
    if args.workload == "agentx":
        command = [binary, "replay", "agentx", "--trace", trace, "--concurrency",
                   str(args.concurrency), "--time-scale", str(args.time_scale)]
        if args.sessions:
            command += ["--sessions", str(args.sessions)]
    else:
        command = [binary, "replay", "mooncake", "--speed", str(args.speed), "--limit",
                   str(args.limit)]
    command += ["--endpoint", urls[0], "--out", out, "--name", name]
    if len(urls) > 1:
        command += ["--spread-over", ",".join(urls[1:])]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, f"{name}.json")) as report:
        return json.load(report)["runs"][0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", choices=["mooncake", "agentx"], default="mooncake")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--speedup", type=float, default=10.0)
    parser.add_argument("--speed", type=float, default=4.0)
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=0)
    parser.add_argument("--max-session-requests", type=int, default=20)
    parser.add_argument("--max-prompt-tokens", type=int, default=60_000)
    parser.add_argument("--time-scale", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--replicas", default="1,2,4")
    parser.add_argument("--push-ms", default="default",
                        help="comma-separated --load-push-min-ms values, or `default`")
    parser.add_argument("--binary", default="target/debug/switchyard")
    args = parser.parse_args()
    counts = [int(g) for g in args.replicas.split(",")]
    pushes = args.push_ms.split(",")
    print("round,replicas,push_ms,completed,failed,ttft_p50_ms,ttft_p99_ms,cache_hit_rate,"
          "requests_per_s,load_reports_per_s,load1")
    with tempfile.TemporaryDirectory() as out:
        trace = agentx_trace(args, out) if args.workload == "agentx" else None
        for round_ in range(args.rounds):
            for g in counts:
                for push_ms in pushes:
                    up, gateways = start_up(args.binary, args, push_ms)
                    try:
                        reports_before, started = load_reports(gateways[0]), time.monotonic()
                        run = replay(args.binary, gateways[:g], args, out,
                                     f"g{g}-p{push_ms}-{round_}", trace)
                        reports_after, seconds = load_reports(gateways[0]), time.monotonic() - started
                    finally:
                        up.terminate()
                        up.wait(timeout=60)
                    load1 = os.getloadavg()[0]
                    ttft = run["ttft_ms"]
                    # What one gateway receives: every replica subscribes to every worker.
                    reports = ("-" if reports_before is None or reports_after is None
                               else f"{(reports_after - reports_before) / seconds:.0f}")
                    rate = (run["requests_completed"] + run["requests_failed"]) / seconds
                    print(f"{round_},{g},{push_ms},{run['requests_completed']},"
                          f"{run['requests_failed']},{ttft['p50']:.1f},{ttft['p99']:.1f},"
                          f"{run['cache_hit_rate']:.4f},{rate:.2f},{reports},{load1:.1f}",
                          flush=True)


if __name__ == "__main__":
    main()
