#!/usr/bin/env python3
"""A protocol-faithful stand-in for TensorRT-LLM's `trtllm-serve`, for tests without a GPU.

It answers like `trtllm-serve` on the wire (shapes from TensorRT-LLM's
`tensorrt_llm/serve/openai_server.py`, `openai_protocol.py`, `postprocess_handlers.py` and the
KV event serializer `tensorrt_llm/_utils.py` `KVCacheEventSerializer`):
  * `GET /health` (200, empty body), `GET /v1/models` (`ModelCard`: id, object, created,
    owned_by "tensorrt_llm"; no max_model_len).
  * `POST /v1/completions`: a token-id `prompt`, SSE streaming; with `detokenize: false` each
    chunk's choice carries `token_ids` and empty `text`; `stream_options.include_usage` adds a
    last chunk with `usage` (`prompt_tokens_details.cached_tokens`). Fields the engine's
    `CompletionRequest` does not declare are refused with 400, as its request model forbids them.
  * `GET /metrics`: the iteration stats queue as a JSON list, drained by each read; one entry per
    iteration (here: per generated token), none while idle (`enable_iter_perf_stats`).
  * `POST /kv_cache_events`: the KV event queue as a JSON list, drained by each read. Events are
    `{"event_id", "data", "window_size"}` (no `attention_dp_rank` without attention DP):
    `created` (`num_blocks_per_cache_level`) at start, `stored` (`parent_hash`, `blocks` of
    `stored_block` with `block_hash`, `tokens` of `unique_token`s, `cache_level`, `priority`,
    `mm_keys`, `cache_salt`), `removed` (`block_hashes`). The queue holds at most
    `--event-buffer-max-size` events and drops the oldest beyond that, as the engine does.
  * Its own block hash (SHA-256 over the parent digest and the tokens, seeded per incarnation,
    folded to an unsigned 64-bit integer): the consumer has to rehash token ids. After a request
    the sequence's blocks are cached, the last partial one too (TensorRT-LLM reuses partial
    blocks), each `stored` event chaining from the longest cached prefix.
  * The secondary (host) pool, with `--host-blocks N` (TensorRT-LLM's
    `kv_cache_config.host_cache_size`), as its block manager keeps it
    (`cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`): a block evicted from the primary pool
    is offloaded to the secondary one, announced as `updated` with `cache_level`
    `{"type": "event_diff", "old_value": 0, "new_value": 1}` (a `removed` for what the
    secondary pool drops to make room), and a hit on it onboards it back (`updated` 1 -> 0).
    `created` announces both pools' sizes.

Test control (POST, JSON body, answers JSON):
  /admin/state       the full blocks held, each as the token prefix ending with it (`blocks`:
                     the primary pool, `host`: the secondary one)
  /admin/store       {"tokens": [...]}: cache a sequence as a request would
  /admin/drop_next   {"count": n}: the next n events never reach the queue (lost, as when the
                     queue wraps before it is read)
  /admin/restart     a new engine: empty cache, new hash seed, event ids from 0, `created` again
  /admin/requests    the bodies of the generation requests received, oldest first (last 64)
  /admin/transfers   disaggregation (fake_trtllm_disagg.py): the context requests held, those
                     handed over, what a generation request was handed and whether its KV
                     arrived, the blocks received instead of computed, and `computed_tokens`
                     (prompt tokens this engine prefilled itself)
  /admin/lose_transfers {"count": n}: the next n context requests answer, then lose their KV

`disaggregated_params` on `/v1/completions` splits a request between two stand-ins as
TensorRT-LLM splits it between a context and a generation server: see fake_trtllm_disagg.py.

Prints one line `READY {"http": port}` when serving.
"""

import argparse
import collections
import hashlib
import json
import os
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fake_trtllm_disagg

# The fields of trtllm-serve's CompletionRequest (openai_protocol.py); anything else is a 400.
COMPLETION_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user", "lora_request", "prompt_ignore_length", "use_beam_search",
    "top_k", "top_p_min", "min_p", "repetition_penalty", "length_penalty", "early_stopping",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "return_context_logits", "detokenize", "thinking_token_budget", "add_special_tokens",
    "response_format", "disaggregated_params", "priority", "conversation_params",
}


