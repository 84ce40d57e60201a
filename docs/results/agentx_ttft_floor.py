#!/usr/bin/env python3
"""TTFT floor of AgentX/Weka traces, straight from the trace files (no replay).

Each call's floor is its prefill alone on an idle simulated worker (the simulator's default
timing model: 8 ms per 8,192-token chunk, 60 us per computed token, 1 ns per attention pair)
that already holds every block of the calls before it in its session (parent and sub-agents,
in trace order). `switchyard replay` reports the same floor per run (`floor p99` column,
`ttft_floor_ms` in the JSON) in the order the run sent the calls; this script gives it for a
corpus without a replay, e.g. for the 256k cut and the long-context case.

usage: agentx_ttft_floor.py TRACE.jsonl.gz [--limit N] [--min-tokens N] [--max-tokens N]
"""
import argparse, gzip, json, math

BS, CHUNK = 64, 8192


def floor_s(cached, total):
    cached = min(cached, total - 1)
    new = total - cached
    pairs = total * (total + 1) // 2 - cached * (cached + 1) // 2
    return math.ceil(new / CHUNK) * 8e-3 + new * 60e-6 + pairs * 1e-9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--min-tokens", type=int, default=0)
    ap.add_argument("--max-tokens", type=int)
    a = ap.parse_args()
    floors = []
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        for i, line in enumerate(f):
            if a.limit is not None and i >= a.limit:
                break
            if not line.strip():
                continue
            sent = set()

            def call(c):
                size = c.get("in", 0) + c.get("out", 0)
                if size < a.min_tokens or (a.max_tokens and size > a.max_tokens):
                    return
                chain, acc = [], 0
                for h in c.get("hash_ids", []):
                    acc = hash((acc, h))
                    chain.append(acc)
                known = next((k for k, x in enumerate(chain) if x not in sent), len(chain))
                floors.append(floor_s(known * BS, c["in"]))
                sent.update(chain)

            for e in json.loads(line)["requests"]:
                for c in e.get("requests", []) if e["type"] == "subagent" else [e]:
                    call(c)
    floors.sort()
    rank = lambda q: floors[max(1, math.ceil(q * len(floors))) - 1] * 1e3
    print(f"calls {len(floors)}: floor p50 {rank(.5):.0f} ms, p90 {rank(.9):.0f} ms, "
          f"p99 {rank(.99):.0f} ms")


if __name__ == "__main__":
    main()
