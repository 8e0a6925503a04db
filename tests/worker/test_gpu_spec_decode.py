"""Speculative decoding on the GPU: steps that verify draft tokens replay CUDA graphs (the
verify graphs: 1 + k tokens per request), the draft model's passes too, and the tokens are
those of the same engine without speculation and of eager steps. Skipped without a CUDA
device (see tests/conftest.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from tests.tiny_models import VOCAB_SIZE, build_checkpoint

pytestmark = pytest.mark.gpu

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A small random Qwen3 (head_dim 64, the Triton kernels' tiles) and a smaller draft."""
    root = tmp_path_factory.mktemp("spec")
    common = dict(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=64,
                  intermediate_size=512, max_position_embeddings=1024)  # fmt: skip
    return {
        "target": build_checkpoint(str(root / "target"), "qwen3", num_layers=4, seed=7, **common),
        "draft": build_checkpoint(str(root / "draft"), "qwen3", num_layers=1, seed=8, **common),
    }


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a block (what prompt lookup finds), of several lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        block = [rng.randint(1, VOCAB_SIZE - 1) for _ in range(rng.randint(3, 24))]
        out.append(block * rng.randint(2, 6))
    return out


def generate(path: str, prompt_ids: list[list[int]], params: SamplingParams, **kw):
    """Every request's tokens, the engine's stats, and how many times each graph family
    of the target (and of the draft model) replayed."""
    args = EngineArgs(
        model=path, device="cuda", max_model_len=1024, kv_cache_memory_bytes=1 << 29,
        distributed_executor_backend="uni", max_num_seqs=32, **kw,
    )  # fmt: skip
    core = EngineCore(args.create_engine_config())
    runner = core.executor.worker.model_runner
    replays: Counter[str] = Counter()
    owners = [("", runner.graphs)]
    if runner.drafter is not None and runner.drafter.graphs is not None:
        owners.append(("draft ", runner.drafter.graphs))
    for prefix, graphs in owners:
        for family in (graphs.decode, graphs.cascade, graphs.prefill, graphs.verify):
            replay = family.replay

            def counted(size, replay=replay, name=prefix + family.name):
                replays[name] += 1
                return replay(size)

            family.replay = counted
    for i, p in enumerate(prompt_ids):
        core.add_request(EngineCoreRequest(str(i), p, params))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompt_ids))}
    while core.has_work():
        for outs in core.step().values():
            for o in outs.outputs:
                got[o.request_id] += o.new_token_ids
    stats = core.stats()
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.num_blocks
    core.shutdown()
    return [got[str(i)] for i in range(len(prompt_ids))], stats, replays


@pytest.mark.parametrize("batch", [1, 24])
def test_ngram_verification_replays_graphs_and_keeps_greedy_tokens(
    models: dict[str, str], batch: int
) -> None:
    ps = prompts(batch)
    expected, _, _ = generate(models["target"], ps, GREEDY)
    got, stats, replays = generate(models["target"], ps, GREEDY, speculative_config=NGRAM)
    assert got == expected
    assert stats["spec_num_draft_tokens"] > 0
    if batch > 1:  # one random model's greedy text rarely follows its prompt's n-grams
        assert stats["spec_num_accepted_tokens"] > 0
    assert replays["verify"] > 0, replays
    eager, _, eager_replays = generate(
        models["target"], ps, GREEDY, speculative_config=NGRAM, enforce_eager=True
    )
    assert eager == expected
    assert not eager_replays


def test_seeded_sampling_with_ngram_is_the_sampling_without(models: dict[str, str]) -> None:
    """n-gram drafts are checked against the ordinary draw (Triton sampler, keyed by seed
    and position): a seeded request gets the tokens it gets without speculation."""
    ps = prompts(8, seed=1)
    params = SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=48, ignore_eos=True)
    expected, _, _ = generate(models["target"], ps, params)
    got, stats, _ = generate(models["target"], ps, params, speculative_config=NGRAM)
    assert got == expected
    assert stats["spec_num_drafts"] > 0


def test_target_as_its_own_draft_accepts_everything(models: dict[str, str]) -> None:
    ps = prompts(6, seed=2)
    spec = {"method": "draft_model", "model": models["target"], "num_speculative_tokens": K}
    expected, _, _ = generate(models["target"], ps, GREEDY)
    got, stats, replays = generate(models["target"], ps, GREEDY, speculative_config=spec)
    assert got == expected
    assert stats["spec_num_drafts"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    # the draft's proposal passes replay its decode graphs, its pass over a verification's
    # tokens its verify graphs
    assert replays["draft decode"] > 0 and replays["draft verify"] > 0, replays


def test_draft_model_keeps_greedy_tokens(models: dict[str, str]) -> None:
    ps = prompts(12, seed=3)
    spec = {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": K}
    expected, _, _ = generate(models["target"], ps, GREEDY)
    got, stats, _ = generate(models["target"], ps, GREEDY, speculative_config=spec)
    assert got == expected
    assert stats["spec_num_draft_tokens"] > 0
