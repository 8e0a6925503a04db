"""Optional Triton import: CPU-only installs have no triton, and the torch paths are used.

Kernels are written against `triton` / `tl` from here. Without triton, `triton.jit` leaves the
function undecorated (it is never launched) and `tl.constexpr` still exists for annotations.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

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


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns scalar tensors (numpy shape (1,)) into loop bounds with
    `int(array)`, which numpy >= 2.4 refuses; index through the single element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:  # noqa: ANN001 - triton internals
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if getattr(original, "__name__", "") != "patch":
        interpreter._patch_lang_tensor = patch


if interpreting():
    _patch_interpreter_scalar_index()


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel (rather than the torch fallback) should handle `x`."""
    return HAS_TRITON and (x.is_cuda or interpreting())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
