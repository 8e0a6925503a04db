"""Request fields -> SamplingParams, and OpenAI's logprobs formats, without a server."""

from __future__ import annotations

from typing import NamedTuple

import msgspec
import pytest

from minivllm.frontend.server.errors import OpenAIError
from minivllm.frontend.server.logprobs import chat_logprobs, completion_logprobs
from minivllm.frontend.server.protocol import ChatCompletionRequest, CompletionRequest
from minivllm.frontend.server.sampling import chat_sampling_params, completion_sampling_params
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams


class Logprob(NamedTuple):  # the shape of minivllm.outputs.Logprob
    logprob: float
    rank: int
    decoded_token: str | None


def completion(**fields) -> CompletionRequest:
    return msgspec.convert(fields, CompletionRequest)


def test_only_sent_fields_reach_sampling_params() -> None:
    params = completion_sampling_params(completion(prompt="x"), stream=False)
    defaults = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k) == (
        defaults.temperature,
        defaults.top_p,
        defaults.top_k,
    )
    assert params.max_tokens == 16 and params.output_kind == RequestOutputKind.FINAL_ONLY
    params = completion_sampling_params(
        completion(prompt="x", temperature=0, top_k=5, stop="\n", seed=3, max_tokens=None),
        stream=True,
    )
    assert (params.temperature, params.top_k, params.stop, params.seed) == (0.0, 5, ["\n"], 3)
    assert params.max_tokens is None and params.output_kind == RequestOutputKind.DELTA


def test_penalties_logprobs_and_logit_bias_reach_sampling_params() -> None:
    params = completion_sampling_params(
        completion(
            prompt="x",
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logit_bias={"5": 250.0, "7": -3},
            logprobs=3,
            echo=True,
            bad_words=["no"],
        ),
        stream=False,
    )
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert params.repetition_penalty == 1.2 and params.bad_words == ["no"]
    assert params.logit_bias == {5: 100.0, 7: -3.0}  # clamped to OpenAI's range
    assert params.logprobs == 3 and params.prompt_logprobs == 3  # echo scores the prompt
    chat = msgspec.convert(
        {"messages": [], "logprobs": True, "top_logprobs": 4}, ChatCompletionRequest
    )
    assert chat_sampling_params(chat, stream=True).logprobs == 4


def test_bad_values_name_their_field() -> None:
    with pytest.raises(OpenAIError) as e:
        completion_sampling_params(completion(prompt="x", top_p=0), stream=False)
    assert e.value.param == "top_p" and e.value.status == 400
    with pytest.raises(OpenAIError) as e:
        completion_sampling_params(completion(prompt="x", logit_bias={"abc": 1.0}), False)
    assert e.value.param == "logit_bias"
    chat = msgspec.convert({"messages": [], "top_logprobs": 2}, ChatCompletionRequest)
    with pytest.raises(OpenAIError) as e:
        chat_sampling_params(chat, stream=False)
    assert e.value.param == "top_logprobs"


def test_chat_max_completion_tokens_wins() -> None:
    chat = msgspec.convert(
        {"messages": [], "max_tokens": 9, "max_completion_tokens": 4}, ChatCompletionRequest
    )
    assert chat_sampling_params(chat, stream=False).max_tokens == 4
    chat = msgspec.convert({"messages": []}, ChatCompletionRequest)
    assert chat_sampling_params(chat, stream=False).max_tokens is None  # up to the context


STEPS = [
    {7: Logprob(-0.5, 1, " a"), 8: Logprob(-1.5, 2, " b"), 9: Logprob(-3.0, 3, " c")},
    {4: Logprob(-2.0, 3, "x"), 5: Logprob(-0.1, 1, "y"), 6: Logprob(-2.5, 2, "z")},
]


def test_completion_logprobs() -> None:
    out = completion_logprobs([7, 4], STEPS, num_top=1, text_offset=10)
    assert out["tokens"] == [" a", "x"]
    assert out["token_logprobs"] == [-0.5, -2.0]
    # the sampled token and the `logprobs` best ones
    assert out["top_logprobs"] == [{" a": -0.5}, {"x": -2.0, "y": -0.1}]
    assert out["text_offset"] == [10, 12]
    echoed = completion_logprobs([3, 7], [None, STEPS[0]], num_top=0, decode=lambda t: "<s>")
    assert echoed["tokens"] == ["<s>", " a"] and echoed["token_logprobs"] == [None, -0.5]
    assert echoed["top_logprobs"] == [None, {" a": -0.5}] and echoed["text_offset"] == [0, 3]


def test_chat_logprobs() -> None:
    out = chat_logprobs([7, 4], STEPS, num_top=2)
    first, second = out["content"]
    assert first["token"] == " a" and first["logprob"] == -0.5 and first["bytes"] == [32, 97]
    assert [t["token"] for t in first["top_logprobs"]] == [" a", " b"]
    assert [t["token"] for t in second["top_logprobs"]] == ["y", "z"]  # by rank
    minus_inf = [{1: Logprob(float("-inf"), 1, None)}]
    (entry,) = chat_logprobs([1], minus_inf, num_top=0)["content"]
    assert entry["logprob"] == -9999.0 and entry["token"] == "token_id:1"
