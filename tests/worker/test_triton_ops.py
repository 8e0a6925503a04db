"""Fused ops and the sampler: Triton kernels against their torch versions.

As in test_triton_attention: on CUDA the checks run directly (`gpu` marker); on CPU they run
under the Triton interpreter in a subprocess. The torch paths are also checked without triton.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from minivllm.worker.ops import rotary, sampling
from minivllm.worker.ops.activation import silu_and_mul, silu_and_mul_torch
from minivllm.worker.ops.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_torch,
    rms_norm,
    rms_norm_torch,
)
from tests.triton_interpreter import needs_triton, run_interpreted


def check_norm_and_activation(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    x = torch.randn(5, 3, 96, generator=gen).to(dtype=dtype, device=device)  # 96: masked tail
    res = torch.randn(5, 3, 96, generator=gen).to(dtype=dtype, device=device)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype=dtype, device=device)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), **tol)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = fused_add_rms_norm_torch(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, **tol)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched
    gate_up = torch.randn(7, 2 * 1100, generator=gen).to(dtype=dtype, device=device)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_torch(gate_up), **tol)
    assert silu_and_mul(gate_up).shape == (7, 1100)


# (head_dim, rotary dim): whole heads; Phi-3-mini's 96 (no power of two); Phi-4-mini's
# partial rotary (0.75 of 128); a rotated half of 9 dims and a pass-through of 6
ROPE_SHAPES = [(64, 64), (96, 96), (128, 96), (24, 18)]


def check_qk_norm_rope(
    device: str, dtype: torch.dtype, apply_norm: bool, d: int = 64, rot: int = 64
) -> None:
    gen = torch.Generator().manual_seed(1)
    t, hq, hk = 6, 4, 2
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype=dtype, device=device)
    q = qkv[:, : hq * d].view(t, hq, d)  # strided views, as the attention layer has them
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    q_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype=dtype, device=device)
    k_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype=dtype, device=device)
    cache = rotary.build_cos_sin_cache(64, rot, 10000.0, torch.float32, device)
    positions = torch.tensor([0, 1, 5, 17, 63, 2], device=device)
    q_ref, k_ref = q.clone(), k.clone()
    rotary.qk_norm_rope_torch(q_ref, k_ref, q_w, k_w, cache, positions, 1e-6, apply_norm)
    v_before = qkv[:, (hq + hk) * d :].clone()
    rotary.qk_norm_rope(q, k, q_w, k_w, cache, positions, 1e-6, apply_norm)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)  # v untouched
    if not apply_norm:  # the dims past the rotary dim pass through, bit for bit
        assert torch.equal(q[..., rot:], q_ref[..., rot:]) and torch.equal(
            k[..., rot:], k_ref[..., rot:]
        )


def check_qk_norm_rope_kv_store(
    device: str, dtype: torch.dtype, apply_norm: bool, cache_dtype: torch.dtype, rot: int = 64
) -> None:
    """The KV store fused into qk_norm_rope against the unfused path (rotate, then the
    attention backend's store kernel): the same q/k and the same cache, for GQA shapes with
    padded head tiles (3 kv heads), slot -1 and rows past the slot mapping left unstored.
    An FP8 cache holds exactly the bytes of the torch reference's quantization, values past
    the range (the small v scale) saturated."""
    from minivllm.worker.attention.torch_attention import store_kv
    from minivllm.worker.attention.triton_attention import store_kv_cache
    from minivllm.worker.ops.kv_cache import FP8

    gen = torch.Generator().manual_seed(3)
    fp32, low = {"atol": 1e-5, "rtol": 1e-5}, {"atol": 2e-2, "rtol": 2e-2}
    tol = fp32 if dtype == torch.float32 else low
    cache_tol = fp32 if cache_dtype == torch.float32 else low
    t, d, page, num_blocks = 7, 64, 4, 5
    # the last token has no slot (a padded row); token 1 has slot -1
    slots = torch.tensor([13, -1, 0, 7, 19, 2], device=device)
    positions = torch.tensor([0, 1, 5, 17, 63, 2, 9], device=device)
    cos_sin = rotary.build_cos_sin_cache(64, rot, 10000.0, torch.float32, device)
    fp8 = cache_dtype == FP8
    kv_scale = torch.tensor([0.03, 0.004], device=device) if fp8 else None
    if fp8:
        cache_tol = {"atol": 0, "rtol": 0}

    def bits(x: torch.Tensor) -> torch.Tensor:  # torch.equal has no float8 kernel on the CPU
        return x.view(torch.uint8) if fp8 else x

    for hq, hk in ((8, 2), (6, 3)):
        qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype=dtype, device=device)
        q = qkv[:, : hq * d].view(t, hq, d)  # strided views, as the attention layer has them
        k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
        v = qkv[:, (hq + hk) * d :].view(t, hk, d)
        q_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype=dtype, device=device)
        k_w = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype=dtype, device=device)
        cache = torch.randn(2, num_blocks, page, hk, d, generator=gen).to(cache_dtype).to(device)
        args = (q_w, k_w, cos_sin, positions, 1e-6, apply_norm)

        q_ref, k_ref, ref_cache = q.clone(), k.clone(), cache.clone()
        rotary.qk_norm_rope(q_ref, k_ref, *args)
        store_kv_cache(k_ref, v, ref_cache, slots, kv_scale)

        v_before, untouched = v.clone(), cache.clone()
        rotary.qk_norm_rope(q, k, *args, v=v, kv_cache=cache, slot_mapping=slots, kv_scale=kv_scale)
        torch.testing.assert_close(q, q_ref, **tol)
        torch.testing.assert_close(k, k_ref, **tol)
        assert torch.equal(v, v_before)
        # exactly the rotated k and the v rows, cast to the cache dtype, at their slots; every
        # other row (slot -1, the padded token's, the unused slots) as it was
        expected = untouched.clone()
        store_kv(k, v, expected, slots, kv_scale)
        assert torch.equal(bits(cache), bits(expected)), (hq, hk)
        torch.testing.assert_close(cache.float(), ref_cache.float(), **cache_tol)
        if fp8:  # the small v scale saturated some values
            assert (cache[1].float().abs() == 448).any()


def check_sampler(sample_fn, device: str, draws: int = 2000) -> None:  # noqa: ANN001
    """`draws` independent draws check the distribution (fewer under the slow interpreter)."""
    gen = torch.Generator().manual_seed(2)
    n, vocab = 4, 9000  # several vocab tiles, so rows split into chunks
    logits = torch.randn(n, vocab, generator=gen).to(device) * 3

    def params(temp: float, k: int = 0, p: float = 1.0, mp: float = 0.0, rows: int = n) -> dict:
        return {
            "temperature": torch.full((rows,), temp, device=device),
            "top_k": torch.full((rows,), k, dtype=torch.int32, device=device),
            "top_p": torch.full((rows,), p, device=device),
            "min_p": torch.full((rows,), mp, device=device),
            "seeds": torch.arange(rows, device=device) * 7 + 1,
            "positions": torch.arange(rows, device=device) + 100,
        }

    argmax = logits.argmax(-1)
    assert torch.equal(sample_fn(logits, **params(0.0)), argmax)  # greedy
    assert torch.equal(sample_fn(logits, **params(0.8, k=1)), argmax)  # top-k 1
    ties = torch.zeros(2, vocab, device=device)
    ties[:, [1034, 10, 4100, 8200]] = 1.0  # greedy takes the first of equal maxima
    assert sample_fn(ties, **params(0.0, rows=2)).tolist() == [10, 10]

    one_pass = {**params(1.0), "top_k": None, "top_p": None, "min_p": None}
    first = sample_fn(logits, **one_pass)
    assert torch.equal(first, sample_fn(logits, **one_pass))  # reproducible
    assert not torch.equal(first, argmax)
    # each row's draw depends only on its own (seed, position): a batch of 1 and a shuffled,
    # larger batch agree
    for i in range(n):
        single = {key: (v[i : i + 1] if v is not None else None) for key, v in one_pass.items()}
        assert sample_fn(logits[i : i + 1], **single).item() == first[i].item()
    order = torch.randperm(n, generator=gen).to(device)
    shuffled = {key: (v[order] if v is not None else None) for key, v in one_pass.items()}
    assert torch.equal(sample_fn(logits[order], **shuffled), first[order])

    # filtered tokens are never drawn (many positions = many independent draws)
    rows, vocab = 32, 3000
    row = torch.randn(vocab, generator=gen).to(device) * 2
    many = row.expand(rows, vocab).contiguous()
    rank = torch.empty(vocab, dtype=torch.long, device=device)
    rank[row.argsort(descending=True)] = torch.arange(vocab, device=device)
    probs = row.softmax(-1)
    sorted_probs = probs.sort(descending=True).values
    in_top_p = (sorted_probs.cumsum(0) - sorted_probs < 0.3)[rank]
    for kwargs, allowed in [
        ({"k": 3}, rank < 3),
        ({"p": 0.3}, in_top_p),
        ({"mp": 0.2}, probs >= 0.2 * probs.max()),
        ({"k": 50, "p": 0.5, "mp": 0.05}, (rank < 50) & (probs >= 0.05 * probs.max())),
    ]:
        got = sample_fn(many, **params(1.0, rows=rows, **kwargs))
        assert allowed[got].all(), kwargs
        assert got.unique().numel() > 1, kwargs  # still random

    # the draws follow softmax(logits / T)
    temp = 0.7
    small = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0, -math.inf, 1.5, 0.2], device=device)
    got = sample_fn(small.expand(draws, -1).contiguous(), **params(temp, rows=draws))
    freq = torch.bincount(got, minlength=8).float() / draws
    atol = 4 * 0.5 / math.sqrt(draws)  # 4 standard deviations at worst
    torch.testing.assert_close(freq, (small / temp).softmax(-1), atol=atol, rtol=0)


def check_qk_norm_rope_store_kv_op(
    device: str, dtype: torch.dtype, partial_rotary_factor: float = 1.0
) -> None:
    """layers.fused.qk_norm_rope_store_kv against the ops one after another (the rotary
    kernel, then the torch store) and against the layers it fuses, `rope(positions,
    q_norm(q), k_norm(k))`: where Triton runs and the backend stores as the rotary
    kernel does, one kernel rotates and stores; on the step that computes the FP8 scales, for
    the torch backend, or without Triton, the rotation, then the backend's store (the scales
    first, from the rotated keys). Each way, q, k, the cache and the scales come out alike."""
    from minivllm.worker.attention.torch_attention import TorchAttentionBackend
    from minivllm.worker.attention.triton_attention import TritonAttentionBackend
    from minivllm.worker.layers import fused
    from minivllm.worker.layers.norm import RMSNorm
    from minivllm.worker.layers.rotary import RotaryEmbedding
    from minivllm.worker.ops.kv_cache import FP8

    gen = torch.Generator().manual_seed(5)
    d = 64  # the head size
    rope = RotaryEmbedding(
        d, 64, {"rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor}
    ).to(device)
    norms = [RMSNorm(d, 1e-6, dtype).to(device) for _ in range(2)]
    for norm in norms:
        norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=gen))
    calls: list[bool] = []  # per rotary launch: whether it stored k and v

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(len(args) > 8 or "kv_cache" in kwargs)
        return rotary.qk_norm_rope(*args, **kwargs)

    cases = [  # backend, cache dtype, the step computes the FP8 scales, per-head norm
        (TritonAttentionBackend(), dtype, False, True),
        (TritonAttentionBackend(), dtype, False, False),
        (TritonAttentionBackend(), FP8, False, True),
        (TritonAttentionBackend(), FP8, True, True),
        (TorchAttentionBackend(), dtype, False, True),
    ]
    fused.qk_norm_rope = spy
    try:
        for case in cases:
            _check_fused_case(case, rope, norms, gen, device, dtype, calls)
    finally:
        fused.qk_norm_rope = rotary.qk_norm_rope


def _check_fused_case(
    case: tuple,
    rope: torch.nn.Module,
    norms: list[torch.nn.Module],
    gen: torch.Generator,
    device: str,
    dtype: torch.dtype,
    calls: list[bool],
) -> None:
    """One case of `check_qk_norm_rope_store_kv_op`: (backend, cache dtype, whether the step
    computes the FP8 scales, per-head norm); `calls` records the rotary kernel's launches."""
    from minivllm.worker.attention.layer import PagedAttention, forward_batch
    from minivllm.worker.attention.torch_attention import store_kv
    from minivllm.worker.attention.triton_attention import TritonAttentionBackend
    from minivllm.worker.layers import fused
    from minivllm.worker.ops._triton import use_triton
    from minivllm.worker.ops.kv_cache import calculate_kv_scales
    from minivllm.worker.step_buffers import StepBuffers

    backend, cache_dtype, compute_scales, qk_norm = case
    t, hq, hk, d, page = 6, 4, 2, 64, 4
    positions = torch.tensor([0, 1, 5, 17, 63, 2], device=device)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    what = (type(backend).__name__, cache_dtype, compute_scales, qk_norm)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(device, dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = (x.unflatten(-1, (-1, d)) for x in (q, k, v))
    cache = torch.zeros(2, 3, page, hk, d, dtype=cache_dtype, device=device)
    attn = PagedAttention(0, backend, d**-0.5).to(device)
    attn.kv_scale.copy_(torch.tensor([0.03, 0.02]))
    buffers = StepBuffers(1, t, 3, page, torch.device(device))
    meta = buffers.one_prompt(np.zeros(t, dtype=np.int64))
    meta.slot_mapping[2] = -1
    meta.compute_kv_scales = compute_scales

    q_ref, k_ref = q.clone(), k.clone()
    ref_cache, ref_scale = cache.clone(), attn.kv_scale.clone()
    # what the fused op computes, by the layers one after another
    q_layers, k_layers = q.clone(), k.clone()
    if qk_norm:
        q_layers, k_layers = norms[0](q_layers), norms[1](k_layers)
    q_layers, k_layers = rope(positions, q_layers, k_layers)
    weights = (norms[0].weight, norms[1].weight) if qk_norm else (None, None)
    rotary.qk_norm_rope(q_ref, k_ref, *weights, rope.cos_sin_cache, positions, 1e-6, qk_norm)
    if compute_scales:
        calculate_kv_scales(k_ref, v, ref_scale)

    calls.clear()
    q_norm, k_norm = norms if qk_norm else (None, None)
    with forward_batch(meta, [cache]):
        got = fused.qk_norm_rope_store_kv(positions, q, k, v, q_norm, k_norm, rope, attn)
    one_kernel = use_triton(q) and isinstance(backend, TritonAttentionBackend)
    assert calls == [one_kernel and not compute_scales], (what, calls)
    assert got[0] is q and got[1] is k
    for got_x, ref, by_layers in ((q, q_ref, q_layers), (k, k_ref, k_layers)):
        torch.testing.assert_close(got_x, ref, **tol, msg=lambda m, w=what: f"{w}: {m}")
        torch.testing.assert_close(got_x, by_layers, **tol)
    assert torch.equal(attn.kv_scale, ref_scale), what
    # the rotated k and v at their slots, as the torch store writes them
    store_kv(k, v, ref_cache, meta.slot_mapping, ref_scale)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8)), what


