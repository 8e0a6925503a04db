"""Every MINIVLLM_* environment variable, read here and nowhere else.

Engine settings are `EngineArgs` fields; these are the process-wide switches for logging,
time limits, profiling and forcing a kernel choice. Each accessor reads its variable when
called (once per process start-up or per object, never per step), so a test's
`monkeypatch.setenv` takes effect; a value that does not parse raises a ValueError naming
the variable.

| variable                         | default | meaning                                            |
|----------------------------------|---------|----------------------------------------------------|
| MINIVLLM_LOG_LEVEL               | INFO    | logging level of every process (the library's own logger in a caller's process) |
| MINIVLLM_STARTUP_TIMEOUT         | 900     | seconds an engine-core or its workers may take to start |
| MINIVLLM_CLIENT_TIMEOUT          | 10      | seconds of silence after which a client is gone and its requests are aborted |
| MINIVLLM_STEP_TRACE              | unset   | FILE: the engine-core writes one JSON line per step there at shutdown |
| MINIVLLM_TORCH_PROFILE           | unset   | DIR: each worker writes a torch-profiler table of a window of steps |
| MINIVLLM_PROFILE_START           | 300     | the first profiled step                            |
| MINIVLLM_PROFILE_STEPS           | 20      | how many steps are profiled                        |
| MINIVLLM_PROFILE_SORT            | unset   | `cpu`: sort the profile by host time, not device time |
| MINIVLLM_PDL                     | 1       | `0`: no programmatic dependent launch of Triton kernels |
| MINIVLLM_ATTENTION_BACKEND       | unset   | force `flash-attn`, `triton`, `cpu` or `torch`     |
| MINIVLLM_DISABLE_SYMM_ALL_REDUCE | 0       | `1`: every tensor-parallel all-reduce goes to NCCL |
| MINIVLLM_API_KEY                 | unset   | the server's default `--api-key`                   |
| MINIVLLM_LOG_STATS_INTERVAL      | 10      | seconds between the server's stats log lines       |
| MINIVLLM_RAY_PLACEMENT_TIMEOUT   | 120     | seconds the Ray cluster may take to place an engine-core's workers |
| MINIVLLM_GRAMMAR_CACHE_MB        | 512     | compiled structured-output grammars the engine-core keeps, in MB |
| MINIVLLM_GRAMMAR_COMPILE_TIMEOUT | 60      | seconds a grammar may compile before its request fails |
| MINIVLLM_PLUGINS                 | unset   | `module:function,...`: called once in every process before it reads the model registry (`model_registry.py`) |
| MINIVLLM_SPIN_WAIT_US            | 3000    | on CUDA, µs a worker waits for its next step (and the engine-core for a worker's output) awake, polling, before it sleeps; 0: sleep at once |
"""

from __future__ import annotations

import os
from collections.abc import Callable


def _number(name: str, default: float, cast: type = float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        if not raw:
            return default
        try:
            return cast(float(raw))
        except ValueError:
            raise ValueError(f"{name} must be a number, got {raw!r}") from None

    return read


def _text(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or default


def _equals(name: str, value: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name) == value


log_level = _text("MINIVLLM_LOG_LEVEL", "INFO")
startup_timeout_s = _number("MINIVLLM_STARTUP_TIMEOUT", 900.0)
client_timeout_s = _number("MINIVLLM_CLIENT_TIMEOUT", 10.0)
step_trace_path = _text("MINIVLLM_STEP_TRACE")
torch_profile_dir = _text("MINIVLLM_TORCH_PROFILE")
profile_start = _number("MINIVLLM_PROFILE_START", 300, int)
profile_steps = _number("MINIVLLM_PROFILE_STEPS", 20, int)
profile_by_cpu = _equals("MINIVLLM_PROFILE_SORT", "cpu")
attention_backend = _text("MINIVLLM_ATTENTION_BACKEND")
symm_all_reduce_disabled = _equals("MINIVLLM_DISABLE_SYMM_ALL_REDUCE", "1")
api_key = _text("MINIVLLM_API_KEY")
log_stats_interval_s = _number("MINIVLLM_LOG_STATS_INTERVAL", 10.0)
ray_placement_timeout_s = _number("MINIVLLM_RAY_PLACEMENT_TIMEOUT", 120.0)
grammar_compile_timeout_s = _number("MINIVLLM_GRAMMAR_COMPILE_TIMEOUT", 60.0)
_grammar_cache_mb = _number("MINIVLLM_GRAMMAR_CACHE_MB", 512)
_spin_wait_us = _number("MINIVLLM_SPIN_WAIT_US", 3000)


def grammar_cache_bytes() -> int:
    return int(_grammar_cache_mb() * (1 << 20))


def spin_wait_s(device: str) -> float:
    """How long a worker on `device` polls for its next step, and the engine-core for its
    workers' outputs, before sleeping. A thread woken from sleep runs its next host work
    slowly (cold caches, a core that clocked down): on an H200 host a batch-1 step's input
    preparation took 540-640 µs woken against 330 µs awake, and each ipc hop 170-200 µs
    against 65-95. Only on CUDA, where a spinning core costs nothing the GPU waits for; a
    CPU engine needs every core for its forward."""
    return _spin_wait_us() / 1e6 if device == "cuda" else 0.0


def plugins() -> list[str]:
    return [p.strip() for p in os.environ.get("MINIVLLM_PLUGINS", "").split(",") if p.strip()]


def pdl_enabled() -> bool:
    return os.environ.get("MINIVLLM_PDL", "1") != "0"
