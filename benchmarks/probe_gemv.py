"""Batch-1 linear layers of Qwen3-0.6B as a decode step sees them: cuBLAS vs a Triton GEMV.

28 distinct weights per shape (one per layer, 112-336 MB in all, so nothing stays in the
50 MB L2), called in turn inside one CUDA graph, as the decode graph does. Times
`F.linear`, `torch.mv` and every `GemvConfig` candidate; checks results against cuBLAS.

    python benchmarks/probe_gemv.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from graph_timing import graph_replay_ms

from minivllm.worker.ops.gemv import GemvConfig, gemv, gemv_fits

SHAPES = {
    "qkv": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
}
LAYERS = 28


def graph_us(fn) -> float:
    """µs per call: `fn` makes one call per layer."""
    return graph_replay_ms(fn, reps=10) * 1e3 / LAYERS


def main() -> None:
    torch.manual_seed(0)
    configs = [
        GemvConfig(bn, bk, warps, stages)
        for bn, bk, warps, stages in itertools.product(
            (4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4)
        )
    ]
    total = {"cuBLAS": 0.0, "best": 0.0}
    top3: list[GemvConfig] = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(LAYERS)]
        for m in (1, 2, 4):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = F.linear(x, ws[0])
            cublas = graph_us(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            mv = graph_us(lambda x=x, ws=ws: [torch.mv(w, x[0]) for w in ws]) if m == 1 else 0
            timed = []
            for cfg in configs if m == 1 else top3:
                if not gemv_fits(cfg, m, n, k):
                    continue
                y = gemv(x, ws[0], cfg)
                if (y.float() - ref.float()).abs().max().item() > 2e-2:
                    print(f"  WRONG {name} {cfg}")
                    continue
                timed.append((graph_us(lambda x=x, ws=ws, c=cfg: [gemv(x, w, c) for w in ws]), cfg))
            timed.sort(key=lambda t: t[0])
            best_us, best = timed[0]
            if m == 1:
                top3 = [c for _, c in timed[:3]]
                total["cuBLAS"] += cublas
                total["best"] += best_us
            print(
                f"{name:8s} M={m} cuBLAS {cublas:5.2f} us  mv {mv:5.2f}  Triton {best_us:5.2f} us "
                f"({n * k * 2 / best_us / 1e3:5.0f} GB/s) {tuple(best)}; next "
                + ", ".join(f"{u:.2f} {tuple(c)}" for u, c in timed[1:3])
            )
    print(f"per layer at M=1: cuBLAS {total['cuBLAS']:.2f} us, best Triton {total['best']:.2f} us")


if __name__ == "__main__":
    main()
