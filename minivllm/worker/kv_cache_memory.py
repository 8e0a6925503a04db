"""The KV cache's shape on one rank, and how many blocks of it fit on the device."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheShape:
    """One tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]` per layer (keys at
    index 0, values at 1) of `dtype`: the model's, or float8_e4m3fn (half the bytes of bf16,
    so twice the blocks in the same memory)."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # on this rank
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, keys and values."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]


def profiled_num_blocks(
    block_bytes: int, device: torch.device, gpu_memory_utilization: float, reserve_share: float
) -> int:
    """Blocks of `block_bytes` (every cache's share of a block, over all layers) that fit in `gpu_memory_utilization` of the device after a profile run (the
    caller's, right before: its peak is the weights plus the largest step's activations)
    and `reserve_share` of the device kept for CUDA graphs. The utilization is this
    engine's share of the device (engine-cores that share a GPU each take their own
    fraction); what other processes use only caps it."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    reserve = reserve_share * total
    budget = min(total * gpu_memory_utilization, total - used_by_others) - peak - reserve
    num = int(budget // block_bytes)
    if num <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: the model's peak use is {peak / 2**30:.2f} GiB "
            f"of {total / 2**30:.2f} GiB; raise gpu_memory_utilization"
        )
    logger.info(
        "memory profile: peak %.2f GiB (weights + activations), %.2f GiB used by others, "
        "%.2f GiB kept for CUDA graphs, %.2f GiB for the KV cache",
        peak / 2**30,
        used_by_others / 2**30,
        reserve / 2**30,
        num * block_bytes / 2**30,
    )
    return num
