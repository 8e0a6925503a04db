"""Structured outputs through the whole engine (frontend, engine-core and worker processes):
constrained and free requests share steps and the free ones sample exactly what they sample
alone; a bad constraint is a ValueError in the caller naming its field, and the engine keeps
serving; n > 1, stop strings and streaming work on constrained requests."""

from __future__ import annotations

import asyncio
import json

import pytest

from minivllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from minivllm import StructuredOutputsParams as SO
from minivllm.frontend.input_processor import InputProcessor
from tests.frontend import test_async_llm
from tests.structured_cases import SCHEMA, check_text, constraints

async_llm = test_async_llm.async_llm  # the fixture: an AsyncLLM of the tiny Qwen3, per module
run = test_async_llm.run  # a coroutine to completion on the shared uvloop


@pytest.fixture
def llm(async_llm: AsyncLLM) -> AsyncLLM:
    return async_llm


async def final(llm: AsyncLLM, prompt: str, params: SamplingParams, request_id: str):
    params.output_kind = RequestOutputKind.FINAL_ONLY
    outs = [o async for o in llm.generate(prompt, params, request_id=request_id)]
    return outs[-1]


def free_params(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)


def test_free_requests_sample_the_same_beside_constrained_ones(llm: AsyncLLM) -> None:
    prompts = [f"Engines schedule {i} requests" for i in range(4)]

    async def alone():
        jobs = [final(llm, p, free_params(i), f"alone-{i}") for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    async def mixed():
        kinds = list(constraints().items())
        jobs = [final(llm, p, free_params(i), f"free-{i}") for i, p in enumerate(prompts)]
        jobs += [
            final(llm, "Hello", SamplingParams(temperature=1.0, seed=i, structured_outputs=so, max_tokens=120), f"{kind}-{i}")
            for i, (kind, so) in enumerate(kinds * 2)
        ]  # fmt: skip
        outs = await asyncio.gather(*jobs)
        return outs[: len(prompts)], list(
            zip([k for k, _ in kinds * 2], outs[len(prompts) :], strict=True)
        )

    expected = run(alone())
    free, constrained = run(mixed())
    for want, got in zip(expected, free, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for kind, out in constrained:
        assert out.outputs[0].finish_reason == "stop"
        check_text(kind, out.outputs[0].text)


def test_bad_constraint_is_a_value_error_and_the_engine_serves_on(llm: AsyncLLM) -> None:
    cases = [
        (SO(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "json"),
        (SO(regex="(a"), "regex"),
        (SO(grammar='root ::= "a" b'), "grammar"),
        (SO(json={"type": "integer", "multipleOf": 3}), "json"),
    ]

    async def main():
        for so, field in cases:
            with pytest.raises(ValueError, match=rf"structured_outputs\.{field}: "):
                await final(llm, "Hi", SamplingParams(structured_outputs=so), "bad")
        params = SamplingParams(temperature=1.0, seed=3, structured_outputs=constraints()["choice"])
        return await final(llm, "Hi", params, "good")

    out = run(main())
    check_text("choice", out.outputs[0].text)


def test_n_completions_each_follow_the_schema(llm: AsyncLLM) -> None:
    params = SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=120, structured_outputs=constraints()["json"]
    )
    out = run(final(llm, "Hello", params, "n3"))
    texts = [c.text for c in out.outputs]
    for text in texts:
        check_text("json", text)
    assert len(set(texts)) > 1


def test_stop_string_and_length_end_inside_the_structure(llm: AsyncLLM) -> None:
    async def main():
        stop = SamplingParams(
            temperature=1.0, seed=5, max_tokens=120, stop=['"role"'], structured_outputs=constraints()["json"]
        )  # fmt: skip
        short = SamplingParams(
            temperature=1.0, seed=5, max_tokens=5, structured_outputs=SO(json=SCHEMA)
        )
        return await final(llm, "Hi", stop, "stop"), await final(llm, "Hi", short, "short")

    stopped, short = run(main())
    text = stopped.outputs[0].text
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == '"role"'
    assert text.startswith('{"id":') and text.endswith(",") and '"role"' not in text
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.outputs[0].text)


def test_streamed_deltas_add_up_to_valid_json(llm: AsyncLLM) -> None:
    async def main():
        params = SamplingParams(
            temperature=1.0, seed=9, max_tokens=120, structured_outputs=constraints()["json"],
            output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        return [o.outputs[0].text async for o in llm.generate("Hey", params, request_id="s")]

    deltas = run(main())
    assert len(deltas) > 5
    check_text("json", "".join(deltas))


def test_structured_outputs_need_a_tokenizer(qwen3_dir: str) -> None:
    config = EngineArgs(model=qwen3_dir, skip_tokenizer_init=True).create_engine_config()
    processor = InputProcessor(config.model, None)
    params = SamplingParams(structured_outputs=SO(choice=["a"]))
    with pytest.raises(ValueError, match="structured_outputs need a tokenizer"):
        processor.process("r", [1, 2], params)


def test_tensor_parallel_ranks_all_take_the_bitmask(qwen3_dir: str) -> None:
    """Every rank waits for the step's bitmask and masks the gathered logits alike."""
    from minivllm import LLM

    llm = LLM(qwen3_dir, dtype="float32", tensor_parallel_size=2)
    try:
        kinds = list(constraints().items())
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=so)
            for i, (_, so) in enumerate(kinds)
        ]
        outs = llm.generate(["Hello"] * len(kinds), params, use_tqdm=False)
    finally:
        llm.shutdown()
    for (kind, _), out in zip(kinds, outs, strict=True):
        check_text(kind, out.outputs[0].text)
