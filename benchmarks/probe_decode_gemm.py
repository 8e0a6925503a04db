"""The decode-step GEMMs of Qwen3-0.6B: cuBLAS against the Triton decode GEMM
(minivllm.worker.ops.decode_gemm) over a sweep of tiles, at M = 32-256 rows.

Each layer's linear follows an RMSNorm of its input, as in a decoder, and 28 distinct
weights per shape are called in turn inside one CUDA graph (so the 50 MB L2 holds none of
them when its turn comes). For the best tile of each shape, also the time without the L2
prefetch and without programmatic dependent launch.

    python benchmarks/probe_decode_gemm.py [--rows 32 64 128 256]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from graph_timing import LAYERS, QWEN3_0_6B_LINEARS, layer_weights, per_layer_us

from minivllm.worker.ops import decode_gemm as dg
from minivllm.worker.ops.decode_gemm import GemmConfig, decode_gemm, decode_gemm_fits
from minivllm.worker.ops.norm import rms_norm


def _configs(m: int) -> list[GemmConfig]:
    bms = [max(16, min(64, m))] if m <= 64 else [64, 128]
    out = [
        GemmConfig(bm, bn, bk, w, s)
        for bm in bms
        for bn, bk, w, s in (
            (32, 128, 4, 4),
            (64, 128, 4, 4),
            (64, 64, 4, 6),
            (128, 64, 4, 4),
            (128, 64, 8, 4),
        )  # fmt: skip
    ]
    out += [
        GemmConfig(min(m, 128), 64, 128, 4, 4, swap=True),
        GemmConfig(max(16, min(m, 64)), 128, 64, 4, 4, swap=True),
        GemmConfig(max(16, min(m, 64)), 64, 128, 4, 5, swap=True),
    ]
    bm = max(64, min(m, 128))
    for ws in (False, True) if "--ws" in sys.argv else (False,):  # --ws: hung on an H100
        out += [
            GemmConfig(bm, bn, bk, w, s, tma=True, warp_specialize=ws)
            for bn, bk, w, s in ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 6))
        ]
        out += [
            GemmConfig(max(16, min(m, 128)), bn, bk, 4, s, swap=True, tma=True, warp_specialize=ws)
            for bn, bk, s in ((64, 128, 4), (128, 64, 4))
        ]
    return out


def _chain(x, nw, ws, linear):
    return lambda: [linear(rms_norm(x, nw, 1e-6), w) for w in ws]


def main() -> None:
    torch.manual_seed(0)
    rows = (
        [int(a) for a in sys.argv[sys.argv.index("--rows") + 1 :]]
        if "--rows" in sys.argv
        else [32, 64, 128, 256]
    )
    rows = [r for r in rows if r > 0]
    weights = layer_weights()
    print(
        f"{torch.cuda.get_device_name()}; µs per layer (norm + linear), 28 weights per shape in one graph"
    )
    for m in rows:
        tot_cublas = tot_best = tot_norm = 0.0
        for name, (n, k) in QWEN3_0_6B_LINEARS.items():
            ws = weights[name]
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            nw = torch.ones(k, dtype=torch.bfloat16, device="cuda")
            norm_only = per_layer_us(
                lambda x=x, nw=nw: [rms_norm(x, nw, 1e-6) for _ in range(LAYERS)]
            )
            cublas = per_layer_us(_chain(x, nw, ws, F.linear))
            ref = F.linear(x, ws[0]).float()
            results = []
            for cfg in _configs(m):
                if not decode_gemm_fits(cfg, n, k) or ("--tma" in sys.argv and not cfg.tma):
                    continue
                print(f"  {name} M={m} {cfg}", end=": ", flush=True)
                try:
                    err = (decode_gemm(x, ws[0], cfg).float() - ref).abs().max().item()
                    if err > 0.05:
                        print(f"  {name} M={m} {cfg}: WRONG (max err {err:.3f})")
                        continue
                    results.append(
                        (
                            per_layer_us(
                                _chain(x, nw, ws, lambda a, w, c=cfg: decode_gemm(a, w, c))
                            ),
                            cfg,
                        )
                    )
                except Exception as e:  # noqa: BLE001 - a probe: report and go on
                    print(f"  {name} M={m} {cfg}: ERR {type(e).__name__}: {str(e)[:120]}")
                print(
                    f"{results[-1][0]:.2f}" if results and results[-1][1] == cfg else "-",
                    flush=True,
                )
            results.sort()
            if not results:
                continue
            best, cfg = results[0]
            no_pf = per_layer_us(
                _chain(x, nw, ws, lambda a, w, c=cfg._replace(prefetch=False): decode_gemm(a, w, c))
            )
            real_pdl = dg.pdl
            dg.pdl = lambda t: {"PDL": False, "launch_pdl": False}
            no_pdl = per_layer_us(_chain(x, nw, ws, lambda a, w, c=cfg: decode_gemm(a, w, c)))
            dg.pdl = real_pdl
            tot_cublas += cublas
            tot_best += best
            tot_norm += norm_only
            runner = ", ".join(f"{t:.2f}" for t, _ in results[1:4])
            print(f"{name:<8} M={m:<4} norm {norm_only:5.2f}  norm+cuBLAS {cublas:6.2f}  norm+Triton {best:6.2f} "
                  f"[{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}{' swap' if cfg.swap else ''}{' tma' if cfg.tma else ''}{' ws' if cfg.warp_specialize else ''}]"
                  f"  no prefetch {no_pf:6.2f}  no PDL {no_pdl:6.2f}  next: {runner}")  # fmt: skip
        print(f"per layer M={m}: norms {tot_norm:.1f}, +cuBLAS {tot_cublas:.1f}, +Triton {tot_best:.1f} µs "
              f"(Triton/cuBLAS {tot_best / tot_cublas:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
