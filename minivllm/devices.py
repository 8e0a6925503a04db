"""Which device an engine runs on, and whether its GPUs can hold it."""

from __future__ import annotations


def resolve_device(device: str) -> str:
    """'cpu', or a CUDA device: 'auto' picks CUDA when there is one; 'cuda' without one raises."""
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return device


def check_gpu_sharing(tp: int, dp: int, gpu_memory_utilization: float) -> None:
    """Engine-cores beyond one per GPU share GPUs: each then takes its own fraction of a
    device's memory, and those fractions must fit in one."""
    import torch

    count = torch.cuda.device_count()
    if tp > count:
        raise ValueError(f"tensor_parallel_size ({tp}) is larger than the {count} visible GPU(s)")
    per_gpu = -(-tp * dp // count)
    if per_gpu > 1 and gpu_memory_utilization * per_gpu > 1.0 + 1e-9:
        raise ValueError(
            f"data_parallel_size ({dp}) x tensor_parallel_size ({tp}) puts {per_gpu} engine-cores "
            f"on each of the {count} GPU(s): gpu_memory_utilization is each one's share of a "
            f"GPU and must be <= {1 / per_gpu:.3f}, got {gpu_memory_utilization}"
        )
