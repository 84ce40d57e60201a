#!/usr/bin/env python3
"""Publishes a scripted KV-event sequence through an engine's OWN publisher code.

The event classes, KVEventBatch, KVEventsConfig, EventPublisherFactory and ZmqEventPublisher
(PUB socket, per-rank sequence numbers, replay ROUTER with its buffer, DP-rank port offsets)
are the real modules of a vLLM or SGLang release, fetched by fetch.py and imported through
shims.py. SGLang stores and removals can also go through SGLang's real KVCacheEventRecorder
(page split and merging, partial and bigram pages, hash namespacing). One publisher per
data-parallel rank, all in this process, as the engine's schedulers would create them.

    publisher.py --engine vllm --version 0.23.0 --dp-ranks 2 --script -

Output (stdout, one line each, JSON after the word):
  READY {"pub_ports": [...], "replay_ports": [...], "pub": [...], "replay": [...]}
        once the sockets are bound. Ports are free ones chosen here unless --pub-port and
        --replay-port are given; rank r uses port + r, as the engines do.
  PUBLISHED {"rank": r, "seq": n, "events": [type, ...]}   after a step's batch went out
        (or was dropped on purpose) and entered the replay buffer
  OK {...}   after any other step (nothing to publish)
  DONE {"batches": [per rank]}   at the end of the script; the replay sockets then stay up for
        --linger seconds (-1, the default: until killed)

Script: a JSON file {"steps": [...]} or a list, or `-`: one step per stdin line (the tests
drive it step by step and wait for each answer). A step is one of
  {"rank": r, "events": [EVENT, ...]}   one KVEventBatch published by rank r (default 0)
  {"drop_live": n, "rank": r}           rank r's next n batches are not sent live but still
                                        enter the real replay buffer: a gap replay can repair
  {"probe": true, "rank": r}            an empty batch (engines never send one): lets a test
                                        see that a subscriber receives rank r
  {"sleep": seconds}
EVENT, any engine: {"type": "BlockStored"|"BlockRemoved"|"AllBlocksCleared", <its fields>};
  fields the release's class lacks are dropped (noted on stderr); a hash is an int or
  {"hex": "..."} (bytes).
EVENT, vLLM helpers. Hashes are computed as vLLM does by default (sha256 over the pickle of
  (parent digest, tokens, extra keys)) and folded by vLLM's maybe_convert_block_hash (u64, or
  the 32 raw bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0):
  {"type": "StoreSeq", "tokens": [...], "block_size": B, "from_block": k, "to_block": m,
   "extra_keys": [per block], <other BlockStored fields>}
      what BlockPool.cache_full_blocks emits for blocks k..m (medium GPU, group_idx 0 unless
      given); `extra_keys` also enter the hashes, as in vLLM
  {"type": "RemoveSeq", "tokens": [...], "block_size": B, "blocks": [i, ...], "medium": ...,
   "group_idx": g, "extra_keys": [...]}
      one BlockRemoved per evicted block, as BlockPool does
EVENT, SGLang helpers (the real KVCacheEventRecorder, --page-size):
  {"type": "StoreNode", "id": "a", "parent": null|"id", "tokens": [...], "bigram": false,
   "extra_key": null, "cache_salt": null, "lora_name": null, "session_id": null, "medium": "GPU"}
  {"type": "RemoveNode", "id": "a", "medium": "GPU"}      {"type": "ClearAll"}
"""

import argparse
import hashlib
import json
import os
import pickle
import socket
import sys
import threading
import time
import types
from array import array

sys.dont_write_bytecode = True  # no __pycache__ in the repository or the module cache
import fetch  # noqa: E402
import shims  # noqa: E402


