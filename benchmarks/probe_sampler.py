"""The device sampler at the reference workload's shape (256 rows x 151,936 bf16 logits,
temperature 0.6): the precise-log noise against the fast one, and the whole `sample` call,
each inside a CUDA graph; then the fast noise's sampling frequencies against softmax.

    python benchmarks/probe_sampler.py
"""

from __future__ import annotations

import torch
from graph_timing import graph_replay_ms

from minivllm.worker.ops.sampling import _sample_chunks, sample

ROWS, VOCAB = 256, 151_936


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    logits = (torch.randn(ROWS, VOCAB, device=dev) * 3).bfloat16()
    temp = torch.full((ROWS,), 0.6, device=dev)
    seeds = torch.arange(ROWS, device=dev)
    pos = torch.full((ROWS,), 700, device=dev)
    read_us = ROWS * VOCAB * 2 / 2.95e6
    for fast in (False, True):
        us = graph_replay_ms(
            lambda f=fast: _sample_chunks(logits, temp, None, seeds, pos, 0, VOCAB, f), reps=50
        )
        print(f"kernel, fast noise {fast!s:<5}: {us * 1e3:7.1f} µs (logits read: {read_us:.1f} µs)")
    us = graph_replay_ms(lambda: sample(logits, temp, None, None, None, seeds, pos), reps=50)
    print(f"sample() whole call: {us * 1e3:7.1f} µs")
    # frequencies of 200k draws of a 16-token row against softmax(logits / T)
    small = torch.randn(16, device=dev) * 1.5
    n = 200_000
    rows = small.repeat(n, 1)
    got = sample(rows, torch.full((n,), 0.8, device=dev), None, None, None,
                 torch.full((n,), 7, device=dev), torch.arange(n, device=dev))  # fmt: skip
    freq = torch.bincount(got, minlength=16).float() / n
    want = (small / 0.8).softmax(-1)
    print(f"max |freq - softmax| over 200k draws: {(freq - want).abs().max().item():.4f} "
          f"(3 sigma of the largest: {3 * (want.max() * (1 - want.max()) / n).sqrt().item():.4f})")  # fmt: skip


if __name__ == "__main__":
    main()
