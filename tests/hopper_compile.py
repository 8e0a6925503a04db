"""Compile a Triton kernel for sm_90 without a GPU, as the launcher would build it, so tests
can check the generated code (PTX, TTGIR) on the CPU machine."""

from __future__ import annotations

from typing import Any


def compile_for_hopper(
    kernel: Any, signature: dict, constants: dict, num_warps: int, **options: Any
) -> Any:
    """kernel for sm_90, every pointer (and tuple of pointers) 16-byte aligned and the ints
    named n_cols or stride_* specialised as multiples of 16. `signature` maps each runtime
    argument to its Triton type (a tuple of types for a tuple argument); `constants` gives
    the constexprs; `options` more of the launch's compile options (`maxnreg`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = [["tt.divisibility", 16]]
    attrs = {}
    for i, (name, kind) in enumerate(signature.items()):
        if isinstance(kind, tuple):
            attrs.update({(i, r): aligned for r in range(len(kind))})
        elif kind.startswith("*") or name == "n_cols" or name.startswith("stride"):
            attrs[(i,)] = aligned
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    return triton.compile(
        ASTSource(kernel, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, **options},
    )
