"""Batch-1 linear layers of Qwen3-0.6B as a decode step sees them: cuBLAS vs a Triton GEMV.

28 distinct weights per shape (one per layer, 112-336 MB in all, so nothing stays in the
50 MB L2), called in turn inside one CUDA graph, as the decode graph does. Times
`F.linear`, `torch.mv` and every `GemvConfig` candidate; checks results against cuBLAS.
With --fused: one layer's four linears with the norms and SiLU*mul as separate kernels
against the GEMV with those ops as prologues, for a few configs.

    python benchmarks/probe_gemv.py [--fused]
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
from graph_timing import LAYERS, layer_weights
from graph_timing import QWEN3_0_6B_LINEARS as SHAPES
from graph_timing import per_layer_us as graph_us

from minivllm.worker.ops.activation import silu_and_mul
from minivllm.worker.ops.gemv import (
    GemvConfig,
    gemv,
    gemv_config,
    gemv_fits,
    gemv_rms_norm,
    gemv_silu_mul,
)
from minivllm.worker.ops.norm import fused_add_rms_norm


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
    weights = layer_weights()
    for name, (n, k) in SHAPES.items():
        ws = weights[name]
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


def fused_layers() -> None:
    """A decode layer's linears at M=1, 28 layers' weights in turn: norm / activation kernels
    plus plain GEMVs, against the GEMVs with the prologues (per config of the fused ones)."""
    torch.manual_seed(0)
    ws = layer_weights()
    h = torch.randn(1, 1024, dtype=torch.bfloat16, device="cuda")
    res = torch.randn_like(h)
    new_res = torch.empty_like(h)
    nw = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    gate_up = torch.randn(1, 6144, dtype=torch.bfloat16, device="cuda")
    attn = torch.randn(1, 2048, dtype=torch.bfloat16, device="cuda")
    base = GemvConfig(4, 1024, 8, 2)

    def cfg(name: str) -> GemvConfig:
        return gemv_config(*SHAPES[name])  # what the layers use

    def separate() -> None:
        for i in range(LAYERS):
            x, _ = fused_add_rms_norm(h, res, nw, 1e-6)
            gemv(x, ws["qkv"][i], cfg("qkv"))
            gemv(attn, ws["o_proj"][i], cfg("o_proj"))
            x, _ = fused_add_rms_norm(h, res, nw, 1e-6)
            gemv(x, ws["gate_up"][i], cfg("gate_up"))
            gemv(silu_and_mul(gate_up), ws["down"][i], cfg("down"))

    def fused(c_qkv: GemvConfig, c_gu: GemvConfig, c_down: GemvConfig) -> None:
        for i in range(LAYERS):
            gemv_rms_norm(h, res, nw, 1e-6, ws["qkv"][i], c_qkv, new_res)
            gemv(attn, ws["o_proj"][i], cfg("o_proj"))
            gemv_rms_norm(h, res, nw, 1e-6, ws["gate_up"][i], c_gu, new_res)
            gemv_silu_mul(gate_up, ws["down"][i], c_down)

    print(f"layer at M=1, separate norm/SiLU kernels: {graph_us(separate):6.2f} us")
    print(f"layer at M=1, fused prologues:            "
          f"{graph_us(lambda: fused(cfg('qkv'), cfg('gate_up'), cfg('down'))):6.2f} us")  # fmt: skip
    for bn, warps in itertools.product((4, 8, 16), (4, 8)):
        c = base._replace(block_n=bn, num_warps=warps)
        c_down = c._replace(block_k=1024)
        t_norm = graph_us(
            lambda c=c: [gemv_rms_norm(h, res, nw, 1e-6, w, c, new_res) for w in ws["qkv"]]
        )
        t_gu = graph_us(
            lambda c=c: [gemv_rms_norm(h, res, nw, 1e-6, w, c, new_res) for w in ws["gate_up"]]
        )
        t_down = graph_us(lambda c=c_down: [gemv_silu_mul(gate_up, w, c) for w in ws["down"]])
        print(f"  {tuple(c)}: qkv+norm {t_norm:5.2f}  gate_up+norm {t_gu:5.2f}  "
              f"silu+down {t_down:5.2f} us")  # fmt: skip


if __name__ == "__main__":
    if "--fused" in sys.argv:
        fused_layers()
    else:
        main()
