"""Decode and prefill attention on the reference workload's real context lengths.

Decode: for every 50th step of the workload (all 256 requests start together; request i
decodes while step < its output length, over a context of prompt + step tokens), one
CUDA graph of 28 decode-attention calls (one per layer of Qwen3-0.6B) over one layer's paged
KV cache, per backend variant. Prints the KV read bandwidth per step and the estimated
attention seconds of the whole run (sampled steps x 50), so variants compare on what the
benchmark actually runs, not on a uniform batch.

Prefill: the first 8,192-token step of prompts, the paged Triton prefill kernel at several
tile shapes against torch's FlashAttention-2 `varlen_attn` (dense) for the same prompts.

    python benchmarks/probe_attention_workload.py
"""

from __future__ import annotations

import sys
from inspect import signature

import torch
from graph_timing import graph_replay_ms
from torch.nn.attention.varlen import varlen_attn

from minivllm.frontend.bench.workloads import reference_workload
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.triton_attention import TritonAttentionBackend

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 28, 16, 8, 128, 16
DT = torch.bfloat16
DEV = "cuda"

VARIANTS = {
    "base (batch order)": dict(order=False),
    "longest first": dict(order=True),
    "longest first, min_programs 512": dict(order=True, min_programs=512),
    "longest first, min_programs 1024": dict(order=True, min_programs=1024),
    "longest first, BLOCK_N 64, 3 stages": dict(order=True, decode_block_n=64, decode_stages=3),
    "longest first, 2 stages": dict(order=True, decode_stages=2),
}

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel
PREFILL_TILES = [
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
    (128, 128, 8, 2), (128, 32, 4, 2),
]  # fmt: skip


def meta_for(ctx: list[int], q_lens: list[int], num_decodes: int) -> AttentionMetadata:
    blocks = [-(-c // PAGE) for c in ctx]
    width = max(blocks)
    table = torch.zeros(len(ctx), width, dtype=torch.int32)
    start = 0
    for i, b in enumerate(blocks):  # contiguous blocks per request, as a fresh run allocates
        table[i, :b] = torch.arange(start, start + b)
        start += b
    q = torch.tensor(q_lens)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q.cumsum(0)]).to(torch.int32)
    seq = torch.tensor(ctx, dtype=torch.int32)
    return AttentionMetadata(
        num_tokens=int(q.sum()),
        num_seqs=len(ctx),
        num_decodes=num_decodes,
        max_query_len=max(q_lens),
        max_seq_len=max(ctx),
        query_start_loc=cu.to(DEV),
        seq_lens=seq.to(DEV),
        block_table=table.to(DEV),
        slot_mapping=torch.empty(0, dtype=torch.long, device=DEV),  # nothing stored: time reads
        block_size=PAGE,
        query_start_loc_cpu=cu,
        seq_lens_cpu=seq,
        decode_order=seq[:num_decodes].argsort(descending=True).to(torch.int32).to(DEV),
    )


def decode_probe(cache: torch.Tensor) -> None:
    w = reference_workload()
    prompts = [len(p) for p in w.prompts]
    steps = list(range(0, max(w.output_lens), 50))
    scale = HEAD_DIM**-0.5
    totals = dict.fromkeys(VARIANTS, 0.0)
    header = " | ".join(f"{n[:22]:>22}" for n in VARIANTS)
    print(f"{'step':>5} {'seqs':>5} {'KV GB':>6} | {header}")
    for s in steps:
        active = [i for i in range(256) if s < w.output_lens[i]]
        ctx = [prompts[i] + s + 1 for i in active]
        n = len(ctx)
        meta = meta_for(ctx, [1] * n, n)
        q = torch.randn(n, Q_HEADS, HEAD_DIM, dtype=DT, device=DEV)
        kv = torch.randn(n, KV_HEADS, HEAD_DIM, dtype=DT, device=DEV)
        gbytes = sum(ctx) * KV_HEADS * HEAD_DIM * 2 * 2 / 1e9
        row = []
        for name, cfg in VARIANTS.items():
            cfg = dict(cfg)
            m = meta if cfg.pop("order") else meta_for(ctx, [1] * n, n)
            if m is not meta:
                m.decode_order = None
            backend = TritonAttentionBackend(**cfg)

            def layers(backend=backend, m=m, q=q, kv=kv):
                for _ in range(LAYERS):
                    backend.store_kv(kv, kv, cache, m.slot_mapping)
                    backend.forward(q, cache, m, scale)

            ms = graph_replay_ms(layers, reps=5) / LAYERS
            totals[name] += ms * LAYERS * 50 / 1e3
            row.append(f"{ms * 1e3:8.1f} us {gbytes / ms:6.2f} TB/s")
        print(f"{s:>5} {n:>5} {gbytes:6.3f} | " + " | ".join(f"{r:>22}" for r in row))
    print("estimated decode attention seconds over the run (sampled steps x 50):")
    for name, t in totals.items():
        print(f"  {name:40s} {t:6.3f} s")


def prefill_probe(cache: torch.Tensor) -> None:
    w = reference_workload()
    lens, total = [], 0
    for p in w.prompts:
        if total + len(p) > 8192:
            break
        lens.append(len(p))
        total += len(p)
    meta = meta_for(lens, lens, 0)
    t = meta.num_tokens
    # store this step's keys (both paths then see the same ones)
    table = meta.block_table.cpu().long()
    meta.slot_mapping = torch.cat(
        [
            table[i, torch.arange(n) // PAGE] * PAGE + torch.arange(n) % PAGE
            for i, n in enumerate(lens)
        ]
    ).to(DEV)
    q = torch.randn(t, Q_HEADS, HEAD_DIM, dtype=DT, device=DEV)
    kv = torch.randn(t, KV_HEADS, HEAD_DIM, dtype=DT, device=DEV)
    scale = HEAD_DIM**-0.5
    cu = meta.query_start_loc

    def paged(backend: TritonAttentionBackend) -> torch.Tensor:
        backend.store_kv(kv, kv, cache, meta.slot_mapping)
        return backend.forward(q, cache, meta, scale)

    runs = {
        f"paged Triton prefill {tiles}": lambda b=TritonAttentionBackend(prefill_tiles=tiles): (
            paged(b)
        )
        for tiles in PREFILL_TILES
    }
    runs |= {
        "dense varlen_attn": lambda: varlen_attn(
            q, kv, kv, cu, cu, max(lens), max(lens), scale=scale, window_size=(-1, 0),
            **({"enable_gqa": True} if "enable_gqa" in signature(varlen_attn).parameters else {}),
        ),
    }  # fmt: skip
    out = {}
    for name, run in runs.items():
        out[name] = run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            run()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / 20
        print(f"prefill {len(lens)} prompts, {t} tokens, {name}: {ms * 1e3:.0f} us per layer")
    dense = out["dense varlen_attn"].float()
    for name, o in out.items():
        print(f"  max |{name} - dense|: {(o.float() - dense).abs().max().item():.4f}")


def main() -> None:
    torch.manual_seed(0)
    num_blocks = 300_000 // PAGE
    cache = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM, dtype=DT, device=DEV)
    if "--prefill-only" not in sys.argv:
        decode_probe(cache)
    prefill_probe(cache)


if __name__ == "__main__":
    main()
