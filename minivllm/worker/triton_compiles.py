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

    def _after(self, *, repr: str, **_: Any) -> None:
        took = time.perf_counter() - self._started
        self.count += 1
        self.seconds += took
        if self._serving:
            self.after_start_up += 1
            logger.info("Triton built a kernel variant after start-up in %.2f s: %s", took, repr)
        else:
            logger.debug("Triton built %s in %.2f s", repr, took)


compiles = TritonCompiles()
