"""Qwen3-MoE and Mixtral on the GPU, through the fused MoE kernels: fp32 greedy tokens equal
transformers', CUDA graphs (decode and prefill) give the eager tokens in bf16, with the
experts in bf16 and in FP8. Skipped without a CUDA device (see tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.hf_reference import hf_greedy
from tests.tiny_models import build_checkpoint
from tests.worker.test_gpu_runner import GREEDY, MAX_TOKENS, SAMPLED, generate, prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Small random mixtures with head_dim 64: Qwen3-MoE (top-4 of 32, one dense layer) and
    Mixtral (top-2 of 8)."""
    root = tmp_path_factory.mktemp("moe")
    common = dict(
        hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=False
    )
    return {
        "qwen3_moe": build_checkpoint(
            str(root / "qwen3_moe"), "qwen3_moe", num_layers=4, intermediate_size=512,
            num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
            mlp_only_layers=[2], max_position_embeddings=1024, seed=11, **common,
        ),
        "mixtral": build_checkpoint(
            str(root / "mixtral"), "mixtral", num_layers=2, intermediate_size=384,
            max_position_embeddings=1024, seed=12, **common,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_fp32_matches_transformers(moe_dirs: dict[str, str], arch: str) -> None:
    path, ps = moe_dirs[arch], prompts(n=12, seed=6)
    out = generate(path, ps, GREEDY, dtype="float32", distributed_executor_backend="uni")
    assert out == hf_greedy(path, ps, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_cuda_graphs_give_the_eager_tokens(moe_dirs: dict[str, str], arch: str) -> None:
    ps = prompts(seed=7)
    for params in (GREEDY, SAMPLED):
        kw = dict(dtype="bfloat16", distributed_executor_backend="uni")
        graphs = generate(moe_dirs[arch], ps, params, **kw)
        eager = generate(moe_dirs[arch], ps, params, enforce_eager=True, **kw)
        assert graphs == eager


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_experts_cuda_graphs_give_the_eager_tokens(
    moe_dirs: dict[str, str], arch: str, tmp_path
) -> None:
    """FP8 experts through the grouped FP8 GEMMs (block scales from a checkpoint written as
    Qwen3-*-FP8 is, and per-channel scales quantized at load): CUDA graphs replay the
    eager tokens."""
    from tests import quantized_models as qm

    block = qm.build_quantized(moe_dirs[arch], str(tmp_path), "fp8")[0]
    ps = prompts(n=12, seed=8)
    for path, quant in ((block, {}), (moe_dirs[arch], {"quantization": "fp8"})):
        kw = dict(dtype="bfloat16", distributed_executor_backend="uni", **quant)
        graphs = generate(path, ps, GREEDY, **kw)
        assert graphs == generate(path, ps, GREEDY, enforce_eager=True, **kw), quant
