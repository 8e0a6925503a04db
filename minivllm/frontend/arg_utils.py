"""EngineArgs on the command line: one `--flag` per field, with vLLM's spelling, help text
and choices; `HelpFormatter` shows each flag's default."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing

from minivllm.config import ENGINE_ARG_CHOICES, EngineArgs
from minivllm.quantization_config import QUANTIZATION_METHODS

# vLLM's short spellings
_ALIASES = {"tensor_parallel_size": ["-tp"], "data_parallel_size": ["-dp"], "quantization": ["-q"]}

HELP = {
    "model": "the model: a directory in HF format (config.json, *.safetensors, tokenizer "
    "files) or a GGUF file",
    "tokenizer": "directory of the tokenizer files, or a GGUF file (default: the model's)",
    "dtype": "weights and activations: auto is the checkpoint's dtype on a GPU and float32 "
    "on the CPU; half = float16, float = float32",
    "seed": "base seed of sampling and of dummy weights",
    "max_model_len": "the longest prompt plus output, in tokens (default: the model's "
    "max_position_embeddings)",
    "max_num_seqs": "the most requests in one step",
    "max_num_batched_tokens": "the most tokens in one step (default: 8192; with "
    "--no-enable-chunked-prefill at least max_model_len)",
    "block_size": "tokens per KV-cache block (a power of two)",
    "num_gpu_blocks_override": "a fixed number of KV-cache blocks instead of what fits",
    "gpu_memory_utilization": "the share of the GPU's memory the engine may use (weights, "
    "activations and KV cache)",
    "kv_cache_memory_bytes": "a fixed KV-cache size in bytes (default: from "
    "--gpu-memory-utilization on a GPU, 1 GiB on the CPU)",
    "kv_cache_dtype": "auto: the model's dtype; fp8 (= fp8_e4m3): e4m3 with per-layer scales",
    "calculate_kv_scales": "fp8 KV cache without scales in the checkpoint: scales from the "
    "first prefill instead of 1.0",
    "disable_cascade_attn": "no cascade attention (a shared prefix read once per decode step)",
    "enable_prefix_caching": "reuse the KV of prompt prefixes seen before",
    "enable_chunked_prefill": "split long prompts over several steps",
    "enforce_eager": "no CUDA graphs: every step runs the model eagerly",
    "tensor_parallel_size": "GPUs (worker processes) one model is split over",
    "data_parallel_size": "engine-cores, each with its own scheduler, KV cache and "
    "tensor-parallel group; requests are routed over them",
    "data_parallel_failover_limit": "a request whose engine-core dies goes on on another "
    "(its tokens so far carried over), unless this many engine-cores have died holding it; "
    "1: it fails with the first",
    "data_parallel_restart": "restart a dead engine-core (same arguments, same GPUs) and "
    "route to it again once it is ready",
    "data_parallel_restart_backoff_s": "with --data-parallel-restart: seconds before "
    "restarting an engine-core that died again soon after its restart, doubling each time",
    "enable_expert_parallel": "mixtures of experts: each rank holds whole experts (E / TP of "
    "them) instead of a slice of every expert (no effect on dense models)",
    "load_format": "auto: the checkpoint's safetensors, or gguf for a GGUF file; gguf: a "
    "GGUF file's tensors, dequantized at load; dummy: random weights of its shape",
    "device": "auto: CUDA when there is a GPU, else the CPU",
    "skip_tokenizer_init": "no tokenizer: prompts must be token ids, outputs carry no text",
    "async_scheduling": "schedule the next step while the current one runs",
    "distributed_executor_backend": "mp: worker processes; uni: the model in the "
    "engine-core's process; ray: workers as Ray actors",
    "execute_timeout": "seconds a step may take before the engine is declared dead "
    "(0: no limit; the first step has none)",
    "max_logprobs": "the most logprobs a request may ask for (-1: the whole vocabulary)",
    "stream_interval": "new tokens per streamed output, the first and last excepted (1: every "
    "token as it comes; more: fewer, larger outputs and less host work per token); a daemon's "
    "clients use the daemon's",
    "logprobs_mode": "what logprobs hold: log-probabilities or logits, before (raw) or after "
    "(processed) penalties, bias and temperature",
    "hf_overrides": "JSON object merged over the model's config.json",
    "trust_remote_code": "accepted for vLLM's command lines; no remote code is ever run: "
    "only the built-in architectures (Qwen3, Qwen2, Llama, Mistral, Qwen3-MoE, Mixtral) load",
    "revision": "refused with an error: models load from local directories, which have no "
    "revisions",
    "quantization": "the weights' quantization method: "
    + ", ".join(QUANTIZATION_METHODS)
    + " (default: the checkpoint's quantization_config; fp8 on a 16-bit checkpoint quantizes "
    "it at load; with --load-format dummy, random weights as that method's tool writes them; "
    "gguf: a GGUF file's, implied by the file)",
    "generation_config": "sampling defaults for fields a request leaves unset: auto: the "
    "model's generation_config.json; vllm: vLLM's neutral defaults; or a directory holding "
    "a generation_config.json",
    "override_generation_config": "JSON object over the generation config, e.g. "
    "'{\"temperature\": 0.5}'",
    "speculative_config": "speculative decoding, as a JSON object: "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": DIR, '
    '"num_speculative_tokens": 4}\'',
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written; each flag's help with its default (unless the help
    says it, or there is none to say)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if "default" in help or action.default in (None, argparse.SUPPRESS) or not help:
            return help
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, [])]
        kind, help = hints[f.name], HELP[f.name]
        if kind is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(*flags, action=action, default=f.default, help=help)
            continue
        base = _base_type(kind)
        if base is dict:
            parser.add_argument(*flags, type=_json_object, default=None, metavar="JSON", help=help)
            continue
        if f.name == "quantization":
            base = _quantization
        required = f.name == "model" and model_required
        default = None if f.name == "model" else f.default
        choices = ENGINE_ARG_CHOICES.get(f.name)
        parser.add_argument(
            *flags, type=base, default=default, required=required, choices=choices, help=help
        )


def _base_type(kind: typing.Any) -> type:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return _base_type(args[0])
    return typing.get_origin(kind) or kind


def _json_object(text: str) -> dict[str, typing.Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _quantization(name: str) -> str:
    """A quantization method this engine loads; anything else is refused before any start."""
    if name not in QUANTIZATION_METHODS:
        supported = ", ".join(QUANTIZATION_METHODS)
        raise argparse.ArgumentTypeError(f"{name!r} is not supported (supported: {supported})")
    return name


def absolute_paths(ns: argparse.Namespace) -> dict[str, str]:
    """The directories among the engine args (model, tokenizer, a generation config), made
    absolute: what a daemon hands its clients must not depend on its working directory."""
    paths = {}
    for name in ("model", "tokenizer", "generation_config"):
        value = getattr(ns, name, None)
        if value and os.path.isdir(value):
            paths[name] = os.path.abspath(value)
    return paths


def engine_args_from(ns: argparse.Namespace, **overrides: typing.Any) -> EngineArgs:
    values = {}
    for f in dataclasses.fields(EngineArgs):
        value = getattr(ns, f.name, None)
        if hasattr(ns, f.name) and (value is not None or f.default_factory is dataclasses.MISSING):
            values[f.name] = value  # a JSON flag not given keeps its empty default
    values.update(overrides)
    return EngineArgs(**values)