class DropProxy:
    """Wraps a publisher's PUB socket: batches whose sequence number is in `drop` are not sent
    (the publisher still buffers them for replay). Chosen by sequence number, not by timing."""

    def __init__(self, sock):
        self.sock, self.drop = sock, set()

    def send_multipart(self, frames, *args, **kwargs):
        seq = int.from_bytes(frames[1], "big")
        if seq in self.drop:
            self.drop.discard(seq)
            return None
        return self.sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def build(cls, spec, medium_cls=None):
    """An instance of the release's event class from a step's JSON fields."""
    import msgspec

    names = {f.name for f in msgspec.structs.fields(cls)}
    fields = {k: v for k, v in spec.items() if k != "type"}
    dropped = sorted(set(fields) - names)
    if dropped:
        print(f"note: {cls.__name__} of this release has no {dropped}; dropped", file=sys.stderr)
    fields = {k: v for k, v in fields.items() if k in names}

    def as_hash(v):
        return bytes.fromhex(v["hex"]) if isinstance(v, dict) else v

    if "block_hashes" in fields:
        fields["block_hashes"] = [as_hash(h) for h in fields["block_hashes"]]
    if fields.get("parent_block_hash") is not None:
        fields["parent_block_hash"] = as_hash(fields["parent_block_hash"])
    if medium_cls is not None and fields.get("medium") in {m.value for m in medium_cls}:
        fields["medium"] = medium_cls(fields["medium"])
    if cls.__name__ == "BlockStored":
        for required in ("lora_id", "medium", "lora_name"):  # no default in the classes
            if required in names:
                fields.setdefault(required, None)
    return cls(**fields)


class Vllm:
    def __init__(self, mods, args):
        self.k, self.config, self.args = mods["kv_events"], mods["config"], args
        self.convert = mods["kv_cache_utils"].maybe_convert_block_hash
        # vLLM's NONE_HASH seed (PYTHONHASHSEED, else 0.33's fixed string); opaque to consumers.
        self.none_hash = self.sha256(os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))

    @staticmethod
    def sha256(obj):  # vllm.utils.hashing.sha256, the default prefix_caching_hash_algo
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    def publisher(self, rank, pub_port, replay_port):
        a = self.args
        # vLLM binds its PUB socket only for wildcard endpoints (otherwise it connects).
        cfg = self.config.KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=a.buffer_steps,
            topic=a.topic)
        return self.k.EventPublisherFactory.create(cfg, rank)

    def digests(self, tokens, bs, extra_keys=None):
        out, parent = [], self.none_hash
        for i in range(len(tokens) // bs):
            extra = extra_keys[i] if extra_keys and extra_keys[i] is not None else None
            parent = self.sha256((parent, tuple(tokens[i * bs:(i + 1) * bs]),
                                  tuple(extra) if extra is not None else None))
            out.append(parent)
        return out

    def events(self, rank, specs):
        out = []
        for s in specs:
            kind = s["type"]
            if kind == "StoreSeq":
                bs, tokens = s["block_size"], s["tokens"]
                k, m = s.get("from_block", 0), s.get("to_block", len(tokens) // bs)
                d = self.digests(tokens, bs, s.get("extra_keys"))
                fields = {key: v for key, v in s.items()
                          if key not in ("type", "tokens", "from_block", "to_block")}
                if "extra_keys" in fields:
                    fields["extra_keys"] = fields["extra_keys"][k:m]
                fields.setdefault("medium", "GPU")
                fields.setdefault("group_idx", 0)
                out.append(build(self.k.BlockStored, dict(
                    fields, block_hashes=[self.convert(h) for h in d[k:m]],
                    parent_block_hash=self.convert(d[k - 1]) if k > 0 else None,
                    token_ids=tokens[k * bs:m * bs])))
            elif kind == "RemoveSeq":
                d = self.digests(s["tokens"], s["block_size"], s.get("extra_keys"))
                for i in s["blocks"]:
                    out.append(build(self.k.BlockRemoved, {
                        "block_hashes": [self.convert(d[i])], "medium": s.get("medium", "GPU"),
                        "group_idx": s.get("group_idx", 0)}))
            else:
                out.append(build(getattr(self.k, kind), s))
        return out


class Key:
    """The parts of SGLang's RadixKey that the recorder and the hash helpers read."""

    def __init__(self, tokens, extra_key=None, cache_salt=None, bigram=False):
        self.token_ids = array("q", tokens)
        self.extra_key, self.cache_salt, self.is_bigram = extra_key, cache_salt or None, bigram

    def raw_token_ids(self):
        return self.token_ids

    def __len__(self):
        n = len(self.token_ids)
        return max(0, n - 1) if self.is_bigram else n


class Node:
    """The parts of SGLang's TreeNode the recorder reads (the root has hash_value [])."""

    def __init__(self, key, parent):
        self.key, self.parent = key, parent
        self.hash_value = [] if parent is None else None
        self.event_hash_value = None


class Sglang:
    def __init__(self, mods, args):
        self.k, self.args = mods["kv_events"], args
        self.recorders, self.nodes = {}, {}
        self.root = Node(Key([]), None)
        self.names = mods["events"].KvEventLoraNames()
        self.recorder_cls = mods["events"].KVCacheEventRecorder

    def publisher(self, rank, pub_port, replay_port):
        a = self.args
        cfg = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub_port}", "bind": True,
               "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
               "buffer_steps": a.buffer_steps, "topic": a.topic, "format": a.sglang_format}
        return self.k.EventPublisherFactory.create(json.dumps(cfg), attn_dp_rank=rank)

    def recorder(self, rank):
        if rank not in self.recorders:
            self.recorders[rank] = self.recorder_cls(
                enabled=True, page_size=self.args.page_size,
                dynamo_format=self.args.sglang_format == "dynamo", lora_names=self.names)
        return self.recorders[rank]

    def events(self, rank, specs):
        rec = self.recorder(rank)

        def medium(s):
            return self.k.StorageMedium(s["medium"]) if s.get("medium") else None

        for s in specs:
            kind = s["type"]
            if kind == "StoreNode":
                parent = self.nodes[s["parent"]] if s.get("parent") else self.root
                key = Key(s["tokens"], s.get("extra_key"), s.get("cache_salt"), s.get("bigram", False))
                if s.get("lora_name") and s.get("extra_key"):
                    request = types.SimpleNamespace(lora_id="lora", extra_key=s["extra_key"])
                    self.names.register(request, s["lora_name"])
                node = self.nodes[s["id"]] = Node(key, parent)
                rec.record_store(node, medium(s), session_id=s.get("session_id"))
            elif kind == "RemoveNode":
                rec.record_remove(self.nodes[s["id"]], medium(s))
            elif kind == "ClearAll":
                rec.record_all_cleared()
            else:
                rec.enqueue(build(getattr(self.k, kind), s, self.k.StorageMedium))
        return rec.take()


