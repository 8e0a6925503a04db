"""The attention and KV-store kernels compile for an H100 (sm_90) without a GPU, with an FP8
and a 16-bit cache, cascade on and off, with a sliding window and without; an FP8 cache is
converted in registers by the hardware's e4m3 conversions (one instruction per pair of
values) and its stores saturate."""

from __future__ import annotations

import re

import pytest

from minivllm.worker.ops._triton import HAS_TRITON
from tests.hopper_compile import compile_for_hopper

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

DEQUANT, QUANT = "cvt.rn.f16x2.e4m3x2", "cvt.rn.satfinite.e4m3x2.f32"
CACHE_STRIDES = dict.fromkeys(
    ("stride_c_kv", "stride_c_blk", "stride_c_pos", "stride_c_head"), "i32"
)


def _i32(*names: str) -> dict:
    return dict.fromkeys(names, "i32")


def _attention(
    kind: str, fp8: bool, cascade: bool = False, window: int = 0, maxnreg: int | None = None
) -> str:
    """PTX of the decode, cascade-prefix or prefill kernel at Qwen3-0.6B's head shapes."""
    import triton.language as tl

    from minivllm.worker.attention import cascade as cascade_mod
    from minivllm.worker.attention import triton_attention as ta

    cache = "*fp8e4nv" if fp8 else "*bf16"
    head = {"q_ptr": "*bf16", "cache_ptr": cache, "block_table_ptr": "*i32", "seq_lens_ptr": "*i32"}
    consts = dict(GQA=2, HEAD_DIM=128, PAGE=16, FP8=fp8, PRECISION="tf32", PDL=True)
    consts["DOT"] = tl.float16 if fp8 else tl.bfloat16
    if kind == "decode":
        kernel = ta._decode_kernel
        sig = head | {"order_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32"}
        sig |= {"part_lse_ptr": "*fp32", "kv_scale_ptr": "*fp32", "prefix_ptr": "*i32"}
        sig |= {"scale_log2": "fp32"} | _i32("stride_q_tok", "stride_q_head", "stride_o_tok")
        sig |= _i32("stride_o_head", "stride_bt") | CACHE_STRIDES
        consts |= dict(BLOCK_G=16, BLOCK_N=128, NUM_SPLITS=1, NUM_PARTS=5 if cascade else 1)
        consts |= dict(NUM_KV_HEADS=8, HAS_ORDER=True, CASCADE=cascade, WINDOW=window)
    elif kind == "prefix":
        kernel = cascade_mod._cascade_prefix_kernel
        sig = head | {"prefix_ptr": "*i32", "kv_scale_ptr": "*fp32", "part_out_ptr": "*fp32"}
        sig |= {"part_lse_ptr": "*fp32", "num_decodes": "i32", "scale_log2": "fp32"}
        sig |= _i32("stride_q_tok", "stride_q_head", "stride_bt") | CACHE_STRIDES
        consts |= dict(BLOCK_M=64, BLOCK_N=64, NUM_SPLITS=4, FIRST_PART=1, NUM_PARTS=5)
        consts |= dict(NUM_KV_HEADS=8)
    else:
        kernel = ta._prefill_kernel
        sig = head | {"query_start_ptr": "*i32", "out_ptr": "*bf16", "kv_scale_ptr": "*fp32"}
        sig |= {"first_seq": "i32", "scale_log2": "fp32"}
        sig |= _i32("stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head")
        sig |= _i32("stride_bt") | CACHE_STRIDES
        consts |= dict(BLOCK_M=64, BLOCK_N=64, WINDOW=window)
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    return compile_for_hopper(kernel, sig, consts, 4, **options).asm["ptx"]


@pytest.mark.parametrize(
    "kind, cascade",
    [("decode", False), ("decode", True), ("prefix", True), ("prefill", False)],
)
def test_attention_kernels_dequantize_in_registers(kind: str, cascade: bool) -> None:
    ptx = _attention(kind, fp8=True, cascade=cascade)
    # float16 tensor-core dots: mma.sync for decode tiles, Hopper's wgmma for 64-row ones
    assert DEQUANT in ptx and re.search(r"mma\.\S*f32\.f16\.f16", ptx)
    assert "cvt.bf16.f16" not in ptx  # no detour through bfloat16
    assert DEQUANT not in _attention(kind, fp8=False, cascade=cascade)


