"""`--dataset-name random` for `bench serve`, as vLLM samples it: per request an input and an
output length drawn uniformly from [len * (1 - r), len * (1 + r)] (r = --random-range-ratio,
0 gives fixed lengths) with numpy's generator seeded by --seed, and input tokens drawn at
random from the vocabulary. Prompts travel as token ids, so their lengths are exact and no
tokenizer is needed on the client."""

from __future__ import annotations

import math

import numpy as np

from minivllm.frontend.bench.workloads import Workload


def sample_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    max_token_id: int = 10000,
    seed: int = 0,
    prefix_len: int = 0,
) -> Workload:
    """`num_prompts` requests; each prompt starts with the same `prefix_len` random ids
    (a shared prefix for the prefix cache) followed by its own."""
    if min(num_prompts, input_len, output_len) < 1:
        raise ValueError("num_prompts, input_len and output_len must be positive")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        low = max(1, math.floor(mean * (1 - range_ratio)))
        high = math.ceil(mean * (1 + range_ratio))
        return rng.integers(low, high + 1, size=num_prompts)

    input_lens, output_lens = lengths(input_len), lengths(output_len)
    prefix = rng.integers(0, max_token_id + 1, size=prefix_len).tolist()
    prompts = [prefix + rng.integers(0, max_token_id + 1, size=int(n)).tolist() for n in input_lens]
    name = f"random {num_prompts}x({input_len} in, {output_len} out, range ratio {range_ratio})"
    return Workload(name, prompts, [int(n) for n in output_lens])
