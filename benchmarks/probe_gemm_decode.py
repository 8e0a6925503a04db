"""The decode-step GEMMs of Qwen3-0.6B at M = 64-256 rows: cuBLAS vs cuBLASLt vs what
Inductor's max-autotune finds (cuBLAS and its own Triton templates, persistent TMA ones
included on Hopper).

28 distinct weights per shape called in turn inside one CUDA graph, as a decode step does
(so the 50 MB L2 holds none of them). Also the memory-traffic bound of each shape.

    python benchmarks/probe_gemm_decode.py [--autotune]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from graph_timing import QWEN3_0_6B_LINEARS, layer_weights
from graph_timing import per_layer_us as graph_us

COPY_TBPS = 2.95  # the H100's measured device copy bandwidth (read + write)


def main() -> None:
    torch.manual_seed(0)
    rows = (64, 128, 256)
    weights = layer_weights()
    print(f"{'shape':<9}{'M':>5}{'bound':>8}{'cuBLAS':>9}{'cuBLASLt':>10}{'autotune':>10}  (µs)")
    totals: dict[str, dict[int, list[float]]] = {}
    for name, (n, k) in QWEN3_0_6B_LINEARS.items():
        ws = weights[name]
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            bound = (n * k + m * k + m * n) * 2 / (COPY_TBPS * 1e6)
            torch.backends.cuda.preferred_blas_library("cublas")
            cublas = graph_us(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            torch.backends.cuda.preferred_blas_library("cublaslt")
            lt = graph_us(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            torch.backends.cuda.preferred_blas_library("cublas")
            tuned = float("nan")
            if "--autotune" in sys.argv and m == 256:
                lin = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                ref = F.linear(x, ws[0])
                if (lin(x, ws[0]).float() - ref.float()).abs().max().item() < 5e-2:
                    tuned = graph_us(lambda x=x, ws=ws, lin=lin: [lin(x, w) for w in ws])
            t = totals.setdefault("x", {}).setdefault(m, [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate((bound, cublas, lt, tuned)):
                t[i] += v
            print(f"{name:<9}{m:>5}{bound:>8.2f}{cublas:>9.2f}{lt:>10.2f}{tuned:>10.2f}")
    for m, (bound, cublas, lt, tuned) in totals["x"].items():
        print(f"per layer M={m}: bound {bound:.1f}  cuBLAS {cublas:.1f}  cuBLASLt {lt:.1f}  "
              f"autotune {tuned:.1f} µs")  # fmt: skip


if __name__ == "__main__":
    main()
