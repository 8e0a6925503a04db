"""The tensor-parallel group a model is built for, passed to every layer that shards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minivllm.worker.layers.symm_all_reduce import SymmMemAllReduce
    from minivllm.worker.layers.triton_all_reduce import TritonAllReduce


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group.

    `group` is a `torch.distributed` process group (None means the default group); it is
    only touched when size > 1, so a size-1 group needs no `torch.distributed` at all.
    `symm_all_reduce`, when set (CUDA, size > 1), sums the messages it fits (those of a
    decode step) over symmetric memory, the Triton one also fused with the add and RMSNorm
    after it; the others go to `group`.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    symm_all_reduce: SymmMemAllReduce | TritonAllReduce | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid TP rank {self.rank} for size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks; returns the sum: x itself (summed in place) or a new tensor."""
        if self.size == 1:
            return x
        if self.symm_all_reduce is not None and self.symm_all_reduce.fits(x):
            return self.symm_all_reduce.all_reduce(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With s = the sum of x over the ranks (+ residual): (rms_norm(s) * weight, s). One
        kernel where the communicator has one (the Triton one) and it takes x, with the bits
        of that communicator's all_reduce and then the norm; else all_reduce, add, norm."""
        from minivllm.worker.layers import ops

        comm = self.symm_all_reduce
        fused = getattr(comm, "all_reduce_add_rms_norm", None)
        if self.size > 1 and fused is not None and comm.fits_rows(x, residual):
            return fused(x, residual, weight, eps)
        return ops.add_rms_norm(self.all_reduce(x), residual, weight, eps)

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim, in rank order; every rank gets the result."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, refusing a remainder (a shape that cannot be sharded evenly)."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor parallel size {denominator}")
    return numerator // denominator
