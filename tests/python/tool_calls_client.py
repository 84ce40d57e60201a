"""Tool calls and reasoning through a Switchyard gateway with the official OpenAI Python SDK.

Usage: python3 tests/python/tool_calls_client.py http://HOST:PORT/v1 MODEL
The engine behind the gateway has been scripted (by the calling test) to answer the next two
requests with a reasoning block and a `get_weather` tool call. Exits non-zero on any mismatch.
"""

import json
import sys

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]},
    },
}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WANT_ARGS = {"city": "Paris", "unit": "celsius"}


def main(base_url: str, model: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)

    chat = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls", chat
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1, chat
    assert calls[0].type == "function" and calls[0].id.startswith("call_"), calls[0]
    assert calls[0].function.name == "get_weather", calls[0]
    assert json.loads(calls[0].function.arguments) == WANT_ARGS, calls[0].function.arguments
    assert choice.message.content is None, choice.message
    reasoning = getattr(choice.message, "reasoning_content", None)
    assert reasoning and "weather" in reasoning, choice.message

    # The assistant turn goes back with the tool's answer: the template renders both.
    follow = MESSAGES + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"}]

    stream = client.chat.completions.create(model=model, messages=follow, tools=TOOLS, max_tokens=200,
                                            stream=True)
    names, args, reasoning, finish = [], {}, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.function.name:
                names.append(call.function.name)
            args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"], names
    assert json.loads(args[0]) == WANT_ARGS, args
    assert "weather" in reasoning, reasoning
    assert finish == "tool_calls", finish
    print("openai sdk tool calls: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
