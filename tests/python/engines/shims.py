"""Stub modules that let the engines' OWN KV-event modules import on their own.

`install(engine, release_dir)` makes the real files fetched by fetch.py importable
(release_dir = <cache>/<pkg>-<ver>) and returns the real modules. Only pyzmq, msgspec and
pydantic are needed (vLLM's `@config` is a pydantic dataclass, SGLang's KVEventsConfig a
pydantic BaseModel). The event classes, the publisher (PUB socket, sequence numbers, replay
ROUTER and its buffer, DP-rank port offsets), the config classes and, for SGLang, the event
recorder and its hash helpers are the releases' own code; what they import from the rest of
the engine (torch, CUDA kernels, psutil, the server machinery) is replaced here:

  stub                                           replaces / why
  vllm, sglang (packages, __path__ = release)    their __init__ imports the whole engine
  vllm.logger.init_logger = logging.getLogger    vllm/logger.py pulls vllm.logging_utils
  vllm.config.utils.config                       imports torch; same pydantic dataclass with
                                                 extra="forbid" as the real decorator
  vllm.v1.core.kv_cache_utils                    imports torch and the scheduler; kv_events.py
                                                 needs only ExternalBlockHash (bytes | int);
                                                 maybe_convert_block_hash is copied verbatim
                                                 (identical in 0.23.0 and 0.33.0)
  vllm.utils.network_utils (0.33)                imports psutil/urllib3; used only to bind
                                                 tcp://*:0
  sglang.srt.runtime_context.get_parallel        server-args machinery; only used by
                                                 is_kv_publisher_rank, never called here
  sglang.srt.utils.network.NetworkAddress        imports psutil and zmq.auth; only parses and
                                                 prints tcp endpoints
  sglang.kernels.ops.kvcache.mla_buffer,         top-level imports of mem_cache/utils.py that
  sglang.srt.environ,                            the hash helpers do not use (dummy classes)
  sglang.srt.mem_cache.evict_policy
  sglang.srt.mem_cache.cpp_utils.native_hash     a C++ extension compiled at run time with
                                                 torch; replaced by a pure-Python port of
                                                 hash_binding.cpp (checked against SGLang's
                                                 published values for tokens 1..8, page 4)
"""

import hashlib
import ipaddress
import logging
import os
import struct
import sys
import types
from dataclasses import dataclass
from typing import NewType


def _module(name, root, **attrs):
    """Registers a stub module `name`. Missing parent packages become empty stubs, unless the
    parent is a directory of the release (then Python imports it as a namespace package)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in sys.modules or os.path.isdir(os.path.join(root, *parts[:i])):
            continue
        pkg = types.ModuleType(parent)
        pkg.__path__ = []
        sys.modules[parent] = pkg
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _dummies(name, root):
    """A stub whose every public attribute is a dummy class (imports that are never used)."""
    mod = _module(name, root)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    mod.__getattr__ = __getattr__
    return mod


def _root_package(name, root):
    """The top-level package, without running the release's __init__ (not fetched anyway)."""
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(root, name)]
    sys.modules[name] = pkg


def _vllm(root):
    _root_package("vllm", root)
    import vllm.envs as envs  # real: stdlib only, reads os.environ lazily

    _module("vllm.logger", root, init_logger=logging.getLogger)

    def config(cls=None, *, config=None, **kwargs):
        from pydantic import ConfigDict
        from pydantic.dataclasses import dataclass as pydantic_dataclass

        merged = ConfigDict(extra="forbid")
        if config is not None:
            merged.update(config)

        def deco(c):
            return pydantic_dataclass(c, config=merged, **kwargs)

        return deco if cls is None else deco(cls)

    _module("vllm.config.utils", root, config=config)

    def maybe_convert_block_hash(hash_bytes):
        if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
            return hash_bytes
        return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)

    _module("vllm.v1.core.kv_cache_utils", root,
            BlockHash=NewType("BlockHash", bytes), ExternalBlockHash=bytes | int,
            maybe_convert_block_hash=maybe_convert_block_hash)

    def is_valid_ipv6_address(address):
        try:
            ipaddress.IPv6Address(address.split("%")[0])
            return True
        except ValueError:
            return False

    def split_zmq_path(path):
        scheme, _, rest = path.partition("://")
        host, _, port = rest.rpartition(":")
        return scheme, host.strip("[]"), port

    _module("vllm.utils.network_utils", root,
            get_ip=lambda: os.environ.get("VLLM_HOST_IP", "127.0.0.1"),
            get_tcp_uri=lambda ip, port: f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip)
            else f"tcp://{ip}:{port}",
            is_valid_ipv6_address=is_valid_ipv6_address, split_zmq_path=split_zmq_path)

    import vllm.config.kv_events as config_mod
    import vllm.distributed.kv_events as kv_events

    return {"kv_events": kv_events, "config": config_mod, "envs": envs,
            "kv_cache_utils": sys.modules["vllm.v1.core.kv_cache_utils"]}


