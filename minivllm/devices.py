"""Which device an engine runs on, and whether its GPUs can hold it.

The frontend decides before it starts the engine-core, and it imports no torch for it where
that can be told cheaply (torch's import takes 3-6 s on a GPU host, and the frontend needs
torch for nothing else): torch's build says whether it has CUDA (torch/version.py, read as
text) and the driver counts the visible devices (libcuda's cuDeviceGetCount, which honors
CUDA_VISIBLE_DEVICES). Where either cannot be read (a ROCm build, no torch/version.py), or
torch is imported already, torch answers.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import importlib.util
import os
import pathlib
import sys


def resolve_device(device: str) -> str:
    """'cpu', or a CUDA device: 'auto' picks CUDA when there is one; 'cuda' without one raises."""
    if device == "cpu":
        return device
    if device == "auto":
        return "cuda" if cuda_device_count() > 0 else "cpu"
    if cuda_device_count() == 0:
        raise ValueError("device='cuda' but no CUDA device is available")
    return device


def cuda_device_count() -> int:
    """torch.cuda.device_count(), without importing torch where the build and the driver
    tell it (see the module docstring)."""
    build = None if "torch" in sys.modules else _torch_cuda_build()
    if build is None:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return _driver_device_count() if build else 0


@functools.cache
def _torch_cuda_build() -> bool | None:
    """Whether the installed torch is built with CUDA (torch.version.cuda set), from its
    version.py's text; None where that does not tell (no such file, a ROCm build)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        return cuda_build_of(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None


def cuda_build_of(version_py: str) -> bool | None:
    """From the text of torch/version.py: whether `cuda` is set; None where the file does not
    tell (no `cuda`, or a ROCm build's `hip`)."""
    values = {}
    for node in ast.parse(version_py).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            values[target.id] = node.value.value
    if "cuda" not in values or values.get("hip") is not None:
        return None
    return values["cuda"] is not None


@functools.cache
def _driver_device_count() -> int:
    """The CUDA devices the driver lets this process see; 0 without a driver. Asked once:
    the driver reads CUDA_VISIBLE_DEVICES at its initialization only, so the answer stays
    (the config's several device checks then cost nothing)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def check_gpu_sharing(tp: int, dp: int, gpu_memory_utilization: float) -> None:
    """Engine-cores beyond one per GPU share GPUs: each then takes its own fraction of a
    device's memory, and those fractions must fit in one."""
    count = cuda_device_count()
    if tp > count:
        raise ValueError(f"tensor_parallel_size ({tp}) is larger than the {count} visible GPU(s)")
    per_gpu = -(-tp * dp // count)
    if per_gpu > 1 and gpu_memory_utilization * per_gpu > 1.0 + 1e-9:
        raise ValueError(
            f"data_parallel_size ({dp}) x tensor_parallel_size ({tp}) puts {per_gpu} engine-cores "
            f"on each of the {count} GPU(s): gpu_memory_utilization is each one's share of a "
            f"GPU and must be <= {1 / per_gpu:.3f}, got {gpu_memory_utilization}"
        )
