"""The Triton kernels this process builds (compiled, or read from Triton's disk cache):
counted and timed through Triton's JIT hooks, and built side by side where start-up can.

Start-up reports how many it built and how long that took (most of a fresh machine's
start-up). A kernel variant first needed after start-up stalls the step that needs it while
it compiles, so each one is logged at INFO with its specialization: the start-up warm-up
should have built it. At DEBUG every build is logged.

`compile_ahead()` runs a forward without launching its Triton kernels: each kernel variant
the forward would launch is compiled on a pool of threads instead (Triton's LLVM and ptxas
stages release the GIL), and leaving the block waits for all of them. The forward that
follows finds every variant built: a fresh machine's ~14 s of serial builds at start-up
(Qwen3-0.6B on an H100) become a few seconds on a many-core host.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType, SimpleNamespace
from typing import Any

logger = logging.getLogger(__name__)

# kernels compile_ahead still launches: collectives, which every rank must run in step
_ALWAYS_LAUNCHED = "minivllm.worker.distributed"


class TritonCompiles:
    """One per process: `install` hooks Triton's JIT, `starting()` and `serving()` mark a
    worker's start-up (builds between them are start-up's; after, each is logged)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.after_start_up = 0
        self.installed = False
        self._serving = False
        self._ahead = False  # in compile_ahead: builds overlap, its wall time is counted
        self._started: dict[Any, float] = {}

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

    def _before(self, *, key: Any, **_: Any) -> bool:
        self._started.setdefault(key, time.perf_counter())
        return False  # a true value would tell Triton to skip the compile

    def _after(self, *, key: Any, fn: Any, compile: dict[str, Any], **_: Any) -> None:
        took = time.perf_counter() - self._started.pop(key, time.perf_counter())
        self.count += 1
        if not self._ahead:
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


def build_ahead(forwards: Iterable[Callable[[], object]]) -> bool:
    """Run each forward under `compile_ahead`; False, running nothing, where builds are not
    counted (a CPU worker, whose forwards would only run twice) or this Triton lacks what
    `compile_ahead` uses (its kernels then build one by one, at their first launch)."""
    if not (compiles.installed and _can_compile_ahead()):
        return False
    with compile_ahead():
        for forward in forwards:
            forward()
    return True


@functools.cache
def _can_compile_ahead() -> bool:
    """Triton's asynchronous compile mode and the two JIT methods `compile_ahead` wraps
    and its loader of C modules (Triton 3.6's; they are not public API)."""
    try:
        from triton.runtime import _async_compile, build
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    do_compile = getattr(JITFunction, "_do_compile", None)
    if do_compile is None or not hasattr(_async_compile, "AsyncCompileMode"):
        return False
    if not callable(getattr(build, "_load_module_from_path", None)):
        return False
    leading = list(inspect.signature(do_compile).parameters)[:4]
    return leading == ["self", "key", "signature", "device"]


def loaded_one_at_a_time(
    load: Callable[[str, str], ModuleType],
) -> Callable[[str, str], SimpleNamespace]:
    """Triton's loader of its small C modules (a launcher per kernel signature), safe on
    the pool's threads: one load at a time, each returning a copy of the module's names.

    Every launcher is a module named `__triton_launcher`. Python loads a file once; loading
    it again returns the one module object of that name and sets its names to that file's,
    so a thread reading `launch` right after its load can get another thread's launcher,
    and a kernel then fails at its first launch ("function takes exactly 31 arguments (48
    given)"). Its builds (the C compiles of a fresh machine) still run side by side."""
    lock = threading.Lock()

    def load_private(name: str, path: str) -> SimpleNamespace:
        with lock:
            return SimpleNamespace(**vars(load(name, path)))

    return load_private


@contextlib.contextmanager
def compile_ahead(max_workers: int | None = None) -> Iterator[None]:
    """Within: Triton kernels are compiled on a thread pool, not launched; on leaving, every
    compile has finished and every kernel is loaded on the device with its launcher (a small
    C module per signature, which a fresh machine compiles too). Torch ops still run, on
    whatever the skipped kernels' outputs hold, so only for model forwards, whose host side
    reads no device data (they are what CUDA graphs capture), never the sampler's. Only in a
    CUDA worker whose Triton has what it wraps: through `build_ahead`."""
    import torch
    from triton.runtime import _async_compile, build
    from triton.runtime.jit import JITFunction

    launch, do_compile = JITFunction.run, JITFunction._do_compile
    load_module = build._load_module_from_path

    def compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        skip = not self.module.startswith(_ALWAYS_LAUNCHED)
        return launch(self, *args, grid=grid, warmup=warmup or skip, **kwargs)

    def compile_once(self: Any, key: Any, signature: Any, device: Any, *args: Any) -> Any:
        kernel = do_compile(self, key, signature, device, *args)
        if kernel is not None:
            # the pending build stands in the kernel cache until it is done (Triton then
            # puts the kernel there): the variant's next launches find it instead of hashing
            # the kernel's source again, thousands of times over a graph's forwards
            self.device_caches[device][0][key] = kernel
        return kernel

    def load(kernel: Any) -> None:
        torch.cuda.set_device(device)  # a pool thread starts on device 0
        kernel._init_handles()

    start, device = time.perf_counter(), torch.cuda.current_device()
    workers = max_workers or min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool:
        JITFunction.run, JITFunction._do_compile = compile_only, compile_once
        build._load_module_from_path = loaded_one_at_a_time(load_module)
        compiles._ahead = True
        try:
            with _async_compile.AsyncCompileMode(pool) as mode:
                yield
            built = [k.kernel for k in mode.future_kernels.values() if k.kernel is not None]
            list(pool.map(load, built))
        finally:
            JITFunction.run, JITFunction._do_compile = launch, do_compile
            build._load_module_from_path = load_module
            compiles._ahead = False
            compiles.seconds += time.perf_counter() - start
