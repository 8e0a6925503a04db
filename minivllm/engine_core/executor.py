"""Executors start the workers, send them each step and return rank 0's answer.

A step is vLLM's two calls: `execute_model(scheduler_output)` launches it on every rank,
`sample_tokens(grammar_bitmask)` has it sampled and returns rank 0's answer. One step at a
time is launched and not yet sampled; the next `execute_model` comes after its
`sample_tokens`. A step without structured outputs costs the workers no second message:
they sample it as soon as its forward is launched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from minivllm.config import EngineConfig
from minivllm.protocol.messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Owns the workers. `num_blocks` is known once the constructor returns, and
    `startup_s`: the seconds each start-up phase took (rank 0's), in order."""

    num_blocks: int
    startup_s: dict[str, float]

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.startup_s = {}

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Launch one step on every rank."""

    @abstractmethod
    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> Future[ModelRunnerOutput]:
        """Sample the launched step; the future resolves to rank 0's output (or raises).
        `grammar_bitmask`: the step's token masks if it has `structured_output_req_ids`,
        else None."""

    def check_health(self) -> None:
        """Raise if a worker is dead."""

    @abstractmethod
    def shutdown(self) -> None: ...


class UniProcExecutor(Executor):
    """One worker in this process: for tests and debugging."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from minivllm.worker.worker import Worker

        self.worker = Worker(config, rank=0)
        self.worker.init_device()
        self.worker.load_model()
        self.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_kv_cache(self.num_blocks)
        self.startup_s = self.worker.startup_s

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.worker.sample_tokens(grammar_bitmask).get())
        except Exception as e:
            future.set_exception(e)
        return future

    def shutdown(self) -> None:
        self.worker.shutdown()
