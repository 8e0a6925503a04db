"""Speculative decoding through the in-process EngineCore on tiny checkpoints: the tokens (and
logprobs) of the same engine without speculation, for both methods, under chunked prefill,
preemption, prefix caching and sync or async scheduling; with seeds, logprobs, penalties,
min_tokens, bad words, bias, allowed ids and structured outputs; and a draft model's sampled
tokens distributed as the target's, against its exact probabilities."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.structured_outputs import StructuredOutputsParams
from tests.hf_reference import hf_greedy, parity_prompts
from tests.tiny_models import VOCAB_SIZE
from tests.worker.test_spec_verification import assert_follows

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def loop_prompts() -> list[list[int]]:
    """Repeated blocks whose continuations the tiny Qwen3 copies (or loops on), so that
    prompt lookup proposes and some drafts are accepted; and parity prompts (which share
    prefixes: the prefix cache serves them)."""
    prompts = []
    for seed in (53, 50, 17, 30, 57):
        rng = random.Random(seed)
        n = rng.choice([3, 4, 5, 6, 7])
        prompts.append([rng.randint(1, VOCAB_SIZE - 1) for _ in range(n)] * rng.randint(2, 4))
    return prompts + parity_prompts()[-4:]


def generate(path: str, prompts, params, spec: dict | None = None, **kw):
    """Each request's tokens, its logprobs rows (as lists) and finish reason, and the stats."""
    args = EngineArgs(
        model=path, distributed_executor_backend="uni", dtype="float32",
        speculative_config=spec, **kw,
    )  # fmt: skip
    core = EngineCore(args.create_engine_config())
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True)):
        core.add_request(EngineCoreRequest(str(i), p, sp, eos_token_ids=[0]))
    got = {str(i): ([], [], None) for i in range(len(prompts))}
    while core.has_work():
        for outs in core.step().values():
            for o in outs.outputs:
                tokens, logprobs, _ = got[o.request_id]
                tokens += o.new_token_ids
                if o.new_logprobs is not None:
                    assert len(o.new_logprobs.ranks) == len(o.new_token_ids)
                    logprobs += o.new_logprobs.logprobs.tolist()
                got[o.request_id] = (tokens, logprobs, o.finish_reason)
    stats = core.stats()
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.num_blocks
    core.shutdown()
    return [got[str(i)] for i in range(len(prompts))], stats


def tokens_of(results) -> list[list[int]]:
    return [r[0] for r in results]


@pytest.fixture(scope="module")
def expected(qwen3_dir: str) -> list[list[int]]:
    prompts = loop_prompts()
    reference = hf_greedy(qwen3_dir, prompts, GREEDY.max_tokens)
    got, _ = generate(qwen3_dir, prompts, GREEDY)
    assert tokens_of(got) == reference
    return reference


VARIANTS = {
    "async": {},
    "sync": dict(async_scheduling=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=24, block_size=4, max_model_len=96),
    "no-prefix-cache": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize(
    ("method", "variant"),
    [("ngram", variant) for variant in VARIANTS]
    + [("draft-itself", v) for v in ("async", "chunked-prefill", "preemption")]
    + [("draft-other", "sync")],
)
def test_greedy_tokens_are_those_without_speculation(
    tiny_models: dict[str, str], expected: list[list[int]], method: str, variant: str
) -> None:
    path = tiny_models["qwen3"]
    spec = NGRAM
    if method != "ngram":
        draft = path if method == "draft-itself" else tiny_models["qwen3-untied"]
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
    got, stats = generate(path, loop_prompts(), GREEDY, spec, **VARIANTS[variant])
    assert tokens_of(got) == expected
    assert stats["spec_num_drafts"] > 0
    if method == "draft-itself":  # every draft accepted at temperature 0
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    elif method == "ngram":
        assert stats["spec_num_accepted_tokens"] > 0
    if variant == "preemption":
        assert stats["num_preemptions"] > 0
    if variant == "async":
        assert stats["prefix_cache_hits"] > 0


PROCESSING = {
    "seeded sampling": dict(temperature=0.9, top_p=0.95, seed=7),
    "sampling": dict(temperature=0.7, top_k=50),  # the engine's per-request seed
    "logprobs": dict(temperature=0.8, seed=3, logprobs=3),
    "penalties": dict(
        temperature=0, repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1,
        logprobs=2,
    ),
    "min_tokens": dict(temperature=0, min_tokens=12, stop_token_ids=[23, 141, 357]),
    "max_tokens": dict(temperature=0, max_tokens=5),
    "bad words": dict(temperature=0, _bad_words_token_ids=[[355, 117], [221], [19, 52, 274]]),
    "bias and allowed ids": dict(
        temperature=0.5, seed=1, logit_bias={23: 2.0, 141: -5.0},
        allowed_token_ids=list(range(0, 300)),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PROCESSING))
def test_sampling_and_processing_as_without_speculation(qwen3_dir: str, case: str) -> None:
    """n-gram drafts are checked against the ordinary draw, keyed by seed and position: the
    same tokens and logprobs as without speculation, whatever the request asks."""
    params = SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **PROCESSING[case]})
    prompts = loop_prompts()
    base, _ = generate(qwen3_dir, prompts, params)
    got, stats = generate(qwen3_dir, prompts, params, NGRAM)
    assert tokens_of(got) == tokens_of(base)
    for (_, lp, reason), (_, lp_base, reason_base) in zip(got, base, strict=True):
        np.testing.assert_allclose(np.array(lp), np.array(lp_base), atol=1e-4)
        assert reason == reason_base
    assert stats["spec_num_drafts"] > 0


