"""`minivllm bench throughput`: offline throughput, printed the way vLLM's
`vllm bench throughput` prints it, plus the memory-traffic floor on CUDA.

Default workload: on a GPU, the reference workload (nano-vllm's offline benchmark: 256
requests, 142,827 prompt and 133,966 output tokens, temperature 0.6, ignore_eos); on the CPU,
where that takes minutes, vLLM's random dataset with 128 prompts of 256 tokens and 128 output
tokens each.
--num-prompts / --input-len / --output-len choose fixed shapes (--prefix-len puts one shared
prefix before every prompt: e.g. 256 x (2048 shared + 64) in, 64 out at temperature 0 is the
shared-prefix scenario that cascade attention serves); --reference-workload forces the
reference workload anywhere. At temperature 0 a digest of all output tokens is printed, so
two runs (cascade on and off, say) can be compared for identical tokens. --logprobs N and
--penalties give every request those settings; --sampling-variants times, on one engine, a
plain run, a run with --logprobs (5 by default) and one with --penalties, one after the
other, and prints each against the plain one. --structured-outputs times a plain run and
one under a JSON schema of eight fields (it needs a tokenizer: --tokenizer DIR with a
geometry; benchmarks/qwen3_tokenizer.py builds Qwen3's).

On CUDA it also prints the memory-traffic floor twice, for a 16-bit and an FP8 KV cache:
every output token re-reads its context's KV, every decode step the weights (in their
quantized format under --quantization: with a geometry, e.g. `--geometry qwen3-8b
--quantization fp8`, dummy weights laid out as that method's checkpoints hold them), at
the device copy bandwidth measured right after the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from typing import Any

import torch

from minivllm.benchmarks import structured
from minivllm.benchmarks.common import (
    add_bench_args,
    max_token_id,
    model_dir,
    spec_decode_figures,
    start_llm,
    token_prompts,
)
from minivllm.benchmarks.floor import ExpertTraffic, measure_copy_bandwidth, memory_floor
from minivllm.benchmarks.geometry import (
    bytes_per_weight,
    expert_parameters,
    sparse_layers,
    weight_bytes,
)
from minivllm.benchmarks.hf_baseline import run_hf
from minivllm.benchmarks.run_result import RunResult
from minivllm.benchmarks.workloads import (
    REFERENCE_TEMPERATURE,
    Workload,
    random_workload,
    reference_workload,
)
from minivllm.config import EngineConfig
from minivllm.devices import resolve_device
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.structured_outputs import StructuredOutputsParams

CPU_DEFAULT_SHAPE = (128, 256, 128)  # prompts, input tokens, output tokens
FIXED_DEFAULT_SHAPE = (1000, 1024, 128)  # what a fixed shape leaves out
PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset-name", choices=["random"], default="random", help="the prompts' source"
    )
    shapes = (
        "default: the reference workload on a GPU, {cpu} on the CPU; {fixed} when another "
        "of --num-prompts/--input-len/--output-len is given"
    )
    for flag, what, cpu, fixed in zip(
        ("--num-prompts", "--input-len", "--output-len"),
        ("requests", "prompt tokens of each", "output tokens of each"),
        CPU_DEFAULT_SHAPE,
        FIXED_DEFAULT_SHAPE,
        strict=True,
    ):
        help = f"fixed shapes: {what} ({shapes.format(cpu=cpu, fixed=fixed)})"
        p.add_argument(flag, type=int, default=None, help=help)
    p.add_argument(
        "--prefix-len", type=int, default=0, help="fixed shapes: a prefix shared by all prompts"
    )
    p.add_argument(
        "--reference-workload",
        action="store_true",
        help="the reference workload even on the CPU (the GPU default)",
    )
    p.add_argument(
        "--temperature", type=float, default=REFERENCE_TEMPERATURE, help="of every request"
    )
    p.add_argument("--logprobs", type=int, default=None, help="logprobs of every request")
    p.add_argument(
        "--penalties",
        action="store_true",
        help=f"every request with the penalties {PENALTIES}",
    )
    p.add_argument(
        "--sampling-variants",
        action="store_true",
        help="time plain, --logprobs (default 5) and --penalties runs on one engine",
    )
    p.add_argument(
        "--structured-outputs",
        action="store_true",
        help="time plain and JSON-schema runs on one engine (needs a tokenizer)",
    )
    p.add_argument(
        "--num-runs",
        type=int,
        default=1,
        help="time the workload this many times on one engine (the prefix cache emptied "
        "before each): the first run right after start-up against the later ones",
    )
    p.add_argument("--compare", choices=["hf"], default=None, help="also run HF transformers")
    p.add_argument("--compare-num-prompts", type=int, default=64, help="requests transformers runs")
    add_bench_args(p)


def sampling_variants(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(name, extra SamplingParams) of each timed run."""
    extra: dict[str, Any] = {}
    if args.logprobs is not None:
        extra["logprobs"] = args.logprobs
    if args.penalties:
        extra.update(PENALTIES)
    if args.structured_outputs:
        schema = {"structured_outputs": StructuredOutputsParams(json=structured.SCHEMA)}
        return [("plain", extra), ("json-schema", schema)]
    if not args.sampling_variants:
        return [(", ".join(f"{k}={v}" for k, v in extra.items()) or "plain", extra)]
    num = 5 if args.logprobs is None else args.logprobs
    return [("plain", {}), (f"logprobs={num}", {"logprobs": num}), ("penalties", PENALTIES)]