def test_fp8_decode_kernel_compiles_under_its_register_cap() -> None:
    """The FP8 decode kernel is launched with at most FP8_DECODE_MAXNREG registers a thread
    (three programs per SM instead of two): the cap reaches the compiled kernel."""
    from minivllm.worker.attention.triton_attention import FP8_DECODE_MAXNREG

    ptx = _attention("decode", fp8=True, maxnreg=FP8_DECODE_MAXNREG)
    assert f".maxnreg {FP8_DECODE_MAXNREG}" in ptx and DEQUANT in ptx
    assert ".maxnreg" not in _attention("decode", fp8=True)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_windowed_attention_kernels_compile(kind: str, fp8: bool) -> None:
    """A sliding window (Gemma 3's 1024 tokens) is a compile-time constant of its own
    variant; without one the kernel is the one it was before windows existed."""
    windowed = _attention(kind, fp8=fp8, window=1024)
    assert re.search(r"\b1024\b|\b1023\b", windowed)
    assert windowed != _attention(kind, fp8=fp8)


@pytest.mark.parametrize("store", ["store_kv_cache", "qk_norm_rope"])
def test_kv_stores_quantize_with_saturation(store: str) -> None:
    from minivllm.worker.ops import kv_cache

    cache = {"*fp8e4nv": True, "*bf16": False}
    for cache_type, fp8 in cache.items():
        if store == "store_kv_cache":
            kernel = kv_cache._store_kv_kernel
            sig = {"k_ptr": "*bf16", "v_ptr": "*bf16", "cache_ptr": cache_type}
            sig |= {"slot_ptr": "*i64", "kv_scale_ptr": "*fp32"}
            sig |= _i32("stride_k_tok", "stride_k_head", "stride_v_tok", "stride_v_head")
            consts = dict(NUM_KV_HEADS=8, BLOCK_H=8, HEAD_DIM=128, PAGE=16, FP8=fp8, PDL=True)
        else:
            kernel, sig, consts = _rotary(cache_type, head_dim=128, rotary_dim=128)
        ptx = compile_for_hopper(kernel, sig | CACHE_STRIDES, consts, 4).asm["ptx"]
        assert (QUANT in ptx) == fp8, cache_type


def _rotary(cache_type: str, head_dim: int, rotary_dim: int, norm: bool = True) -> tuple:
    """The rotary kernel (norm, rotation and KV store) at Qwen3-8B's head counts."""
    from minivllm.worker.ops import rotary

    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16"}
    sig |= {"cache_ptr": "*fp32", "pos_ptr": "*i64"}
    sig |= _i32("stride_q_tok", "stride_q_head", "stride_k_tok", "stride_k_head")
    sig |= _i32("stride_cache", "n_q_heads", "n_k_heads") | {"eps": "fp32"}
    sig |= {"v_ptr": "*bf16", "kv_ptr": cache_type, "slot_ptr": "*i64"}
    sig |= {"kv_scale_ptr": "*fp32", "n_slots": "i32"}
    sig |= _i32("stride_v_tok", "stride_v_head")
    half, pass_dims = rotary_dim // 2, head_dim - rotary_dim
    consts = dict(BLOCK_HQ=32, BLOCK_HK=8, HALF=half, BLOCK_R=1 << (half - 1).bit_length())
    consts |= dict(PASS=pass_dims, BLOCK_P=1 << max(pass_dims - 1, 0).bit_length())
    consts |= dict(APPLY_NORM=norm, STORE_KV=True, PAGE=16, FP8=cache_type == "*fp8e4nv")
    return rotary._qk_norm_rope_kernel, sig | CACHE_STRIDES, consts | dict(PDL=True)


@pytest.mark.parametrize(
    ("head_dim", "rotary_dim"),
    [(128, 128), (96, 96), (128, 96), (24, 18)],
    ids=["whole-heads", "phi3-mini-96", "phi4-mini-partial", "odd-half"],
)
def test_rotary_kernel_compiles_for_every_head_shape(head_dim: int, rotary_dim: int) -> None:
    """Head dims that are no power of two and partial rotary (the pass-through dims stored
    with the rotated ones) build for an H100, with and without the norm, into 16-bit and FP8
    caches."""
    for cache_type in ("*bf16", "*fp8e4nv"):
        for norm in (True, False):
            kernel, sig, consts = _rotary(cache_type, head_dim, rotary_dim, norm)
            ptx = compile_for_hopper(kernel, sig, consts, 4).asm["ptx"]
            assert (QUANT in ptx) == (cache_type == "*fp8e4nv")
