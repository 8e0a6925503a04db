"""GPU time of a function as a decode step runs it: captured once in a CUDA graph, replayed.

Replaying removes the host's launch cost, so small kernels are timed as they run inside the
engine's decode graphs. Shared by the probes in this folder (run them as scripts, which puts
this folder on sys.path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_replay_ms(fn: Callable[[], object], reps: int) -> float:
    """Milliseconds per replay of a graph of `fn` (warmed up eagerly and once replayed)."""
    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
