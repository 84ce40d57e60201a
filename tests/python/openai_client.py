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

    # models.retrieve, and its 404 for a model nobody serves.
    card = client.models.retrieve("sim-8b")
    assert card.id == "sim-8b" and card.object == "model", card
    try:
        client.models.retrieve("no-such-model")
        raise AssertionError("unknown model retrieved")
    except openai.NotFoundError as err:
        assert "no-such-model" in str(err), err

    # Chat log probabilities: one entry per generated token, the alternatives sorted, the
    # generated token's own figure among them when it is one of the most likely.
    chat = client.chat.completions.create(
        model="sim-8b",
        messages=[{"role": "user", "content": "Log probabilities, please"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6, chat
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3, entry
        assert entry.bytes == list(entry.token.encode()), entry
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True), entry
        assert all(t.logprob == entry.logprob for t in entry.top_logprobs if t.token == entry.token), entry

    # Streamed, the same request (greedy, so the same tokens) carries the same log
    # probabilities, chunk by chunk.
    greedy = dict(model="sim-8b", messages=[{"role": "user", "content": "Greedy logprobs"}], max_tokens=5,
                  logprobs=True, top_logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**greedy).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **greedy):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole], (streamed, whole)

    # Text completion log probabilities in the legacy shape.
    completion = client.completions.create(
        model="sim-8b", prompt="Count with me", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4, lp
    assert lp.text_offset == sorted(lp.text_offset), lp
    assert all(len(top) >= 2 for top in lp.top_logprobs), lp

    # n choices and a batch of prompts: indexed prompt * n + i, usage summed.
    many = client.chat.completions.create(
        model="sim-8b", messages=[{"role": "user", "content": "Three ways"}], max_tokens=3, n=3, seed=11,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2], many
    assert many.usage.completion_tokens == 9, many.usage
    assert len({c.message.content for c in many.choices}) > 1, "seed + i makes the choices differ"
    batch = client.completions.create(
        model="sim-8b", prompt=["First prompt", "Second prompt"], max_tokens=2, n=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3], batch
    assert batch.usage.completion_tokens == 8, batch.usage
    streamed_indexes = set()
    for chunk in client.completions.create(
        model="sim-8b", prompt=[[1, 2, 3], [4, 5, 6]], max_tokens=2, stream=True, extra_body={"ignore_eos": True}
    ):
        streamed_indexes.update(c.index for c in chunk.choices if c.finish_reason)
    assert streamed_indexes == {0, 1}, streamed_indexes

    # echo: the prompt, then the completion.
    echoed = client.completions.create(
        model="sim-8b", prompt="Echo this", max_tokens=2, echo=True, extra_body={"ignore_eos": True}
    )
    assert echoed.choices[0].text.startswith("Echo this"), echoed

    # What the gateway cannot honour is refused by name.
    for kwargs, param in [
        (dict(best_of=3), "best_of"),
        (dict(echo=True, logprobs=1), "echo"),
        (dict(logprobs=6), "logprobs"),
    ]:
        try:
            client.completions.create(model="sim-8b", prompt="x", max_tokens=1, **kwargs)
            raise AssertionError("accepted %s" % kwargs)
        except openai.BadRequestError as err:
            assert err.body["param"] == param, err.body

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
