"""The device sampler at the reference workload's shape (256 rows x 151,936 bf16 logits,
temperature 0.6): the precise-log noise against the fast one, and the whole `sample` call,
each inside a CUDA graph; then what logprobs and penalties add (the logprobs kernels, the
penalties kernel, the draw from its float32 output); then the fast noise's sampling
frequencies against softmax.

    python benchmarks/probe_sampler.py
"""

from __future__ import annotations

import torch
from graph_timing import graph_replay_ms

from minivllm.worker.ops.logprobs import gather_logprobs
from minivllm.worker.ops.penalties import apply_penalties
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
    probe_logprobs_and_penalties(logits, temp, seeds, pos)
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


def probe_logprobs_and_penalties(logits, temp, seeds, pos) -> None:  # noqa: ANN001
    """What logprobs=5 and the three penalties add to a step of every row asking for them."""
    rows, vocab = logits.shape
    sampled = sample(logits, temp, None, None, None, seeds, pos)
    for num in (1, 5, 20):
        us = graph_replay_ms(lambda n=num: gather_logprobs(logits, n, sampled), reps=50)
        print(f"gather_logprobs(num={num}): {us * 1e3:7.1f} µs")
    counts = torch.randint(0, 3, (rows, vocab), device=logits.device, dtype=torch.int32)
    mask = torch.rand(rows, vocab, device=logits.device) < 0.01
    batch_rows = torch.arange(rows, device=logits.device)
    rep, freq, pres = (torch.full((rows,), v, device=logits.device) for v in (1.1, 0.5, 0.5))
    state = (batch_rows, rep, freq, pres, counts, mask)
    us = graph_replay_ms(lambda: apply_penalties(logits, *state), reps=50)
    print(f"apply_penalties (bf16 in, float32 out): {us * 1e3:7.1f} µs")
    penalized = apply_penalties(logits, *state)
    us = graph_replay_ms(lambda: sample(penalized, temp, None, None, None, seeds, pos), reps=50)
    print(f"sample() of the float32 logits: {us * 1e3:7.1f} µs")


if __name__ == "__main__":
    main()