class Engine:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.requests = collections.deque(maxlen=64)
        self.stats = []
        self.iteration = 0
        self.running = 0
        self.reused = 0
        self.missed = 0
        self.computed_tokens = 0
        self.transceiver = fake_trtllm_disagg.Transceiver(self)
        self.restart()

    def restart(self):
        self.seed = os.urandom(16)
        self.next_id = 0
        self.events = collections.deque(maxlen=self.args.event_buffer_max_size)
        self.drop = 0
        # engine hash -> (tokens of the block, parent hash, prefix ending with it); LRU order.
        self.blocks = collections.OrderedDict()
        # The secondary pool, same shape, LRU order (--host-blocks).
        self.host = collections.OrderedDict()
        self.transceiver.restart()
        self.emit({"type": "created",
                   "num_blocks_per_cache_level": [self.args.num_blocks, self.args.host_blocks]})

    def emit(self, data):
        event = {"event_id": self.next_id, "data": data, "window_size": self.args.window_size}
        self.next_id += 1
        if self.drop > 0:
            self.drop -= 1
            return
        self.events.append(event)

    def digest(self, parent, tokens):
        h = hashlib.sha256(self.seed + struct.pack("<Q", parent or 0))
        h.update(struct.pack("<%dI" % len(tokens), *tokens))
        return int.from_bytes(h.digest()[:8], "little")

    def cache(self, tokens):
        """Caches `tokens` block by block (the last partial block too); publishes one `stored`
        event for the new blocks and a `removed` for what made room. Returns the prompt tokens
        that were hits."""
        bs = self.args.block_size
        parent, new_parent, new, hits, pinned = None, None, [], 0, set()
        for start in range(0, len(tokens), bs):
            block = tokens[start:start + bs]
            h = self.digest(parent, block)
            pinned.add(h)
            if h in self.blocks:
                self.blocks.move_to_end(h)
                if len(block) == bs:
                    hits += bs
            elif h in self.host:
                # Onboarded from the secondary pool: a hit, moved back to the primary one.
                if new:
                    self.emit({"type": "stored", "parent_hash": new_parent, "blocks": new})
                    new = []
                self.make_room(pinned)
                self.blocks[h] = self.host.pop(h)
                self.emit(self.level_change(h, 1, 0))
                if len(block) == bs:
                    hits += bs
            else:
                if not new:
                    new_parent = parent
                self.make_room(pinned)
                self.blocks[h] = (block, parent, tokens[:start + len(block)])
                new.append({"type": "stored_block", "block_hash": h,
                            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                       for t in block],
                            "cache_level": 0, "priority": 35, "mm_keys": [], "cache_salt": None})
            if len(block) < bs:
                break
            parent = h
        if new:
            self.emit({"type": "stored", "parent_hash": new_parent, "blocks": new})
        return hits

    def make_room(self, pinned):
        evicted = []
        while len(self.blocks) >= self.args.num_blocks:
            victim = next((h for h in self.blocks if h not in pinned), None)
            if victim is None:
                break
            entry = self.blocks.pop(victim)
            if self.args.host_blocks > 0:
                self.offload(victim, entry)
            else:
                evicted.append(victim)
        if evicted:
            self.emit({"type": "removed", "block_hashes": evicted})

    def offload(self, h, entry):
        """Moves an evicted primary block to the secondary pool (dropping that pool's least
        recently used block when it is full), as the block manager's offloadBlock does."""
        if len(self.host) >= self.args.host_blocks:
            dropped, _ = self.host.popitem(last=False)
            self.emit({"type": "removed", "block_hashes": [dropped]})
        self.host[h] = entry
        self.emit(self.level_change(h, 0, 1))

    @staticmethod
    def level_change(h, old, new):
        return {"type": "updated", "block_hash": h,
                "cache_level": {"type": "event_diff", "new_value": new, "old_value": old},
                "priority": None}

    def iteration_stat(self):
        bs = self.args.block_size
        self.iteration += 1
        used = len(self.blocks)
        self.stats.append({
            "iter": self.iteration, "iterLatencyMS": 1.0, "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
            "numActiveRequests": self.running, "numQueuedRequests": 0, "maxNumActiveRequests": 64,
            "gpuMemUsage": 0, "cpuMemUsage": 0, "pinnedMemUsage": 0,
            "inflightBatchingStats": {"numScheduledRequests": self.running, "numContextRequests": 0,
                                      "numGenRequests": self.running, "numPausedRequests": 0,
                                      "numCtxTokens": 0, "microBatchId": 0, "avgNumDecodedTokensPerIter": 1.0},
            "kvCacheStats": {"maxNumBlocks": self.args.num_blocks, "freeNumBlocks": self.args.num_blocks - used,
                             "usedNumBlocks": used, "tokensPerBlock": bs, "allocTotalBlocks": used,
                             "allocNewBlocks": 0, "reusedBlocks": self.reused, "missedBlocks": self.missed,
                             "cacheHitRate": self.reused / max(1, self.reused + self.missed)},
        })
        del self.stats[:-1000]

    def state(self, pool=None):
        bs = self.args.block_size
        pool = self.blocks if pool is None else pool
        return [prefix for block, _, prefix in pool.values() if len(block) == bs]


