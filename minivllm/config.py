"""Engine arguments with vLLM's names, validated into frozen configs: `EngineArgs` here, the
configs it builds in model_config.py (`ModelConfig`), engine_config.py (cache, scheduler,
parallel, device, `EngineConfig`) and speculative_config.py, all importable from here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from minivllm import generation_defaults, rope_config
from minivllm.devices import check_gpu_sharing, resolve_device
from minivllm.engine_config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from minivllm.model_config import ModelConfig, check_moe_sharding
from minivllm.model_files import eos_ids, read_hf_config, resolve_load_format
from minivllm.quantization_config import QUANTIZATION_METHODS, resolve_quantization
from minivllm.speculative_config import (
    SpeculativeConfig,
    check_speculative_config,
    resolve_speculative_config,
)

__all__ = [
    "ENGINE_ARG_CHOICES",
    "KV_CACHE_DTYPES",
    "LOGPROBS_MODES",
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "check_moe_sharding",
]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's other spellings
_LOAD_FORMATS = ("auto", "dummy", "gguf")
_DEVICES = ("auto", "cpu", "cuda")
_EXECUTORS = ("mp", "uni", "ray")
# "auto": the model's dtype; "fp8" (= "fp8_e4m3"): e4m3 values with a per-layer k and v scale
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
_CPU_KV_CACHE_BYTES = 1 << 30  # the KV budget on a CPU when none is given
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
# the EngineArgs fields whose value is one of a fixed set (the CLI's choices)
ENGINE_ARG_CHOICES = {
    "dtype": _DTYPES + tuple(_DTYPE_ALIASES),
    "load_format": _LOAD_FORMATS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "device": _DEVICES,
    "distributed_executor_backend": _EXECUTORS,
    "logprobs_mode": LOGPROBS_MODES,
}


@dataclass
class EngineArgs:
    """Everything that configures an engine, with vLLM's argument names and defaults."""

    model: str = ""
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    disable_cascade_attn: bool = False
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_failover_limit: int = 2  # engine-cores that may die under one request
    data_parallel_restart: bool = False  # restart dead engine-cores (off, as in vLLM)
    data_parallel_restart_backoff_s: float = 5.0
    enable_expert_parallel: bool = False
    load_format: str = "auto"
    device: str = "auto"
    skip_tokenizer_init: bool = False
    async_scheduling: bool = True
    distributed_executor_backend: str = "mp"
    execute_timeout: float = 300.0  # seconds a step may take; 0: no limit
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    stream_interval: int = 1
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # ---- vLLM's spellings, and where the sampling defaults come from
    trust_remote_code: bool = False  # accepted; no remote code is ever run (built-in models only)
    revision: str | None = None  # a hub revision: refused, a local directory has none
    quantization: str | None = None  # one of QUANTIZATION_METHODS
    generation_config: str = "auto"  # "auto", "vllm" or a directory (generation_defaults.py)
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}: see
    # speculative_config.py
    speculative_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a directory with config.json or a GGUF file")
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        for name, choices in ENGINE_ARG_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        self._check_vllm_spellings()
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1, got {self.max_logprobs!r}")
        for name in (
            "max_num_seqs",
            "block_size",
            "tensor_parallel_size",
            "data_parallel_size",
            "data_parallel_failover_limit",
            "stream_interval",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in (
            "max_model_len",
            "max_num_batched_tokens",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.execute_timeout, (int, float)) or not self.execute_timeout >= 0:
            raise ValueError(
                f"execute_timeout must be a number of seconds >= 0 (0: no limit), "
                f"got {self.execute_timeout!r}"
            )
        backoff = self.data_parallel_restart_backoff_s
        if not isinstance(backoff, (int, float)) or not backoff >= 0:
            raise ValueError(
                f"data_parallel_restart_backoff_s must be a number of seconds >= 0, got {backoff!r}"
            )
        if self.data_parallel_restart and self.data_parallel_size == 1:
            raise ValueError(
                "data_parallel_restart restarts a dead engine-core of several: it needs "
                "data_parallel_size > 1"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.speculative_config is not None:
            check_speculative_config(self.speculative_config)
        if self.data_parallel_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(
                "data_parallel_size > 1 runs one engine-core process per rank: "
                "distributed_executor_backend must be 'mp' or 'ray', not 'uni'"
            )

    def _check_vllm_spellings(self) -> None:
        """vLLM's arguments that name something this engine does not have, refused by name."""
        if self.revision is not None:
            raise ValueError(
                f"revision={self.revision!r}: models load from local directories, which have "
                "no revisions; check out the revision into a directory and pass that as model"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization={self.quantization!r} is not supported (supported: "
                f"{', '.join(QUANTIZATION_METHODS)})"
            )
        generation_defaults.check_source(self.generation_config)
        if not isinstance(self.override_generation_config, dict):
            raise ValueError(
                "override_generation_config must be a dict, got "
                f"{type(self.override_generation_config).__name__}"
            )

    def _default_sampling_params(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """The model's sampling defaults, checked as SamplingParams so a bad value names the
        generation config at start-up rather than failing every request."""
        from minivllm.protocol.sampling_params import SamplingParams

        defaults = generation_defaults.default_sampling_params(
            self.model, self.generation_config, hf_config, self.override_generation_config
        )
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(f"generation_config ({self.generation_config}): {e}") from None
        generation_defaults.log_defaults(self.generation_config, defaults)
        return defaults

    def read_hf_config(self) -> dict[str, Any]:
        """The model's config.json (or GGUF metadata) with `hf_overrides` over it."""
        return {**read_hf_config(self.model), **self.hf_overrides}

    def model_config(self, hf_config: dict[str, Any]) -> ModelConfig:
        """The model's config: dtype, context length and the rest resolved from `hf_config`."""
        device = resolve_device(self.device)
        dtype = self.dtype
        if dtype == "auto":
            torch_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
            dtype = "float32" if device == "cpu" else torch_dtype
            if dtype not in _DTYPES[1:]:
                dtype = "bfloat16"
        derived_max = rope_config.max_len_with_scaling(hf_config)  # checks the rope type
        max_model_len = self.max_model_len or derived_max
        if max_model_len > derived_max:
            scaled = derived_max != rope_config.max_position_embeddings(hf_config)
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's "
                + ("context with its rope scaling" if scaled else "max_position_embeddings")
                + f" ({derived_max})"
            )
        load_format = resolve_load_format(self.model, self.load_format, self.quantization)
        model_cfg = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer or self.model,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            load_format=load_format,
            hf_config=hf_config,
            eos_token_ids=eos_ids(self.model, hf_config),
            skip_tokenizer_init=self.skip_tokenizer_init,
            disable_cascade_attn=self.disable_cascade_attn,
            max_logprobs=self.max_logprobs,
            logprobs_mode=self.logprobs_mode,
            generation_config=self.generation_config,
            default_sampling_params=self._default_sampling_params(hf_config),
            override_generation_config=self.override_generation_config,
            quantization=resolve_quantization(self.quantization, hf_config, load_format),
            stream_interval=self.stream_interval,
        )
        # a layout no layer can serve fails here, not in a worker
        _ = model_cfg.sliding_windows
        rope_config.rotary_dim(
            model_cfg.head_dim,
            rope_config.rope_parameters(hf_config, rope_config.GLOBAL_LAYER_TYPE),
        )
        return model_cfg

    def create_engine_config(self) -> EngineConfig:
        """Read the model directory and resolve every default into frozen configs."""
        model_cfg = self.model_config(self.read_hf_config())
        device = resolve_device(self.device)
        scheduler_cfg = self._scheduler_config(model_cfg)
        self._check_parallel(model_cfg, device)
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and device == "cpu" and self.num_gpu_blocks_override is None:
            kv_bytes = _CPU_KV_CACHE_BYTES
        return EngineConfig(
            model=model_cfg,
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=kv_bytes,
                kv_cache_dtype=self.kv_cache_dtype,
                calculate_kv_scales=self.calculate_kv_scales,
            ),
            scheduler=scheduler_cfg,
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                data_parallel_size=self.data_parallel_size,
                data_parallel_failover_limit=self.data_parallel_failover_limit,
                data_parallel_restart=self.data_parallel_restart,
                data_parallel_restart_backoff_s=self.data_parallel_restart_backoff_s,
                execute_timeout=float(self.execute_timeout) or None,
                enable_expert_parallel=self.enable_expert_parallel,
            ),
            device=DeviceConfig(device=device, enforce_eager=self.enforce_eager),
            speculative=None
            if self.speculative_config is None
            else resolve_speculative_config(self.speculative_config, self, model_cfg),
        )

    def _scheduler_config(self, model_cfg: ModelConfig) -> SchedulerConfig:
        max_model_len = model_cfg.max_model_len
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = 8192 if self.enable_chunked_prefill else max(max_model_len, 8192)
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= max_model_len "
                f"({max_model_len}) when enable_chunked_prefill is False"
            )
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_model_len=max_model_len,
            async_scheduling=self.async_scheduling,
            long_rope_threshold=rope_config.long_rope_threshold(model_cfg.hf_config, max_model_len),
        )

    def _check_parallel(self, model_cfg: ModelConfig, device: str) -> None:
        """The model splits evenly over the tensor-parallel ranks, and the GPUs can hold them."""
        tp = self.tensor_parallel_size
        if model_cfg.num_attention_heads % tp:
            raise ValueError(
                f"tensor_parallel_size ({tp}) must divide num_attention_heads "
                f"({model_cfg.num_attention_heads})"
            )
        kv_heads = model_cfg.num_kv_heads
        if kv_heads % tp and tp % kv_heads:
            raise ValueError(
                f"tensor_parallel_size ({tp}) and num_key_value_heads ({kv_heads}) must divide "
                "one another"
            )
        check_moe_sharding(model_cfg, tp, self.enable_expert_parallel)
        if device == "cuda" and self.distributed_executor_backend != "ray":
            check_gpu_sharing(tp, self.data_parallel_size, self.gpu_memory_utilization)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]