def build_workload(args: argparse.Namespace, max_id: int = 10000, device: str = "cuda") -> Workload:
    fixed = (args.num_prompts, args.input_len, args.output_len)
    if args.reference_workload or (fixed == (None,) * 3 and device != "cpu"):
        return reference_workload()
    if fixed == (None,) * 3:
        fixed = CPU_DEFAULT_SHAPE
    shape = [n or default for n, default in zip(fixed, FIXED_DEFAULT_SHAPE, strict=True)]
    return random_workload(*shape, seed=args.seed, vocab_limit=max_id, prefix_len=args.prefix_len)


def run_minivllm(
    llm: Any, workload: Workload, temperature: float, extra: dict[str, Any] | None = None
) -> RunResult:
    """Warm up on a few other prompts (so the prefix cache gives the timed run nothing),
    then time one `generate` of the whole workload; `extra`: more SamplingParams."""
    extra = extra or {}
    max_id = max(max(p) for p in workload.prompts)
    warm = random_workload(min(8, len(workload.prompts)), 32, 16, seed=12345, vocab_limit=max_id)
    warm_params = SamplingParams(max_tokens=16, temperature=temperature, ignore_eos=True, **extra)
    llm.generate(token_prompts(warm.prompts), warm_params, use_tqdm=False)
    params = [
        SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True, **extra)
        for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(token_prompts(workload.prompts), params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"generated {produced} tokens, asked for {workload.num_output_tokens}")
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    return RunResult(elapsed, len(outputs), workload.num_prompt_tokens, produced, digest, outputs)


def timed_runs(
    llm: Any, workload: Workload, args: argparse.Namespace, figures: dict[str, Any]
) -> dict[str, list[RunResult]]:
    """Each sampling variant's `--num-runs` runs, the prefix cache emptied between them
    (a run must not find the previous one's prompts cached)."""
    results: dict[str, list[RunResult]] = {}
    for name, extra in sampling_variants(args):
        print(f"Sampling: {name}")
        for i in range(args.num_runs):
            if i:
                llm.reset_prefix_cache()
            run = run_minivllm(llm, workload, args.temperature, extra)
            results.setdefault(name, []).append(run)
            print_vllm_lines(run)
        if "structured_outputs" in extra:
            eos = llm.llm_engine.input_processor.eos_token_ids
            figures["structured_outputs"] = structured.summarize(run.outputs, eos)
    return results


def runs_report(runs: list[RunResult], floor_s: float | None) -> list[dict[str, float]]:
    """One line per run (its share of the floor on CUDA) and the first run against the last."""
    report = []
    for i, r in enumerate(runs, 1):
        share = "" if floor_s is None else f", {100 * floor_s / r.elapsed_s:.1f}% of the floor"
        print(f"Run {i}: {r.elapsed_s:.3f} s, {r.output_tokens_per_s:.0f} output tok/s{share}")
        report.append({"elapsed_s": r.elapsed_s, "output_tokens_per_s": r.output_tokens_per_s})
    first, last = runs[0], runs[-1]
    print(f"Run 1 against run {len(runs)}: {first.elapsed_s / last.elapsed_s:.3f}x the time")
    return report


def print_vllm_lines(r: RunResult) -> None:
    print(
        f"Throughput: {r.requests_per_s:.2f} requests/s, {r.total_tokens_per_s:.2f} total "
        f"tokens/s, {r.output_tokens_per_s:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {r.prompt_tokens}")
    print(f"Total num output tokens:  {r.output_tokens}")
    print(f"Elapsed: {r.elapsed_s:.3f} s; output token digest: {r.digest}")


