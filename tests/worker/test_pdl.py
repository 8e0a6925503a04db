"""Programmatic dependent launch without a GPU: the step's kernels compile for sm_90 with PDL
on, waiting for the kernel before them and letting the next one launch; with PDL off they
do neither. The GPU tests run the same kernels with PDL on (the default)."""

from __future__ import annotations

import pytest
import torch

from minivllm.worker.ops import _triton
from minivllm.worker.ops._triton import HAS_TRITON
from tests.hopper_compile import compile_for_hopper

WAIT, LAUNCH = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
_BF16_NORM = dict.fromkeys(("x_ptr", "res_ptr", "w_ptr", "out_ptr", "new_res_ptr"), "*bf16")


def _kernels() -> dict:
    """name -> (kernel, signature, constants, warps)."""
    from minivllm.worker.attention import triton_attention
    from minivllm.worker.ops import activation, gemv, norm

    strides4 = dict.fromkeys(("stride_x", "stride_res", "stride_out", "stride_new_res"), "i32")
    gemv_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "K": "i32"}
    gemv_sig |= dict.fromkeys(("stride_xm", "stride_wn", "stride_om"), "i32")
    gemv_sig |= {"res_ptr": "*bf16", "new_res_ptr": "*bf16", "nw_ptr": "*bf16", "eps": "fp32"}
    gemv_consts = {"M": 1, "BLOCK_N": 4, "BLOCK_K": 1024, "HAS_RESIDUAL": True}
    rows_sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "K": "i32"}
    rows_sig |= {k: v for k, v in gemv_sig.items() if k not in rows_sig}
    rows_consts = {"M_PAD": 4, "BLOCK_N": 4, "BLOCK_K": 1024, "HAS_RESIDUAL": True}
    return {
        "add_rms_norm": (
            norm._rms_norm_kernel,
            _BF16_NORM | strides4 | {"n_cols": "i32", "eps": "fp32"},
            {"BLOCK": 1024, "HAS_RESIDUAL": True},
            4,
        ),
        "silu_mul": (
            activation._act_and_mul_kernel,
            {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "stride_out": "i32"}
            | {"n_cols": "i32"},
            {"BLOCK": 1024, "GELU": False},
            4,
        ),
        "gelu_mul": (
            activation._act_and_mul_kernel,
            {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "stride_out": "i32"}
            | {"n_cols": "i32"},
            {"BLOCK": 1024, "GELU": True},
            4,
        ),
        "gemv_silu_mul": (
            gemv._gemv_kernel,
            gemv_sig,
            gemv_consts | {"PROLOGUE": 2, "ONE_SLICE": False},
            8,
        ),
        "gemv_rms_norm": (
            gemv._gemv_kernel,
            gemv_sig,
            gemv_consts | {"PROLOGUE": 1, "ONE_SLICE": True},
            8,
        ),
        "gemv_rows_rms_norm": (
            gemv._gemv_rows_kernel,
            rows_sig,
            rows_consts | {"PROLOGUE": 1, "ONE_SLICE": True},
            8,
        ),
        "gemv_rows_silu_mul": (
            gemv._gemv_rows_kernel,
            rows_sig,
            rows_consts | {"PROLOGUE": 2, "ONE_SLICE": False},
            8,
        ),
        "split_kv_merge": (
            triton_attention._merge_kernel,
            {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16"}
            | {"stride_o_tok": "i32", "stride_o_head": "i32"},
            {"NUM_HEADS": 16, "HEAD_DIM": 128, "NUM_SPLITS": 4, "BLOCK_S": 4},
            4,
        ),
    }


def _ptx(name: str, pdl: bool) -> str:
    kernel, signature, constants, warps = _kernels()[name]
    return compile_for_hopper(kernel, signature, constants | {"PDL": pdl}, warps).asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    "name",
    [
        "add_rms_norm",
        "silu_mul",
        "gelu_mul",
        "gemv_silu_mul",
        "gemv_rms_norm",
        "gemv_rows_rms_norm",
        "gemv_rows_silu_mul",
        "split_kv_merge",
    ],
)
def test_with_pdl_a_kernel_waits_and_lets_the_next_launch(name: str) -> None:
    ptx = _ptx(name, pdl=True)
    assert WAIT in ptx and LAUNCH in ptx
    without = _ptx(name, pdl=False)
    assert WAIT not in without and LAUNCH not in without


def test_pdl_is_off_for_cpu_tensors() -> None:
    assert _triton.pdl(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}


def test_pdl_is_off_where_the_switch_or_the_build_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """MINIVLLM_PDL=0, or a ROCm build (whose Triton has no griddepcontrol), turns it off
    before the device is even asked for its capability."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("MINIVLLM_PDL", raising=False)
    _triton._pdl_on.cache_clear()
    try:
        assert _triton._pdl_on(0)
        _triton._pdl_on.cache_clear()
        monkeypatch.setenv("MINIVLLM_PDL", "0")
        assert not _triton._pdl_on(0)
        _triton._pdl_on.cache_clear()
        monkeypatch.delenv("MINIVLLM_PDL")
        monkeypatch.setattr(torch.version, "hip", "6.4")
        assert not _triton._pdl_on(0)
    finally:
        _triton._pdl_on.cache_clear()
