"""The fused MoE kernels in `python benchmarks/kernels.py --only moe`: the routing and the two
grouped GEMMs of one layer at Qwen3-30B-A3B's and Mixtral-8x7B's shapes (and a rank's share
of them under TP=2 and EP=2), checked against the torch loop over experts, then timed.

The layer (routing, sort, both GEMMs, the sum) is timed replayed in a CUDA graph, as a
decode step runs it, and eagerly (its few kernels' launches then show at small batches). TB/s
counts the expert weights a call must read (each expert some token is routed to, once) over
its graph time; the H200's device copy runs at ~4.3 TB/s (read + write), the H100's at ~3.0.
A sweep of tile configurations at decode shapes shows what the defaults leave.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DEV = "cuda"

# name -> (experts on this rank, all experts, top-k, hidden, intermediate on this rank)
SHAPES = {
    "qwen3-30b-a3b": (128, 128, 8, 2048, 768),
    "qwen3-30b-a3b TP=2": (128, 128, 8, 2048, 384),
    "qwen3-30b-a3b EP=2": (64, 128, 8, 2048, 768),
    "mixtral-8x7b": (8, 8, 2, 4096, 14336),
}
TOKENS = (1, 64, 256, 2048, 8192)
SWEEP_TOKENS = (1, 256)


def _layer(shape: tuple[int, ...], num_tokens: int) -> dict[str, Any]:
    """Random inputs of one layer: weights scaled so the outputs are O(1)."""
    local, experts, _, hidden, inter = shape
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*size, generator=gen, device=DEV) * scale
        return x.to(torch.bfloat16)

    return {
        "x": rand(num_tokens, hidden),
        "logits": rand(num_tokens, experts, scale=2.0),
        "w13": rand(local, 2 * inter, hidden, scale=hidden**-0.5),
        "w2": rand(local, hidden, inter, scale=inter**-0.5),
    }


def _touched_bytes(ids: torch.Tensor, shape: tuple[int, ...], w: dict[str, Any]) -> int:
    local, experts = shape[0], shape[1]
    first = experts - local  # the EP shape is the second rank's half
    hit = torch.unique(ids)
    hit = hit[(hit >= first) & (hit < first + local)].numel()
    per_expert = (w["w13"].nbytes + w["w2"].nbytes) // local
    return hit * per_expert


def _captured(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    fn()  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_moe(rows: list, bench: Callable[[Callable[[], Any]], float]) -> None:
    from minivllm.worker.ops.fused_moe import (
        MoETileConfig,
        fused_experts,
        fused_experts_torch,
        moe_tile_config,
    )
    from minivllm.worker.ops.moe_routing import select_experts

    for name, shape in SHAPES.items():
        local, experts, top_k = shape[:3]
        first = experts - local
        for num_tokens in TOKENS:
            w = _layer(shape, num_tokens)
            weights, ids = select_experts(w["logits"], top_k, True)
            args = (w["x"], w["w13"], w["w2"], weights, ids, experts, first)
            ref = fused_experts_torch(*args[:5], first_expert=first)
            label = f"{name}, {num_tokens} tok"
            try:
                torch.testing.assert_close(fused_experts(*args), ref, atol=3e-2, rtol=3e-2)
            except AssertionError as e:
                rows.append(("fused_moe", label, float("nan"), f"wrong: {str(e)[:80]}"))
                continue
            touched = _touched_bytes(ids, shape, w)

            def layer(w: dict = w, a: tuple = args) -> torch.Tensor:  # routing included
                weights, ids = select_experts(w["logits"], a[4].shape[1], True)
                return fused_experts(*a[:3], weights, ids, *a[5:])

            us, torch_us = bench(layer), bench(lambda a=args: fused_experts_torch(*a[:5]))
            graph_us = bench(_captured(layer).replay)
            cfg = moe_tile_config(num_tokens, top_k, experts)
            note = (f"{touched / graph_us / 1e6:.2f} TB/s of experts; eager {us:.0f} µs; "
                    f"tiles {tuple(cfg)}; torch loop {torch_us:.0f} µs")  # fmt: skip
            us = graph_us
            rows.append(("fused_moe", label, us, note))
            if name != "qwen3-30b-a3b" or num_tokens not in SWEEP_TOKENS:
                continue
            for cfg in (
                MoETileConfig(16, 64, 128, 4, 4),
                MoETileConfig(16, 128, 128, 4, 3),
                MoETileConfig(32, 64, 128, 4, 4),
                MoETileConfig(32, 128, 64, 4, 4),
                MoETileConfig(64, 64, 64, 4, 3),
                MoETileConfig(64, 128, 64, 4, 3),
            ):
                call = lambda a=args, c=cfg: fused_experts(*a, config=c)  # noqa: E731
                try:
                    torch.testing.assert_close(call(), ref, atol=3e-2, rtol=3e-2)
                    sweep_us = bench(_captured(call).replay)
                except Exception as e:  # noqa: BLE001 - a config that fails is a result too
                    rows.append(
                        ("fused_moe sweep", f"{label} {tuple(cfg)}", float("nan"), repr(e)[:60])
                    )
                    continue
                rows.append(("fused_moe sweep", f"{label} {tuple(cfg)}", sweep_us,
                             f"{touched / sweep_us / 1e6:.2f} TB/s (no routing)"))  # fmt: skip
