#!/usr/bin/env python3
"""A protocol-faithful stand-in for a vLLM (or SGLang) server, for tests without a GPU.

It answers like the real engines on the wire:
  * HTTP: vLLM's OpenAI `POST /v1/completions` (token-id prompts, SSE streaming with
    `token_ids` per chunk when `return_token_ids` is set, `logprobs.tokens` as "token_id:N" with
    `return_tokens_as_token_ids`, a final usage chunk), SGLang's `POST /generate` (`input_ids`,
    cumulative `output_ids`, `meta_info`), `GET /v1/models`, `GET /metrics`,
    `GET /get_server_info` (SGLang).
  * Log probabilities as each engine gives them: vLLM's `logprobs: k` fills the choice's
    `logprobs` (`tokens`, `token_logprobs`, `top_logprobs` maps of the k most likely tokens plus
    the sampled one, keyed "token_id:N" with `return_tokens_as_token_ids`, `text_offset`);
    SGLang's `return_logprob` + `top_logprobs_num: k` fill `meta_info.output_token_logprobs`
    and `output_top_logprobs` (cumulative `[logprob, id, null]` triples). The figures are made
    up from the token id: the sampled token is the most likely, each alternative less so.
  * ZMQ: one PUB socket per data-parallel rank on port+rank, 3-frame messages (topic, 8-byte
    big-endian sequence, msgpack `[ts, events, rank]`), events positional or map-encoded
    (`--encoding`), hashes as uint64 or 32 raw bytes (`--hash-bytes`); one ROUTER replay socket
    per rank with a bounded buffer (`--buffer-steps`), ending each replay with seq -1.
  * Its own block hash (SHA-256 over parent digest + tokens, seeded randomly per incarnation, as
    vLLM without PYTHONHASHSEED): the consumer has to rehash token ids, as with a real engine.
  * LoRA adapters (`--lora-modules NAME ...`): listed in `/v1/models` with the base model as
    `parent`, served under their own name as `model` (SGLang: `lora_path`), their blocks hashed
    apart and published with `lora_id` and `lora_name`; any other model name is vLLM's 404.
    Loaded and unloaded at run time as each engine does: vLLM's `POST /v1/load_lora_adapter`
    and `/v1/unload_lora_adapter` (200 with a sentence, 400 with an error object), SGLang's
    `POST /load_lora_adapter` and `/unload_lora_adapter` (its `LoadLoRAAdapterReqOutput`:
    `success`, `error_message`, `loaded_adapters`, with 200 or 400).
  * Request priority: vLLM refuses a non-zero `priority` with a 400 unless started with
    `--scheduling-policy priority`; the SGLang flavour refuses any `priority` on `/generate`
    unless started with `--enable-priority-scheduling` (as SGLang does with
    `--abort-on-priority-when-disabled`; by default it ignores one: either way a worker must not
    send a priority to an engine that does not schedule by it).
    The requests log (`/admin/requests`) shows what arrived.
  * SGLang's priority eviction (`--radix-eviction-policy priority`), as its radix cache does it
    (`mem_cache/radix_cache.py`, `evict_policy.py`): a request's `priority` (none: 0) is taken
    into each block on its path as max(block's, request's) when its KV is cached, a new block
    starts at the request's, so a block's priority never goes down while it is held; eviction
    takes the leaf (a block no held block continues) with the smallest (priority, last use)
    first. SGLang keeps a request's priority for the cache whether or not it schedules by it,
    so a stand-in with this policy accepts `priority` without `--enable-priority-scheduling`.

Test control (POST, JSON body, answers JSON):
  /admin/state             blocks held per rank, each as the full token prefix ending with it
  /admin/store             {"tokens": [...], "rank": r, "priority": p}: cache a sequence as a
                           request (of priority p, default 0) would
  /admin/priorities        blocks held per rank with their eviction priority, each as
                           {"prefix": [...], "priority": p}, in the order SGLang's
                           PriorityStrategy ranks them (smallest (priority, last use) first)
  /admin/drop_next         {"count": n, "forget": bool}: publish the next n batches to the replay
                           buffer only (a gap replay can repair), or nowhere with forget
  /admin/restart           new incarnation: empty cache, new hash seed, sequences from 0
  /admin/clear             prefix-cache reset: AllBlocksCleared on every rank
  /admin/malformed         {"rank": r}: send malformed messages (frame count, seq size, payload)
  /admin/transfers         disaggregation: the transfer parameters a decode stand-in was handed
                           (with the outcome: pulled, recomputed, failed) and the hand-offs a
                           prefill stand-in completed (see fake_pd.py)
  /admin/lose_rooms        {"count": n}: SGLang prefill accepts n requests but never offers
                           their rooms (an engine failing after it accepted them)
  /admin/requests          the bodies of the generation requests received, oldest first (the
                           last 64): what a real engine would have been asked
  /admin/hold_prefill      {"hold": bool}: while held, generation requests wait before their
                           first token (a prefill queue the test controls); releasing lets them on

Disaggregated prefill/decode (vLLM `kv_transfer_params`, SGLang bootstrap): see fake_pd.py.

Prints one line `READY {"http": port, "zmq": port, "replay": port, "bootstrap": port}` when
serving.
"""