def test_torch_paths_and_rope_cache() -> None:
    check_norm_and_activation("cpu", torch.float32)  # without the interpreter: torch paths
    for d, rot in ROPE_SHAPES:
        check_qk_norm_rope("cpu", torch.float32, True, d, rot)
    check_qk_norm_rope_store_kv_op("cpu", torch.float32)
    check_qk_norm_rope_store_kv_op("cpu", torch.float32, partial_rotary_factor=0.75)
    check_sampler(sampling.sample_reference, "cpu")
    # the torch fallback rotates only; a KV store asked of it is refused, not dropped
    q, k, v = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)
    cos_sin = rotary.build_cos_sin_cache(4, 8, 100.0, torch.float32, "cpu")
    kv_cache, pos, slots = torch.zeros(2, 1, 4, 2, 8), torch.arange(2), torch.arange(2)
    with pytest.raises(ValueError, match="only into the Triton kernel"):
        rotary.qk_norm_rope(q, k, None, None, cos_sin, pos, 0.0, False, v, kv_cache, slots)
    with pytest.raises(ValueError, match="come together"):
        rotary.qk_norm_rope(q, k, None, None, cos_sin, pos, 0.0, False, v, kv_cache)
    cache = rotary.build_cos_sin_cache(8, 4, 100.0, torch.float32, "cpu")
    angles = torch.arange(8.0)[:, None] * torch.tensor([1.0, 0.1])  # theta^(-2i/d)
    torch.testing.assert_close(cache, torch.cat([angles.cos(), angles.sin()], -1))
    with pytest.raises(ValueError, match="'ntk'.*supported: default, linear, dynamic"):
        rotary.build_cos_sin_cache(8, 4, 100.0, torch.float32, "cpu", {"rope_type": "ntk"})
    with pytest.raises(ValueError, match="rotary dim 6 must be even and at most head_dim 4"):
        rotary.qk_norm_rope(q[..., :4], k[..., :4], None, None, cos_sin[:, :6], pos, 0.0, False)


