"""Engine arguments with vLLM's names, validated into frozen configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from minivllm import generation_defaults, rope_config, speculative_config
from minivllm.devices import check_gpu_sharing, resolve_device
from minivllm.model_files import eos_ids, read_hf_config, resolve_load_format
from minivllm.quantization_config import QUANTIZATION_METHODS, resolve_quantization
from minivllm.sliding_windows import kv_sliding_window, layer_sliding_windows
from minivllm.speculative_config import (
    SpeculativeConfig,
    check_speculative_config,
    resolve_speculative_config,
)

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


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    seed: int
    load_format: str
    hf_config: dict[str, Any]  # config.json as a plain dict
    eos_token_ids: tuple[int, ...]  # from generation_config.json, else config.json
    skip_tokenizer_init: bool = False
    # decode batches sharing a cached prefix attend it once per step unless this is set
    disable_cascade_attn: bool = False
    max_logprobs: int = 20  # the most (prompt) logprobs a request may ask; -1: the vocabulary
    logprobs_mode: str = "raw_logprobs"  # what logprobs hold: one of LOGPROBS_MODES
    # where the sampling defaults come from ("auto", "vllm" or a directory), and those
    # defaults: SamplingParams fields the model's generation config sets (generation_defaults.py)
    generation_config: str = "auto"
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # the linear layers' quantization method (one of LINEAR_QUANTIZATION_METHODS), from the
    # checkpoint's quantization_config, else online fp8; None: the weights are in `dtype`
    # (a GGUF file's too: dequantized at load)
    quantization: str | None = None

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or [""]
        return archs[0]

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        hd = self.hf_config.get("head_dim")
        return int(hd) if hd else int(self.hf_config["hidden_size"]) // self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, None where it sees the whole context."""
        return layer_sliding_windows(self.hf_config, self.num_layers, self.max_model_len)

    @property
    def kv_sliding_window(self) -> int | None:
        """Set when every layer attends over a window: the KV blocks behind the largest are
        read by no layer and go back to the pool (engine_core/kv_cache_manager.py)."""
        return kv_sliding_window(self.sliding_windows)

    @property
    def num_experts(self) -> int:
        """Routed experts of each sparse MLP (Qwen3-MoE's num_experts, Mixtral's
        num_local_experts); 0 for a dense model."""
        hf = self.hf_config
        return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)

    @property
    def num_experts_per_tok(self) -> int:
        return int(self.hf_config.get("num_experts_per_tok") or 0)

    @property
    def moe_intermediate_size(self) -> int:
        """Each expert's intermediate size (Mixtral's experts have the dense one)."""
        hf = self.hf_config
        return int(hf.get("moe_intermediate_size") or hf["intermediate_size"])

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a sparse MLP: every decoder_sparse_step-th layer
        (1: all) except those in mlp_only_layers (Qwen3-MoE's knobs; Mixtral sets neither)."""
        hf = self.hf_config
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = hf.get("mlp_only_layers") or ()
        return self.num_experts > 0 and layer_idx not in dense and (layer_idx + 1) % step == 0


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None  # a fixed KV budget (the CPU default); None: profile
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" (e4m3, scaled)
    # fp8 without k_scale/v_scale in the checkpoint: scales from the first prefill, else 1.0
    calculate_kv_scales: bool = False

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype != "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_model_len: int
    async_scheduling: bool
    # LongRoPE (Phi-3's long variants): a sequence longer than this is rotated with the long
    # factors, every token of it, so its KV differs from a shorter sequence's of the same
    # tokens: its blocks hash apart, and a sequence that grows past it is computed again
    # (rope_config.long_rope_threshold; None: no such switch)
    long_rope_threshold: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    # "mp": worker processes; "uni": in-process (tests); "ray": workers as Ray actors
    distributed_executor_backend: str
    data_parallel_size: int = 1  # engine-cores, each with its own scheduler, KV cache and TP group
    data_parallel_rank: int = 0  # which of them this config starts
    # CUDA_VISIBLE_DEVICES of this engine-core's workers (a data-parallel slice); None: inherit
    visible_devices: str | None = None
    # failover (frontend/dp_failover.py): a request whose engine-core dies goes on on another
    # one, unless this many engine-cores have died holding it (1: it fails with the first)
    data_parallel_failover_limit: int = 2
    # restart a dead engine-core (frontend/dp_restart.py), waiting this back-off (doubling)
    # before each restart of one that died again soon after the last
    data_parallel_restart: bool = False
    data_parallel_restart_backoff_s: float = 5.0
    # seconds a step's results may take before the engine is declared dead (None: no limit);
    # the first step, which compiles and captures, has none
    execute_timeout: float | None = None
    # mixtures of experts: each rank holds E / tensor_parallel_size whole experts, rather
    # than every expert sliced along its intermediate dimension
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        """Worker processes over all engine-cores."""
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # resolved: cpu | cuda
    enforce_eager: bool


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    speculative: SpeculativeConfig | None = None  # speculative decoding, when asked for


def check_moe_sharding(model: ModelConfig, tp: int, expert_parallel: bool) -> None:
    """A mixture of experts splits over the ranks by whole experts (expert parallelism) or
    by each expert's intermediate dimension: either must divide evenly."""
    if not model.num_experts or tp == 1:
        return
    if expert_parallel and model.num_experts % tp:
        raise ValueError(
            f"enable_expert_parallel: tensor_parallel_size ({tp}) must divide the number of "
            f"experts ({model.num_experts})"
        )
    if not expert_parallel and model.moe_intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must divide the experts' intermediate size "
            f"({model.moe_intermediate_size}); enable_expert_parallel places whole experts "
            "instead"
        )


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


# SpeculativeConfig.draft is a ModelConfig, which speculative_config.py can import only for
# type checkers (this module imports it): give its namespace the class, so msgspec can
# resolve the field when an EngineConfig is decoded (a Ray worker's config travels so).
speculative_config.ModelConfig = ModelConfig  # type: ignore[attr-defined]
