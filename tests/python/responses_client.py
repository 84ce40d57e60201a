"""The Responses API (`/v1/responses`) through `switchyard up` with the official OpenAI Python SDK.
The simulated engine writes a valid answer for a constraint (a json_schema, a compulsory tool
call) and decodes greedily at temperature 0.

Usage: python3 tests/python/responses_client.py http://HOST:PORT/v1 MODEL
Exits non-zero on any mismatch.
"""

import json
import sys

import openai
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
    {"type": "function", "name": "get_weather", "description": "Current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
     "strict": True},
    {"type": "function", "name": "get_time", "description": "Local time in a zone",
     "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
     "strict": True},
]


def refused(call, param):
    try:
        call()
    except openai.BadRequestError as err:
        assert err.status_code == 400, err
        body = err.body if isinstance(err.body, dict) else {}
        got = body.get("param") or (body.get("error") or {}).get("param")
        assert got == param, (param, err.body)
        return
    raise AssertionError(f"accepted what should be refused by name: {param}")


def main(base_url: str, model: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)

    # Plain: the SDK's simplest call parses into a Response.
    plain = client.responses.create(model=model, input="Say hello.", max_output_tokens=16)
    assert plain.id.startswith("resp_"), plain
    assert plain.object == "response" and plain.model == model, plain
    assert plain.status in ("completed", "incomplete"), plain
    assert plain.output[0].type == "message" and plain.output[0].role == "assistant", plain
    assert plain.output_text, plain
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0, plain.usage
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    if plain.status == "incomplete":
        assert plain.incomplete_details.reason == "max_output_tokens", plain

    # Instructions are the first (system) message: the prompt grows; settings are echoed.
    told = client.responses.create(model=model, input="Say hello.", max_output_tokens=16,
                                   instructions="Answer in one short sentence.", temperature=0,
                                   metadata={"case": "instructions"}, user="tester")
    assert told.instructions == "Answer in one short sentence.", told
    assert told.usage.input_tokens > plain.usage.input_tokens, (told.usage, plain.usage)
    assert told.metadata == {"case": "instructions"}, told.metadata
    assert told.temperature == 0 and told.max_output_tokens == 16, told

    # A short limit ends the answer as incomplete.
    short = client.responses.create(model=model, input="Tell me a long story.", max_output_tokens=2,
                                    temperature=0)
    assert short.usage.output_tokens <= 2, short.usage
    if short.usage.output_tokens == 2:
        assert short.status == "incomplete", short
        assert short.incomplete_details.reason == "max_output_tokens", short

    # Streamed: the events in the API's order; the text is the whole answer's at temperature 0.
    ask = dict(model=model, input="Describe the sea.", max_output_tokens=24, temperature=0)
    whole = client.responses.create(**ask)
    kinds, deltas, sequence, final = [], "", [], None
    for event in client.responses.create(stream=True, **ask):
        kinds.append(event.type)
        sequence.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert sequence == list(range(len(sequence))), sequence
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    for a, b in [("response.output_item.added", "response.content_part.added"),
                 ("response.content_part.added", "response.output_text.delta"),
                 ("response.output_text.delta", "response.output_text.done"),
                 ("response.output_text.done", "response.content_part.done"),
                 ("response.content_part.done", "response.output_item.done")]:
        assert kinds.index(a) < kinds.index(b), (a, b, kinds)
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert deltas == whole.output_text, (deltas, whole.output_text)
    assert final is not None and final.output_text == whole.output_text, final
    assert final.usage.output_tokens == whole.usage.output_tokens, (final.usage, whole.usage)

    # Function tools (flat shape): a compulsory named call comes back as a function_call item.
    called = client.responses.create(model=model, input="What is the weather in Paris?", tools=TOOLS,
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     max_output_tokens=200)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", called.output
    assert calls[0].call_id and calls[0].id and calls[0].status == "completed", calls[0]
    assert isinstance(json.loads(calls[0].arguments)["city"], str), calls[0].arguments
    assert called.status == "completed", called
    assert called.tools[0].name == "get_weather" and called.tool_choice.name == "get_weather", called

    # tool_choice "required", streamed: the call's events.
    kinds, arguments, done_items = [], "", []
    for event in client.responses.create(model=model, input="What time is it in Tokyo?", tools=TOOLS,
                                         tool_choice="required", max_output_tokens=300, stream=True):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            done_items.append(event.item)
    assert done_items, kinds
    assert "response.function_call_arguments.done" in kinds, kinds
    assert json.loads(done_items[0].arguments) is not None, done_items
    assert arguments == "".join(item.arguments for item in done_items), (arguments, done_items)

    # The call's output goes back: the conversation is sent whole (stateless), the template renders
    # the call and its output, and the model answers in text.
    follow = [{"role": "user", "content": "What is the weather in Paris?"}] + called.output + [
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}]
    answered = client.responses.create(model=model, input=follow, tools=TOOLS, tool_choice="none",
                                       max_output_tokens=32, temperature=0)
    assert answered.output[0].type == "message" and answered.output_text, answered
    # The same question without the call and its output: the round trip's prompt is longer by them.
    asked = client.responses.create(model=model, input=follow[:1], tools=TOOLS, tool_choice="none",
                                    max_output_tokens=1)
    assert answered.usage.input_tokens > asked.usage.input_tokens + 5, (answered.usage, asked.usage)

    # Structured output through text.format.
    fmt = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}
    structured = client.responses.create(model=model, input="Weather in Paris, as JSON.", text=fmt,
                                         max_output_tokens=200)
    value = json.loads(structured.output_text)
    assert set(value) == {"city", "temperature", "conditions"}, value
    assert isinstance(value["temperature"], int) and -40 <= value["temperature"] <= 50, value
    assert value["conditions"] in ("sunny", "cloudy", "rain"), value
    assert structured.text.format.type == "json_schema", structured.text
    obj = client.responses.create(model=model, input="Any JSON object.", max_output_tokens=100,
                                  text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict), obj

    # Advisory and unknown fields are taken (docs/openai-api.md): a reasoning effort the
    # model's template has no switch for, hosted tools, Codex's own fields.
    taken = client.responses.create(model=model, input="x", max_output_tokens=4,
                                    reasoning={"effort": "high", "summary": "auto"},
                                    tools=[{"type": "web_search"}], store=False,
                                    include=["reasoning.encrypted_content"],
                                    prompt_cache_key="py-session",
                                    extra_body={"frobnicate": 1, "client_metadata": {"a": "b"}})
    assert taken.status in ("completed", "incomplete"), taken
    # Stored by default, as OpenAI's are: read back, listed, continued, deleted.
    assert client.responses.retrieve(plain.id).output_text == plain.output_text
    items = client.responses.input_items.list(plain.id)
    assert [i.content[0].text for i in items.data] == ["Say hello."], items
    follow = client.responses.create(model=model, input="And again.", max_output_tokens=4,
                                     previous_response_id=plain.id)
    assert follow.previous_response_id == plain.id, follow
    assert follow.usage.input_tokens > plain.usage.input_tokens, (follow.usage, plain.usage)
    client.responses.delete(plain.id)
    try:
        client.responses.retrieve(plain.id)
        raise AssertionError("a deleted response is gone")
    except openai.NotFoundError:
        pass
    # What cannot be honoured is a 400 naming the field.
    refused(lambda: client.responses.create(model=model, input="x", previous_response_id=plain.id),
            "previous_response_id")
    refused(lambda: client.responses.create(model=model, input="x", background=True),
            "background")
    refused(lambda: client.responses.create(model=model, input="x", reasoning={"effort": "extreme"}),
            "reasoning.effort")
    refused(lambda: client.responses.create(model=model, input=[{"role": "tool", "content": "x"}]),
            "input[0].role")
    refused(lambda: client.responses.create(model=model, input="x",
                                            include=["message.output_text.logprobs"]),
            "include")
    refused(lambda: client.responses.create(model=model, input="x", extra_body={"stop": ["y"]}),
            "stop")
    print("openai sdk responses: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
