"""The Triton kernels this process builds (compiled, or read from Triton's disk cache),
counted and timed through Triton's JIT hooks.

Start-up reports how many it built and how long that took (most of a fresh machine's
start-up). A kernel variant first needed after start-up stalls the step that needs it while
it compiles, so each one is logged at INFO with its specialization: the start-up warm-up
should have built it. At DEBUG every build is logged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class TritonCompiles:
    """One per process: `install` hooks Triton's JIT, `starting()` and `serving()` mark a
    worker's start-up (builds between them are start-up's; after, each is logged)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.after_start_up = 0
        self.installed = False
        self._serving = False
        self._started = 0.0

    def install(self) -> bool:
        """Hook Triton's JIT (once); False where Triton is missing."""
        if not self.installed:
            try:
                from triton import knobs
            except ImportError:
                return False
            knobs.runtime.jit_cache_hook = self._before
            knobs.runtime.jit_post_compile_hook = self._after
            self.installed = True
        return True

    def starting(self) -> None:
        self._serving = False

    def serving(self) -> None:
        self._serving = True

    def _before(self, **_: Any) -> bool:
        self._started = time.perf_counter()
        return False  # a true value would tell Triton to skip the compile

    def _after(self, *, fn: Any, compile: dict[str, Any], **_: Any) -> None:
        took = time.perf_counter() - self._started
        self.count += 1
        self.seconds += took
        if self._serving:
            self.after_start_up += 1
            what = _described(fn, compile)
            logger.info("Triton built a kernel variant after start-up in %.2f s: %s", took, what)
        elif logger.isEnabledFor(logging.DEBUG):
            logger.debug("Triton built %s in %.2f s", _described(fn, compile), took)


def _described(fn: Any, compile: dict[str, Any]) -> str:
    try:
        return describe(fn.name, fn.jit_function.arg_names, compile)
    except Exception:  # another Triton's layout: the name still says which kernel
        return str(getattr(fn, "name", fn))


def describe(name: str, arg_names: list[str], compile: dict[str, Any]) -> str:
    """`_decode_kernel(BLOCK=64, n=1; 16 | stride)`: a variant by what tells it apart, its
    constants (constexprs, and integers specialized to 1) and the integer arguments Triton
    specialized as multiples of 16 (pointers, always aligned here, left out)."""
    signature = compile["signature"]
    constants = [
        f"{arg_names[path[0]]}={getattr(value, 'value', value)}"
        for path, value in sorted(compile["constants"].items())
        if len(path) == 1
    ]
    aligned = [
        arg_names[path[0]]
        for path, attrs in sorted(compile["configs"][0].items())
        if len(path) == 1
        and not str(signature.get(arg_names[path[0]], "")).startswith("*")
        and any(attr[0] == "tt.divisibility" for attr in attrs)
    ]
    return f"{name}({', '.join(constants)}; 16 | {' '.join(aligned) or '-'})"


compiles = TritonCompiles()
