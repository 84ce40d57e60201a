"""Disaggregated prefill/decode for the stand-in engine (imported by fake_vllm.py).

Two stand-ins hand a prompt's KV to each other the way the real engines do, with the KV reduced
to the token ids of each block so the receiving side can check it got the right blocks:

  * vLLM (`--kv-transfer`, like `--kv-transfer-config` with NixlConnector): a request with
    `kv_transfer_params.do_remote_decode` is prefilled, its full blocks are held under block ids
    (vLLM delays freeing them), and the answer carries `kv_transfer_params` with
    `do_remote_prefill`, `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`
    and `tp_size`. A request with `do_remote_prefill` reads those blocks from the prefill
    stand-in's side channel (`remote_host:remote_port`, which releases them), checks them against
    its prompt, caches them (publishing `BlockStored`) and generates. A failed read is recomputed
    locally, vLLM's default `kv_load_failure_policy`.
  * SGLang (`--disaggregation-mode prefill|decode`): both stand-ins get the same
    `bootstrap_host`/`bootstrap_port`/`bootstrap_room`. The prefill stand-in registers the room on
    its bootstrap server and does not finish until a decode stand-in takes the room's KV (or the
    transfer timeout passes, then it aborts); the decode stand-in takes it, checks it, caches it
    and generates. Servers in either mode refuse requests without bootstrap fields.

What a decode stand-in was handed is kept for the tests (`POST /admin/transfers`);
`POST /admin/lose_rooms {"count": n}` makes a prefill stand-in accept its next n bootstrapped
requests and never offer their rooms, as an engine that failed after accepting them.
"""

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Transfers:
    def __init__(self, engine):
        self.engine = engine
        self.args = engine.args
        self.engine_id = str(uuid.uuid4())
        self.cond = threading.Condition()
        self.held = {}  # vLLM: block id -> (tokens, deadline)
        self.next_block_id = 0
        self.rooms = {}  # SGLang: room -> {"tokens": [...], "taken": bool}
        self.received = []  # decode side: what it was handed and what came of it
        self.handed_over = 0  # prefill side: KV hand-offs completed
        self.lose_rooms = 0  # prefill side: rooms to drop, as an engine that failed mid-way
        server = ThreadingHTTPServer(("127.0.0.1", self.args.bootstrap_port), self.handler())
        server.daemon_threads = True
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def restart(self):
        """A new incarnation forgets what it held and has a new engine id."""
        with self.cond:
            self.held.clear()
            self.rooms.clear()
            self.engine_id = str(uuid.uuid4())

    # ---- vLLM (NixlConnector-like) ----

    def vllm_hold(self, prompt):
        """Prefill side: holds the prompt's full blocks; returns the answer's kv_transfer_params."""
        bs = self.args.block_size
        deadline = time.time() + self.args.transfer_timeout
        ids = []
        with self.cond:
            for i in range(len(prompt) // bs):
                self.held[self.next_block_id] = (prompt[i * bs:(i + 1) * bs], deadline)
                ids.append(self.next_block_id)
                self.next_block_id += 1
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": ids, "remote_host": "127.0.0.1", "remote_port": self.port, "tp_size": 1}

    def vllm_read(self, engine_id, block_ids):
        with self.cond:
            now = time.time()
            for b in [b for b, (_, d) in self.held.items() if d < now]:
                del self.held[b]
            if engine_id != self.engine_id or not all(b in self.held for b in block_ids):
                return None
            blocks = [self.held.pop(b)[0] for b in block_ids]
            self.handed_over += 1
            return blocks

    # ---- SGLang (bootstrap) ----

    def sglang_wait(self, room, prompt):
        """Prefill side: offers the room's KV; True once a decode stand-in took it."""
        deadline = time.time() + self.args.transfer_timeout
        with self.cond:
            if self.lose_rooms > 0:
                self.lose_rooms -= 1
                return False
            self.rooms[room] = {"tokens": list(prompt), "taken": False}
            self.cond.notify_all()
            while not self.rooms[room]["taken"]:
                left = deadline - time.time()
                if left <= 0:
                    del self.rooms[room]
                    return False
                self.cond.wait(left)
            del self.rooms[room]
            self.handed_over += 1
            return True

    def sglang_take(self, room):
        deadline = time.time() + self.args.transfer_timeout
        with self.cond:
            while room not in self.rooms or self.rooms[room]["taken"]:
                left = deadline - time.time()
                if left <= 0:
                    return None
                self.cond.wait(left)
            self.rooms[room]["taken"] = True
            self.cond.notify_all()
            return self.rooms[room]["tokens"]

    # ---- decode side ----

    def receive(self, rank, prompt, body, sglang):
        """Fetches the prompt's KV from the prefill stand-in, caches it on `rank`; returns an
        error message when the request must fail, None otherwise."""
        bs = self.args.block_size
        full = len(prompt) // bs * bs
        if sglang:
            params = {k: body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
            got = post("http://%s:%s/bootstrap/take" % (params["bootstrap_host"], params["bootstrap_port"]),
                       {"room": params["bootstrap_room"]}, self.args.transfer_timeout + 5)
            ok = got is not None and got.get("tokens") == list(prompt)
        else:
            params = body["kv_transfer_params"]
            got = post("http://%s:%s/nixl/read" % (params.get("remote_host"), params.get("remote_port")),
                       {"engine_id": params.get("remote_engine_id"), "block_ids": params.get("remote_block_ids")}, 10)
            blocks = got.get("blocks") if got else None
            ok = blocks is not None and [t for b in blocks for t in b] == list(prompt[:full])
        outcome = "pulled" if ok else ("failed" if sglang else "recomputed")
        with self.engine.lock:
            self.received.append({"params": params, "outcome": outcome, "tokens": full if ok else 0})
            if ok and full:
                rank.cache(prompt[:full])
        return None if ok or not sglang else "KV transfer from the prefill engine failed"

    def handler(self):
        transfers = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path == "/nixl/read":
                    blocks = transfers.vllm_read(body.get("engine_id"), body.get("block_ids") or [])
                    out = (200, {"blocks": blocks}) if blocks is not None else (404, {"error": "unknown blocks"})
                elif self.path == "/bootstrap/take":
                    tokens = transfers.sglang_take(body.get("room"))
                    out = (200, {"tokens": tokens}) if tokens is not None else (404, {"error": "no such room"})
                else:
                    out = (404, {"error": "not found"})
                data = json.dumps(out[1]).encode()
                self.send_response(out[0])
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def post(url, obj, timeout):
    request = urllib.request.Request(url, data=json.dumps(obj).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
