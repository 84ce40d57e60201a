"""What the Messages API translation costs next to the chat path it runs on: the same prompt,
alternately as `/v1/chat/completions` and `/v1/messages` (non-streamed and streamed), one at a
time, and each endpoint's median and mean latency. Figures in docs/BENCHMARKS.md.

Usage: python3 tests/python/messages_overhead.py http://HOST:PORT [ROUNDS]
"""

import json
import statistics
import sys
import time
import urllib.request

PROMPT = [{"role": "user", "content": "Name three rivers of Europe."}]


def post(url: str, body: dict) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


def main(base: str, rounds: int) -> None:
    chat = {"model": "sim-8b", "max_tokens": 8, "temperature": 0, "messages": PROMPT}
    shapes = {
        "chat": (f"{base}/v1/chat/completions", chat),
        "messages": (f"{base}/v1/messages", chat),
        "chat stream": (f"{base}/v1/chat/completions", {**chat, "stream": True}),
        "messages stream": (f"{base}/v1/messages", {**chat, "stream": True}),
    }
    times = {name: [] for name in shapes}
    for name, (url, body) in shapes.items():  # warm up
        post(url, body)
    for _ in range(rounds):
        for name, (url, body) in shapes.items():
            start = time.perf_counter()
            post(url, body)
            times[name].append((time.perf_counter() - start) * 1000)
    print("| endpoint | requests | median ms | mean ms |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {len(t)} | {statistics.median(t):.2f} | {statistics.mean(t):.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200)
