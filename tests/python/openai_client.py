"""Drives a Switchyard gateway with the official OpenAI Python SDK.

Usage: python3 tests/python/openai_client.py http://HOST:PORT/v1
Exits non-zero (with the failing check) when anything is off.
"""

import sys

import openai
from openai import OpenAI


def main(base_url: str) -> None:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)

    models = [m.id for m in client.models.list()]
    assert "sim-8b" in models, models

    chat = client.chat.completions.create(
        model="sim-8b",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length", chat
    assert chat.usage.completion_tokens == 8, chat.usage

    pieces = []
    usage = None
    stream = client.chat.completions.create(
        model="sim-8b",
        messages=[{"role": "user", "content": "Stream please"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert usage is not None and usage.completion_tokens == 6, usage

    completion = client.completions.create(
        model="sim-8b", prompt="The quick brown fox", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5

    texts = []
    for chunk in client.completions.create(
        model="sim-8b", prompt=[1, 2, 3, 4, 5], max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    ):
        texts.extend(c.text for c in chunk.choices)

    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as err:
        assert "no-such-model" in str(err), err

    try:
        client.chat.completions.create(model="sim-8b", messages=[], max_tokens=1)
        raise AssertionError("empty messages accepted")
    except openai.BadRequestError as err:
        assert "messages" in str(err), err

    print("openai sdk: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
