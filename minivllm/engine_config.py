"""The frozen configs an engine runs with: one per concern (KV cache, scheduler, parallelism,
device), gathered in `EngineConfig`. `EngineArgs.create_engine_config` (config.py) builds
them; they travel to every process as msgpack."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.model_config import ModelConfig
from minivllm.speculative_config import SpeculativeConfig


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
    # failover (frontend/clients/dp_failover.py): a request whose engine-core dies goes on on another
    # one, unless this many engine-cores have died holding it (1: it fails with the first)
    data_parallel_failover_limit: int = 2
    # restart a dead engine-core (frontend/clients/dp_restart.py), waiting this back-off (doubling)
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
