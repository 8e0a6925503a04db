"""`python benchmarks/kernels.py [--only GROUP]`: the Triton kernels at Qwen3-0.6B's shapes
on a CUDA GPU, each checked against a torch reference first, then timed (median of
`triton.testing.do_bench`).

Decode attention runs over a bf16 and an FP8 KV cache (the FP8 dots in float16, as the
engine runs them, and in bfloat16), with the bytes of KV each call must read over its time
(TB/s: the H100's device copy runs at ~3.0); cascade attention against plain decode
attention on the shared-prefix shape (256 sequences sharing 2,048 tokens); prefill
attention; the sampler; the fused small ops; the fused MoE layer (moe_kernels.py); the
quantized linear layers (FP8 block-wise and per-channel, AWQ INT4) at Qwen3-8B's shapes
against bf16 (quant_kernels.py).
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import torch
from moe_kernels import bench_moe
from quant_kernels import bench_quant

from minivllm.benchmarks import run_script

HQ, HKV, D, BLOCK = 16, 8, 128, 16
DEV = "cuda"
rows: list[tuple[str, str, float, str]] = []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--only",
        choices=["attention", "sampler", "ops", "moe", "quant"],
        default=None,
        help="one group of kernels (default: all)",
    )


def bench(fn: Any) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3  # µs


def paged_batch(
    q_lens: list[int], seq_lens: list[int], fp8: bool = False, shared: int = 0
) -> tuple:
    """(q, k, v, kv_cache, meta, kv_scale) for sequences whose blocks are scattered over the
    cache; with `shared`, the decode sequences' first `shared` tokens are the same blocks."""
    from minivllm.worker.attention.metadata import AttentionMetadata
    from minivllm.worker.ops.kv_cache import FP8

    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 8
    perm = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=DEV)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = perm[start : start + n]
        start += n
    table[:, : shared // BLOCK] = table[0, : shared // BLOCK]
    kv_cache = torch.randn(2, num_blocks, BLOCK, HKV, D, device=DEV)
    kv_scale = torch.tensor([0.02, 0.01], device=DEV) if fp8 else None
    if fp8:
        # e4m3 holds |x| <= 448 and torch's conversion turns anything past that into NaN
        # (the engine's store saturates): clamp as the store does
        kv_cache = torch.stack(
            [(kv_cache[i] / kv_scale[i]).clamp(-448, 448).to(FP8) for i in range(2)]
        )
    else:
        kv_cache = kv_cache.to(torch.bfloat16)
    slots = []
    for i, (q_len, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s - q_len, s, device=DEV)
        slots.append(table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    t = sum(q_lens)
    q_lens_t = torch.tensor(q_lens, device=DEV)
    decodes = max(q_lens) == 1
    meta = AttentionMetadata(
        num_tokens=t,
        num_seqs=len(seq_lens),
        num_decodes=len(q_lens) if decodes else 0,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.cat([q_lens_t.new_zeros(1), q_lens_t.cumsum(0)]).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_table=table,
        slot_mapping=torch.cat(slots),
        block_size=BLOCK,
        cascade_prefix_len=torch.tensor([shared], dtype=torch.int32, device=DEV)
        if shared
        else None,
    )
    qkv = [torch.randn(t, h, D, dtype=torch.bfloat16, device=DEV) for h in (HQ, HKV, HKV)]
    return (*qkv, kv_cache, meta, kv_scale)


def reference(q, kv_cache, meta, q_lens, seq_lens, scale, kv_scale) -> Any:  # noqa: ANN001
    """Dense attention over the (dequantized) cache in float32."""
    scales = kv_scale.tolist() if kv_scale is not None else [1.0, 1.0]
    outs, row = [], 0
    for i, (q_len, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(s, device=DEV)
        blocks = meta.block_table[i, pos // BLOCK].long()
        k = kv_cache[0, blocks, pos % BLOCK].float().repeat_interleave(HQ // HKV, 1) * scales[0]
        v = kv_cache[1, blocks, pos % BLOCK].float().repeat_interleave(HQ // HKV, 1) * scales[1]
        scores = torch.einsum("qhd,khd->hqk", q[row : row + q_len].float(), k) * scale
        causal = pos[None, :] > torch.arange(s - q_len, s, device=DEV)[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(causal, -1e30).softmax(-1), v))
        row += q_len
    return torch.cat(outs)


def captured(backend: Any, args: tuple, kwargs: dict, expected: Any) -> Any:
    """The forward captured in a CUDA graph, after checking that a replay matches eager."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(*args, **kwargs)  # warm-up (JIT) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*args, **kwargs)
    graph.replay()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    return graph


KV_VARIANTS = {  # name -> (fp8 cache, backend knobs)
    "bf16 KV": (False, {}),
    "fp8 KV": (True, {}),
    "fp8 KV, bf16 dots": (True, {"fp8_dot_f16": False}),
    "fp8 KV, 256-key tiles": (True, {"decode_block_n": 256}),
    "fp8 KV, 4 stages": (True, {"decode_stages": 4}),
    "fp8 KV, uncapped registers": (True, {"decode_maxnreg": 0}),
    "fp8 KV, at most 128 registers, 2 stages": (True, {"decode_maxnreg": 128, "decode_stages": 2}),
}


def bench_decode() -> None:
    from minivllm.worker.attention.triton_attention import (
        TritonAttentionBackend,
        num_decode_splits,
    )

    scale = D**-0.5
    for n in (256, 4):
        seq_lens = [random.randint(550, 650) for _ in range(n)]
        for label, (fp8, knobs) in KV_VARIANTS.items():
            q, k, v, kv_cache, meta, kv_scale = paged_batch([1] * n, seq_lens, fp8)
            kv_bytes = sum(seq_lens) * HKV * D * 2 * kv_cache.element_size()
            ref = None  # after the first forward has stored this step's k/v
            for splits in sorted({1, num_decode_splits(n, HKV)}):
                shape = f"{n} seqs ~600 ctx, {splits} splits, {label}"
                try:
                    backend = TritonAttentionBackend(num_splits=splits, **knobs)
                    backend.store_kv(k, v, kv_cache, meta.slot_mapping, kv_scale)
                    args, kwargs = (q, kv_cache, meta, scale), {"kv_scale": kv_scale}
                    out = backend.forward(*args, **kwargs)
                    if ref is None:
                        ref = reference(q, kv_cache, meta, [1] * n, seq_lens, scale, kv_scale)
                    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
                    us = bench(lambda b=backend, a=args, kw=kwargs: b.forward(*a, **kw))
                    graph_us = bench(captured(backend, args, kwargs, out).replay)
                except Exception as e:  # noqa: BLE001 - a variant that fails is a result too
                    rows.append(("decode attention", shape, float("nan"), f"failed: {e!r:.80}"))
                    continue
                note = f"{kv_bytes / us / 1e6:.2f} TB/s KV; in a CUDA graph {graph_us:.1f} µs"
                rows.append(("decode attention", shape, us, note))


def bench_cascade(n: int = 256, shared: int = 2048, kv: tuple = (False, True)) -> None:
    """n decodes sharing a prefix of `shared` tokens plus 64-128 tokens of their own."""
    from minivllm.worker.attention.triton_attention import TritonAttentionBackend

    scale = D**-0.5
    seq_lens = [shared + random.randint(64, 128) for _ in range(n)]
    for fp8 in kv:
        q, k, v, kv_cache, meta, kv_scale = paged_batch([1] * n, seq_lens, fp8, shared)
        backend = TritonAttentionBackend()
        backend.store_kv(k, v, kv_cache, meta.slot_mapping, kv_scale)
        args, kwargs = (q, kv_cache, meta, scale), {"kv_scale": kv_scale}
        out = backend.forward(*args, **kwargs)
        plain_meta = type(meta)(**{**meta.__dict__, "cascade_prefix_len": None})
        plain_args = (q, kv_cache, plain_meta, scale)
        plain = backend.forward(*plain_args, **kwargs)
        torch.testing.assert_close(out, plain, atol=2e-2, rtol=2e-2)
        call = backend.forward
        us = bench(lambda f=call, a=args, kw=kwargs: f(*a, **kw))
        plain_us = bench(lambda f=call, a=plain_args, kw=kwargs: f(*a, **kw))
        label = "fp8 KV" if fp8 else "bf16 KV"
        note = f"plain decode attention {plain_us:.1f} µs ({plain_us / us:.1f}x)"
        rows.append(("cascade attention", f"{n} seqs, {shared} shared + 64-128, {label}", us, note))


def bench_prefill(kv: tuple = (False, True)) -> None:
    from minivllm.worker.attention.triton_attention import TritonAttentionBackend

    scale = D**-0.5
    seq_lens = [random.randint(100, 1024) for _ in range(16)]
    flops = sum(4 * s * (s + 1) / 2 * D * HQ for s in seq_lens)
    for fp8 in kv:
        q, k, v, kv_cache, meta, kv_scale = paged_batch(seq_lens, seq_lens, fp8)
        backend = TritonAttentionBackend()
        args, kwargs = (q, kv_cache, meta, scale), {"kv_scale": kv_scale}  # attention alone
        out = backend.forward(*args, **kwargs)
        ref = reference(q, kv_cache, meta, seq_lens, seq_lens, scale, kv_scale)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        us = bench(lambda f=backend.forward, a=args, kw=kwargs: f(*a, **kw))
        label = "fp8 KV" if fp8 else "bf16 KV"
        rows.append(("prefill attention", f"16 prompts, {sum(seq_lens)} tokens, {label}", us,
                     f"{flops / us / 1e6:.0f} TFLOP/s"))  # fmt: skip


def bench_sampler() -> None:
    from minivllm.worker.ops.sampling import sample

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
    from minivllm.worker.ops import norm, rotary
    from minivllm.worker.ops.activation import silu_and_mul, silu_and_mul_torch
    from minivllm.worker.ops.kv_cache import store_kv_cache

    DTYPE = torch.bfloat16  # noqa: N806 - as the probe this came from names it
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


def main(args: argparse.Namespace) -> list[tuple[str, str, float, str]]:
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    random.seed(0)
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    groups = {
        "attention": (bench_decode, bench_cascade, bench_prefill),
        "sampler": (bench_sampler,),
        "ops": (bench_ops,),
        "moe": (lambda: bench_moe(rows, bench),),
        "quant": (lambda: bench_quant(rows, bench),),
    }
    for name, fns in groups.items():
        if args.only in (None, name):
            for fn in fns:
                fn()
    print(f"{'kernel':<20} {'shape':<48} {'median µs':>10}  note")
    for name, shape, us, note in rows:
        print(f"{name:<20} {shape:<48} {us:>10.1f}  {note}")
    return rows


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
