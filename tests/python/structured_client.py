"""Structured output and compulsory tool calls through `switchyard up` with the official OpenAI
Python SDK. The simulated engine writes a valid answer for the constraint it is given.

Usage: python3 tests/python/structured_client.py http://HOST:PORT/v1
Exits non-zero on any mismatch.
"""

import json
import sys

from openai import OpenAI

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "temperature": {"type": "integer", "minimum": -40, "maximum": 50},
        "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain"]},
    },
    "required": ["city", "temperature", "conditions"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris, as JSON."}]


def check_schema(value):
    assert set(value) == {"city", "temperature", "conditions"}, value
    assert isinstance(value["city"], str), value
    assert isinstance(value["temperature"], int) and -40 <= value["temperature"] <= 50, value
    assert value["conditions"] in ("sunny", "cloudy", "rain"), value


def main(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}

    chat = client.chat.completions.create(model="sim-8b", messages=MESSAGES, max_tokens=200,
                                          response_format=fmt, seed=7)
    check_schema(json.loads(chat.choices[0].message.content))
    assert chat.choices[0].finish_reason == "stop", chat

    # Streamed, and the same seed gives the same answer.
    text = ""
    for chunk in client.chat.completions.create(model="sim-8b", messages=MESSAGES, max_tokens=200,
                                                response_format=fmt, seed=7, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == chat.choices[0].message.content, (text, chat.choices[0].message.content)

    obj = client.chat.completions.create(model="sim-8b", messages=MESSAGES, max_tokens=100,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict), obj

    # vLLM's extension, on the text endpoint.
    choice = client.completions.create(model="sim-8b", prompt="Yes or no?", max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no"), choice

    named = client.chat.completions.create(
        model="sim-8b", messages=MESSAGES, max_tokens=200, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_time", named
    assert isinstance(json.loads(calls[0].function.arguments)["zone"], str), calls[0]

    required = client.chat.completions.create(model="sim-8b", messages=MESSAGES, max_tokens=300,
                                              tools=TOOLS, tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls, required
    for call in calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time"), call
        assert ("city" in args) if call.function.name == "get_weather" else ("zone" in args), call
    assert required.choices[0].finish_reason == "tool_calls", required

    # What the simulator cannot write is refused, by name at the gateway or by the engine.
    try:
        client.chat.completions.create(model="sim-8b", messages=MESSAGES, max_tokens=10,
                                       response_format={"type": "xml"})
        raise AssertionError("an unknown response_format type was accepted")
    except Exception as err:  # openai.BadRequestError
        assert getattr(err, "status_code", None) == 400, err
    print("openai sdk structured output: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
