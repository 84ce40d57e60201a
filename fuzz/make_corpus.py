#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into fuzz/corpus/<target>/.

The seeds are real inputs: the worked examples of shared/data/WIRE_FORMATS.md (vLLM's positional
and map batches, SGLang's, the replay framings), the request bodies of docs/openai-api.md and
the gateway's tests, the gRPC messages the worker and gateway exchange, and the chat templates
the gateway ships (built-in ChatML) or is tested with (Qwen3). Run it again after changing it;
the files are committed, and libFuzzer adds what it finds to its own working copy (fuzz/README.md).

    python3 fuzz/make_corpus.py        (needs the msgpack package, as the tests do)
"""
import hashlib
import json
import os
import struct
import sys

import msgpack

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- http_chat_body: request bodies, as clients send them -------------------------------------
bodies = {
    "chat_minimal": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "chat_full_sampling": {
        "model": "qwen3", "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Count to three."}],
        "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "seed": 7, "stop": ["\n\n", "END"], "presence_penalty": 0.1, "frequency_penalty": 0.2,
        "repetition_penalty": 1.1, "logit_bias": {"100": -5.0, "42": 2.5}, "n": 1,
        "stream": True, "stream_options": {"include_usage": True}, "user": "tenant-a",
        "ignore_eos": False, "stop_token_ids": [151645], "min_tokens": 1,
        "skip_special_tokens": True, "include_stop_str_in_output": False,
        "logprobs": False, "top_logprobs": 0},
    "chat_parts_and_tools": {
        "model": "m", "max_completion_tokens": 32,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "tool said so"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object",
                                                  "properties": {"city": {"type": "string"}}}}}]},
    "chat_unknown_field": {"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "store": True},
    "chat_bad_n": {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2},
    "chat_bad_temperature": {"model": "m", "messages": [{"role": "user", "content": "x"}],
                             "temperature": 3.5},
    "chat_logprobs": {"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "logprobs": True, "top_logprobs": 3},
    "chat_empty_messages": {"model": "m", "messages": [], "stop": ["a", "b"]},
    "chat_image_part": {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
    "chat_top_k_disabled": {"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "top_k": -1, "stop": "x"},
    "completion_text": {"model": "m", "prompt": "hello", "max_tokens": 8},
    "completion_tokens": {"model": "m", "prompt": [1, 2, 3], "stream": True},
    "completion_batch": {"model": "m", "prompt": [[1], [2]]},
    "completion_text_batch": {"model": "m", "prompt": ["a", "b"]},
    "completion_echo": {"model": "m", "prompt": "x", "echo": True},
    "completion_bad_logit_bias": {"model": "m", "prompt": "x", "logit_bias": {"abc": 1.0}},
    "completion_zero_max_tokens": {"model": "m", "prompt": "x", "max_tokens": 0},
    # /v1/responses bodies (the same target tries each body on every endpoint).
    "responses_text": {"model": "m", "input": "hi", "instructions": "be brief",
                       "max_output_tokens": 8, "temperature": 0, "stream": True},
    "responses_items_and_tools": {"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\": \"Paris\"}", "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"},
                   "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        "metadata": {"k": "v"}, "store": False},
    "responses_stateful": {"model": "m", "input": "x", "previous_response_id": "resp_1"},
    "responses_unknown_role": {"model": "m", "input": [{"role": "tool", "content": "x"}]},
    "messages_tools_round_trip": {
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C", "is_error": False}]}],
        "tools": [{"name": "w", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "stream": True, "metadata": {"user_id": "u"}},
    "messages_image_block": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
}
for name, body in bodies.items():
    write("http_chat_body", name, json.dumps(body))
write("http_chat_body", "not_utf8", b"{\"model\":\"\xff\xfe\"}")
write("http_chat_body", "truncated", "{\"model\":\"m\",\"messages\":[{\"role\":")
write("http_chat_body", "deep_nesting", "[" * 200 + "]" * 200)

# ---- zmq_event: KV-event payloads and messages ------------------------------------------------
H0, H1 = 2164874634404590027, 17270480062156288726  # WIRE_FORMATS.md 6.1
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]
positional = [1700000000.5, [
    ["BlockStored", [H0, H1], None, TOKENS, 4, None, "GPU", None],
    ["BlockRemoved", [H1], "GPU"],
    ["AllBlocksCleared"]], 0]
mapped = [1700000000.5, [
    {"type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None,
     "token_ids": TOKENS, "block_size": 4, "lora_id": None, "medium": "GPU",
     "lora_name": None, "extra_keys": [None, None], "group_idx": 0},
    {"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"},
    {"type": "AllBlocksCleared"}], 0]
sg0, sg1 = -3488128144981237669, 5674439469042975057  # WIRE_FORMATS.md 6.4
sglang_old = [1700000000.5, [["BlockStored", [sg0], None, [1, 2, 3, 4], 4, None],
                             ["BlockStored", [sg1], sg0, [5, 6, 7, 8], 4, None],
                             ["BlockRemoved", [sg1]]]]
sglang_map = [1700000000.5, [
    {"type": "BlockStored", "block_hashes": [sg0], "parent_block_hash": None,
     "token_ids": [1, 2, 3, 4], "block_size": 4, "medium": "GPU", "cache_salt": "s1"},
    {"type": "BlockStored", "block_hashes": [sg1], "parent_block_hash": sg0,
     "token_ids": [[5, 6], [6, 7], [7, 8], [8, 9]], "block_size": 4},
    {"type": "BlockStored", "block_hashes": [99], "parent_block_hash": sg1,
     "token_ids": [9, 10], "block_size": 2, "medium": "EXTERNAL"}], 1]
d0 = hashlib.sha256(b"a").digest()
d1 = hashlib.sha256(b"b").digest()
bytes_hashes = {"ts": 1.5, "events": [
    {"type": "BlockStored", "block_hashes": [d0, d1], "parent_block_hash": None,
     "token_ids": TOKENS, "block_size": 4, "medium": "CPU", "lora_name": "adapter-a",
     "extra_keys": [[["mm", 1]], None], "group_idx": 1,
     "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 128},
    {"type": "BlockRemoved", "block_hashes": [d1], "medium": "DISK", "group_idx": 1},
    {"type": "Unknown", "x": 1}], "data_parallel_rank": 1}
payloads = {
    "vllm_positional": positional, "vllm_map": mapped, "sglang_positional": sglang_old,
    "sglang_map_bigram_partial": sglang_map, "vllm_bytes_hashes_groups": bytes_hashes,
    "empty_batch": [1.0, []],
}
topic = b"kv-events"


def frames(*fs):
    return b"".join(struct.pack(">H", len(f)) + f for f in fs)


for i, (name, value) in enumerate(payloads.items()):
    payload = msgpack.packb(value, use_bin_type=True)
    write("zmq_event", "payload_" + name, bytes([i % 2]) + payload)
    seq = struct.pack(">Q", i)
    write("zmq_event", "live_" + name, bytes([0x04 | (i % 2)]) + frames(topic, seq, payload))
    if i % 2:
        replay = frames(b"", topic, seq, payload)  # vLLM >= 0.26, SGLang
    else:
        replay = frames(b"", seq, payload)  # vLLM <= 0.25
    write("zmq_event", "replay_" + name, bytes([0x08]) + replay)
write("zmq_event", "replay_end_marker", bytes([0x08]) + frames(b"", b"\xff" * 8, b""))
write("zmq_event", "live_short_seq", bytes([0x04]) + frames(topic, b"\x00\x01", b"\x90"))

# ---- trtllm_events: trtllm-serve's /kv_cache_events bodies ------------------------------------
# In the shape of TensorRT-LLM's KVCacheEventSerializer (tensorrt_llm/_utils.py); polls are
# separated by a 0x00 byte.
def trt_block(h, ids, level=0, **extra):
    b = {"type": "stored_block", "block_hash": h, "cache_level": level, "priority": 35,
         "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids],
         "mm_keys": [], "cache_salt": None}
    b.update(extra)
    return b


def trt(i, data, **env):
    e = {"event_id": i, "data": data, "window_size": 4096}
    e.update(env)
    return e


trt_created = {"type": "created", "num_blocks_per_cache_level": [128, 64]}
trt_polls = {
    "stored_removed": [[trt(0, trt_created), trt(1, {"type": "stored", "parent_hash": None, "blocks": [
        trt_block(11, [1, 2]), trt_block(12, [3, 4]), trt_block(13, [5])]}),
        trt(2, {"type": "removed", "block_hashes": [12, 13]})]],
    "wrap_and_restart": [[trt(0, trt_created), trt(1, {"type": "stored", "parent_hash": None,
                                                    "blocks": [trt_block(11, [1, 2])]})],
                         [trt(5, {"type": "stored", "parent_hash": 11, "blocks": [trt_block(12, [3, 4])]})],
                         [trt(0, trt_created)]],
    "updated_tiers": [[trt(0, {"type": "stored", "parent_hash": None, "blocks": [
        trt_block(11, [1, 2]), trt_block(12, [3, 4], 1)]}),
        trt(1, {"type": "updated", "block_hash": 11,
                "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
                "priority": {"type": "event_diff", "new_value": 35, "old_value": 35}})]],
    "windows_ranks_groups": [[trt(0, trt_created, window_size=512), trt(1, trt_created),
                              trt(2, {"type": "stored", "parent_hash": None,
                                      "blocks": [trt_block(11, [1, 2])]}, window_size=512),
                              trt(0, {"type": "stored", "parent_hash": None,
                                      "blocks": [trt_block(11, [1, 2], lora_id=3, cache_salt="s")]},
                                  attention_dp_rank=1, layer_group_id=1),
                              trt(9, {"type": "removed", "block_hashes": [11]}, attention_dp_rank=7)]],
    "hashes_hex_signed_big": [[trt(0, {"type": "stored", "parent_hash": None, "blocks": [
        trt_block(18000000000000000000, [1, 2]), trt_block(-5, [3, 4]),
        trt_block("ff" * 32, [5, 6], mm_keys=[{"type": "mm_key", "hash": "0102", "start_offset": 0}])]})]],
    "malformed": [[{"data": {"type": "removed"}}, trt(0, {"type": "teleported"}),
                   trt(1, {"type": "stored", "parent_hash": "zz", "blocks": None})]],
}
for name, trt_bodies in trt_polls.items():
    write("trtllm_events", name, b"\x00".join(json.dumps(b).encode() for b in trt_bodies))
write("trtllm_events", "not_a_list", b'{"events": []}\x00<html>\x00[]')

# ---- proto_conversions: switchyard.v1 messages -----------------------------------------------


def varint(n):
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(field, wire):
    return varint(field << 3 | wire)


def f_varint(field, n):
    return key(field, 0) + varint(n)


def f_bytes(field, b):
    if isinstance(b, str):
        b = b.encode()
    return key(field, 2) + varint(len(b)) + b


def f_float(field, x):
    return key(field, 5) + struct.pack("<f", x)


def packed(field, values):
    return f_bytes(field, b"".join(varint(v) for v in values))


def stored(parent, blocks, tier):
    body = b"" if parent is None else f_varint(1, parent)
    for h, toks in blocks:
        body += f_bytes(2, f_varint(1, h) + packed(2, toks))
    return body + f_varint(3, tier)


def kv_event(seq, kind, body):
    return f_varint(1, seq) + f_bytes(kind, body)


def response(incarnation, payload_field, payload):
    return f_bytes(1, "worker-1") + f_varint(2, incarnation) + f_bytes(payload_field, payload)


def delimited(*msgs):
    return b"".join(varint(len(m)) + m for m in msgs)


# Switchyard's own chain hash is xxh3 over tokens (docs/block-hash.md); these are arbitrary,
# which the verified index refuses and the trusted one stores.
h = [11, 22]
snapshot = f_varint(1, 0) + f_bytes(2, f_varint(1, h[0]) + f_varint(3, 0)) + \
    f_bytes(2, f_varint(1, h[1]) + f_varint(2, h[0]) + f_varint(3, 1))
ev_stored = kv_event(0, 2, stored(None, [(h[0], [1, 2, 3, 4]), (h[1], [5, 6, 7, 8])], 0))
ev_removed = kv_event(1, 3, packed(1, [h[1]]) + f_varint(2, 0))
ev_cleared = kv_event(2, 4, b"")
stream = delimited(response(1, 4, snapshot), response(1, 3, ev_stored), response(1, 3, ev_removed),
                   response(1, 3, ev_cleared))
write("proto_conversions", "kv_stream_snapshot_then_events", b"\x00" + stream)
write("proto_conversions", "kv_stream_gap_and_new_incarnation", b"\x00" + delimited(
    response(1, 4, f_varint(1, 5)), response(1, 3, kv_event(7, 4, b"")),
    response(2, 4, f_varint(1, 0)), response(2, 3, ev_stored)))
write("proto_conversions", "kv_stream_seq_near_max", b"\x00" + delimited(
    response(1, 4, f_varint(1, (1 << 64) - 2)), response(1, 3, kv_event((1 << 64) - 2, 4, b""))))
worker_info = f_bytes(1, "worker-1") + f_bytes(2, "127.0.0.1:7001") + f_bytes(3, "qwen3") + \
    f_varint(4, 3) + f_varint(5, 16) + f_varint(6, 4096) + f_varint(7, 32768) + \
    f_bytes(8, "sim") + f_varint(9, 12345) + f_varint(10, 1)
write("proto_conversions", "worker_info", b"\x01" + worker_info)
write("proto_conversions", "worker_info_vllm_prefill",
      b"\x01" + worker_info.replace(b"sim", b"vllm") + f_varint(4, 1))
write("proto_conversions", "worker_info_zero_block_size", b"\x01" + f_bytes(1, "w") +
      f_varint(4, 3) + f_bytes(8, "sglang"))
sampling = f_varint(1, 64) + f_float(2, 0.7) + f_varint(3, 42) + f_varint(4, 1) + \
    packed(5, [151645]) + f_float(6, 0.9) + f_varint(7, 40)
generate = f_bytes(1, "req-1") + packed(2, [1, 2, 3, 4, 5]) + f_bytes(3, sampling)
write("proto_conversions", "generate_request", b"\x02" + generate)
write("proto_conversions", "generate_request_no_sampling", b"\x02" + f_bytes(1, "req-2"))
load = f_bytes(1, "worker-1") + b"".join(f_varint(i, i * 10) for i in range(2, 12)) + \
    f_varint(12, 2) + f_varint(13, 1) + f_varint(14, 1700000000000)
write("proto_conversions", "load_report", b"\x03" + load)
write("proto_conversions", "control_set_role", b"\x04" + f_bytes(1, f_varint(1, 1)))
write("proto_conversions", "control_drain", b"\x04" + f_bytes(2, f_varint(1, 500)))
write("proto_conversions", "control_unknown_role", b"\x04" + f_bytes(1, f_varint(1, 9)))
write("proto_conversions", "kv_event_stored", b"\x05" + ev_stored)
write("proto_conversions", "kv_event_removed_host", b"\x05" +
      kv_event(3, 3, packed(1, [1, 2, 3]) + f_varint(2, 1)))
write("proto_conversions", "kv_event_no_kind", b"\x05" + f_varint(1, 9))

# ---- chat_template: conversations and templates ------------------------------------------------
here = os.path.dirname(os.path.abspath(__file__))
qwen3 = open(os.path.join(here, "../crates/switchyard-tokenize/tests/fixtures/qwen3_chat_template.jinja")).read()
builtin_src = open(os.path.join(here, "../crates/switchyard-tokenize/src/builtin.rs")).read()
start = builtin_src.index('BUILTIN_CHAT_TEMPLATE: &str = "') + len('BUILTIN_CHAT_TEMPLATE: &str = "')
end = builtin_src.index('";', start)
builtin = builtin_src[start:end].replace("\\\n", "").encode().decode("unicode_escape")

conversations = {
    "simple": {"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hello!"}]},
    "multi_turn_no_gen": {"messages": [{"role": "user", "content": "a"},
                                       {"role": "assistant", "content": "b"},
                                       {"role": "user", "content": "c"}],
                          "add_generation_prompt": False},
    "tools": bodies["chat_parts_and_tools"],
    "thinking_off": {"messages": [{"role": "user", "content": "x"}],
                     "template_kwargs": {"enable_thinking": False}},
    "assistant_reasoning": {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhm\n</think>\n\nanswer"},
        {"role": "user", "content": "q2"}]},
    "no_user": {"messages": [{"role": "system", "content": "only system"}]},
}
for name, conv in conversations.items():
    conv = {k: v for k, v in conv.items() if k not in ("model", "max_completion_tokens")}
    write("chat_template", "conv_" + name, "0" + json.dumps(conv))
simple = json.dumps(conversations["simple"])
write("chat_template", "template_qwen3", "1" + qwen3 + "\0" + json.dumps(conversations["tools"]))
write("chat_template", "template_builtin", "1" + builtin + "\0" + simple)
write("chat_template", "template_loops", "1{% for i in range(100000) %}{% for j in range(100000) %}"
      "{{ i }}{% endfor %}{% endfor %}\0" + simple)
write("chat_template", "template_huge_string", "1{% set s = 'x' * 100000000 %}{{ s }}")
write("chat_template", "template_macro_recursion",
      "1{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
write("chat_template", "template_raise", "1{{ raise_exception('roles must alternate') }}")
write("chat_template", "template_syntax_error", "1{% for m in messages %}{{ m.content ")
print("corpus written to", ROOT, file=sys.stderr)