def make_handler(engine):
    args = engine.args

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, code, obj):
            body = b"" if obj is None else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def error(self, code, message):
            self.reply(code, {"object": "error", "message": message, "type": "BadRequestError",
                              "param": None, "code": code})

        def do_GET(self):
            if self.path == "/health":
                return self.reply(200, None)
            if self.path == "/v1/models":
                return self.reply(200, {"object": "list", "data": [
                    {"id": args.model, "object": "model", "created": int(time.time()),
                     "owned_by": "tensorrt_llm"}]})
            if self.path == "/metrics":
                with engine.lock:
                    stats, engine.stats = engine.stats, []
                return self.reply(200, stats)
            self.reply(404, {"detail": "Not Found"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            if self.path == "/kv_cache_events":
                with engine.lock:
                    events = list(engine.events)
                    engine.events.clear()
                return self.reply(200, events)
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                return self.error(400, "bad json")
            if self.path.startswith("/admin/"):
                return self.admin(self.path[len("/admin/"):], body)
            if self.path == "/v1/completions":
                engine.requests.append(body)
                return self.completions(body)
            self.reply(404, {"detail": "Not Found"})

        def admin(self, what, body):
            with engine.lock:
                if what == "state":
                    return self.reply(200, {"blocks": engine.state(),
                                            "host": engine.state(engine.host)})
                if what == "store":
                    return self.reply(200, {"cached_tokens": engine.cache(body["tokens"])})
                if what == "drop_next":
                    engine.drop = body.get("count", 1)
                    return self.reply(200, {})
                if what == "restart":
                    engine.restart()
                    return self.reply(200, {})
                if what == "requests":
                    return self.reply(200, {"requests": list(engine.requests)})
                if what == "transfers":
                    report = engine.transceiver.report()
                    report["computed_tokens"] = engine.computed_tokens
                    return self.reply(200, report)
                if what == "lose_transfers":
                    engine.transceiver.lose = body.get("count", 1)
                    return self.reply(200, {})
            self.reply(404, {"detail": "unknown admin action"})

        def completions(self, body):
            unknown = sorted(set(body) - COMPLETION_FIELDS)
            if unknown:
                return self.error(400, "Extra inputs are not permitted: %s" % ", ".join(unknown))
            prompt = body.get("prompt")
            if body.get("model") != args.model:
                return self.error(404, "The model `%s` does not exist." % body.get("model"))
            if (not isinstance(prompt, list) or not prompt
                    or not all(isinstance(t, int) and t >= 0 for t in prompt)):
                return self.error(400, "prompt must be a non-empty list of token ids")
            max_tokens = body.get("max_tokens") or 16
            if len(prompt) + max_tokens > args.max_seq_len:
                return self.error(400, "the prompt and max_tokens exceed max_seq_len %d" % args.max_seq_len)
            disagg = body.get("disaggregated_params")
            kind = "context_and_generation"
            if disagg is not None:
                problem = fake_trtllm_disagg.check_params(disagg)
                if problem:
                    return self.error(400, problem)
                kind = disagg["request_type"].lower()
            if kind == "context_only":
                return self.context_only(body, prompt, disagg)
            first = []
            if kind == "generation_only":
                # The prompt's KV comes from the context server; nothing is recomputed here.
                failure = engine.transceiver.receive(disagg, prompt, args.block_size)
                if failure:
                    return self.failed(body, failure)
                first = disagg["first_gen_tokens"][:1]
                with engine.lock:
                    engine.cache(prompt)
                cached = len(prompt)
            else:
                cached = self.prefill(prompt)
            self.generate(body, prompt, max_tokens, cached, first)

        def prefill(self, prompt):
            """Computes the prompt's KV (what is not cached); the prompt tokens that were hits."""
            with engine.lock:
                cached = engine.cache(prompt)
                engine.reused += cached // args.block_size
                engine.missed += len(prompt) // args.block_size - cached // args.block_size
                engine.computed_tokens += len(prompt) - cached
            return cached

        def context_only(self, body, prompt, disagg):
            """The context phase: the prompt's KV computed and held, the first token sampled,
            the parameters a generation server needs in the (non-streamed) answer."""
            if body.get("stream"):
                return self.error(400, "the stand-in serves context_only requests unstreamed, as "
                                       "TensorRT-LLM's disaggregated proxy sends them")
            cached = self.prefill(prompt)
            token = next_token(prompt, 0, body.get("seed") or 0)
            with engine.lock:
                engine.iteration_stat()
            ctx_request_id = engine.transceiver.hold(prompt)
            params = {"request_type": "context_only", "first_gen_tokens": [token],
                      "ctx_request_id": ctx_request_id,
                      "encoded_opaque_state": engine.transceiver.opaque_state(),
                      "draft_tokens": None, "disagg_request_id": disagg.get("disagg_request_id"),
                      "ctx_dp_rank": 0, "ctx_info_endpoint": None}
            detokenize = body.get("detokenize", True)
            self.reply(200, {
                "id": "cmpl-%d" % ctx_request_id, "object": "text_completion",
                "created": int(time.time()), "model": args.model,
                "choices": [{"index": 0, "text": " t%d" % token if detokenize else "",
                             "token_ids": None if detokenize else [token], "logprobs": None,
                             "context_logits": None, "finish_reason": "length", "stop_reason": None,
                             "disaggregated_params": params}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1,
                          "total_tokens": len(prompt) + 1,
                          "prompt_tokens_details": {"cached_tokens": cached}},
                "prompt_token_ids": prompt,
            })

        def failed(self, body, message):
            """A request the engine took and then failed: inside a stream (already 200) an SSE
            error event and [DONE], as openai_server.py reports it; otherwise an error answer."""
            if not body.get("stream"):
                return self.error(400, message)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.event({"error": {"message": message, "type": "server_error", "code": None,
                                  "param": None}})
            self.chunk(b"data: [DONE]\n\n")
            self.chunk(b"")

        def generate(self, body, prompt, max_tokens, cached, first):
            """Streams the completion; `first`: tokens already sampled by a context server."""
            stops = set(body.get("stop_token_ids") or [])
            detokenize = body.get("detokenize", True)
            with engine.lock:
                engine.running += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            out, finish, seed = [], None, body.get("seed") or 0
            try:
                for i in range(max_tokens):
                    tok = first[i] if i < len(first) else next_token(prompt, i, seed)
                    out.append(tok)
                    if tok in stops and not body.get("ignore_eos"):
                        finish = "stop"
                    elif i + 1 == max_tokens:
                        finish = "length"
                    with engine.lock:
                        engine.iteration_stat()
                    choice = {"index": 0, "text": "" if not detokenize else " t%d" % tok,
                              "token_ids": None if detokenize else [tok],
                              "finish_reason": finish, "stop_reason": None}
                    self.event({"id": "cmpl-1", "object": "text_completion", "created": int(time.time()),
                                "model": args.model, "choices": [choice]})
                    if finish:
                        break
                    time.sleep(args.token_delay_ms / 1000.0)
                if (body.get("stream_options") or {}).get("include_usage"):
                    self.event({"id": "cmpl-1", "object": "text_completion", "created": int(time.time()),
                                "model": args.model, "choices": [],
                                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                                          "total_tokens": len(prompt) + len(out),
                                          "prompt_tokens_details": {"cached_tokens": cached}}})
                self.chunk(b"data: [DONE]\n\n")
                self.chunk(b"")
                with engine.lock:
                    # The KV of the sequence the request leaves: all but the last token.
                    engine.cache(prompt + out[:-1])
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                with engine.lock:
                    engine.running -= 1

        def event(self, obj):
            self.chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(self, data):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    return Handler


def next_token(prompt, i, seed):
    """The i-th generated token: a function of the prompt's last token, so any two engines (and
    the two halves of a disaggregated request) agree on a completion."""
    return (prompt[-1] * 31 + i * 7 + seed) % 50000 + 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--block-size", type=int, default=4, help="kv_cache_config.tokens_per_block")
    p.add_argument("--num-blocks", type=int, default=128)
    p.add_argument("--host-blocks", type=int, default=0,
                   help="secondary (host) pool blocks (kv_cache_config.host_cache_size); 0: none")
    p.add_argument("--event-buffer-max-size", type=int, default=1024,
                   help="kv_cache_config.event_buffer_max_size")
    p.add_argument("--window-size", type=int, default=4096)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--token-delay-ms", type=float, default=2.0)
    p.add_argument("--kv-transfer-timeout-ms", type=int, default=30000,
                   help="cache_transceiver_config.kv_transfer_timeout_ms: how long context KV is held")
    args = p.parse_args()
    engine = Engine(args)
    server = ThreadingHTTPServer(("127.0.0.1", args.http_port), make_handler(engine))
    server.daemon_threads = True
    print("READY " + json.dumps({"http": server.server_address[1]}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
