"""FP8 KV cache and cascade attention end to end on the GPU: CUDA graphs against eager with an
FP8 cache, FP8 logits against bf16-KV logits within the bound of test_fp8_kv.py's reasoning,
and cascade attention giving plain attention's tokens. Skipped without a CUDA device."""

from __future__ import annotations

import random

import pytest

from minivllm.config import EngineArgs
from minivllm.protocol.sampling_params import SamplingParams
from tests.tiny_models import VOCAB_SIZE, build_checkpoint
from tests.worker.test_cascade import shared_prefix_run
from tests.worker.test_gpu_runner import generate, prompts

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small random Qwen3 with Qwen3-0.6B's head shapes (head_dim 128, GQA 2)."""
    return build_checkpoint(
        str(tmp_path_factory.mktemp("small") / "qwen3"),
        "qwen3",
        num_layers=4,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        intermediate_size=512,
        max_position_embeddings=2048,
        seed=11,
    )


def test_fp8_cuda_graphs_give_the_eager_tokens(small_dir: str) -> None:
    kw = dict(dtype="bfloat16", kv_cache_dtype="fp8", calculate_kv_scales=True)
    ps = prompts(seed=2)
    graphs = generate(small_dir, ps, GREEDY, distributed_executor_backend="uni", **kw)
    eager = generate(small_dir, ps, GREEDY, enforce_eager=True, **kw)
    assert graphs == eager


def test_fp8_logits_stay_close_to_bf16_kv(small_dir: str, monkeypatch) -> None:
    """Teacher-forced over 16 prompts, a bf16 model with an FP8 cache against a bf16 cache.
    The Triton kernels cost what the torch reference's arithmetic costs (on an H100: top-1
    86.4%, mean KL 2.68e-2; the reference on the CPU, same model and prompts: 86.9%,
    2.70e-2: this random model's flat logits make it the most sensitive one measured), and
    the two FP8 runs agree with each other far more closely than either with bf16."""
    from benchmarks.kv_accuracy import Agreement, PrefillLogits, compare
    from minivllm.worker.ops.kv_cache import FP8

    config = EngineArgs(
        model=small_dir, dtype="bfloat16", device="cuda", calculate_kv_scales=True
    ).create_engine_config()
    rng = random.Random(0)
    ps = [[rng.randint(1, VOCAB_SIZE - 1) for _ in range(rng.randint(50, 400))] for _ in range(16)]
    fp8 = compare(config, ps)["fp8 vs model dtype"]
    assert fp8.top1 >= 0.8 and fp8.mean_kl < 0.05, fp8.line("fp8 vs bf16 KV")
    # the same FP8 arithmetic through the torch reference backend, on the GPU
    triton_run = PrefillLogits(config)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "torch")
    torch_run = PrefillLogits(config)
    same = Agreement()
    for i, tokens in enumerate(ps[:4]):
        same.add(torch_run(tokens, FP8, i == 0), triton_run(tokens, FP8, i == 0))
    assert same.top1 >= 0.97 and same.mean_kl < fp8.mean_kl / 10, same.line("triton vs torch")


def _shared_prefix_tokens(model: str, dtype: str, kv: str, disable: bool) -> tuple[list, list, int]:
    """40 requests sharing a 600-token prefix, 24 greedy tokens (`shared_prefix_run`)."""
    args = EngineArgs(
        model=model, device="cuda", dtype=dtype, max_model_len=1024, kv_cache_dtype=kv,
        kv_cache_memory_bytes=1 << 30, distributed_executor_backend="uni",
        disable_cascade_attn=disable,
    )  # fmt: skip
    rng = random.Random(5)
    prefix = [rng.randint(1, VOCAB_SIZE - 1) for _ in range(600)]
    ps = [prefix + [rng.randint(1, VOCAB_SIZE - 1) for _ in range(n)] for n in range(1, 41)]
    return shared_prefix_run(args, ps, GREEDY.max_tokens)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_cascade_gives_the_tokens_of_plain_attention(small_dir: str, kv: str) -> None:
    """float32, where the two summation orders agree far inside any logit gap: the same
    tokens; the decode steps ran the cascade graphs (600 tokens = 37 whole blocks shared)."""
    on, chosen, replays = _shared_prefix_tokens(small_dir, "float32", kv, disable=False)
    off, unused, no_replays = _shared_prefix_tokens(small_dir, "float32", kv, disable=True)
    assert on == off
    assert 592 in chosen and set(unused) == {0}
    assert replays >= 16 and no_replays == 0  # every pure-decode step of the 24 tokens
