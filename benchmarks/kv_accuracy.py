"""`python benchmarks/kv_accuracy.py`: what an FP8 KV cache costs in next-token accuracy -- or,
with --quantization METHOD, what quantized weights cost: the same weights in the model's
dtype and quantized (a 16-bit checkpoint quantized at load, or a geometry's dummy weights,
which are the same random tensors either way), both with a KV cache of the model's dtype.

Each prompt runs through the model once with a KV cache of the model's dtype and once with an
FP8 cache. Attention reads every key and value back from the cache, the step's own included,
so the logits at position t are those a decode step at t computes; both runs are compared
at every position: top-1 agreement (the same greedy token) and the mean KL divergence
KL(reference || fp8) of the next-token distributions. With --compare hf (a real checkpoint),
transformers' float32 logits are the reference of both runs instead.

The FP8 scales follow the engine's rules: the checkpoint's, else with --calculate-kv-scales
those of the first prompt, else 1.0. Default prompts: the reference workload's first 64 on
CUDA, 8 random prompts of 128 tokens on the CPU.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from minivllm.benchmarks import run_script
from minivllm.benchmarks.common import (
    add_bench_args,
    bench_engine_args,
    max_token_id,
    model_dir,
)
from minivllm.benchmarks.workloads import random_workload, reference_workload
from minivllm.devices import resolve_device
from minivllm.gguf_file import pretrained_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=None, help="default 64 (CUDA) / 8 (CPU)")
    p.add_argument("--input-len", type=int, default=None, help="random prompts of this length")
    p.add_argument("--compare", choices=["hf"], default=None, help="transformers as reference")
    add_bench_args(p)


@dataclass
class Agreement:
    """Next-token agreement of one run against a reference, over all positions."""

    positions: int = 0
    top1_equal: int = 0
    kl_sum: float = 0.0
    max_kl: float = 0.0

    def add(self, ref_logits: Any, logits: Any) -> None:
        ref_logp = ref_logits.float().log_softmax(-1)
        logp = logits.float().log_softmax(-1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        self.positions += kl.numel()
        self.top1_equal += int((ref_logits.argmax(-1) == logits.argmax(-1)).sum())
        self.kl_sum += float(kl.sum())
        self.max_kl = max(self.max_kl, float(kl.max()))

    @property
    def top1(self) -> float:
        return self.top1_equal / max(1, self.positions)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(1, self.positions)

    def line(self, what: str) -> str:
        return (
            f"{what}: top-1 agreement {100 * self.top1:.2f}% of {self.positions} positions, "
            f"mean KL {self.mean_kl:.2e}, max KL {self.max_kl:.2e}"
        )


class PrefillLogits:
    """The model of an engine config on one device, and the logits of a whole prompt with a
    KV cache of a given dtype (the caches are allocated per call, sized to the prompt)."""

    def __init__(self, config: Any) -> None:
        from minivllm.worker.attention.selector import get_attention_backend
        from minivllm.worker.distributed.parallel_state import TPGroup
        from minivllm.worker.model_loader import load_model

        self.config = config
        self.device = torch.device(config.device.device)
        self.dtype = getattr(torch, config.model.dtype)
        _, backend = get_attention_backend(
            self.device.type,
            block_size=config.cache.block_size,
            head_dim=config.model.head_dim,
            dtype=self.dtype,
        )
        self.model = load_model(config.model, self.device, TPGroup(), backend)

    def __call__(self, tokens: list[int], kv_dtype: Any, compute_kv_scales: bool = False) -> Any:
        from minivllm.worker.kv_cache_memory import KVCacheShape
        from minivllm.worker.step_buffers import StepBuffers

        m, bs, dev, n = self.config.model, self.config.cache.block_size, self.device, len(tokens)
        shape = KVCacheShape(m.num_layers, bs, m.num_kv_heads, m.head_dim, kv_dtype)
        caches = shape.allocate(-(-n // bs), dev)
        buffers = StepBuffers(1, n, -(-n // bs), bs, dev)
        meta = buffers.one_prompt(np.array(tokens, dtype=np.int64))
        meta.compute_kv_scales = compute_kv_scales
        with torch.inference_mode():
            d = buffers.dev
            hidden = self.model(d.input_ids[:n], d.positions[:n], caches, meta)
            return self.model.compute_logits(hidden)


def compare(config: Any, prompts: list[list[int]], hf_model: Any = None) -> dict[str, Agreement]:
    """Agreement of the FP8-cache run (and, against transformers, the reference run too)."""
    from minivllm.worker.ops.kv_cache import FP8

    run = PrefillLogits(config)
    calculate = config.cache.calculate_kv_scales and not run.model.has_kv_scales
    results = {"fp8 vs model dtype": Agreement()}
    if hf_model is not None:
        results = {"model dtype vs hf": Agreement(), "fp8 vs hf": Agreement()}
    for i, tokens in enumerate(prompts):
        ref = run(tokens, run.dtype)
        fp8 = run(tokens, FP8, compute_kv_scales=calculate and i == 0)
        if hf_model is None:
            results["fp8 vs model dtype"].add(ref, fp8)
            continue
        with torch.no_grad():
            hf = hf_model(torch.tensor([tokens])).logits[0].to(ref.device)
        results["model dtype vs hf"].add(hf, ref)
        results["fp8 vs hf"].add(hf, fp8)
    return results


def compare_weights(
    config: Any, quantized_config: Any, prompts: list[list[int]]
) -> dict[str, Agreement]:
    """Agreement of the quantized weights' logits with the model dtype's, one model loaded
    at a time."""
    logits = []
    for cfg in (config, quantized_config):
        run = PrefillLogits(cfg)
        logits.append([run(tokens, run.dtype).float().cpu() for tokens in prompts])
        del run
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    agreement = Agreement()
    for ref, quant in zip(*logits, strict=True):
        agreement.add(ref, quant)
    return {f"{quantized_config.model.quantization} weights vs model dtype": agreement}


def main(args: argparse.Namespace) -> dict:
    device = resolve_device(args.device)
    with model_dir(args) as (model, geometry):
        if args.input_len is None and device == "cuda":
            prompts = reference_workload().subset(args.num_prompts or 64).prompts
        else:
            shape = (args.num_prompts or 8, args.input_len or 128)
            prompts = random_workload(*shape, 1, seed=args.seed, vocab_limit=max_token_id(model))
            prompts = prompts.prompts
        config = bench_engine_args(args, model, geometry).create_engine_config()
        if args.quantization is not None:
            if args.compare == "hf":
                raise SystemExit(
                    "--quantization compares against the model dtype, not --compare hf"
                )
            reference = bench_engine_args(args, model, geometry, quantization=None)
            print(
                f"Model: {geometry or model} ({config.model.dtype}); {len(prompts)} prompts, "
                f"{sum(map(len, prompts))} positions; weights {config.model.quantization} "
                f"against {config.model.dtype}"
            )
            results = compare_weights(reference.create_engine_config(), config, prompts)
            return _report(results)
        hf_model = None
        if args.compare == "hf":
            from transformers import AutoModelForCausalLM

            name, kwargs = pretrained_args(model)  # a GGUF file: transformers dequantizes it too
            hf_model = AutoModelForCausalLM.from_pretrained(name, dtype="float32", **kwargs)
            hf_model.eval()
        print(
            f"Model: {geometry or model} ({config.model.dtype}); {len(prompts)} prompts, "
            f"{sum(map(len, prompts))} positions; FP8 scales: "
            f"{'first prompt' if config.cache.calculate_kv_scales else 'checkpoint or 1.0'}"
        )
        results = compare(config, prompts, hf_model)
    return _report(results)


def _report(results: dict[str, Agreement]) -> dict:
    figures = {}
    for what, agreement in results.items():
        print(agreement.line(what))
        figures[what] = {
            k: getattr(agreement, k) for k in ("positions", "top1", "mean_kl", "max_kl")
        }
    return figures


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