def test_processed_logprobs_count_the_drafts(qwen3_dir: str) -> None:
    """The logprobs of what the draw saw (penalties that count the drafts before each row
    included) are those without speculation, where drafts are accepted under penalties."""
    params = SamplingParams(
        temperature=0.3, seed=2, max_tokens=24, ignore_eos=True, logprobs=2,
        frequency_penalty=0.05, presence_penalty=0.05, repetition_penalty=1.05,
    )  # fmt: skip
    prompts = loop_prompts()
    base, _ = generate(qwen3_dir, prompts, params, logprobs_mode="processed_logprobs")
    got, stats = generate(qwen3_dir, prompts, params, NGRAM, logprobs_mode="processed_logprobs")
    assert tokens_of(got) == tokens_of(base)
    for (_, lp, _), (_, lp_base, _) in zip(got, base, strict=True):
        np.testing.assert_allclose(np.array(lp), np.array(lp_base), atol=1e-4)
    assert stats["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(regex=r"(ab|cd )+"),
        StructuredOutputsParams(regex=r"(Hello world! How are you today\? )+"),
    ],
)
def test_structured_outputs_as_without_speculation(qwen3_dir: str, constraint) -> None:
    """The grammar cuts each proposal to what it allows, masks each verified position, and
    takes the accepted tokens: the tokens of the same request without speculation."""
    pytest.importorskip("xgrammar")
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=constraint)
    prompts = loop_prompts()[:4]
    base, _ = generate(qwen3_dir, prompts, params)
    got, stats = generate(qwen3_dir, prompts, params, NGRAM)
    assert tokens_of(got) == tokens_of(base)
    assert [r[2] for r in got] == [r[2] for r in base]
    assert stats["spec_num_drafts"] > 0


@pytest.fixture(scope="module")
def near_draft(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3 with noise on its weights: a draft that often agrees with it, not
    always (so rejection sampling accepts some drafts and draws again for the others)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("near_draft")
    for name in os.listdir(qwen3_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(qwen3_dir, name), out / name)
    gen = torch.Generator().manual_seed(0)
    state = load_file(os.path.join(qwen3_dir, "model.safetensors"))
    noisy = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_draft_model_samples_follow_the_targets_distribution(
    qwen3_dir: str, near_draft: str
) -> None:
    """Drafts drawn from another model (q) at temperature 1, verified by rejection sampling:
    the first three tokens of 1000 requests follow the target's exact joint distribution
    (top-3 of each step, from transformers). Sync scheduling: the second and third tokens
    are those of the step that verifies the two drafts proposed after the first."""
    from transformers import AutoModelForCausalLM

    target, draft = qwen3_dir, near_draft
    prompt = [5, 9, 13, 5, 9, 13, 5]
    n, top_k = 1000, 3
    params = [
        SamplingParams(temperature=1.0, top_k=top_k, seed=s, max_tokens=4, ignore_eos=True)
        for s in range(n)
    ]
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    got, stats = generate(
        target, [prompt] * n, params, spec, max_num_seqs=256, async_scheduling=False
    )
    accepted, drafted = stats["spec_num_accepted_tokens"], stats["spec_num_draft_tokens"]
    assert 0.1 * drafted < accepted < 0.9 * drafted, stats  # some drafts drawn again

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def top_probs(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        values, idx = logits.topk(top_k)
        return dict(zip(idx.tolist(), values.softmax(-1).tolist(), strict=True))

    cells, probs = {}, []
    for a, pa in top_probs(prompt).items():
        for b, pb in top_probs(prompt + [a]).items():
            for c, pc in top_probs(prompt + [a, b]).items():
                cells[(a, b, c)] = len(probs)
                probs.append(pa * pb * pc)
    samples = np.array([cells[tuple(tokens[:3])] for tokens, _, _ in got])
    assert_follows(samples, np.array(probs))


def test_a_draft_of_another_architecture(tiny_models: dict[str, str]) -> None:
    """A draft model of another architecture (Qwen2 for a Qwen3, the method left for vLLM's
    rule to infer) proposes in the same workers; both caches hold the same blocks."""
    path = tiny_models["qwen3"]
    spec = {"model": tiny_models["qwen2"], "num_speculative_tokens": 2}
    got, stats = generate(path, loop_prompts()[:3], GREEDY, spec)
    assert tokens_of(got) == hf_greedy(path, loop_prompts()[:3], GREEDY.max_tokens)
    assert 0 < stats["spec_num_draft_tokens"] <= 2 * stats["spec_num_drafts"]
