"""Times the Triton kernels on a CUDA GPU at Qwen3-0.6B shapes, after checking them.

    python benchmarks/kernels_gpu.py

Decode attention reports the KV bytes it must read per call over its median time (TB/s);
the H100's device copy runs at ~3.0 TB/s (measured).
"""

from __future__ import annotations

import random

import torch
import triton.testing

from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.triton_attention import (
    TritonAttentionBackend,
    num_decode_splits,
    store_kv_cache,
)
from minivllm.worker.ops import norm, rotary
from minivllm.worker.ops.activation import silu_and_mul, silu_and_mul_torch
from minivllm.worker.ops.sampling import sample

HQ, HKV, D, BLOCK, DTYPE = 16, 8, 128, 16, torch.bfloat16
DEV = "cuda"
rows: list[tuple[str, str, float, str]] = []


def bench(fn) -> float:  # noqa: ANN001
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3  # µs


def paged_batch(q_lens: list[int], seq_lens: list[int]) -> tuple:
    """q, k, v, kv_cache, meta for sequences whose blocks are scattered over the cache."""
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 8
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=DEV)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = perm[start : start + n]
        start += n
    kv_cache = torch.randn(2, num_blocks, BLOCK, HKV, D, dtype=DTYPE, device=DEV)
    slots = []
    for i, (q_len, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s - q_len, s, device=DEV)
        slots.append(table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    t = sum(q_lens)
    q_lens_t = torch.tensor(q_lens, device=DEV)
    meta = AttentionMetadata(
        num_tokens=t,
        num_seqs=len(seq_lens),
        num_decodes=sum(1 for n in q_lens if n == 1) if max(q_lens) == 1 else 0,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.cat([q_lens_t.new_zeros(1), q_lens_t.cumsum(0)]).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_table=table,
        slot_mapping=torch.cat(slots),
        block_size=BLOCK,
    )
    qkv = [torch.randn(t, h, D, dtype=DTYPE, device=DEV) for h in (HQ, HKV, HKV)]
    return (*qkv, kv_cache, meta)


def reference(q, kv_cache, meta, q_lens, seq_lens, scale) -> torch.Tensor:  # noqa: ANN001
    outs, row = [], 0
    for i, (q_len, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s, device=DEV)
        blocks = meta.block_table[i, pos // BLOCK].long()
        k = kv_cache[0, blocks, pos % BLOCK].float().repeat_interleave(HQ // HKV, 1)
        v = kv_cache[1, blocks, pos % BLOCK].float().repeat_interleave(HQ // HKV, 1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + q_len].float(), k) * scale
        causal = pos[None, :] > torch.arange(s - q_len, s, device=DEV)[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(causal, -1e30).softmax(-1), v))
        row += q_len
    return torch.cat(outs)


def attend(backend: TritonAttentionBackend, q, k, v, kv_cache, meta, scale):  # noqa: ANN001, ANN201
    """One layer's attention: store this step's k/v, then attend."""
    backend.store_kv(k, v, kv_cache, meta.slot_mapping)
    return backend.forward(q, kv_cache, meta, scale)


def captured(backend: TritonAttentionBackend, args: tuple, expected: torch.Tensor):  # noqa: ANN201
    """`attend` captured in a CUDA graph, after checking that a replay matches eager."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend(backend, *args)  # warm-up (JIT) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(backend, *args)
    graph.replay()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    return graph


def bench_varlen(q, k, v, seq_lens: list[int], scale: float) -> str:  # noqa: ANN001
    """torch's dense FlashAttention-2 varlen prefill on the same tokens, for comparison."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        lens = torch.tensor([0, *seq_lens], device=DEV).cumsum(0).int()
        m = max(seq_lens)
        us = bench(lambda: varlen_attn(q, k, v, lens, lens, m, m, scale=scale, window_size=(-1, 0)))
        return f"torch varlen_attn {us:.1f} µs"
    except Exception as e:  # noqa: BLE001 - only a reference number
        return f"varlen_attn n/a ({type(e).__name__})"


def bench_attention() -> None:
    scale = D**-0.5
    for n in (256, 4):
        seq_lens = [random.randint(550, 650) for _ in range(n)]
        q, k, v, kv_cache, meta = paged_batch([1] * n, seq_lens)
        kv_bytes = sum(seq_lens) * HKV * D * 2 * kv_cache.element_size()
        for splits in sorted({1, num_decode_splits(n, HKV)}):
            backend = TritonAttentionBackend(num_splits=splits)
            out = attend(backend, q, k, v, kv_cache, meta, scale)
            ref = reference(q, kv_cache, meta, [1] * n, seq_lens, scale)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
            args = (q, k, v, kv_cache, meta, scale)
            us = bench(lambda b=backend, a=args: attend(b, *a))
            graph_us = bench(captured(backend, args, out).replay)
            tbs = kv_bytes / us / 1e6
            rows.append(
                (
                    "decode attention",
                    f"{n} seqs ~600 ctx, {splits} splits",
                    us,
                    f"{tbs:.2f} TB/s KV; in a CUDA graph {graph_us:.1f} µs",
                )
            )

    seq_lens = [random.randint(100, 1024) for _ in range(16)]
    q, k, v, kv_cache, meta = paged_batch(seq_lens, seq_lens)
    backend = TritonAttentionBackend()
    out = attend(backend, q, k, v, kv_cache, meta, scale)
    torch.testing.assert_close(
        out.float(), reference(q, kv_cache, meta, seq_lens, seq_lens, scale), atol=2e-2, rtol=2e-2
    )
    us = bench(lambda: attend(backend, q, k, v, kv_cache, meta, scale))
    flops = sum(4 * s * (s + 1) / 2 * D * HQ for s in seq_lens)
    note = f"{flops / us / 1e6:.0f} TFLOP/s; " + bench_varlen(q, k, v, seq_lens, scale)
    rows.append(("prefill attention", f"16 prompts, {sum(seq_lens)} tokens", us, note))


def bench_sampler() -> None:
    n, vocab = 256, 151936
    logits = torch.randn(n, vocab, device=DEV).to(torch.bfloat16) * 5
    temp = torch.full((n,), 0.6, device=DEV)
    seeds = torch.arange(n, device=DEV)
    positions = torch.full((n,), 700, device=DEV)
    greedy = sample(logits, torch.zeros(n, device=DEV), None, None, None, seeds, positions)
    assert torch.equal(greedy, logits.argmax(-1))
    top_k = torch.full((n,), 20, dtype=torch.int32, device=DEV)
    top_p = torch.full((n,), 0.9, device=DEV)
    min_p = torch.full((n,), 0.05, device=DEV)
    picked = sample(logits, temp, top_k, None, None, seeds, positions)
    assert (logits.gather(1, picked[:, None]) >= logits.topk(20).values[:, -1:]).all()
    for label, args in [
        ("one pass (no filters)", (None, None, None)),
        ("min-p (row max + pass)", (None, None, min_p)),
        ("top-k + top-p (sort)", (top_k, top_p, None)),
    ]:
        us = bench(lambda a=args: sample(logits, temp, *a, seeds, positions))
        rows.append(("sampler", f"256x151936 bf16, {label}", us, f"{logits.nbytes / us / 1e6:.2f} TB/s"))  # fmt: skip


def bench_ops() -> None:
    t, hidden, inter = 256, 1024, 3072
    x = torch.randn(t, hidden, dtype=DTYPE, device=DEV)
    res = torch.randn(t, hidden, dtype=DTYPE, device=DEV)
    w = torch.randn(hidden, dtype=DTYPE, device=DEV)
    gate_up = torch.randn(t, 2 * inter, dtype=DTYPE, device=DEV)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, dtype=DTYPE, device=DEV)
    q, k = qkv[:, : HQ * D].view(t, HQ, D), qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D)
    qw, kw = torch.randn(D, dtype=DTYPE, device=DEV), torch.randn(D, dtype=DTYPE, device=DEV)
    cache = rotary.build_cos_sin_cache(4096, D, 1e6, torch.float32, DEV)
    pos = torch.randint(0, 4096, (t,), device=DEV)
    tol = {"atol": 3e-2, "rtol": 3e-2}

    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), norm.rms_norm_torch(x, w, 1e-6), **tol)
    got, ref = (
        norm.fused_add_rms_norm(x, res, w, 1e-6),
        norm.fused_add_rms_norm_torch(x, res, w, 1e-6),
    )
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_torch(gate_up), **tol)
    q2, k2 = q.clone(), k.clone()
    rotary.qk_norm_rope(q, k, qw, kw, cache, pos, 1e-6, True)
    rotary.qk_norm_rope_torch(q2, k2, qw, kw, cache, pos, 1e-6, True)
    torch.testing.assert_close((q, k), (q2, k2), **tol)
    # the KV store fused into the rotary kernel against the rotation, then the store kernel
    v = qkv[:, (HQ + HKV) * D :].view(t, HKV, D)
    kv_cache = torch.zeros(2, t // BLOCK + 1, BLOCK, HKV, D, dtype=DTYPE, device=DEV)
    slots = torch.randperm(kv_cache.shape[1] * BLOCK, device=DEV)[:t]
    fused_cache, q2, k2 = kv_cache.clone(), q.clone(), k.clone()
    rotary.qk_norm_rope(q, k, qw, kw, cache, pos, 1e-6, True, v, fused_cache, slots)
    rotary.qk_norm_rope(q2, k2, qw, kw, cache, pos, 1e-6, True)
    store_kv_cache(k2, v, kv_cache, slots)
    torch.testing.assert_close((q, k, fused_cache), (q2, k2, kv_cache), **tol)

    def rope_then_store(n: int) -> None:
        rotary.qk_norm_rope(q[:n], k[:n], qw, kw, cache, pos[:n], 1e-6, True)
        store_kv_cache(k[:n], v[:n], kv_cache, slots[:n])

    for n in (1, t):
        us = bench(
            lambda n=n: rotary.qk_norm_rope(
                q[:n], k[:n], qw, kw, cache, pos[:n], 1e-6, True, v[:n], kv_cache, slots[:n]
            )
        )
        two_us = bench(lambda n=n: rope_then_store(n))
        rows.append(("qk_norm_rope+kv", f"{n} tok, {HQ}+{HKV} heads, KV store fused", us,
                     f"rope then store kernel {two_us:.1f} µs"))  # fmt: skip

    cases = [
        ("rms_norm", f"{t}x{hidden}", lambda: norm.rms_norm(x, w, 1e-6), lambda: norm.rms_norm_torch(x, w, 1e-6)),
        ("fused_add_rms_norm", f"{t}x{hidden}", lambda: norm.fused_add_rms_norm(x, res, w, 1e-6),
         lambda: norm.fused_add_rms_norm_torch(x, res, w, 1e-6)),
        ("silu_and_mul", f"{t}x{2 * inter}", lambda: silu_and_mul(gate_up), lambda: silu_and_mul_torch(gate_up)),
        ("qk_norm_rope", f"{t} tok, {HQ}+{HKV} heads", lambda: rotary.qk_norm_rope(q, k, qw, kw, cache, pos, 1e-6, True),
         lambda: rotary.qk_norm_rope_torch(q, k, qw, kw, cache, pos, 1e-6, True)),
    ]  # fmt: skip
    for name, shape, fused, eager in cases:
        us, eager_us = bench(fused), bench(eager)
        rows.append((name, shape, us, f"eager torch {eager_us:.1f} µs"))


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    random.seed(0)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    bench_attention()
    bench_sampler()
    bench_ops()
    print(f"{'kernel':<20} {'shape':<38} {'median µs':>10}  note")
    for name, shape, us, note in rows:
        print(f"{name:<20} {shape:<38} {us:>10.1f}  {note}")


if __name__ == "__main__":
    main()
