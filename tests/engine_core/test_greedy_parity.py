"""Greedy generation through EngineCore equals transformers' `generate`, token for token."""

from __future__ import annotations

import pytest

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, longrope_prompts, parity_prompts
from tests.tiny_models import LONGROPE_ORIGINAL_LEN

MAX_TOKENS = 12


def run_core(path: str, prompts: list[list[int]], **engine_kwargs) -> tuple[list[list[int]], dict]:
    args = EngineArgs(
        model=path, distributed_executor_backend="uni", dtype="float32", **engine_kwargs
    )
    core = EngineCore(args.create_engine_config())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), p, params))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished = set()
    while core.has_work():
        for outs in core.step().values():
            for o in outs.outputs:
                assert o.request_id not in finished, "an output after the final one"
                got[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    finished.add(o.request_id)
    stats = core.stats()
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.num_blocks
    core.shutdown()
    assert finished == set(got)
    return [got[str(i)] for i in range(len(prompts))], stats


@pytest.mark.parametrize(
    "model",
    [
        "qwen3", "qwen3-untied", "qwen2", "llama", "phi3",
        # prompts and outputs past the original length (llama-linear: past
        # max_position_embeddings, which the scaling doubles)
        "qwen3-yarn", "llama-linear", "llama-dynamic",
        "qwen3_moe", "mixtral",
    ],
)  # fmt: skip
def test_greedy_matches_transformers(tiny_models: dict[str, str], model: str) -> None:
    path = tiny_models[model]
    prompts = parity_prompts()
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    got, stats = run_core(path, prompts)
    assert got == expected
    assert stats["prefix_cache_hits"] > 0  # the shared prefixes were served from the cache


PRESSURE = [
    pytest.param(dict(enable_prefix_caching=False), id="no-prefix-cache"),
    pytest.param(dict(async_scheduling=False), id="sync-scheduling"),
    pytest.param(dict(max_num_batched_tokens=16), id="chunked-prefill"),
    pytest.param(dict(num_gpu_blocks_override=24, block_size=4, max_model_len=96), id="preemption"),
]


@pytest.mark.parametrize("model", ["qwen3", "phi3", "qwen3-yarn", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("engine_kwargs", PRESSURE)
def test_greedy_matches_transformers_under_pressure(
    tiny_models: dict[str, str], model: str, engine_kwargs: dict
) -> None:
    path = tiny_models[model]
    prompts = parity_prompts()
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    got, stats = run_core(path, prompts, **engine_kwargs)
    assert got == expected
    if "num_gpu_blocks_override" in engine_kwargs:
        assert stats["num_preemptions"] >= 2
    if not engine_kwargs.get("enable_prefix_caching", True):
        assert stats["prefix_cache_hits"] == 0


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="default"),
        *PRESSURE[:3],
        # room for the longest prompt and its outputs, not for all of them at once
        pytest.param(
            dict(num_gpu_blocks_override=26, block_size=4, max_model_len=104), id="preemption"
        ),
    ],
)
def test_longrope_matches_transformers_across_its_switch(
    tiny_models: dict[str, str], engine_kwargs: dict
) -> None:
    """Phi-3's LongRoPE: a sequence longer than the original length is rotated with the long
    factors, every token of it; transformers recomputes one that grows past it. Tokens equal
    its, below, across and past the switch, with prefix caching (short and long sequences
    of the same prefix), chunked prefill and preemption."""
    path = tiny_models["phi3-longrope"]
    prompts = longrope_prompts(LONGROPE_ORIGINAL_LEN)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    got, stats = run_core(path, prompts, **engine_kwargs)
    assert got == expected
    # the three prompts that grow past the switch were computed again, once each
    if "num_gpu_blocks_override" in engine_kwargs:
        assert stats["num_preemptions"] >= 3
    else:
        assert stats["num_preemptions"] == 3
    if engine_kwargs.get("enable_prefix_caching", True):
        assert stats["prefix_cache_hits"] > 0