def free_port_run(n):
    """A port p with p .. p+n-1 all free now (ranks offset the port; pub and replay share the
    run: pub = p, replay = p + ranks)."""
    for _ in range(200):
        held = []
        try:
            first = socket.socket()
            held.append(first)
            first.bind(("0.0.0.0", 0))
            base = first.getsockname()[1]
            for i in range(1, n):
                s = socket.socket()
                held.append(s)
                s.bind(("0.0.0.0", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise SystemExit("error: found no run of free ports")


def start_publishers(engine, args):
    """One real publisher per rank; with chosen ports, retried when another process takes a
    port between the check and the bind."""
    import zmq

    for _ in range(1 if args.pub_port else 10):
        if args.pub_port:
            pub, replay = args.pub_port, args.replay_port
        else:
            pub = free_port_run(2 * args.dp_ranks)
            replay = pub + args.dp_ranks
        pubs = []
        try:
            for r in range(args.dp_ranks):
                pubs.append(engine.publisher(r, pub, replay))
            return pubs, pub, replay
        except zmq.ZMQError as err:
            print(f"note: binding ports {pub}/{replay} failed ({err}); retrying", file=sys.stderr)
            for p in pubs:
                p.shutdown()
    raise SystemExit("error: could not bind the publishers' ports")


def steps_from(path):
    if path == "-":
        for line in iter(sys.stdin.readline, ""):
            if line.strip():
                yield json.loads(line)
        return
    with open(path) as f:
        doc = json.load(f)
    yield from (doc["steps"] if isinstance(doc, dict) else doc)


def say(word, obj):
    print(f"{word} {json.dumps(obj)}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    p.add_argument("--version", required=True, help="a release of fetch.MATRIX, e.g. 0.23.0")
    p.add_argument("--modules", default=None, help="default: fetch.py's cache directory")
    p.add_argument("--dp-ranks", type=int, default=1)
    p.add_argument("--pub-port", type=int, default=0, help="0: free ports chosen here")
    p.add_argument("--replay-port", type=int, default=0)
    p.add_argument("--script", required=True, help="a JSON file, or - for stdin")
    p.add_argument("--topic", default="")
    p.add_argument("--buffer-steps", type=int, default=10000)
    p.add_argument("--page-size", type=int, default=4, help="SGLang's page size")
    p.add_argument("--sglang-format", choices=["default", "dynamo"], default="default")
    p.add_argument("--linger", type=float, default=-1,
                   help="seconds to keep the replay sockets up after the script (-1: until killed)")
    args = p.parse_args()
    if bool(args.pub_port) != bool(args.replay_port):
        p.error("give both --pub-port and --replay-port, or neither")

    if (args.engine, args.version) not in fetch.MATRIX:
        p.error(f"{args.engine} {args.version} is not in fetch.py's MATRIX")
    missing = fetch.missing_files(args.engine, args.version, args.modules)
    if missing:
        where = fetch.release_dir(args.engine, args.version, args.modules)
        sys.exit(f"error: {args.engine} {args.version} modules missing or altered in {where} "
                 f"({', '.join(missing)}): run python3 tests/python/engines/fetch.py")
    mods = shims.install(args.engine, fetch.release_dir(args.engine, args.version, args.modules))
    engine = (Vllm if args.engine == "vllm" else Sglang)(mods, args)

    pubs, pub_port, replay_port = start_publishers(engine, args)
    proxies = []
    for pub in pubs:
        pub._pub = DropProxy(pub._pub)
        proxies.append(pub._pub)
    say("READY", {"engine": args.engine, "version": args.version,
                  "pub_ports": [pub_port + r for r in range(args.dp_ranks)],
                  "replay_ports": [replay_port + r for r in range(args.dp_ranks)],
                  "pub": [pb._endpoint for pb in pubs],
                  "replay": [pb._replay_endpoint for pb in pubs]})

    published = [0] * args.dp_ranks  # = the sequence number the rank's next batch gets
    for step in steps_from(args.script):
        rank = step.get("rank", 0)
        if "sleep" in step:
            time.sleep(step["sleep"])
            say("OK", step)
            continue
        if "drop_live" in step:
            proxies[rank].drop.update(range(published[rank], published[rank] + step["drop_live"]))
            say("OK", step)
            continue
        events = engine.events(rank, step.get("events", []))
        if not events and not step.get("probe"):
            say("OK", {"rank": rank, "events": []})
            continue
        pub = pubs[rank]
        pub.publish(mods["kv_events"].KVEventBatch(ts=time.time(), events=events))
        # The publisher thread sends, buffers, then marks the batch done: wait for that, so
        # PUBLISHED means the batch is on the wire (or dropped on purpose) and replayable.
        deadline = time.time() + 30
        while pub._event_queue.unfinished_tasks and time.time() < deadline:
            time.sleep(0.002)
        if pub._event_queue.unfinished_tasks:
            sys.exit(f"error: rank {rank}'s publisher thread did not send the batch")
        say("PUBLISHED", {"rank": rank, "seq": published[rank],
                          "events": [type(e).__name__ for e in events]})
        published[rank] += 1

    say("DONE", {"batches": published})
    try:
        threading.Event().wait(None if args.linger < 0 else args.linger)
    except KeyboardInterrupt:
        pass
    if args.engine == "vllm":  # SGLang's publishers shut themselves down at exit (atexit)
        for pub in pubs:
            pub.shutdown()


if __name__ == "__main__":
    main()
