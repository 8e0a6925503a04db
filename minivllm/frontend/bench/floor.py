"""The memory-traffic floor of a decode workload, and the device copy bandwidth it is
measured against."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Floor:
    kv_bytes: int  # every output token re-reads its whole KV context
    weight_bytes: int  # every decode step re-reads all weights once

    def seconds(self, bandwidth: float) -> float:
        """Floor time at `bandwidth` bytes/s (bytes read + written, like a device copy)."""
        return (self.kv_bytes + self.weight_bytes) / bandwidth


def memory_floor(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    param_bytes: int,
    kv_dtype_bytes: int = 2,
) -> Floor:
    """Bytes a decode of this workload must read, with all requests running concurrently.

    The j-th output token (j = 0, 1, ...) of a request with a P-token prompt attends to P + j
    cached tokens; summed over j < O that is O*P + O*(O-1)/2. All requests decode together,
    so there are max(output_lens) steps, each reading every weight once.
    """
    kv_per_token = num_layers * num_kv_heads * head_dim * 2 * kv_dtype_bytes  # K and V
    context_tokens = sum(
        o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens, strict=True)
    )
    return Floor(
        kv_bytes=context_tokens * kv_per_token,
        weight_bytes=max(output_lens, default=0) * param_bytes,
    )


def measure_copy_bandwidth(num_bytes: int = 1 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth on CUDA in bytes/s, counting bytes read + written
    (median of `iters` timed copies after a warm-up)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / statistics.median(times)
