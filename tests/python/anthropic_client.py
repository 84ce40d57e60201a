"""Anthropic's Messages API through `switchyard up` with the official, unmodified `anthropic`
Python SDK: plain, with a system prompt, streamed (the same text as unstreamed at temperature
0, where the simulator's answer depends on the prompt alone), stop sequences, tool use and a
tool_result round trip, count_tokens, and the errors the SDK raises.

Usage: python3 tests/python/anthropic_client.py http://HOST:PORT API_KEY
Exits non-zero on any mismatch.
"""

import json
import sys

import anthropic

MODEL = "sim-8b"
# Greedy on the simulator. `temperature` goes in the body itself: the 2.x SDK no longer has a
# keyword for it, and the API still takes it.
T0 = {"temperature": 0}
MESSAGES = [{"role": "user", "content": "Tell me about Paris."}]
TOOLS = [{
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}]


def prompt_tokens(message) -> int:
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def expect(error_class, call, *names):
    """`call` raises `error_class` whose message names each of `names`."""
    try:
        call()
    except error_class as e:
        body = e.body if isinstance(e.body, dict) else {}
        assert body.get("type") == "error", body
        message = body["error"]["message"]
        for name in names:
            assert name in message, (name, message)
        return body["error"]["type"]
    raise AssertionError(f"expected {error_class.__name__} naming {names}")


def plain_system_and_streamed(client) -> str:
    m = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=T0,
                               metadata={"user_id": "user-1"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
    assert m.model == MODEL, m
    assert m.stop_reason in ("end_turn", "max_tokens"), m
    assert m.stop_sequence is None, m
    assert [b.type for b in m.content] == ["text"] and m.content[0].text, m
    assert 0 < m.usage.output_tokens <= 24, m.usage
    assert m.usage.cache_creation_input_tokens == 0, m.usage

    counted = client.messages.count_tokens(model=MODEL, messages=MESSAGES)
    assert counted.input_tokens == prompt_tokens(m), (counted, m.usage)

    s = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=T0,
                               system="You are terse.")
    counted_system = client.messages.count_tokens(model=MODEL, messages=MESSAGES,
                                                  system=[{"type": "text", "text": "You are terse."}])
    assert counted_system.input_tokens == prompt_tokens(s) > prompt_tokens(m), (counted_system, s.usage)

    with client.messages.stream(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=T0) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == m.content[0].text, (streamed, m.content[0].text)
    assert text_of(final) == streamed, final
    assert final.stop_reason == m.stop_reason, (final, m)
    assert final.usage.output_tokens == m.usage.output_tokens, (final.usage, m.usage)
    assert prompt_tokens(final) == prompt_tokens(m), (final.usage, m.usage)
    assert final.id.startswith("msg_"), final

    kinds = [e.type for e in client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES,
                                                    extra_body=T0, stream=True)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert kinds[-2] == "message_delta" and "content_block_delta" in kinds, kinds
    return m.content[0].text


def stop_sequences(client, text: str) -> None:
    """A word of the greedy answer as a stop sequence: the same answer, cut before it."""
    words = [w for w in text.split() if len(w) >= 2] or text.split()
    word = words[len(words) // 2]
    want = text[:text.find(word)]
    cut = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=T0,
                                 stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word, (cut, word)
    assert text_of(cut) == want, (text_of(cut), want, word)
    with client.messages.stream(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=T0,
                                stop_sequences=[word]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want, (streamed, want, word)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word, final


def tools(client) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.messages.create(model=MODEL, max_tokens=200, messages=ask, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert named.stop_reason == "tool_use", named
    uses = [b for b in named.content if b.type == "tool_use"]
    assert len(uses) == 1, named
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather", use
    assert isinstance(use.input, dict) and isinstance(use.input.get("city"), str), use.input

    with client.messages.stream(model=MODEL, max_tokens=200, messages=ask, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(streamed) == 1, final
    assert streamed[0].input == use.input and streamed[0].name == "get_weather", (streamed, use)

    anyone = client.messages.create(model=MODEL, max_tokens=200, messages=ask, tools=TOOLS,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    calls = [b for b in anyone.content if b.type == "tool_use"]
    assert anyone.stop_reason == "tool_use" and len(calls) == 1, anyone
    assert calls[0].name == "get_weather", calls

    # The call and its result go back; the answer is text again.
    follow = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in named.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "18 C and sunny"}]}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=16, messages=follow, tools=TOOLS,
                                    extra_body=T0)
    assert answer.stop_reason in ("end_turn", "max_tokens"), answer
    assert [b.type for b in answer.content] == ["text"], answer
    counted = client.messages.count_tokens(model=MODEL, messages=follow, tools=TOOLS)
    assert counted.input_tokens == prompt_tokens(answer), (counted, answer.usage)
    failed = follow[:-1] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "city not found", "is_error": True}]}]
    assert client.messages.create(model=MODEL, max_tokens=4, messages=failed, tools=TOOLS).content


