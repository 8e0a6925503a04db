"""Executors start the workers, send them each step and return rank 0's answer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from minivllm.config import EngineConfig
from minivllm.protocol.messages import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Owns the workers. `num_blocks` is known once the constructor returns."""

    num_blocks: int

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start one step; the future resolves to rank 0's output (or raises). A step with
        `structured_output_req_ids` samples once `send_grammar_bitmask` has given its mask."""

    @abstractmethod
    def send_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        """The token bitmask of a step already started, which waits for it to sample."""

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

        # a step waiting for its grammar bitmask (it runs when the bitmask comes)
        self._waiting: tuple[SchedulerOutput, Future[ModelRunnerOutput]] | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        future: Future[ModelRunnerOutput] = Future()
        if scheduler_output.structured_output_req_ids:
            self._waiting = (scheduler_output, future)
        else:
            self._run(future, scheduler_output)
        return future

    def send_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        (so, future), self._waiting = self._waiting, None
        assert so.step_id == bitmask.step_id, "a bitmask for another step"
        self._run(future, so, bitmask)

    def _run(self, future: Future, so: SchedulerOutput, bitmask: GrammarBitmask | None = None):
        try:
            future.set_result(self.worker.execute_model(so, lambda: bitmask))
        except Exception as e:
            future.set_exception(e)

    def shutdown(self) -> None:
        self.worker.shutdown()
