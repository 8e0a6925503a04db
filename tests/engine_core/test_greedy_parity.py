"""Greedy generation through EngineCore equals transformers' `generate`, token for token."""

from __future__ import annotations

import functools

import pytest

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, longrope_prompts, parity_prompts
from tests.tiny_models import LONGROPE_ORIGINAL_LEN, build_gemma3_multimodal

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


@functools.cache
def _hf_expected(path: str) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, hf_greedy(path, parity_prompts(), MAX_TOKENS)))


_WINDOW_CASES = [
    pytest.param(dict(block_size=4), id="block4"),
    pytest.param(dict(block_size=4, enable_prefix_caching=False), id="no-prefix-cache"),
    pytest.param(dict(block_size=4, async_scheduling=False), id="sync-scheduling"),
    pytest.param(dict(block_size=4, max_num_batched_tokens=16), id="chunked-prefill"),
    pytest.param(dict(num_gpu_blocks_override=24, block_size=4, max_model_len=96), id="preemption"),
]


_EVERY_LAYER_WINDOWED = ("mistral-window", "mixtral-window", "phi3-window")


@pytest.mark.parametrize("engine_kwargs", _WINDOW_CASES)
@pytest.mark.parametrize(
    "model", ["gemma3", "gemma3-pattern", *_EVERY_LAYER_WINDOWED, "qwen2-window"]
)
def test_sliding_window_greedy_matches_transformers(
    window_models: dict[str, str], model: str, engine_kwargs: dict
) -> None:
    """8-token windows under prompts of up to 60 tokens and 12 more generated: Gemma 3's
    interleaved sliding and global layers, Mistral's, Mixtral's and Phi-3's windowed layers
    (whose blocks behind the window go back to the pool)."""
    path = window_models[model]
    got, stats = run_core(path, parity_prompts(), **engine_kwargs)
    assert got == [list(t) for t in _hf_expected(path)]
    if engine_kwargs.get("enable_prefix_caching", True):
        assert stats["prefix_cache_hits"] > 0
    if "num_gpu_blocks_override" in engine_kwargs and model not in _EVERY_LAYER_WINDOWED:
        assert stats["num_preemptions"] >= 2  # a global layer: every block of it is kept


def test_windowed_contexts_outgrow_the_kv_cache(window_models: dict[str, str]) -> None:
    """Mistral's blocks behind its 8-token window go back to the pool, so sequences of 72
    tokens (18 blocks) run in a cache of 8 blocks, many at once, with the same tokens."""
    path = window_models["mistral-window"]
    prompts = parity_prompts()
    assert max(len(p) for p in prompts) + MAX_TOKENS > 8 * 4
    kwargs = dict(num_gpu_blocks_override=8, block_size=4, max_num_batched_tokens=16)
    got, stats = run_core(path, prompts, max_model_len=96, **kwargs)
    assert got == [list(t) for t in _hf_expected(path)]
    assert stats["num_preemptions"] > 0  # nine requests took turns in the 8 blocks


@pytest.mark.parametrize("hub_layout", [False, True], ids=["saved", "hub-layout"])
def test_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path, hub_layout: bool) -> None:
    """Gemma3ForConditionalGeneration, text prompts: transformers' tokens, from its weights
    under either naming and from a config that leaves the text model's defaults out."""
    path = build_gemma3_multimodal(str(tmp_path / "gemma3-mm"), hub_layout=hub_layout)
    prompts = parity_prompts()
    got, _ = run_core(path, prompts, block_size=4)
    assert got == hf_greedy(path, prompts, MAX_TOKENS)
