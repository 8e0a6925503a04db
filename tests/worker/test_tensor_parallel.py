"""Tensor parallelism across worker processes (gloo on CPU): the same greedy tokens as one
rank, and a dead rank brings the engine down cleanly instead of hanging its peers — on 2 GPUs
too, where the survivor may be spinning in the all-reduce kernel's barrier for good."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
import uvloop

from minivllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, RequestOutputKind, SamplingParams
from tests.hf_reference import hf_greedy, longrope_prompts, parity_prompts
from tests.process_helpers import spawned_children, wait_gone
from tests.tiny_models import LONGROPE_ORIGINAL_LEN


@pytest.mark.parametrize(
    ("model", "expert_parallel"),
    [
        ("qwen3", False),
        ("llama", False),
        ("phi3", False),
        ("phi3-longrope", False),
        ("qwen3_moe", False),  # each expert sliced along its intermediate dimension
        ("qwen3_moe", True),  # whole experts per rank
        ("mixtral", False),
        ("mixtral", True),
    ],
)
def test_tp2_equals_tp1(tiny_models: dict[str, str], model: str, expert_parallel: bool) -> None:
    """Each rank takes its heads of q, k and v and its part of gate and up, from separate
    tensors or from Phi-3's fused ones; LongRoPE switches on every rank alike; a mixture's
    experts are sliced, or placed whole per rank."""
    path = tiny_models[model]
    prompts = parity_prompts()[:5]
    if model == "phi3-longrope":  # below, across and past its switch
        prompts = longrope_prompts(LONGROPE_ORIGINAL_LEN)[1::2]
    expected = hf_greedy(path, prompts, 10)
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        core = spawned_children(os.getpid())[-1]
        assert len(spawned_children(core)) == 2, "one worker process per rank"
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("model", ["gemma3", "mistral-window"])
def test_tp2_sliding_windows_equal_transformers(window_models: dict[str, str], model: str) -> None:
    """8-token windows over TP=2 (Mistral's blocks behind the window freed as it goes)."""
    path = window_models[model]
    prompts = parity_prompts()[:5]
    expected = hf_greedy(path, prompts, 12)
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, block_size=4)
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected


_TWO_GPUS = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.mark.parametrize(
    ("device", "dtype"), [("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=_TWO_GPUS)]
)
def test_killing_one_rank_reaches_every_caller(qwen3_dir: str, device: str, dtype: str) -> None:
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=qwen3_dir, dtype=dtype, tensor_parallel_size=2, device=device)
    )
    core = spawned_children(os.getpid())[-1]
    workers = spawned_children(core)
    params = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def stream(i: int, started: asyncio.Event):
        try:
            async for _ in llm.generate([1, 2, 3, i + 4], params, request_id=f"r{i}"):
                started.set()
        except EngineDeadError as e:
            return e
        return None

    async def main():
        started = asyncio.Event()
        tasks = [asyncio.create_task(stream(i, started)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 60)
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return results, time.monotonic() - killed

    try:
        results, waited = uvloop.run(main())
    finally:
        llm.shutdown()
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert waited < 5.0
    assert wait_gone([core, *workers], timeout=15) == []


def test_dummy_weights_are_the_same_model_at_any_tp(tiny_models: dict[str, str]) -> None:
    """Benchmarks compare TP sizes on dummy weights: each rank must slice the same model."""
    tokens = []
    for tp in (1, 2):
        llm = LLM(
            tiny_models["qwen3-untied"],
            load_format="dummy",
            dtype="float32",
            tensor_parallel_size=tp,
        )
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([[1, 2, 3, 4, 5], [7, 8, 9]], params, use_tqdm=False)
        llm.shutdown()
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]
    assert len(set(tokens[0][0])) > 3  # not a degenerate constant stream


def test_tp2_samples_and_processes_as_tp1(qwen3_dir: str) -> None:
    """Seeded random draws (each rank draws from its slice of the vocabulary), and logprobs
    with penalties (the logits are gathered first) give what one rank gives."""
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:4]]
    drawn = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    processed = SamplingParams(
        temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=3,
        repetition_penalty=0.8, frequency_penalty=-0.5, logit_bias={5: 1.0},
    )  # fmt: skip
    results = []
    for tp in (2, 1):
        backend = "mp" if tp > 1 else "uni"
        llm = LLM(
            qwen3_dir,
            dtype="float32",
            tensor_parallel_size=tp,
            distributed_executor_backend=backend,
        )
        try:
            results.append([llm.generate(prompts, p, use_tqdm=False) for p in (drawn, processed)])
        finally:
            llm.shutdown()
    for outs_tp2, outs_tp1 in zip(*results, strict=True):
        for a, b in zip(outs_tp2, outs_tp1, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
                assert list(x) == list(y)
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
