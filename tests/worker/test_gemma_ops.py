"""Gemma's ops: its RMSNorm (and the norm-add-norm around each residual add), GELU-tanh * up
(alone and in the GEMV's prologue), and the per-head norm of the rotary kernel with the
weight offset; the torch paths against transformers' modules, the Triton kernels against the
torch paths.

As in test_triton_ops: on CUDA the checks run directly (`gpu` marker); on CPU they run under
the Triton interpreter in a subprocess; the torch paths are checked without triton too.
"""

from __future__ import annotations

import sys

import pytest
import torch

from minivllm.worker.ops import rotary
from minivllm.worker.ops.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_torch
from minivllm.worker.ops.gemma_norm import (
    gemma_norm_add_norm,
    gemma_rms_norm,
    gemma_rms_norm_torch,
)
from tests.triton_interpreter import needs_triton, run_interpreted


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def check_norms_and_activation(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 96, generator=gen).to(device, dtype)  # 96: a masked tail
    res = torch.randn(5, 3, 96, generator=gen).to(device, dtype)
    w_post = (0.3 * torch.randn(96, generator=gen)).to(device, dtype)
    w = (0.3 * torch.randn(96, generator=gen)).to(device, dtype)
    torch.testing.assert_close(gemma_rms_norm(x, w, 1e-6), gemma_rms_norm_torch(x, w, 1e-6))
    before = (x.clone(), res.clone())
    out, new_res = gemma_norm_add_norm(x, res, w_post, w, 1e-6)
    want_res = res + gemma_rms_norm_torch(x, w_post, 1e-6)
    torch.testing.assert_close(new_res, want_res, **_tol(dtype))
    torch.testing.assert_close(out, gemma_rms_norm_torch(want_res, w, 1e-6), **_tol(dtype))
    assert torch.equal(x, before[0]) and torch.equal(res, before[1])  # inputs untouched
    gate_up = (3 * torch.randn(7, 2 * 1100, generator=gen)).to(device, dtype)
    got = gelu_tanh_and_mul(gate_up)
    assert got.shape == (7, 1100)
    torch.testing.assert_close(got, gelu_tanh_and_mul_torch(gate_up), **_tol(dtype))


def check_qk_norm_rope_offset(device: str, dtype: torch.dtype) -> None:
    """The rotary kernel's Gemma norm (with the KV store) equals the torch path, over whole
    heads and with partial rotary (the pass-through dims normed too)."""
    for rot in (64, 48):
        _check_qk_norm_rope_offset(device, dtype, rot)