import argparse
import collections
import hashlib
import json
import os
import random
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgpack
import zmq

from fake_pd import Transfers


class Rank:
    """One data-parallel rank: its prefix cache, its publisher and its replay buffer."""

    def __init__(self, engine, rank, pub, buffer_steps):
        self.engine = engine
        self.rank = rank
        self.pub = pub
        self.seq = 0
        self.buffer = collections.deque(maxlen=buffer_steps)
        self.blocks = collections.OrderedDict()  # engine digest -> (prefix tokens, parent digest)
        self.priority = {}  # engine digest -> eviction priority (--radix-eviction-policy priority)
        self.drop = 0
        self.forget = False
        self.seed = os.urandom(32)

    def digest(self, parent, tokens, lora=None):
        h = hashlib.sha256(parent or self.seed)
        h.update(struct.pack("<%dI" % len(tokens), *tokens))
        if lora is not None:  # vLLM keys a LoRA request's blocks by the adapter too
            h.update(b"lora:" + lora.encode())
        return h.digest()

    def wire_hash(self, digest):
        if self.engine.args.hash_bytes:
            return digest
        return int.from_bytes(digest[-8:], "big")

    def cache(self, tokens, lora=None, priority=0):
        """Caches the full blocks of `tokens` (under LoRA adapter `lora`, if any) for a request
        of eviction `priority`; returns how many prompt tokens were hits."""
        bs = self.engine.args.block_size
        parent, hits, events, pinned = None, 0, [], set()
        new_hashes, new_tokens, new_parent = [], [], None
        for i in range(len(tokens) // bs):
            block = tokens[i * bs:(i + 1) * bs]
            d = self.digest(parent, block, lora)
            pinned.add(d)
            if d in self.blocks:
                self.blocks.move_to_end(d)
                # SGLang's _insert_helper: max(node.priority, priority) along the path.
                self.priority[d] = max(self.priority.get(d, 0), priority)
                hits += bs
                if new_hashes:  # a hole in the middle: flush what was new so far
                    events.append(self.stored(new_hashes, new_parent, new_tokens, lora))
                    new_hashes, new_tokens = [], []
            else:
                if not new_hashes:
                    new_parent = parent
                evicted = self.make_room(pinned)
                if evicted:
                    if new_hashes:
                        events.append(self.stored(new_hashes, new_parent, new_tokens, lora))
                        new_hashes, new_tokens, new_parent = [], [], parent
                    events.append(self.removed(evicted))
                self.blocks[d] = (tokens[:(i + 1) * bs], parent)
                self.priority[d] = priority
                new_hashes.append(d)
                new_tokens.extend(block)
            parent = d
        if new_hashes:
            events.append(self.stored(new_hashes, new_parent, new_tokens, lora))
        if events:
            self.publish(events)
        return hits

    def make_room(self, pinned):
        """Evicts least recently used blocks (by priority first under the priority policy),
        never those of the sequence being cached."""
        evicted = []
        while len(self.blocks) >= self.engine.args.num_blocks:
            if self.engine.args.radix_eviction_policy == "priority":
                victim = self.priority_victim(pinned)
            else:
                victim = next((d for d in self.blocks if d not in pinned), None)
            if victim is None:
                break
            del self.blocks[victim]
            self.priority.pop(victim, None)
            evicted.append(victim)
        return evicted

    def eviction_order(self, pinned=()):
        """Held blocks ranked as SGLang's PriorityStrategy ranks nodes: (priority, last use)."""
        lru = {d: i for i, d in enumerate(self.blocks)}
        return sorted((d for d in self.blocks if d not in pinned),
                      key=lambda d: (self.priority.get(d, 0), lru[d]))

    def priority_victim(self, pinned):
        """SGLang evicts leaves only: the first block in eviction order no held block continues."""
        parents = {parent for _, parent in self.blocks.values()}
        return next((d for d in self.eviction_order(pinned) if d not in parents), None)

    def event(self, tag, fields):
        """One event in the configured encoding; `fields` in vLLM's declaration order."""
        if self.engine.args.encoding == "map":
            out = {"type": tag}
            out.update({k: v for k, v in fields if v is not None or k in ("parent_block_hash", "lora_id", "medium", "lora_name")})
            out["future_field"] = {"ignored": True}
            return out
        return [tag] + [v for _, v in fields]

    def stored(self, hashes, parent, tokens, lora=None):
        # A LoRA request's blocks carry the adapter as vLLM publishes it: its integer id (1 and
        # up, in --lora-modules order) and its name.
        lora_id = None if lora is None else self.engine.lora_id(lora)
        return self.event("BlockStored", [
            ("block_hashes", [self.wire_hash(d) for d in hashes]),
            ("parent_block_hash", None if parent is None else self.wire_hash(parent)),
            ("token_ids", tokens),
            ("block_size", self.engine.args.block_size),
            ("lora_id", lora_id),
            ("medium", "GPU"),
            ("lora_name", lora),
        ])

    def removed(self, hashes):
        return self.event("BlockRemoved", [
            ("block_hashes", [self.wire_hash(d) for d in hashes]),
            ("medium", "GPU"),
        ])

    def clear(self):
        self.blocks.clear()
        self.priority.clear()
        self.publish([self.event("AllBlocksCleared", [])])

    def publish(self, events):
        payload = msgpack.packb([time.time(), events, self.rank], use_bin_type=True)
        self.send_payload(payload)

    def send_payload(self, payload):
        seq = self.seq
        self.seq += 1
        frames = [self.engine.args.topic.encode(), struct.pack(">q", seq), payload]
        if self.drop > 0:
            self.drop -= 1
            if not self.forget:
                self.buffer.append((seq, payload))
            return
        self.buffer.append((seq, payload))
        self.pub.send_multipart(frames)

    def restart(self):
        self.seq = 0
        self.buffer.clear()
        self.blocks.clear()
        self.priority.clear()
        self.seed = os.urandom(32)

    def malformed(self):
        self.pub.send_multipart([b"", struct.pack(">q", self.seq)])  # 2 frames
        self.pub.send_multipart([b"", b"\x00\x01\x02", b"\x90"])  # short seq frame
        self.send_payload(b"\xc1not msgpack")  # a real seq, a payload nobody can read

    def state(self):
        return [list(prefix) for prefix, _ in self.blocks.values()]

    def priorities(self):
        return [{"prefix": list(self.blocks[d][0]), "priority": self.priority.get(d, 0)}
                for d in self.eviction_order()]


def logprobs_of(tok, k):
    """The made-up log probability of `tok` and its k most likely alternatives, itself first."""
    chosen = -((tok % 97) + 1) / 100.0
    top = [(chosen, tok)] + [(chosen - 0.5 * (j + 1), (tok + 1 + j) % 50000 + 1) for j in range(max(0, k - 1))]
    return chosen, top[:k]


class Engine:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        # The generation requests received (the last 64), for tests asking what arrived.
        self.requests = collections.deque(maxlen=64)
        # Scripted outputs: each generation request takes the next list of token ids, if any, and
        # generates exactly those (then finishes with "stop"), so tests can make the engine say
        # something meaningful (a tool call, a reasoning block).
        self.scripts = collections.deque()
        # vLLM's integer LoRA ids: 1 and up, in the order adapters were first served.
        self.lora_ids = {}
        self.lora_paths = {}
        self.ctx = zmq.Context()
        self.next_rank = 0
        self.stats = {"prompt": 0, "cached": 0, "running": 0}
        # Set unless a test holds requests before their first token (/admin/hold_prefill).
        self.prefill_gate = threading.Event()
        self.prefill_gate.set()
        self.zmq_port = self.bind_range("zmq_port", zmq.PUB)
        self.replay_port = self.bind_range("replay_port", zmq.ROUTER)
        self.ranks = [Rank(self, r, self.pubs[r], args.buffer_steps) for r in range(args.dp_ranks)]
        for r in range(args.dp_ranks):
            threading.Thread(target=self.serve_replay, args=(r,), daemon=True).start()
        self.pd = Transfers(self)

    def lora_id(self, name):
        return self.lora_ids.setdefault(name, len(self.lora_ids) + 1)

    def bind_range(self, which, kind):
        base = getattr(self.args, which)
        for _ in range(50):
            port = base or random.randint(20000, 60000)
            socks = []
            try:
                for r in range(self.args.dp_ranks):
                    s = self.ctx.socket(kind)
                    s.setsockopt(zmq.LINGER, 0)
                    socks.append(s)
                    s.bind("tcp://127.0.0.1:%d" % (port + r))
            except zmq.ZMQError:
                for s in socks:
                    s.close()
                if base:
                    raise
                continue
            if kind == zmq.PUB:
                self.pubs = socks
            else:
                self.routers = socks
            return port
        raise RuntimeError("no free port range")

    def serve_replay(self, r):
        router = self.routers[r]
        while True:
            frames = router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], struct.unpack(">Q", frames[2])[0]
            with self.lock:
                batches = [(s, p) for s, p in self.ranks[r].buffer if s >= start]
            for s, p in batches:
                router.send_multipart([ident, b"", struct.pack(">q", s), p])
            router.send_multipart([ident, b"", struct.pack(">q", -1), b""])

    def pick_rank(self):
        r = self.next_rank % len(self.ranks)
        self.next_rank += 1
        return self.ranks[r]

    def metrics(self):
        a, m = self.args, self.args.model
        used = sum(len(r.blocks) for r in self.ranks) / max(1, a.num_blocks * len(self.ranks))
        if a.flavor == "sglang":
            return "".join([
                '# TYPE sglang:num_running_reqs gauge\n',
                'sglang:num_running_reqs{model_name="%s"} %d\n' % (m, self.stats["running"]),
                'sglang:num_queue_reqs{model_name="%s"} 0\n' % m,
                'sglang:token_usage{model_name="%s"} %f\n' % (m, used),
                'sglang:max_total_num_tokens{model_name="%s"} %d\n' % (m, a.num_blocks * a.block_size),
                'sglang:prompt_tokens_total{model_name="%s"} %d\n' % (m, self.stats["prompt"]),
                'sglang:cached_tokens_total{model_name="%s"} %d\n' % (m, self.stats["cached"]),
            ])
        return "".join([
            '# HELP vllm:num_requests_running Number of requests in model execution batches.\n',
            '# TYPE vllm:num_requests_running gauge\n',
            'vllm:num_requests_running{engine="0",model_name="%s"} %d.0\n' % (m, self.stats["running"]),
            'vllm:num_requests_waiting{engine="0",model_name="%s"} 0.0\n' % m,
            'vllm:kv_cache_usage_perc{engine="0",model_name="%s"} %f\n' % (m, used),
            'vllm:cache_config_info{block_size="%d",cache_dtype="auto",enable_prefix_caching="True",'
            'num_gpu_blocks="%d",prefix_caching_hash_algo="sha256"} 1.0\n' % (a.block_size, a.num_blocks),
            'vllm:prompt_tokens_total{engine="0",model_name="%s"} %d.0\n' % (m, self.stats["prompt"]),
            'vllm:prefix_cache_hits_total{engine="0",model_name="%s"} %d.0\n' % (m, self.stats["cached"]),
        ])


