"""A step whose every row is greedy takes one argmax (`argmax_rows`) instead of the draw
(`ops.sampling.sample`): both must pick the same token on every row, the first index on
ties, with banned (-inf) stretches and in bf16, where equal scores are common.

On CPU the draw's kernel runs through the Triton interpreter in a subprocess; on a GPU at
the reference workload's vocabulary.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted


def check_greedy(device: str, dtype: torch.dtype, rows: int, vocab: int) -> None:
    from minivllm.worker.ops.sampling import argmax_rows, sample

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, : vocab // 2] = float("-inf")  # the first half banned
    logits[1, 11] = logits[1, vocab - 3] = 50.0  # a tie across the row: the first wins
    logits[2, 5] = logits[2, 6] = 50.0  # a tie inside one tile
    logits = logits.to(dtype=dtype, device=device)
    zeros = torch.zeros(rows, device=device)
    seeds = torch.arange(rows, device=device)
    positions = torch.arange(rows, device=device) + 100
    drawn = sample(logits, zeros, None, None, None, seeds, positions)
    picked = argmax_rows(logits)
    assert picked.dtype == drawn.dtype == torch.int64
    assert torch.equal(picked, drawn), (picked, drawn)
    assert picked[1].item() == 11 and picked[2].item() == 5
    assert picked[0].item() >= vocab // 2


def test_reference_on_cpu() -> None:
    check_greedy("cpu", torch.float32, 4, 1000)


@needs_triton
def test_kernel_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_gpu(dtype: torch.dtype) -> None:
    check_greedy("cuda", dtype, 256, 151_936)


if __name__ == "__main__":
    check_greedy("cpu", torch.float32, 5, 9000)
    check_greedy("cpu", torch.bfloat16, 3, 5000)
    print("ok", file=sys.stderr)
