"""Run a test module's checks through the Triton interpreter, on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, and this pytest process has
imported it already, so the module runs again as a script in a subprocess with the
variable set (its `if __name__ == "__main__":` block does the checks), started through this
file, which first patches the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def run_interpreted(script: str, *args: str, timeout: float = 240) -> None:
    """`python script *args` with TRITON_INTERPRET=1; fails the test with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, __file__, script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns scalar tensors (numpy shape (1,)) into loop bounds with
    `int(array)`, which numpy >= 2.4 refuses; index through the single element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope) -> None:  # noqa: ANN001 - triton internals
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


def _round_like_the_gpu() -> None:
    """Make the interpreter convert float32 to float8_e4m3fn and to bfloat16 by
    round-to-nearest-even, as the GPU's `cvt.rn` does (torch's conversion): Triton 3.6's
    interpreter rounds float8 half up and drops the carry into the exponent (-127.45 becomes
    -64, not -128), and truncates bfloat16."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):  # noqa: A002, ANN001, ANN202
        if input_dtype == tl.float32 and output_dtype in (tl.float8e4nv, tl.bfloat16):
            x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            if output_dtype == tl.float8e4nv:
                return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert


def _dot_bfloat16_values() -> None:
    """Make the interpreter's tl.dot multiply bfloat16 operands by value, as the GPU's tensor
    cores do (exactly, accumulating in float32): Triton 3.6's interpreter multiplies the
    uint16 bit patterns it stores them as."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def as_float32(h):  # noqa: ANN001, ANN202 - triton internals
        if h.dtype != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << 16  # a bfloat16 is the top half of a float32
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        return original(
            self, as_float32(a), as_float32(b), d, input_precision, max_num_imprecise_acc
        )

    interpreter.InterpreterBuilder.create_dot = create_dot


if __name__ == "__main__":  # python triton_interpreter.py SCRIPT ARGS...
    _patch_interpreter_scalar_index()
    _round_like_the_gpu()
    _dot_bfloat16_values()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