def structured(client) -> None:
    """output_config.format: the engine writes an instance of the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string"},
              "conditions": {"type": "string", "enum": ["sunny", "rain"]}},
              "required": ["city", "conditions"], "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=200, messages=MESSAGES,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    value = json.loads(text_of(m))
    assert set(value) == {"city", "conditions"} and value["conditions"] in ("sunny", "rain"), value
    # An effort the simulated model's template has no switch for is advisory (taken); one
    # Anthropic does not define is refused by name.
    assert client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES,
                                  output_config={"effort": "high"}).content
    expect(anthropic.BadRequestError,
           lambda: client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES,
                                          output_config={"effort": "extreme"}),
           "output_config.effort")


def thinking(client) -> None:
    """The simulator's model has no reasoning parser: adaptive and disabled thinking are what it
    does already (no thinking blocks); asking for thinking is refused, by name."""
    for config in ({"type": "adaptive"}, {"type": "disabled"}):
        m = client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES, thinking=config)
        assert [b.type for b in m.content] == ["text"], (config, m)
    expect(anthropic.BadRequestError,
           lambda: client.messages.create(model=MODEL, max_tokens=2048, messages=MESSAGES,
                                          thinking={"type": "enabled", "budget_tokens": 1024}),
           "thinking", "reasoning parser")


def errors(client, base_url: str) -> None:
    # Unknown and advisory fields are taken (docs/anthropic-api.md); what would change the
    # answer is refused by name.
    taken = client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES,
                                   service_tier="auto", extra_body={"frobnicate": 1})
    assert taken.stop_reason in ("max_tokens", "end_turn"), taken
    kind = expect(anthropic.BadRequestError,
                  lambda: client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES,
                                                 extra_body={"container": "c_1"}),
                  "container")
    assert kind == "invalid_request_error", kind
    # NOT_GIVEN leaves the field out of the body.
    expect(anthropic.BadRequestError,
           lambda: client.messages.create(model=MODEL, max_tokens=anthropic.NOT_GIVEN, messages=MESSAGES),
           "max_tokens")
    expect(anthropic.BadRequestError,
           lambda: client.messages.create(model=MODEL, max_tokens=8,
                                          messages=[{"role": "wizard", "content": "hi"}]),
           "messages.0.role")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    expect(anthropic.BadRequestError,
           lambda: client.messages.create(model=MODEL, max_tokens=8, messages=[
               {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]),
           "messages.0.content.1", "image")
    kind = expect(anthropic.NotFoundError,
                  lambda: client.messages.create(model="no-such-model", max_tokens=8, messages=MESSAGES),
                  "no-such-model")
    assert kind == "not_found_error", kind
    stranger = anthropic.Anthropic(base_url=base_url, api_key="not-a-key", max_retries=0, timeout=60)
    kind = expect(anthropic.AuthenticationError,
                  lambda: stranger.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES))
    assert kind == "authentication_error", kind


def main(base_url: str, api_key: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
    text = plain_system_and_streamed(client)
    stop_sequences(client, text)
    tools(client)
    structured(client)
    thinking(client)
    errors(client, base_url)
    print("anthropic sdk: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
