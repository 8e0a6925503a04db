"""Logprobs, penalties and logit_bias through the official `openai` client, in OpenAI's
formats: completions' `tokens / token_logprobs / top_logprobs / text_offset`, chat's
`content[].{token, logprob, bytes, top_logprobs}`."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import MODEL


@pytest.fixture(scope="module")
def client(api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0)


def test_completion_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0, logprobs=2)
    out = client.completions.create(**kwargs)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and token in top and 1 <= len(top) <= 3
        assert top[token] == pytest.approx(max(top.values()))  # greedy: the best token
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    streamed_lp = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.tokens
    assert streamed_lp == pytest.approx(lp.token_logprobs)
    offsets = [x for c in chunks for x in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=3, temperature=0, logprobs=1, echo=True
    )
    lp = out.choices[0].logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert out.choices[0].text.startswith("Hello world")


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for c in content:
        assert c.bytes == list(c.token.encode("utf-8", errors="replace"))
        assert [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True
        )
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], top_logprobs=2
        )
    assert e.value.body["param"] == "top_logprobs"


def test_logit_bias_and_penalties(client: openai.OpenAI) -> None:
    forced = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=5,
        logit_bias={"42": 100},
        extra_body={"return_token_ids": True},
    )
    assert forced.choices[0].token_ids == [42] * 5
    plain = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    penalized = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=12,
        temperature=0,
        presence_penalty=2.0,
        frequency_penalty=1.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.5, "min_tokens": 4},
    )
    assert penalized.usage.completion_tokens == 12
    assert penalized.choices[0].text != plain.choices[0].text  # the penalties act
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", logprobs=21)
    assert e.value.body["param"] == "logprobs"
