"""Speculative decoding on the model variants with a switch, a window or a sparse MLP: Phi-3's
LongRoPE (a sequence that grows past the original length is computed again with the long
factors, drafts included), Mistral's sliding window (blocks behind it freed) and a mixture of
experts; greedy tokens are transformers'."""

from __future__ import annotations

import random

import pytest

from minivllm.protocol.sampling_params import SamplingParams
from tests.engine_core.test_spec_decode import NGRAM, K, generate, loop_prompts, tokens_of
from tests.hf_reference import hf_greedy, longrope_prompts
from tests.tiny_models import LONGROPE_ORIGINAL_LEN

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def copying_longrope_prompts() -> list[list[int]]:
    """The switch's prompts (below, across and past it) and repeated blocks ending a few
    tokens short of it, which prompt lookup proposes across it."""
    rng = random.Random(5)
    block = [rng.randint(1, 300) for _ in range(6)]
    near = [(block * 12)[: LONGROPE_ORIGINAL_LEN - d] for d in (2, 5)]
    return longrope_prompts(LONGROPE_ORIGINAL_LEN) + near


@pytest.mark.parametrize("method", ["ngram", "draft-itself"])
def test_longrope_across_its_switch(tiny_models: dict[str, str], method: str) -> None:
    """No draft is verified past the switch while a sequence is rotated short (its KV there
    would be short): a sequence is computed again as often as without speculation. A draft
    model of the same switch reads the long rows once a sequence is long: as its own draft,
    the target's every draft is accepted."""
    path = tiny_models["phi3-longrope"]
    prompts = copying_longrope_prompts()
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    _, plain = generate(path, prompts, GREEDY)
    spec = NGRAM
    if method == "draft-itself":
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
    got, stats = generate(path, prompts, GREEDY, spec)
    assert tokens_of(got) == expected
    assert stats["num_preemptions"] == plain["num_preemptions"] > 0
    assert stats["spec_num_accepted_tokens"] > 0
    if method == "draft-itself":
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]


def test_draft_of_another_longrope_switch_is_refused(tiny_models: dict[str, str]) -> None:
    from minivllm.config import EngineArgs

    spec = {"method": "draft_model", "model": tiny_models["phi3"], "num_speculative_tokens": 2}
    args = EngineArgs(model=tiny_models["phi3-longrope"], dtype="float32", speculative_config=spec)
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft switches"):
        args.create_engine_config()


def test_mixture_of_experts_with_ngram_drafts(tiny_models: dict[str, str]) -> None:
    """Verification steps through the sparse MLP: each draft's token routed as its own."""
    path = tiny_models["qwen3_moe"]
    prompts = loop_prompts()
    got, stats = generate(path, prompts, GREEDY, NGRAM)
    assert tokens_of(got) == hf_greedy(path, prompts, GREEDY.max_tokens)
    assert stats["spec_num_drafts"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft-itself"])
def test_sliding_window_with_drafts(window_models: dict[str, str], method: str) -> None:
    """Mistral's 8-token window: with n-gram drafts its blocks behind the window go back to
    the pool (sequences of up to 72 tokens in 8 blocks), freed from where the rejected
    drafts were taken back, never past it; a draft model keeps them (its own layers may
    read the whole context)."""
    path = window_models["mistral-window"]
    prompts = loop_prompts()
    spec, kwargs = NGRAM, dict(num_gpu_blocks_override=8, max_num_batched_tokens=16)
    if method == "draft-itself":
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K}
        kwargs = dict(num_gpu_blocks_override=40)
    got, stats = generate(path, prompts, GREEDY, spec, block_size=4, max_model_len=96, **kwargs)
    assert tokens_of(got) == hf_greedy(path, prompts, GREEDY.max_tokens)
    accepted, drafted = stats["spec_num_accepted_tokens"], stats["spec_num_draft_tokens"]
    if method == "ngram":  # it seldom copies: drafts rejected, their slots taken back
        assert max(map(len, prompts)) + GREEDY.max_tokens > 8 * 4  # longer than the cache
        assert accepted < drafted
    else:
        assert accepted == drafted > 0