@needs_triton
@pytest.mark.parametrize("checks", [["norm", "rope"], ["rope_kv_store"], ["sampler"]])
def test_triton_ops_interpreted(checks: list[str]) -> None:
    run_interpreted(__file__, *checks)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_ops_gpu(dtype: torch.dtype) -> None:
    check_norm_and_activation("cuda", dtype)
    for d, rot in ROPE_SHAPES:
        check_qk_norm_rope("cuda", dtype, True, d, rot)
        check_qk_norm_rope("cuda", dtype, False, d, rot)
    for rot in (64, 48):  # whole heads; partial, with a rotated half of 24 dims
        check_qk_norm_rope_kv_store("cuda", dtype, True, dtype, rot)
        check_qk_norm_rope_kv_store("cuda", dtype, False, dtype, rot)
        check_qk_norm_rope_kv_store("cuda", dtype, True, torch.bfloat16, rot)
        check_qk_norm_rope_kv_store("cuda", dtype, True, torch.float8_e4m3fn, rot)
    check_qk_norm_rope_store_kv_op("cuda", dtype)
    check_qk_norm_rope_store_kv_op("cuda", dtype, partial_rotary_factor=0.75)


@pytest.mark.gpu
def test_kv_stores_replay_in_a_cuda_graph() -> None:
    """Both KV stores read their slots on the device: a captured graph replayed with new
    slots and positions writes where the new slots say, as an eager run does."""
    from minivllm.worker.attention.triton_attention import store_kv_cache

    gen = torch.Generator().manual_seed(4)
    t, hq, hk, d, page = 4, 8, 2, 128, 16

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=torch.bfloat16, device="cuda")

    qkv, cache, w = rand(t, (hq + 2 * hk) * d), rand(2, 6, page, hk, d), rand(d)
    cos_sin = rotary.build_cos_sin_cache(512, d, 10000.0, torch.float32, "cuda")
    positions = torch.zeros(t, dtype=torch.long, device="cuda")
    slots = torch.full((t,), -1, dtype=torch.long, device="cuda")

    def step(qkv: torch.Tensor, cache: torch.Tensor) -> None:
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
        v = qkv[:, (hq + hk) * d :].view(t, hk, d)
        rotary.qk_norm_rope(q, k, w, w, cos_sin, positions, 1e-6, True, v, cache, slots)
        store_kv_cache(k, v, cache[:, 3:], slots)  # a second copy, blocks 3.. of the cache

    static_qkv, static_cache = qkv.clone(), cache.clone()
    step(static_qkv.clone(), static_cache.clone())  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static_qkv, static_cache)
    positions.copy_(torch.tensor([3, 100, 7, 511]))
    slots.copy_(torch.tensor([5, -1, 40, 17]))
    static_qkv.copy_(qkv)
    static_cache.copy_(cache)
    graph.replay()
    eager_qkv, eager_cache = qkv.clone(), cache.clone()
    step(eager_qkv, eager_cache)
    assert torch.equal(static_qkv, eager_qkv)
    assert torch.equal(static_cache, eager_cache)
    assert not torch.equal(eager_cache, cache)  # the new slots were written


