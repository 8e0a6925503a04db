"""Every MINIVLLM_* environment variable, read here and nowhere else.

Engine settings are `EngineArgs` fields; these are the process-wide switches for logging,
time limits, profiling and forcing a kernel choice. Each accessor reads its variable when
called (once per process start-up or per object, never per step), so a test's
`monkeypatch.setenv` takes effect; a value that does not parse raises a ValueError naming
the variable.

| variable                         | default | meaning                                            |
|----------------------------------|---------|----------------------------------------------------|
| MINIVLLM_LOG_LEVEL               | INFO    | logging level of the CLI, engine-core and workers  |
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
"""

from __future__ import annotations

import os


def _number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def log_level() -> str:
    return os.environ.get("MINIVLLM_LOG_LEVEL") or "INFO"


def startup_timeout_s() -> float:
    return _number("MINIVLLM_STARTUP_TIMEOUT", 900.0)


def client_timeout_s() -> float:
    return _number("MINIVLLM_CLIENT_TIMEOUT", 10.0)


def step_trace_path() -> str | None:
    return os.environ.get("MINIVLLM_STEP_TRACE") or None


def torch_profile_dir() -> str | None:
    return os.environ.get("MINIVLLM_TORCH_PROFILE") or None


def profile_start() -> int:
    return int(_number("MINIVLLM_PROFILE_START", 300))


def profile_steps() -> int:
    return int(_number("MINIVLLM_PROFILE_STEPS", 20))


def profile_by_cpu() -> bool:
    return os.environ.get("MINIVLLM_PROFILE_SORT") == "cpu"


def pdl_enabled() -> bool:
    return os.environ.get("MINIVLLM_PDL", "1") != "0"


def attention_backend() -> str | None:
    return os.environ.get("MINIVLLM_ATTENTION_BACKEND") or None


def symm_all_reduce_disabled() -> bool:
    return os.environ.get("MINIVLLM_DISABLE_SYMM_ALL_REDUCE") == "1"


def api_key() -> str | None:
    return os.environ.get("MINIVLLM_API_KEY") or None


def log_stats_interval_s() -> float:
    return _number("MINIVLLM_LOG_STATS_INTERVAL", 10.0)


def ray_placement_timeout_s() -> float:
    return _number("MINIVLLM_RAY_PLACEMENT_TIMEOUT", 120.0)


def grammar_cache_bytes() -> int:
    return int(_number("MINIVLLM_GRAMMAR_CACHE_MB", 512) * (1 << 20))


def grammar_compile_timeout_s() -> float:
    return _number("MINIVLLM_GRAMMAR_COMPILE_TIMEOUT", 60.0)