def _check_qk_norm_rope_offset(device: str, dtype: torch.dtype, rot: int) -> None:
    gen = torch.Generator().manual_seed(1)
    t, hq, hk, d = 6, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(device, dtype)
    q, k, v = (x.unflatten(-1, (-1, d)) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    q_w = (0.3 * torch.randn(d, generator=gen)).to(device, dtype)
    k_w = (0.3 * torch.randn(d, generator=gen)).to(device, dtype)
    cos_sin = rotary.build_cos_sin_cache(64, rot, 10000.0, torch.float32, device)
    positions = torch.tensor([0, 1, 5, 17, 63, 2], device=device)
    q_ref, k_ref = q.clone(), k.clone()
    rotary.qk_norm_rope_torch(q_ref, k_ref, q_w, k_w, cos_sin, positions, 1e-6, True, True)
    cache = torch.zeros(2, 1, 8, hk, d, dtype=dtype, device=device)
    slots = torch.arange(t, device=device)  # block 0, one slot per token
    rotary.qk_norm_rope(
        q, k, q_w, k_w, cos_sin, positions, 1e-6, True, v, cache, slots, None, norm_offset=True
    )
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(k, k_ref, **_tol(dtype))
    torch.testing.assert_close(cache[0, 0, :t], k_ref, **_tol(dtype))
    torch.testing.assert_close(cache[1, 0, :t], v, atol=0, rtol=0)


def check_gelu_prologue(device: str, dtype: torch.dtype) -> None:
    """The GEMV's GELU prologue, and `gelu_tanh_mul_linear`, which runs it for one to four
    16-bit rows and the separate ops otherwise."""
    from minivllm.worker.distributed.parallel_state import TPGroup
    from minivllm.worker.layers import fused
    from minivllm.worker.layers.linear import RowParallelLinear
    from minivllm.worker.ops.gemv import GemvConfig, gemv_config, gemv_gelu_tanh_mul

    gen = torch.Generator().manual_seed(2)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for m, n, k in ((1, 64, 512), (2, 32, 1024), (1, 16, 256), (4, 16, 512)):
        cfg = gemv_config(n, k) if device == "cuda" else GemvConfig(4, 256, 4, 2)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
        gate_up = torch.randn(m, 2 * k, generator=gen).to(device, dtype)
        want = gelu_tanh_and_mul_torch(gate_up).double() @ w.double().T
        got = gemv_gelu_tanh_mul(gate_up, w, cfg)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)

    bf16, k, n = torch.bfloat16, 512, 64
    down = RowParallelLinear(k, n, TPGroup(), params_dtype=bf16).to(device)
    down.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
    launched = []
    original = fused.gemv_gelu_tanh_mul
    fused.gemv_gelu_tanh_mul = lambda *a: launched.append(1) or original(*a)
    try:
        for rows in (1, 2, 5):
            launched.clear()
            gate_up = torch.randn(rows, 2 * k, generator=gen).to(device, bf16)
            want = gelu_tanh_and_mul_torch(gate_up).double() @ down.weight.double().T
            got = fused.gelu_tanh_mul_linear(gate_up, down)
            torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
            assert len(launched) == int(rows <= 4)
    finally:
        fused.gemv_gelu_tanh_mul = original


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_paths_equal_transformers(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 64, generator=gen).to(dtype)
    res = torch.randn(4, 3, 64, generator=gen).to(dtype)
    hf_norms = [Gemma3RMSNorm(64, eps=1e-6).to(dtype) for _ in range(2)]
    for norm in hf_norms:
        torch.nn.init.normal_(norm.weight, 0.0, 0.3, generator=gen)
    w_post, w = (norm.weight.detach() for norm in hf_norms)
    with torch.no_grad():
        want_res = res + hf_norms[0](x)
        want = hf_norms[1](want_res)
    assert torch.equal(gemma_rms_norm_torch(x, w, 1e-6), hf_norms[1](x).detach())
    out, new_res = gemma_norm_add_norm(x, res, w_post, w, 1e-6)
    assert torch.equal(new_res, want_res) and torch.equal(out, want)
    gate_up = torch.randn(5, 2 * 40, generator=gen).to(dtype)
    hf_act = ACT2FN["gelu_pytorch_tanh"](gate_up[:, :40]) * gate_up[:, 40:]
    assert torch.equal(gelu_tanh_and_mul_torch(gate_up), hf_act)
    check_norms_and_activation("cpu", dtype)  # without the interpreter: the torch paths


def test_rotary_norm_offset_torch_path_equals_transformers() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(4)
    t, h, d = 5, 3, 32
    q, k = torch.randn(t, h, d, generator=gen), torch.randn(t, h, d, generator=gen)
    norm = Gemma3RMSNorm(d, eps=1e-6)
    torch.nn.init.normal_(norm.weight, 0.0, 0.3, generator=gen)
    cos_sin = rotary.build_cos_sin_cache(16, d, 1000.0, torch.float32, "cpu")
    positions = torch.tensor([0, 3, 7, 15, 1])
    cos, sin = (c.repeat(1, 2) for c in cos_sin[positions].chunk(2, dim=-1))
    with torch.no_grad():
        want_q, want_k = apply_rotary_pos_emb(norm(q), norm(k), cos, sin, unsqueeze_dim=1)
    w = norm.weight.detach()
    rotary.qk_norm_rope(q, k, w, w, cos_sin, positions, 1e-6, True, norm_offset=True)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)


