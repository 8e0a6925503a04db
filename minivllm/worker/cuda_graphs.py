"""CUDA graphs of the whole decode forward (embedding, every layer, attention, final norm),
one per padded batch size.

A pure-decode step of n sequences replays the graph of the smallest captured size B >= n.
The graphs read their inputs from the runner's persistent device buffers (`StepBuffers`),
so a replay costs one launch (5 µs for ~300 kernels) instead of ~300 launches. Rows n..B-1
are padding: slot -1 (their keys/values are stored nowhere) and sequence length 0 (the
decode kernel reads no keys for them and writes zeros).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, name: str = "decode") -> None:
        self.name = name
        self.pool: object = None
        self.sizes: list[int] = []
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(
        self, forward: Callable[[int], torch.Tensor], sizes: list[int], pool: object = None
    ) -> None:
        """Capture `forward(B)` (the decode forward of B rows over the static buffers) for
        each size; the largest first, so the smaller ones reuse its memory pool (or `pool`,
        that of other graphs: only one graph runs at a time)."""
        start = time.monotonic()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for size in sorted(sizes, reverse=True):
            forward(size)  # warm-up: Triton compiles and autotunes outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = forward(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.sizes = sorted(sizes)
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured %d CUDA graphs for %s batch sizes %s in %.1f s, using %.2f GiB",
            len(sizes),
            self.name,
            _ranges(self.sizes),
            time.monotonic() - start,
            used / 2**30,
        )

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size >= n, or None when n is larger than all of them."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size`; returns its output (hidden states [size, hidden])."""
        graph, out = self._graphs[size]
        graph.replay()
        return out


def _ranges(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return str(sizes)
    return f"[{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}]"