def make_handler(engine):
    args = engine.args

    def sglang_lists_adapters():
        """SGLang lists its LoRA adapters in /v1/models from 0.5.5 on."""
        return tuple(int(x) for x in args.sglang_version.split(".")[:3]) >= (0, 5, 5)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, code, obj, ctype="application/json"):
            body = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def body(self):
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}")

        def do_GET(self):
            if self.path == "/metrics":
                with engine.lock:
                    return self.reply(200, engine.metrics(), "text/plain; version=0.0.4")
            if self.path == "/v1/models":
                # vLLM lists each LoRA module after the base model, with the base as `parent`;
                # SGLang too from 0.5.5 on, and none before.
                listed = args.lora_modules if args.flavor == "vllm" or sglang_lists_adapters() else []
                adapters = [{"id": name, "object": "model", "parent": args.model,
                             "root": engine.lora_paths.get(name, f"/adapters/{name}"), "max_model_len": args.max_model_len}
                            for name in listed]
                return self.reply(200, {"object": "list", "data": [
                    {"id": args.model, "object": "model", "max_model_len": args.max_model_len},
                    *adapters]})
            if self.path == "/get_server_info" and args.flavor == "sglang":
                return self.reply(200, {"page_size": args.block_size,
                                        "max_total_num_tokens": args.num_blocks * args.block_size,
                                        "version": args.sglang_version,
                                        "enable_lora": bool(args.lora_modules)})
            self.reply(404, {"error": {"message": "not found"}})

        def do_POST(self):
            try:
                body = self.body()
            except ValueError:
                return self.reply(400, {"error": {"message": "bad json"}})
            if self.path.startswith("/admin/"):
                return self.admin(self.path[len("/admin/"):], body)
            if self.path == "/v1/completions":
                engine.requests.append(body)
                return self.completions(body, sglang=False)
            if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and args.flavor == "vllm":
                return self.lora(self.path == "/v1/load_lora_adapter", body)
            if self.path in ("/load_lora_adapter", "/unload_lora_adapter") and args.flavor == "sglang":
                return self.sglang_lora(self.path == "/load_lora_adapter", body)
            if self.path == "/generate" and args.flavor == "sglang":
                engine.requests.append(body)
                return self.completions(body, sglang=True)
            self.reply(404, {"error": {"message": "not found"}})

        def admin(self, what, body):
            with engine.lock:
                if what == "state":
                    return self.reply(200, {"ranks": [r.state() for r in engine.ranks]})
                if what == "store":
                    hits = engine.ranks[body.get("rank", 0)].cache(body["tokens"], None, body.get("priority", 0))
                    return self.reply(200, {"cached_tokens": hits})
                if what == "priorities":
                    return self.reply(200, {"ranks": [r.priorities() for r in engine.ranks]})
                if what == "drop_next":
                    for r in engine.ranks:
                        r.drop, r.forget = body.get("count", 1), body.get("forget", False)
                    return self.reply(200, {})
                if what == "restart":
                    engine.pd.restart()
                    for r in engine.ranks:
                        r.restart()
                    return self.reply(200, {})
                if what == "clear":
                    for r in engine.ranks:
                        r.clear()
                    return self.reply(200, {})
                if what == "transfers":
                    return self.reply(200, {"received": engine.pd.received, "handed_over": engine.pd.handed_over,
                                            "engine_id": engine.pd.engine_id})
                if what == "script":
                    engine.scripts.append([int(t) for t in body["tokens"]])
                    return self.reply(200, {"scripts": len(engine.scripts)})
                if what == "requests":
                    return self.reply(200, {"requests": list(engine.requests)})
                if what == "hold_prefill":
                    (engine.prefill_gate.clear if body.get("hold", True) else engine.prefill_gate.set)()
                    return self.reply(200, {})
                if what == "lose_rooms":
                    engine.pd.lose_rooms = body.get("count", 1)
                    return self.reply(200, {})
                if what == "malformed":
                    engine.ranks[body.get("rank", 0)].malformed()
                    return self.reply(200, {})
            self.reply(404, {"error": {"message": "unknown admin action"}})

        def lora(self, load, body):
            """vLLM's run-time LoRA endpoints (VLLM_ALLOW_RUNTIME_LORA_UPDATING): 200 with a
            sentence, 400 for a name already loaded or not loaded."""
            name = body.get("lora_name")
            with engine.lock:
                if not isinstance(name, str) or not name or (load and not body.get("lora_path")):
                    return self.reply(400, {"error": {"message": "lora_name and lora_path are required"}})
                if load == (name in args.lora_modules):
                    what = "has already been loaded" if load else "cannot be found"
                    return self.reply(400, {"error": {"message": "The lora adapter '%s' %s." % (name, what),
                                                      "type": "BadRequestError", "code": 400}})
                if load:
                    args.lora_modules.append(name)
                else:
                    args.lora_modules.remove(name)
            verb = "added" if load else "removed"
            self.reply(200, "Success: LoRA adapter '%s' %s successfully." % (name, verb), "text/plain")

        def sglang_lora(self, load, body):
            """SGLang's run-time LoRA endpoints: `LoadLoRAAdapterReqOutput` (success,
            error_message, loaded_adapters: name -> path) with 200, or 400 when it failed."""
            name = body.get("lora_name")
            with engine.lock:
                error = None
                if not isinstance(name, str) or not name or (load and not body.get("lora_path")):
                    error = "lora_name and lora_path are required"
                elif load and name in args.lora_modules:
                    error = "The LoRA adapter with name '%s' is already loaded." % name
                elif not load and name not in args.lora_modules:
                    error = "LoRA adapter '%s' is not loaded." % name
                elif load:
                    args.lora_modules.append(name)
                    engine.lora_paths[name] = body["lora_path"]
                else:
                    args.lora_modules.remove(name)
                    engine.lora_paths.pop(name, None)
                loaded = {n: engine.lora_paths.get(n, f"/adapters/{n}") for n in args.lora_modules}
            self.reply(200 if error is None else 400,
                       {"success": error is None, "error_message": error, "loaded_adapters": loaded})

        def completions(self, body, sglang):
            prompt = body.get("input_ids") if sglang else body.get("prompt")
            sp = body.get("sampling_params", {}) if sglang else body
            max_tokens = sp.get("max_new_tokens" if sglang else "max_tokens") or 16
            if (not isinstance(prompt, list) or not prompt
                    or not all(isinstance(t, int) and t >= 0 for t in prompt)):
                return self.reply(400, {"error": {"message": "prompt must be a non-empty list of token ids",
                                                  "type": "BadRequestError", "code": 400}})
            # vLLM serves the base model and each LoRA module under its own name; SGLang names
            # the adapter in `lora_path`.
            priority = body.get("priority")
            if priority is not None:
                # SGLang keeps a priority for its radix cache under the priority eviction policy
                # (a server without --abort-on-priority-when-disabled takes it either way).
                scheduling = (args.enable_priority_scheduling or args.radix_eviction_policy == "priority"
                              if sglang else args.scheduling_policy == "priority")
                if isinstance(priority, bool) or not isinstance(priority, int):
                    return self.reply(400, {"error": {"message": "priority must be an integer",
                                                      "type": "BadRequestError", "code": 400}})
                if not scheduling and (sglang or priority != 0):
                    return self.reply(400, {"error": {"message": "Got priority %d but Priority scheduling is not enabled." % priority,
                                                      "type": "BadRequestError", "code": 400}})
            model = body.get("lora_path") if sglang else body.get("model")
            lora = model if model in args.lora_modules else None
            if not sglang and model != args.model and lora is None:
                return self.reply(404, {"error": {"message": "The model `%s` does not exist." % model,
                                                  "type": "NotFoundError", "param": None, "code": 404}})
            if len(prompt) + max_tokens > args.max_model_len:
                return self.reply(400, {"error": {"message": "This model's maximum context length is %d tokens" % args.max_model_len,
                                                  "type": "BadRequestError", "code": 400}})
            kvp = body.get("kv_transfer_params") if args.kv_transfer and not sglang else None
            kvp = kvp if isinstance(kvp, dict) else {}
            room = body.get("bootstrap_room") if sglang else None
            if sglang and args.disaggregation_mode != "null" and room is None:
                return self.reply(400, {"error": {"message": "a %s-mode server needs bootstrap_host, bootstrap_port "
                                                  "and bootstrap_room" % args.disaggregation_mode}})
            stops = set(sp.get("stop_token_ids") or [])
            with engine.lock:
                rank = engine.pick_rank()
                script = engine.scripts.popleft() if engine.scripts else None
            failure = None
            if kvp.get("do_remote_prefill") or (room is not None and args.disaggregation_mode == "decode"):
                failure = engine.pd.receive(rank, prompt, body, sglang)
            # SGLang's cache_unfinished_req / cache_finished_req: `req.priority or 0`.
            eviction = (priority or 0) if sglang else 0
            with engine.lock:
                cached = rank.cache(prompt, lora, eviction)
                engine.stats["prompt"] += len(prompt)
                engine.stats["cached"] += cached
                engine.stats["running"] += 1
            stream = bool(body.get("stream"))
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
            out, finish = [], None
            try:
                if room is not None and args.disaggregation_mode == "prefill":
                    # SGLang's prefill finishes only once the decode side took the KV.
                    max_tokens = 1
                    if not engine.pd.sglang_wait(room, prompt):
                        failure = "bootstrap timeout: no decode engine took room %s" % room
                engine.prefill_gate.wait(timeout=60)
                seed = body.get("seed") or sp.get("sampling_seed") or 0
                events = []
                steps = max_tokens if script is None else min(max_tokens, len(script))
                for i in range(0 if failure else steps):
                    tok = (prompt[-1] * 31 + i * 7 + seed) % 50000 + 1 if script is None else script[i]
                    out.append(tok)
                    if script is not None and i + 1 == len(script):
                        finish = "stop"
                    elif tok in stops and not sp.get("ignore_eos"):
                        finish = "stop"
                    elif i + 1 == max_tokens:
                        finish = "length"
                    if sglang:
                        events.append(self.sglang_event(body, prompt, cached, out, finish))
                    else:
                        choice = {"index": 0, "text": " t%d" % tok, "finish_reason": finish, "stop_reason": None}
                        if body.get("return_token_ids"):
                            choice["token_ids"] = [tok]
                        if body.get("logprobs") is not None:
                            as_ids = body.get("return_tokens_as_token_ids")
                            name = (lambda t: "token_id:%d" % t) if as_ids else (lambda t: " t%d" % t)
                            chosen, top = logprobs_of(tok, int(body["logprobs"]))
                            alternatives = {name(t): lp for lp, t in top}
                            alternatives[name(tok)] = chosen  # vLLM adds the sampled token
                            choice["logprobs"] = {"tokens": [name(tok)], "token_logprobs": [chosen],
                                                  "top_logprobs": [alternatives], "text_offset": [0]}
                        events.append({"id": "cmpl-1", "object": "text_completion", "model": args.model,
                                       "choices": [choice], "usage": None})
                    if stream:
                        self.event(events[-1])
                    if finish:
                        break
                    time.sleep(args.token_delay_ms / 1000.0)
                if failure:
                    events.append(self.sglang_event(body, prompt, cached, out, "abort", failure))
                    if stream:
                        self.event(events[-1])
                usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                         "total_tokens": len(prompt) + len(out), "prompt_tokens_details": {"cached_tokens": cached}}
                if not sglang and stream:
                    self.event({"id": "cmpl-1", "object": "text_completion", "model": args.model, "choices": [],
                                "usage": usage})
                if stream:
                    self.chunk(b"data: [DONE]\n\n")
                    self.chunk(b"")
                elif sglang:
                    self.reply(200, events[-1])
                else:
                    answer = {"id": "cmpl-1", "object": "text_completion", "model": args.model, "usage": usage,
                              "choices": [{"index": 0, "text": "".join(e["choices"][0]["text"] for e in events),
                                           "token_ids": out if body.get("return_token_ids") else None,
                                           "finish_reason": finish, "stop_reason": None}]}
                    if kvp.get("do_remote_decode") and finish == "length":
                        answer["kv_transfer_params"] = engine.pd.vllm_hold(prompt)
                    self.reply(200, answer)
                with engine.lock:
                    rank.cache(prompt + out, lora, eviction)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away: the request is aborted
            finally:
                with engine.lock:
                    engine.stats["running"] -= 1

        def sglang_event(self, body, prompt, cached, out, finish, message=None):
            reason = {"type": finish, "message": message} if finish else None
            meta = {"id": body.get("rid"), "prompt_tokens": len(prompt), "cached_tokens": cached,
                    "completion_tokens": len(out), "finish_reason": reason}
            if body.get("return_logprob"):
                k = int(body.get("top_logprobs_num") or 0)
                meta["output_token_logprobs"] = [[logprobs_of(t, k)[0], t, None] for t in out]
                meta["output_top_logprobs"] = [[[lp, a, None] for lp, a in logprobs_of(t, k)[1]] for t in out]
            return {"text": "t" * len(out), "output_ids": list(out), "meta_info": meta}

        def event(self, obj):
            self.chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(self, data):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    return Handler


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--zmq-port", type=int, default=0)
    p.add_argument("--replay-port", type=int, default=0)
    p.add_argument("--dp-ranks", type=int, default=1)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--buffer-steps", type=int, default=64)
    p.add_argument("--encoding", choices=["positional", "map"], default="positional")
    p.add_argument("--hash-bytes", action="store_true")
    p.add_argument("--flavor", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--sglang-version", default="0.5.23",
                   help="the version /get_server_info reports; below 0.5.5 /v1/models lists no "
                        "LoRA adapter, as SGLang before 0.5.5")
    p.add_argument("--topic", default="")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--lora-modules", nargs="*", default=[],
                   help="LoRA adapter names listed in /v1/models (vLLM's --lora-modules NAME=PATH)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--token-delay-ms", type=float, default=2.0)
    p.add_argument("--kv-transfer", action="store_true",
                   help="vLLM: act as with --kv-transfer-config NixlConnector (kv_transfer_params)")
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                   help="SGLang: bootstrapped prefill or decode server")
    p.add_argument("--bootstrap-port", type=int, default=0,
                   help="SGLang bootstrap server / vLLM NIXL side channel port (0 = any free one)")
    p.add_argument("--transfer-timeout", type=float, default=30.0,
                   help="seconds held KV waits for its decode side")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="vLLM: 'priority' accepts a non-zero request priority")
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="SGLang: accept a request priority on /generate")
    p.add_argument("--radix-eviction-policy", choices=["lru", "priority"], default="lru",
                   help="SGLang: 'priority' evicts by the requests' priorities (max along each "
                        "path, smallest first), as SGLang's PriorityStrategy")
    args = p.parse_args()
    engine = Engine(args)
    server = ThreadingHTTPServer(("127.0.0.1", args.http_port), make_handler(engine))
    server.daemon_threads = True
    print("READY " + json.dumps({"http": server.server_address[1], "zmq": engine.zmq_port,
                                 "replay": engine.replay_port, "bootstrap": engine.pd.port}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