@needs_triton
def test_gemma_kernels_compile_for_hopper() -> None:
    """Gemma's kernel variants build for sm_90 without a GPU: the norm (alone and with the
    add between two norms), GELU * up, the GEMV's GELU prologue, the rotary's offset norm."""
    from minivllm.worker.ops import activation, gemma_norm, gemv
    from tests.hopper_compile import compile_for_hopper

    i32 = "i32"
    norm_sig = dict.fromkeys(("x_ptr", "res_ptr", "post_w_ptr", "w_ptr", "out_ptr"), "*bf16")
    norm_sig |= {"new_res_ptr": "*bf16"}
    norm_sig |= dict.fromkeys(("stride_x", "stride_res", "stride_out", "stride_new_res"), i32)
    norm_sig |= {"n_cols": i32, "eps": "fp32"}
    for sandwich in (False, True):
        compile_for_hopper(
            gemma_norm._gemma_norm_kernel, norm_sig, {"BLOCK": 1024, "SANDWICH": sandwich}, 4
        )
    act_sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": i32, "stride_out": i32}
    act = compile_for_hopper(
        activation._act_and_mul_kernel, act_sig | {"n_cols": i32}, {"BLOCK": 1024, "GELU": True}, 4
    )
    assert "ex2.approx" in act.asm["ptx"]  # the sigmoid of the tanh form
    gemv_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "K": i32}
    gemv_sig |= dict.fromkeys(("stride_xm", "stride_wn", "stride_om"), i32)
    gemv_sig |= {"res_ptr": "*bf16", "new_res_ptr": "*bf16", "nw_ptr": "*bf16", "eps": "fp32"}
    consts = {"M": 1, "BLOCK_N": 4, "BLOCK_K": 1024, "PROLOGUE": 3, "HAS_RESIDUAL": False}
    compile_for_hopper(gemv._gemv_kernel, gemv_sig, consts | {"ONE_SLICE": False}, 8)
    rows_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "M": i32, "K": i32}
    rows_sig |= {k: v for k, v in gemv_sig.items() if k not in rows_sig}
    rows_consts = {k: v for k, v in consts.items() if k != "M"} | {"M_PAD": 4, "ONE_SLICE": False}
    compile_for_hopper(gemv._gemv_rows_kernel, rows_sig, rows_consts, 8)
    rope_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16"}
    rope_sig |= {"cache_ptr": "*fp32", "pos_ptr": "*i64"}
    rope_sig |= dict.fromkeys(("stride_q_tok", "stride_q_head", "stride_k_tok"), i32)
    rope_sig |= dict.fromkeys(("stride_k_head", "stride_cache", "n_q_heads", "n_k_heads"), i32)
    rope_sig |= {"eps": "fp32", "v_ptr": "*bf16", "kv_ptr": "*bf16", "slot_ptr": "*i64"}
    rope_sig |= {"kv_scale_ptr": "*fp32", "n_slots": i32}
    rope_sig |= dict.fromkeys(("stride_v_tok", "stride_v_head", "stride_c_kv"), i32)
    rope_sig |= dict.fromkeys(("stride_c_blk", "stride_c_pos", "stride_c_head"), i32)
    consts = dict(BLOCK_HQ=8, BLOCK_HK=4, HALF=128, BLOCK_R=128, PASS=0, BLOCK_P=1)
    consts |= dict(APPLY_NORM=True, STORE_KV=True, PAGE=16)
    compile_for_hopper(rotary._qk_norm_rope_kernel, rope_sig, consts | {"NORM_OFFSET": True}, 4)


@needs_triton
def test_gemma_ops_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_ops_gpu(dtype: torch.dtype) -> None:
    check_norms_and_activation("cuda", dtype)
    check_qk_norm_rope_offset("cuda", dtype)
    check_gelu_prologue("cuda", dtype)


if __name__ == "__main__":  # the interpreted run
    check_norms_and_activation("cpu", torch.float32)
    check_qk_norm_rope_offset("cpu", torch.float32)
    check_gelu_prologue("cpu", torch.float32)
    print("ok", sys.argv[0])
