"""The mixture-of-experts kernels against their torch versions: top-k routing, the sort of
slots into expert blocks, and the two grouped GEMMs, with even and uneven expert loads (one
hot expert, empty experts), every tile configuration, and a rank's share of the experts.

As in test_triton_ops: on CPU the checks run under the Triton interpreter in a subprocess at
small sizes; on CUDA (`gpu` marker) at Qwen3-30B-A3B's and Mixtral-8x7B's sizes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from minivllm.worker.ops.fused_moe import (
    MoETileConfig,
    fused_experts,
    fused_experts_torch,
    moe_tile_config,
)
from minivllm.worker.ops.moe_routing import align_to_blocks, select_experts, select_experts_torch
from tests.triton_interpreter import needs_triton, run_interpreted

LOADS = ("even", "hot", "empty")


def routed_ids(num_tokens: int, num_experts: int, top_k: int, load: str, gen) -> torch.Tensor:
    """int32 [T, k] of distinct experts per token: "even" draws uniformly; "hot" sends every
    token to expert 1 first; "empty" uses only experts 0..k, leaving the rest without slots."""
    used = top_k + 1 if load == "empty" else num_experts
    ids = torch.rand(num_tokens, used, generator=gen).argsort(dim=-1)[:, :top_k]
    if load == "hot":
        ids = torch.rand(num_tokens, num_experts, generator=gen)
        ids[:, 1] = 2.0  # the largest: every token's first choice
        ids = ids.argsort(dim=-1, descending=True)[:, :top_k]
    return ids.to(torch.int32)


def check_select_experts(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for num_experts, top_k in ((128, 8), (8, 2), (60, 4)):  # 60: a masked tail
        # distinct values, also in bfloat16: no ties for the two top-k to break differently
        ranks = torch.rand(37, num_experts, generator=gen).argsort(dim=-1) - num_experts / 2
        logits = (ranks * 0.05).to(dtype=dtype, device=device)
        for renormalize in (True, False):
            weights, ids = select_experts(logits, top_k, renormalize)
            ref_weights, ref_ids = select_experts_torch(logits, top_k, renormalize)
            assert ids.dtype == torch.int32 and weights.dtype == torch.float32
            assert torch.equal(ids, ref_ids)
            torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def check_align(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    for load in LOADS:
        for block_m, first, local in ((16, 0, 16), (4, 0, 16), (16, 4, 8)):
            ids = routed_ids(50, 16, 3, load, gen).to(device)
            blocks = align_to_blocks(ids, local, block_m, first)
            flat = ids.reshape(-1).cpu()
            num_padded = int(blocks.num_padded)
            assert num_padded % block_m == 0
            slots = blocks.sorted_slots[:num_padded].cpu().view(-1, block_m)
            experts = blocks.block_experts[: num_padded // block_m].cpu()
            real = slots < flat.numel()
            # every block holds slots of its expert only, padding after them
            assert (
                flat[slots[real].long()] == (experts[:, None] + first).expand_as(slots)[real]
            ).all()
            assert (real.int().diff(dim=1) <= 0).all()
            # each of this rank's slots exactly once, in order within its expert
            mine = ((flat >= first) & (flat < first + local)).nonzero().flatten()
            assert sorted(slots[real].tolist()) == mine.tolist()
            counts = torch.bincount(flat[mine] - first, minlength=local)
            assert num_padded == int(((counts + block_m - 1) // block_m * block_m).sum())


def check_fused_experts(
    device: str, dtype: torch.dtype, sizes: tuple[int, ...], configs: list[MoETileConfig | None]
) -> None:
    """sizes: tokens, experts, top-k, hidden, intermediate."""
    num_tokens, num_experts, top_k, hidden, inter = sizes
    gen = torch.Generator().manual_seed(2)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    x = rand(num_tokens, hidden)
    w13, w2 = (
        rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5),
        rand(num_experts, hidden, inter, scale=inter**-0.5),
    )
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for load in LOADS:
        ids = routed_ids(num_tokens, num_experts, top_k, load, gen).to(device)
        weights = torch.rand(num_tokens, top_k, generator=gen).to(device)
        ref = fused_experts_torch(x, w13, w2, weights, ids)
        for cfg in configs:
            got = fused_experts(x, w13, w2, weights, ids, num_experts, config=cfg)
            torch.testing.assert_close(
                got, ref, **tol, msg=lambda m, c=cfg, ld=load: f"{ld} {c}: {m}"
            )
        # expert parallelism: the second half of the experts on this rank, and the torch
        # path agrees that the two halves add up to the whole
        half = num_experts // 2
        ref_half = fused_experts_torch(x, w13[half:], w2[half:], weights, ids, first_expert=half)
        got_half = fused_experts(x, w13[half:], w2[half:], weights, ids, num_experts, half)
        torch.testing.assert_close(got_half, ref_half, **tol)
        rest = fused_experts_torch(x, w13[:half], w2[:half], weights, ids)
        torch.testing.assert_close(rest + ref_half, ref, **tol)


def check_tile_configs() -> None:
    """Decode takes blocks of 32 slots, prefill larger tiles; float32 half as deep ones."""
    assert moe_tile_config(256, 8, 128).block_m == 32  # 16 slots per expert
    assert moe_tile_config(1, 8, 128).block_m == 32
    assert moe_tile_config(8192, 8, 128).block_m == 128
    assert moe_tile_config(256, 8, 128, dtype_bytes=4).block_k == 64


SMALL_CONFIGS = [None, MoETileConfig(16, 32, 32, 4, 2), MoETileConfig(32, 16, 16, 4, 2)]


@needs_triton
@pytest.mark.parametrize("checks", [["routing"], ["experts_fp32"], ["experts_bf16"]])
def test_moe_kernels_interpreted(checks: list[str]) -> None:
    run_interpreted(__file__, *checks, timeout=400)


def test_torch_experts_match_a_dense_loop() -> None:
    """The reference against the plainest formula: every token through its k experts."""
    gen = torch.Generator().manual_seed(3)
    x, w13, w2 = (
        torch.randn(9, 12, generator=gen),
        torch.randn(5, 16, 12, generator=gen),
        torch.randn(5, 12, 8, generator=gen),
    )
    weights = torch.rand(9, 2, generator=gen)
    ids = routed_ids(9, 5, 2, "hot", gen)
    expected = torch.zeros(9, 12)
    for t in range(9):
        for j in range(2):
            e = int(ids[t, j])
            gate_up = w13[e] @ x[t]
            h = torch.nn.functional.silu(gate_up[:8]) * gate_up[8:]
            expected[t] += weights[t, j] * (w2[e] @ h)
    torch.testing.assert_close(fused_experts_torch(x, w13, w2, weights, ids), expected)
    check_tile_configs()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_kernels_gpu(dtype: torch.dtype) -> None:
    check_select_experts("cuda", dtype)
    check_align("cuda")
    for num_tokens in (1, 256, 2048):  # decode at batch 1 and 256, a prefill chunk
        check_fused_experts("cuda", dtype, (num_tokens, 128, 8, 2048, 768), [None])
    check_fused_experts("cuda", dtype, (256, 128, 8, 2048, 384), [None])  # I / 2 under TP=2
    check_fused_experts("cuda", dtype, (256, 8, 2, 4096, 14336 // 4), [None])  # Mixtral, I / 4
    check_fused_experts("cuda", dtype, (100, 16, 4, 256, 96), SMALL_CONFIGS)  # K and N tails


if __name__ == "__main__":  # the interpreted run: python this_file.py CHECK...
    from minivllm.worker.ops._triton import interpreting

    assert interpreting()
    for check in sys.argv[1:]:
        if check == "routing":
            check_select_experts("cpu", torch.float32)
            check_select_experts("cpu", torch.bfloat16)
            check_align("cpu")
        elif check == "experts_fp32":
            check_fused_experts("cpu", torch.float32, (40, 8, 2, 64, 48), SMALL_CONFIGS)
        elif check == "experts_bf16":
            check_fused_experts("cpu", torch.bfloat16, (40, 8, 2, 64, 48), SMALL_CONFIGS)
        print("ok", check)
