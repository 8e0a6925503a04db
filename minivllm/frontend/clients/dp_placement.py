"""Where each data-parallel engine-core runs: one config per rank, each with its slice of
the visible GPUs (`CUDA_VISIBLE_DEVICES` of its workers).

Rank i's TP ranks take GPUs (i * tp + r) mod count: disjoint slices while there are enough
GPUs, wrapping round when there are not, so engine-cores then share GPUs (each with its
own `gpu_memory_utilization` share, checked when the config was made). On the CPU every
engine-core runs on the same CPUs; under Ray, Ray gives each worker actor its GPU.
"""

from __future__ import annotations

import dataclasses
import os

from minivllm.config import EngineConfig


def engine_configs(config: EngineConfig) -> list[EngineConfig]:
    """The config of each data-parallel rank, in rank order."""
    parallel = config.parallel
    dp, tp = parallel.data_parallel_size, parallel.tensor_parallel_size
    slices: list[str | None] = [None] * dp
    if config.device.device == "cuda" and parallel.distributed_executor_backend != "ray":
        slices = list(gpu_slices(dp, tp, visible_gpus()))
    return [
        dataclasses.replace(
            config,
            parallel=dataclasses.replace(parallel, data_parallel_rank=i, visible_devices=s),
        )
        for i, s in enumerate(slices)
    ]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` names them."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    from minivllm.devices import cuda_device_count

    return [str(i) for i in range(cuda_device_count())]


def gpu_slices(dp: int, tp: int, gpus: list[str]) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` of each of `dp` engine-cores of `tp` ranks over `gpus`."""
    if not gpus:
        raise ValueError("data_parallel_size on CUDA needs at least one visible GPU")
    n = len(gpus)
    return [",".join(gpus[(i * tp + r) % n] for r in range(tp)) for i in range(dp)]
