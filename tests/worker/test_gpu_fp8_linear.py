"""FP8 block-wise linear layers in a whole model on the GPU. Its shapes (hidden 512,
intermediate 1024) fit cuBLASLt's block scales, so on Hopper every projection goes through
`block_scaled_mm` (the Triton GEMM elsewhere); the CUDA graphs replay the eager tokens."""

from __future__ import annotations

import pytest
import torch

from tests import quantized_models as qm
from tests.tiny_models import build_checkpoint
from tests.worker.test_gpu_runner import GREEDY, generate, prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("fp8_linear")
    float_dir = build_checkpoint(
        str(root / "qwen3"), "qwen3", num_layers=2, hidden_size=512, num_heads=8,
        num_kv_heads=4, head_dim=64, intermediate_size=1024, max_position_embeddings=1024,
        seed=13,
    )  # fmt: skip
    return qm.build_quantized(float_dir, str(root), "fp8")[0]


def _cublas_has_block_scales() -> bool:
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    return torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9)


def test_block_fp8_cuda_graphs_give_the_eager_tokens(fp8_dir: str, monkeypatch) -> None:
    from minivllm.worker.ops import fp8_cublas

    rows: list[int] = []
    real = fp8_cublas.block_scaled_mm

    def counted(xq: torch.Tensor, *args, **kw) -> torch.Tensor:
        rows.append(xq.shape[0])
        return real(xq, *args, **kw)

    monkeypatch.setattr(fp8_cublas, "block_scaled_mm", counted)
    ps = prompts(n=12, seed=9)
    kw = dict(dtype="bfloat16", distributed_executor_backend="uni")
    eager = generate(fp8_dir, ps, GREEDY, enforce_eager=True, **kw)
    if _cublas_has_block_scales():
        # every projection of every step with more than four rows: 4 per layer
        assert len(rows) >= 8 and all(r % 4 == 0 for r in rows), rows[:20]
    assert generate(fp8_dir, ps, GREEDY, **kw) == eager
