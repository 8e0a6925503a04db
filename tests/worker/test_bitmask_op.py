"""The grammar bitmask kernel against its torch reference and against the bits themselves:
cleared tokens of the named rows become -inf, everything else keeps its exact value.

On CPU the kernel runs through the Triton interpreter in a subprocess; on a GPU at the
reference shape (256 rows of Qwen3's 151,936 tokens) in bf16 and fp32.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted


def check_bitmask(device: str, dtype: torch.dtype, rows: int, vocab: int) -> None:
    from minivllm.worker.ops.bitmask import apply_token_bitmask, apply_token_bitmask_reference

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype=dtype, device=device)
    words = -(-vocab // 32)
    constrained = torch.randperm(rows, generator=gen)[: max(1, rows // 2)]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(constrained), words), generator=gen)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = 0  # a row that allows nothing ...
    bitmask[0, 0] = 1 << 3  # ... but token 3
    bitmask = bitmask.to(device)
    rows_dev = constrained.to(device)

    got, want = logits.clone(), logits.clone()
    apply_token_bitmask(got, bitmask, rows_dev)
    apply_token_bitmask_reference(want, bitmask, rows_dev)
    assert torch.equal(got, want)

    # by the definition, bit by bit
    token = torch.arange(vocab, device=device)
    allowed = ((bitmask[:, token // 32] >> (token % 32)) & 1).bool()
    expect = logits.clone()
    expect[rows_dev] = torch.where(allowed, logits[rows_dev], float("-inf")).to(dtype)
    assert torch.equal(got, expect)
    free = torch.ones(rows, dtype=torch.bool, device=device)
    free[rows_dev] = False
    assert torch.equal(got[free], logits[free])  # unconstrained rows untouched
    assert (
        torch.isfinite(got[rows_dev[0]]).sum() == 1
        and got[rows_dev[0], 3] == logits[rows_dev[0], 3]
    )

    empty = logits.clone()
    apply_token_bitmask(empty, bitmask[:0], rows_dev[:0])
    assert torch.equal(empty, logits)


def test_masked_tokens_are_never_drawn_on_cpu() -> None:
    """Seed 7 at position 1 draws the CPU sampler's largest noise at index 239,470: a banned
    (-inf) token there must stay banned, not become NaN, which argmax picks."""
    from minivllm.worker.ops.sampling import sample_reference

    logits = torch.full((1, 239_471), float("-inf"))
    logits[0, 5] = 0.0
    seed, position = torch.tensor([7]), torch.tensor([1])
    assert sample_reference(logits, torch.tensor([1.0]), None, None, None, seed, position) == 5


def test_reference_on_cpu() -> None:
    check_bitmask("cpu", torch.float32, 6, 1000)


@needs_triton
def test_kernel_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_gpu(dtype: torch.dtype) -> None:
    check_bitmask("cuda", dtype, 256, 151_936)
    check_bitmask("cuda", dtype, 3, 1000)  # a vocabulary that ends inside a word


if __name__ == "__main__":
    check_bitmask("cpu", torch.float32, 5, 5000)
    check_bitmask("cpu", torch.bfloat16, 3, 1000)
    print("ok", file=sys.stderr)
