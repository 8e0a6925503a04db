"""Greedy reference outputs from HF transformers, and the prompts the parity tests use."""

from __future__ import annotations

import functools
import json
import os
import random

import torch


def parity_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths; the last ones share long prefixes with earlier ones."""
    rng = random.Random(seed)
    prompts = [[rng.randint(1, 300) for _ in range(rng.randint(3, 60))] for _ in range(6)]
    long_prefix = [rng.randint(1, 300) for _ in range(40)]
    prompts += [long_prefix + [7, 8, 9], long_prefix + [10], prompts[2] + [11, 12]]
    return prompts


def longrope_prompts(original_len: int, seed: int = 0) -> list[list[int]]:
    """Prompts about a LongRoPE checkpoint's original length (its switch to the long
    factors): below it, growing past it while 12 tokens are generated, and past it from the
    start. The long ones share prefixes with short ones, whose cached blocks (rotated with
    the short factors) they must not reuse."""
    rng = random.Random(seed)
    base = [rng.randint(1, 300) for _ in range(original_len + 26)]
    lengths = (12, 40, original_len - 8, original_len - 1, original_len, original_len + 1)
    return [base[:n] for n in (*lengths, original_len + 16, len(base))] + [[7, *base[:70]]]


@functools.lru_cache(maxsize=8)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    kwargs = {}
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config") or {}
    if quant.get("quant_method") == "compressed-tensors":  # decompressed to the dtype on load
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    # FP8 checkpoints (quant_method fp8) load dequantized on a CPU by themselves
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Token ids transformers' `generate` picks greedily, EOS ignored as `ignore_eos` does:
    picked like any token and not an end (`min_new_tokens` would forbid it instead)."""
    outs = _hf_greedy(path, tuple(tuple(p) for p in prompts), max_new_tokens)
    return [list(o) for o in outs]


@functools.lru_cache(maxsize=32)  # several tests compare against the same generations
def _hf_greedy(path: str, prompts: tuple[tuple[int, ...], ...], max_new_tokens: int) -> tuple:
    model = _hf_model(path)
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(tuple(out[0, len(p) :].tolist()))
    return tuple(outs)


def hf_logits(path: str, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(tokens), vocab]: row i predicts token i + 1."""
    with torch.no_grad():
        return _hf_model(path)(torch.tensor([tokens])).logits[0].float()
