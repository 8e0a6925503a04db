"""The tensor-parallel group a model is built for, passed to every layer that shards."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from minivllm import envs
from minivllm.worker.ops.norm import add_rms_norm

if TYPE_CHECKING:
    from minivllm.worker.distributed.triton_all_reduce import TritonAllReduce

logger = logging.getLogger(__name__)

DISABLE_ENV = "MINIVLLM_DISABLE_SYMM_ALL_REDUCE"  # "1": every message goes to NCCL


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group.

    `group` is a `torch.distributed` process group (None means the default group); it is
    only touched when size > 1, so a size-1 group needs no `torch.distributed` at all.
    `fast_all_reduce`, when set (CUDA, size > 1), sums the messages it fits (those of a
    decode step) over symmetric memory, also fused with the add and RMSNorm after them; the
    others go to NCCL through `group`.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    fast_all_reduce: TritonAllReduce | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid TP rank {self.rank} for size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks; returns the sum: x itself (summed in place) or a new tensor."""
        if self.size == 1:
            return x
        if self.fast_all_reduce is not None and self.fast_all_reduce.fits(x):
            return self.fast_all_reduce.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With s = the sum of x over the ranks (+ residual): (rms_norm(s) * weight, s). One
        kernel where the fast all-reduce takes x, with the bits of its all_reduce and then
        the norm; else all_reduce, add, norm."""
        comm = self.fast_all_reduce
        if comm is not None and comm.fits_rows(x, residual):
            return comm.all_reduce_add_rms_norm(x, residual, weight, eps)
        return add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim, in rank order; every rank gets the result."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def init_tp_group(
    rank: int, size: int, device: torch.device, store: Any, max_bytes: int
) -> TPGroup:
    """Join the `size`-rank process group through `store` (NCCL on CUDA, gloo on CPU) and
    set up the fast all-reduce for messages up to `max_bytes` where it can run. Collective."""
    if size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        store=store,
        world_size=size,
        rank=rank,
        **({"device_id": device} if backend == "nccl" else {}),
    )
    group = dist.group.WORLD
    fast = _fast_all_reduce(group, device, max_bytes) if backend == "nccl" else None
    return TPGroup(rank=rank, size=size, group=group, fast_all_reduce=fast)


def _fast_all_reduce(group: Any, device: torch.device, max_bytes: int) -> TritonAllReduce | None:
    """The Triton all-reduce, or None after one log line saying why: disabled by
    DISABLE_ENV, or any setup failure (the group still works on NCCL, so the engine never
    fails for it). A ValueError (bad arguments) still raises. Collective."""
    from minivllm.worker.distributed.triton_all_reduce import TritonAllReduce

    rank = dist.get_rank(group)
    if envs.symm_all_reduce_disabled():
        if rank == 0:
            logger.info("symmetric-memory all-reduce disabled by %s=1", DISABLE_ENV)
        return None
    try:
        comm = TritonAllReduce(group, device, max_bytes)
    except ValueError:
        raise
    except Exception as e:  # whatever the cause, the group still works: never fail for it
        logger.warning("rank %d: all-reduce stays on %s: %s", rank, dist.get_backend(group), e)
        return None
    if rank == 0:
        logger.info(
            "Triton all-reduce for messages up to %.2f MiB, NCCL above", comm.max_bytes / 2**20
        )
    return comm


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, refusing a remainder (a shape that cannot be sharded evenly)."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor parallel size {denominator}")
    return numerator // denominator
