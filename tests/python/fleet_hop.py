"""What forwarding a session's turn to its owner replica costs: `switchyard up --gateways 2`,
one fresh session per round, its turn sent to each replica in turn (which goes first
alternates), each send classed as served directly (the replica owns the session) or forwarded
(the replica's switchyard_fleet_forwarded_requests counter moved), and the median and mean of
each class. Figures in docs/BENCHMARKS.md.

Usage: python3 tests/python/fleet_hop.py http://HOST:PORT http://HOST:PORT [ROUNDS]
"""

import json
import statistics
import sys
import time
import urllib.request


def post(url: str, body: dict, session: str) -> float:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "content-type": "application/json", "x-session-id": session})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    return time.perf_counter() - started


def forwarded(base: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("switchyard_fleet_forwarded_requests_total")
               and 'outcome="forwarded"' in line)


def main(replicas: list, rounds: int) -> None:
    times = {"direct": [], "forwarded": []}
    for i in range(rounds):
        body = {"model": "sim-8b", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": f"round {i}: name three rivers of Europe."}]}
        order = replicas if i % 2 == 0 else list(reversed(replicas))
        for base in order:
            before = forwarded(base)
            took = post(f"{base}/v1/chat/completions", body, f"hop-{i}")
            kind = "forwarded" if forwarded(base) > before else "direct"
            times[kind].append(took)
    for kind, samples in times.items():
        print(f"{kind:>10}: n={len(samples)} median={statistics.median(samples) * 1e3:.2f} ms "
              f"mean={statistics.fmean(samples) * 1e3:.2f} ms")
    extra = statistics.median(times["forwarded"]) - statistics.median(times["direct"])
    print(f"extra hop (median difference): {extra * 1e3:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1:3], int(sys.argv[3]) if len(sys.argv) > 3 else 200)
