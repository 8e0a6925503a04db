"""Benchmark workloads as token ids: the reference workload and vLLM's random dataset."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# The reference workload (nano-vllm's offline bench); a change to the draw
# order or ranges changes these totals, so they are checked whenever the workload is built.
REFERENCE_NUM_PROMPTS = 256
REFERENCE_PROMPT_TOKENS = 142_827
REFERENCE_OUTPUT_TOKENS = 133_966
REFERENCE_TEMPERATURE = 0.6


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids and the exact number of tokens to generate for each."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_model_len(self) -> int:
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens, strict=True))

    def subset(self, n: int) -> Workload:
        return Workload(f"{self.name}[:{n}]", self.prompts[:n], self.output_lens[:n])


def reference_workload() -> Workload:
    """random.seed(0); all 256 prompts (randint(100, 1024) ids of randint(0, 10000)) first,
    then all 256 output lengths randint(100, 1024). Raises if the totals drift."""
    rng = random.Random(0)  # same stream as random.seed(0) without touching global state
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
        for _ in range(REFERENCE_NUM_PROMPTS)
    ]
    output_lens = [rng.randint(100, 1024) for _ in range(REFERENCE_NUM_PROMPTS)]
    w = Workload("reference (nano-vllm offline)", prompts, output_lens)
    got = (w.num_prompt_tokens, w.num_output_tokens)
    if got != (REFERENCE_PROMPT_TOKENS, REFERENCE_OUTPUT_TOKENS):
        raise RuntimeError(
            f"reference workload drifted: {got[0]} prompt / {got[1]} output tokens, expected "
            f"{REFERENCE_PROMPT_TOKENS} / {REFERENCE_OUTPUT_TOKENS}"
        )
    return w


def random_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    vocab_limit: int = 10000,
    prefix_len: int = 0,
    range_ratio: float = 0.0,
) -> Workload:
    """vLLM's `--dataset-name random`: per request an input and an output length drawn
    uniformly from [len * (1 - r), len * (1 + r)] (r = range_ratio; 0 gives fixed lengths and
    draws nothing for them) and input ids drawn from 0..vocab_limit; with `prefix_len`, every
    prompt starts with the same `prefix_len` random ids (a shared system prompt for the prefix
    cache) before its own. Prompts travel as token ids: their lengths are exact and a client
    needs no tokenizer."""
    if min(num_prompts, input_len, output_len) < 1 or prefix_len < 0:
        raise ValueError("num_prompts, input_len and output_len must be positive")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def lengths(mean: int) -> list[int]:
        if not range_ratio:
            return [mean] * num_prompts
        low = max(1, math.floor(mean * (1 - range_ratio)))
        high = math.ceil(mean * (1 + range_ratio))
        return [rng.randint(low, high) for _ in range(num_prompts)]

    input_lens, output_lens = lengths(input_len), lengths(output_len)
    prefix = [rng.randint(0, vocab_limit) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randint(0, vocab_limit) for _ in range(n)] for n in input_lens]
    shared = f"{prefix_len} shared + " if prefix_len else ""
    ratio = f", range ratio {range_ratio}" if range_ratio else ""
    name = f"random {num_prompts}x({shared}{input_len} in, {output_len} out{ratio})"
    return Workload(name, prompts, output_lens)