def floor_report(config: EngineConfig, workload: Workload, r: RunResult) -> dict:
    """Measure the device copy bandwidth now and compare the run with the traffic floors of
    a 16-bit and an FP8 KV cache (the one this run used first)."""
    model, dtype_bytes = config.model, getattr(torch, config.model.dtype).itemsize
    bandwidth = measure_copy_bandwidth()
    print(f"Device copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)")
    kv_kinds = [(model.dtype, dtype_bytes), ("fp8", 1)]
    if config.cache.kv_cache_dtype != "auto":
        kv_kinds.reverse()
    figures: dict[str, Any] = {"copy_bandwidth_bytes_per_s": bandwidth}
    experts, per_weight = None, bytes_per_weight(dtype_bytes, model.quantization)
    if model.num_experts:
        experts = ExpertTraffic(
            round(expert_parameters(model.hf_config) * per_weight),
            model.num_experts,
            model.num_experts_per_tok,
            sparse_layers(model.hf_config),
        )
    for name, elem in kv_kinds:
        floor = memory_floor(
            [len(p) for p in workload.prompts],
            workload.output_lens,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            param_bytes=weight_bytes(model.hf_config, dtype_bytes, model.quantization),
            kv_dtype_bytes=elem,
            experts=experts,
            sliding_windows=model.sliding_windows,
        )
        floor_s = floor.seconds(bandwidth)
        pct = 100 * floor_s / r.elapsed_s
        of_experts = f" (experts routed to: {floor.expert_bytes / 1e12:.2f} TB)" if experts else ""
        print(
            f"Memory-traffic floor, {name} KV: {floor.kv_bytes / 1e12:.2f} TB KV + "
            f"{floor.weight_bytes / 1e12:.2f} TB weights{of_experts} -> {floor_s:.2f} s = "
            f"{r.output_tokens / floor_s:.0f} output tok/s; this run: {pct:.1f}% of it"
        )
        if "floor_s" not in figures:  # the floor of the KV dtype this run used
            figures.update(
                floor_kv_bytes=floor.kv_bytes,
                floor_weight_bytes=floor.weight_bytes,
                floor_expert_bytes=floor.expert_bytes,
                floor_s=floor_s,
                percent_of_floor=pct,
            )
        figures[f"floor_s_{name}_kv"] = floor_s
    return figures


def main(args: argparse.Namespace) -> dict:
    figures: dict[str, Any] = {}
    with model_dir(args) as (model, geometry):
        workload = build_workload(args, max_token_id(model), resolve_device(args.device))
        print(
            f"Workload: {workload.name}: {len(workload.prompts)} requests, "
            f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens"
        )
        figures["workload"] = workload.name
        overrides: dict[str, Any] = {}
        if args.structured_outputs:
            if geometry is not None and args.tokenizer is None:
                raise SystemExit(
                    "--structured-outputs compiles grammars against a tokenizer: give "
                    "--tokenizer DIR (benchmarks/qwen3_tokenizer.py builds Qwen3's)"
                )
            overrides["skip_tokenizer_init"] = False
        llm = start_llm(args, model, geometry, workload.max_model_len, **overrides)
        config = llm.llm_engine.config
        what = f"geometry {geometry} (dummy weights)" if geometry else f"model {model}"
        print(
            f"Model: {what}; {config.model.num_layers} layers, hidden "
            f"{config.model.hf_config['hidden_size']}, vocab {config.model.vocab_size}; "
            f"device {config.device.device}, dtype {config.model.dtype}, weights "
            f"{config.model.quantization or config.model.dtype}"
        )
        try:
            results = timed_runs(llm, workload, args, figures)
            figures.update(spec_decode_figures(llm))
        finally:
            llm.shutdown()
        last = {name: runs[-1] for name, runs in results.items()}  # each variant's last run
        base_name, result = next(iter(last.items()))
        if len(last) > 1:
            for name, r in last.items():
                tok_s = r.output_tokens_per_s
                share = 100 * tok_s / result.output_tokens_per_s
                print(f"{name}: {tok_s:.0f} output tok/s = {share:.1f}% of {base_name}")
            figures["sampling_variants"] = {
                name: {"elapsed_s": r.elapsed_s, "output_tokens_per_s": r.output_tokens_per_s}
                for name, r in last.items()
            }
        figures.update(
            model=model if geometry is None else geometry,
            device=config.device.device,
            dtype=config.model.dtype,
            quantization=config.model.quantization,
            **result.figures(),
            output_digest=result.digest,
        )
        if config.device.device == "cuda":
            figures.update(floor_report(config, workload, result))
        if args.num_runs > 1:
            figures["runs"] = runs_report(results[base_name], figures.get("floor_s"))
        if args.compare == "hf":
            sub = workload.subset(args.compare_num_prompts)
            hf = run_hf(model, sub, config.device.device, args.temperature, args.seed)
            ratio = result.output_tokens_per_s / hf.output_tokens_per_s
            print(
                f"HF transformers ({sub.name}): {hf.output_tokens} output tokens in "
                f"{hf.elapsed_s:.2f} s = {hf.output_tokens_per_s:.2f} output tokens/s; "
                f"mini-vllm / HF = {ratio:.2f}x"
            )
            figures.update(hf.figures("hf_"), ratio_to_hf=ratio)
    return figures