def _native_hash(token_ids, prior_digest, page_size=None):
    """Port of sglang/srt/mem_cache/cpp_utils/hash_binding.cpp: per page, SHA-256(prior digest
    || tokens as uint32 LE), or a 0xff tag and uint64 LE words when a token exceeds uint32;
    bigram keys hash the (t_i, t_i+1) pairs. Hex digests, one per page (or one for all)."""
    raw_fn = getattr(token_ids, "raw_token_ids", None)
    raw = raw_fn() if raw_fn is not None else getattr(token_ids, "token_ids", token_ids)
    n = len(token_ids)
    bigram = getattr(token_ids, "is_bigram", False)

    def words(start, end):
        if bigram:
            return [w for i in range(start, end) for w in (raw[i], raw[i + 1])]
        return [int(t) for t in raw[start:end]]

    def page(prior, ws):
        d = hashlib.sha256()
        if prior is not None:
            d.update(prior)
        if any(w > 0xFFFFFFFF for w in ws):
            d.update(b"\xff" + struct.pack("<%dQ" % len(ws), *ws))
        elif ws:
            d.update(struct.pack("<%dI" % len(ws), *ws))
        return d.digest()

    if page_size is None:
        return page(prior_digest, words(0, n)).hex()
    out, prior = [], prior_digest
    for start in range(0, n, page_size):
        prior = page(prior, words(start, min(start + page_size, n)))
        out.append(prior.hex())
    return out


def _sglang(root):
    _root_package("sglang", root)
    parallel = types.SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0,
                                     attn_dp_size=1, attn_dp_rank=0, dp_rank=0)
    _module("sglang.srt.runtime_context", root, get_parallel=lambda: parallel)

    @dataclass
    class NetworkAddress:
        host: str
        port: int

        @property
        def is_ipv6(self):
            try:
                return isinstance(ipaddress.ip_address(self.host), ipaddress.IPv6Address)
            except ValueError:
                return False

        @classmethod
        def parse(cls, text):
            if text.startswith("["):
                host, _, rest = text[1:].partition("]")
                port = rest.lstrip(":")
            else:
                host, sep, port = text.rpartition(":")
                if not sep or ":" in host:
                    raise ValueError(f"cannot parse {text!r}")
            return cls(host, int(port))

        def to_tcp(self):
            return f"tcp://[{self.host}]:{self.port}" if self.is_ipv6 \
                else f"tcp://{self.host}:{self.port}"

    _module("sglang.srt.utils.network", root, NetworkAddress=NetworkAddress)
    for unused in ("sglang.kernels.ops.kvcache.mla_buffer", "sglang.srt.environ",
                   "sglang.srt.mem_cache.evict_policy"):
        _dummies(unused, root)
    _module("sglang.srt.mem_cache.cpp_utils.native_hash", root, get_native_hash=_native_hash)

    import sglang.srt.disaggregation.kv_events as kv_events
    import sglang.srt.mem_cache.events as events

    return {"kv_events": kv_events, "events": events}


def install(engine, release_dir):
    root = os.path.abspath(release_dir)
    if engine == "vllm":
        return _vllm(root)
    if engine == "sglang":
        return _sglang(root)
    raise ValueError(f"unknown engine {engine!r}")
