"""The memory-traffic floor of a decode workload, and the device copy bandwidth it is
measured against."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Floor:
    kv_bytes: int  # every output token re-reads its KV context (in each layer's window)
    weight_bytes: int  # every decode step re-reads all weights once (of a MoE: those it routes to)
    expert_bytes: int = 0  # the routed experts' share of weight_bytes

    def seconds(self, bandwidth: float) -> float:
        """Floor time at `bandwidth` bytes/s (bytes read + written, like a device copy)."""
        return (self.kv_bytes + self.weight_bytes) / bandwidth


@dataclass(frozen=True)
class ExpertTraffic:
    """The routed experts among a model's weights: a decode step reads only the experts its
    tokens are routed to."""

    expert_bytes: int  # one expert of one layer
    num_experts: int  # per sparse layer
    top_k: int
    num_layers: int  # sparse layers

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.num_experts * self.num_layers

    def step_bytes(self, num_tokens: int) -> float:
        """Expected bytes of experts a step of num_tokens tokens reads, routed uniformly:
        each layer reads the E (1 - (1 - k/E)^n) distinct experts its tokens pick (of
        Qwen3-30B-A3B's 128: all at 256 tokens, 52 at 8)."""
        e, k = self.num_experts, self.top_k
        return e * (1 - (1 - k / e) ** num_tokens) * self.expert_bytes * self.num_layers


def memory_floor(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    param_bytes: int,
    kv_dtype_bytes: int = 2,
    experts: ExpertTraffic | None = None,
    sliding_windows: Sequence[int | None] | None = None,
) -> Floor:
    """Bytes a decode of this workload must read, with all requests running concurrently.

    The j-th output token (j = 0, 1, ...) of a request with a P-token prompt attends to P + j
    cached tokens; summed over j < O that is O*P + O*(O-1)/2. All requests decode together,
    so there are max(output_lens) steps, each reading every weight once -- but of a mixture
    of experts (`experts`, part of param_bytes) only the experts that step's tokens (the
    requests still decoding) are routed to. A layer with a sliding window W (one entry of
    `sliding_windows` per layer, None: the whole context) reads at most the W - 1 cached
    tokens before each query.
    """
    windows = sliding_windows if sliding_windows is not None else (None,) * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"sliding_windows has {len(windows)} entries for {num_layers} layers")
    kv_per_token = num_kv_heads * head_dim * 2 * kv_dtype_bytes  # K and V of one layer
    lens = list(zip(prompt_lens, output_lens, strict=True))
    context_tokens = sum(_context_tokens(lens, w) for w in windows)
    steps = max(output_lens, default=0)
    if experts is None:
        return Floor(kv_bytes=context_tokens * kv_per_token, weight_bytes=steps * param_bytes)
    running = sorted(output_lens, reverse=True)  # running[i] decodes steps 0 .. running[i] - 1
    expert_bytes = sum(experts.step_bytes(sum(1 for o in running if o > j)) for j in range(steps))
    weight_bytes = steps * (param_bytes - experts.total_bytes) + expert_bytes
    return Floor(context_tokens * kv_per_token, round(weight_bytes), round(expert_bytes))


def _context_tokens(lens: list[tuple[int, int]], window: int | None) -> int:
    """Cached tokens the output tokens of requests of (prompt, output) lengths read in one
    layer: P + j for the j-th of a P-token prompt, at most window - 1 of them."""
    total = 0
    for p, o in lens:
        if window is None:
            total += o * p + o * (o - 1) // 2
            continue
        n = max(0, min(o, window - p))  # outputs whose P + j cached tokens all lie in the window
        total += n * p + n * (n - 1) // 2 + (o - n) * (window - 1)
    return total


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
