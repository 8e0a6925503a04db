"""`stream_interval` (vLLM's `--stream-interval` and SamplingParams field): streamed outputs
carry that many new tokens each, the first and the last excepted; the texts, ids and
logprobs they carry add up to the same completion. Through HTTP: tests/server/test_openai_api.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from minivllm.config import EngineArgs
from minivllm.frontend.async_llm import AsyncLLM
from minivllm.frontend.input_processor import InputProcessor
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.tokenizer import load_tokenizer
from minivllm.outputs import RequestOutput
from minivllm.protocol.messages import EngineCoreOutput, FinishReason, LogprobsArrays
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Hello world! How are you today? Fine, thanks."
DELTA, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE


@pytest.fixture(scope="module")
def setup(qwen3_dir: str):
    config = EngineArgs(model=qwen3_dir, max_model_len=64, device="cpu").create_engine_config()
    return config.model, load_tokenizer(qwen3_dir)


def _stream(setup, engine_interval: int, ids: list[int], **params) -> list[RequestOutput]:
    """Feed `ids` one per step (the last finishes by length); the outputs made."""
    model_config, tokenizer = setup
    processor = OutputProcessor(tokenizer, engine_interval)
    (request,) = processor.add_user_request(
        "u", "Hi", SamplingParams(max_tokens=50, **params), InputProcessor(model_config, tokenizer)
    )
    outputs = []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        step = processor.process_outputs([EngineCoreOutput(request.request_id, [token_id], finish)])
        outputs += step.request_outputs
    assert not processor.has_unfinished_requests()
    return outputs


def _sizes(n: int, interval: int) -> list[int]:
    """Tokens per output: one, then `interval` at a time, then what is left."""
    sizes = [1]
    while sum(sizes) < n:
        sizes.append(min(interval, n - sum(sizes)))
    return sizes


@pytest.mark.parametrize(
    "engine_interval, request_interval, effective",
    [(3, None, 3), (1, 4, 4), (4, 2, 4)],  # a request may raise the engine's, never lower it
)
def test_delta_outputs_carry_interval_tokens_and_add_up(
    setup, engine_interval, request_interval, effective
):
    ids = setup[1].encode(TEXT)
    outputs = _stream(
        setup, engine_interval, ids, output_kind=DELTA, stream_interval=request_interval
    )
    completions = [o.outputs[0] for o in outputs]
    assert [len(c.token_ids) for c in completions] == _sizes(len(ids), effective)
    assert sum((c.token_ids for c in completions), []) == ids
    assert "".join(c.text for c in completions) == TEXT
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


def test_cumulative_outputs_come_at_the_interval_with_everything_so_far(setup):
    ids = setup[1].encode(TEXT)
    outputs = _stream(setup, 5, ids, output_kind=CUMULATIVE)
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    sizes = _sizes(len(ids), 5)
    assert counts == [sum(sizes[: i + 1]) for i in range(len(sizes))]
    assert outputs[-1].outputs[0].text == TEXT


def test_delta_logprobs_match_the_tokens_each_output_carries(setup):
    model_config, tokenizer = setup
    processor = OutputProcessor(tokenizer, 3)
    (request,) = processor.add_user_request(
        "u",
        "Hi",
        SamplingParams(max_tokens=50, logprobs=0, output_kind=DELTA),
        InputProcessor(model_config, tokenizer),
    )
    ids = tokenizer.encode(TEXT)[:8]
    outputs = []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        lp = LogprobsArrays(
            np.array([[token_id]], np.int32),
            np.array([[-float(i)]], np.float32),
            np.zeros(1, np.int32),
        )
        out = EngineCoreOutput(request.request_id, [token_id], finish, new_logprobs=lp)
        outputs += processor.process_outputs([out]).request_outputs
    got = [c for o in outputs for c in o.outputs]
    assert [len(c.token_ids) for c in got] == _sizes(len(ids), 3)
    for c in got:
        assert len(c.logprobs) == len(c.token_ids)
        assert [p[t].logprob for p, t in zip(c.logprobs, c.token_ids, strict=True)] == [
            -float(ids.index(t)) for t in c.token_ids
        ]


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_a_bad_interval_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=bad)
    with pytest.raises(ValueError, match="stream_interval"):
        EngineArgs(model="m", stream_interval=bad)


def test_async_llm_streams_the_same_tokens_in_fewer_outputs(qwen3_dir: str):
    async def stream(interval: int) -> list[list[int]]:
        args = EngineArgs(model=qwen3_dir, max_model_len=64, device="cpu")
        args.stream_interval = interval
        params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, output_kind=DELTA)
        async with AsyncLLM.from_engine_args(args) as llm:
            return [o.outputs[0].token_ids async for o in llm.generate("Hello", params, "r")]

    every, grouped = asyncio.run(stream(1)), asyncio.run(stream(4))
    assert sum(grouped, []) == sum(every, [])
    assert len(grouped) < len(every)
    assert all(len(ids) <= 4 for ids in grouped) and len(grouped[0]) == 1
