"""GPU time of a function as a decode step runs it: captured once in a CUDA graph, replayed.

Replaying removes the host's launch cost, so small kernels are timed as they run inside the
engine's decode graphs. Also the Qwen3-0.6B layer's linear shapes and distinct per-layer
weights that the GEMM probes time. Shared by the probes in this folder (run them as
scripts, which puts this folder on sys.path).
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


# The linears of one Qwen3-0.6B layer, (N, K), and its layer count: the probes of the
# decode-step GEMMs time one call per layer on 28 distinct weights, so none stays in L2.
QWEN3_0_6B_LINEARS = {
    "qkv": (4096, 1024),
    "o_proj": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
}
LAYERS = 28


def layer_weights() -> dict[str, list[torch.Tensor]]:
    """LAYERS distinct bf16 weights per linear of QWEN3_0_6B_LINEARS, on the GPU."""
    return {
        name: [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(LAYERS)]
        for name, (n, k) in QWEN3_0_6B_LINEARS.items()
    }


def per_layer_us(fn: Callable[[], object]) -> float:
    """µs per layer of `fn`, which makes one call per layer, inside a CUDA graph."""
    return graph_replay_ms(fn, reps=10) * 1e3 / LAYERS
