"""Optional Triton import: CPU-only installs have no triton, and the torch paths are used.

Kernels are written against `triton` / `tl` from here. Without triton, `triton.jit` leaves the
function undecorated (it is never launched) and `tl.constexpr` still exists for annotations.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from minivllm import envs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False
    # `@triton.jit` and `@triton.jit(...)` both leave the function as it is
    triton = SimpleNamespace(jit=lambda fn=None, **_: fn if fn is not None else (lambda f: f))
    tl = SimpleNamespace(constexpr=None)


def interpreting() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter (tests)."""
    return HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel (rather than the torch fallback) should handle `x`."""
    return HAS_TRITON and (x.is_cuda or interpreting())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if not envs.pdl_enabled():
        return False
    if torch.version.hip is not None:  # the wait and the trigger are PTX instructions
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl(x: torch.Tensor) -> dict[str, bool]:
    """Launch arguments for programmatic dependent launch (Hopper and later; MINIVLLM_PDL=0
    turns it off): the grid may start while the kernel before it on the stream finishes, so
    its launch and set-up overlap that kernel's tail. The kernel must take `PDL: tl.constexpr`
    and call `wait_for_producers(PDL)` before it reads anything an earlier kernel wrote."""
    on = bool(x.is_cuda and HAS_TRITON and _pdl_on(x.device.index or 0))
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """Under PDL: wait until the kernel before this one on the stream has finished and its
    writes are visible (so has every kernel before it), then let the kernel after this one
    launch, which waits here in turn. Without PDL nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a GEMM's program `pid`, taken GROUP_M row tiles at a time
    down each column of tiles, so that consecutive programs share B's tiles in L2."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_n) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n
