"""One rank: its device, its place in the tensor-parallel group, its model runner."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from minivllm.config import EngineConfig
from minivllm.protocol.messages import (
    TRITON_BUILD_S,
    TRITON_KERNELS,
    GrammarBitmask,
    SchedulerOutput,
)
from minivllm.worker.async_output import AsyncModelRunnerOutput
from minivllm.worker.triton_compiles import compiles

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, dist_store=None) -> None:
        self.config = config
        self.rank = rank
        self.dist_store = dist_store  # a torch.distributed Store all ranks reach (TP > 1)
        self.model_runner = None
        self.startup_s: dict[str, float] = {}  # seconds per start-up phase, in order
        self._compiles_before = (0, 0.0)  # Triton's builds before this worker started

    def _timed(self, phase: str, fn: Callable[[], _T]) -> _T:
        start = time.perf_counter()
        result = fn()
        self.startup_s[phase] = time.perf_counter() - start
        return result

    def init_device(self) -> None:
        self._timed("device", self._init_device)

    def _init_device(self) -> None:
        from minivllm.worker.distributed.parallel_state import init_tp_group

        cfg = self.config
        tp_size = cfg.parallel.tensor_parallel_size
        if cfg.device.device == "cuda":
            if compiles.install():
                compiles.starting()
                self._compiles_before = (compiles.count, compiles.seconds)
            local = self.rank % max(torch.cuda.device_count(), 1)
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            # one rank per core at most (over every data-parallel engine-core); the frontend
            # and engine-cores need some too
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.parallel.world_size))
        # the largest decode message: one hidden-state row per sequence
        row_bytes = cfg.model.hf_config["hidden_size"] * getattr(torch, cfg.model.dtype).itemsize
        self.tp = init_tp_group(
            self.rank, tp_size, self.device, self.dist_store, cfg.scheduler.max_num_seqs * row_bytes
        )
        torch.manual_seed(cfg.model.seed)
        from minivllm.worker.model_runner import ModelRunner

        self.model_runner = ModelRunner(cfg, self.device, self.tp)

    def load_model(self) -> None:
        self._timed("load", self.model_runner.load_model)

    def determine_num_blocks(self) -> int:
        return self._timed("profile", self.model_runner.determine_num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        self.startup_s.update(self.model_runner.startup_s)
        if compiles.installed:
            count, seconds = self._compiles_before
            # not phases: what the phases above spent building Triton kernels
            self.startup_s[TRITON_KERNELS] = compiles.count - count
            self.startup_s[TRITON_BUILD_S] = compiles.seconds - seconds
            compiles.serving()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Launch one step's forward; `sample_tokens` samples it."""
        self.model_runner.execute_model(scheduler_output)

    def sample_tokens(
        self, grammar_bitmask: GrammarBitmask | None = None
    ) -> AsyncModelRunnerOutput | None:
        """Sample the launched step (`grammar_bitmask`: its own, if it has structured
        outputs); rank 0 gets a handle whose `get()` waits for its output."""
        output = self.model_runner.sample_tokens(grammar_bitmask)
        return output if self.rank == 0 else None

    def shutdown(self) -> None:
        if self.config.parallel.tensor_parallel_size > 1:
            import torch.distributed as dist

            # With symmetric-memory buffers still mapped, destroying the NCCL group was seen
            # to block (2 x H200); the process exits right after this, which frees both.
            if dist.is_initialized() and self.tp.fast_all_reduce is None:
                dist.destroy_process_group()