@pytest.mark.gpu
def test_sampler_gpu() -> None:
    check_sampler(sampling.sample, "cuda")


if __name__ == "__main__":  # the interpreted run: python this_file.py CHECK...
    from minivllm.worker.ops._triton import interpreting

    assert interpreting()
    for check in sys.argv[1:]:
        if check == "norm":
            check_norm_and_activation("cpu", torch.float32)
        elif check == "rope":
            for d, rot in ROPE_SHAPES:
                check_qk_norm_rope("cpu", torch.float32, True, d, rot)
                check_qk_norm_rope("cpu", torch.float32, False, d, rot)
        elif check == "rope_kv_store":
            check_qk_norm_rope_kv_store("cpu", torch.float32, True, torch.float32)
            check_qk_norm_rope_kv_store("cpu", torch.float32, False, torch.float32)
            check_qk_norm_rope_kv_store("cpu", torch.float32, True, torch.float16)
            check_qk_norm_rope_kv_store("cpu", torch.float32, True, torch.float8_e4m3fn)
            check_qk_norm_rope_kv_store("cpu", torch.bfloat16, False, torch.float8_e4m3fn)
            check_qk_norm_rope_kv_store("cpu", torch.float32, True, torch.float32, rot=48)
            check_qk_norm_rope_kv_store("cpu", torch.float32, False, torch.float16, rot=48)
            check_qk_norm_rope_store_kv_op("cpu", torch.float32)
            check_qk_norm_rope_store_kv_op("cpu", torch.float32, partial_rotary_factor=0.75)
        elif check == "sampler":
            check_sampler(sampling.sample, "cpu", draws=300)
        print("ok", check)
