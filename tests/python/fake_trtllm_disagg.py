"""Disaggregated serving for the `trtllm-serve` stand-in (imported by fake_trtllm.py).

TensorRT-LLM splits a request between a context server and a generation server through the
`disaggregated_params` of `/v1/completions` (`tensorrt_llm/serve/openai_protocol.py`
`DisaggregatedParams`; the proxy in `openai_disagg_server.py` drives it):

  * a `context_only` request (non-streamed) computes the prompt's KV, samples the first token
    and keeps the KV for a generation server; its choice carries `disaggregated_params` with
    `request_type: "context_only"`, `first_gen_tokens`, `ctx_request_id` and
    `encoded_opaque_state` (base64 of the engine's communicator state: how a peer reaches its
    cache transceiver);
  * a `generation_only` request carries those parameters back; the generation server's cache
    transceiver fetches the KV from the context server (NIXL/UCX in the engine), starts from
    `first_gen_tokens` and generates the rest. A transfer that fails fails the request: the
    stream has already answered 200, so the failure is an SSE `error` event followed by
    `[DONE]` (as `openai_server.py` reports errors inside a stream).

Here the KV is the token ids of the prompt, the communicator state names a side channel
(`POST /transceiver/read`) on which the context stand-in hands a held request's tokens over
once, and the generation stand-in checks them against its prompt before it counts the prompt's
blocks as transferred (never recomputed). What happened is kept for the tests
(`POST /admin/transfers`); `POST /admin/lose_transfers {"count": n}` makes the context stand-in
answer its next n context requests and then lose their KV, as an engine that failed after
answering.
"""

import base64
import binascii
import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The fields of TensorRT-LLM's DisaggregatedParams (openai_protocol.py, main branch); its model
# forbids any other.
DISAGG_FIELDS = {
    "request_type", "first_gen_tokens", "first_gen_log_probs", "first_gen_logits",
    "ctx_request_id", "encoded_opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank",
    "ctx_info_endpoint", "schedule_style", "conversation_id", "ctx_usage",
}
REQUEST_TYPES = ("context_only", "generation_only", "context_and_generation")


def check_params(params):
    """The error TensorRT-LLM answers (400) for unusable `disaggregated_params`, or None."""
    if not isinstance(params, dict):
        return "disaggregated_params: Input should be a valid dictionary"
    extra = sorted(set(params) - DISAGG_FIELDS)
    if extra:
        return "disaggregated_params: Extra inputs are not permitted: %s" % ", ".join(extra)
    kind = params.get("request_type")
    if not isinstance(kind, str):
        return "disaggregated_params.request_type: Field required"
    if kind.lower() not in REQUEST_TYPES:
        return ("Unknown request type: %s. Must be context_only, generation_only or "
                "context_and_generation" % kind)
    encoded = params.get("encoded_opaque_state")
    if encoded is not None:
        try:
            base64.b64decode(encoded, validate=True)
        except (binascii.Error, TypeError, ValueError) as e:
            return "encoded_opaque_state: %s" % e
    if kind.lower() == "generation_only":
        first = params.get("first_gen_tokens")
        if not isinstance(first, list) or not first or not all(isinstance(t, int) for t in first):
            return "a generation_only request needs first_gen_tokens from its context phase"
        if not isinstance(params.get("ctx_request_id"), int):
            return "a generation_only request needs the ctx_request_id of its context phase"
    return None


class Transceiver:
    """The engine's cache transceiver: holds context-phase KV and serves it to peers."""

    def __init__(self, engine):
        self.args = engine.args
        self.cond = threading.Lock()
        self.ids = itertools.count(int.from_bytes(os.urandom(3), "little") * 1000 + 1)
        self.lose = 0
        self.restart()
        server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        server.daemon_threads = True
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def restart(self):
        """A new engine incarnation: a new communicator, nothing held."""
        self.instance = str(uuid.uuid4())
        self.held = {}  # ctx_request_id -> (prompt tokens, deadline)
        self.handed_over = 0  # context side: KV read by a generation server
        self.received = []  # generation side: what it was handed and what came of it
        self.transferred_blocks = 0

    def opaque_state(self):
        state = {"instance": self.instance, "endpoint": "127.0.0.1:%d" % self.port}
        return base64.b64encode(json.dumps(state).encode()).decode()

    def hold(self, prompt):
        """Context side: keeps the prompt's KV for a generation server; its ctx_request_id."""
        deadline = time.time() + self.args.kv_transfer_timeout_ms / 1000.0
        with self.cond:
            ctx_request_id = next(self.ids)
            if self.lose > 0:
                self.lose -= 1
            else:
                self.held[ctx_request_id] = (list(prompt), deadline)
        return ctx_request_id

    def hand_over(self, instance, ctx_request_id):
        with self.cond:
            now = time.time()
            for k in [k for k, (_, d) in self.held.items() if d < now]:
                del self.held[k]
            if instance != self.instance or ctx_request_id not in self.held:
                return None
            self.handed_over += 1
            return self.held.pop(ctx_request_id)[0]

    def receive(self, params, prompt, block_size):
        """Generation side: fetches the context phase's KV. None when it arrived and matches
        the prompt, else why the transfer failed."""
        try:
            state = json.loads(base64.b64decode(params.get("encoded_opaque_state") or ""))
            endpoint = state["endpoint"]
        except (ValueError, KeyError, TypeError):
            state, endpoint = {}, None
        got = None
        if endpoint:
            got = post("http://%s/transceiver/read" % endpoint,
                       {"instance": state.get("instance"), "ctx_request_id": params["ctx_request_id"]},
                       self.args.kv_transfer_timeout_ms / 1000.0 + 5)
        tokens = got.get("tokens") if got else None
        if tokens is None:
            why = "KV cache transfer for context request %s failed: the context server holds no such request" % params["ctx_request_id"]
        elif tokens != list(prompt):
            why = "KV cache transfer for context request %s failed: its tokens are not this prompt's" % params["ctx_request_id"]
        else:
            why = None
        blocks = len(prompt) // block_size
        with self.cond:
            self.received.append({"params": params, "outcome": "failed" if why else "transferred",
                                  "blocks": 0 if why else blocks})
            if not why:
                self.transferred_blocks += blocks
        return why

    def report(self):
        with self.cond:
            return {"instance": self.instance, "held": sorted(self.held),
                    "handed_over": self.handed_over, "received": list(self.received),
                    "transferred_blocks": self.transferred_blocks}

    def handler(self):
        transceiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(n) or b"{}")
                except ValueError:
                    body = {}
                tokens = None
                if self.path == "/transceiver/read":
                    tokens = transceiver.hand_over(body.get("instance"), body.get("ctx_request_id"))
                code, out = (200, {"tokens": tokens}) if tokens is not None else (404, {"error": "unknown request"})
                data = json.dumps(out).encode()
                self.send_response(code)
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
