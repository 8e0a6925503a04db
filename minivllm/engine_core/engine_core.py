"""The engine's step loop, with no I/O: add requests, abort them, step.

Usable in-process (tests, debugging, `LLMEngine` with the in-process client) and wrapped by
`EngineCoreProc`, which adds sockets, threads and the busy loop.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine_core.admission import check_request
from minivllm.engine_core.executor import Executor, UniProcExecutor
from minivllm.engine_core.multiproc_executor import MultiprocExecutor
from minivllm.engine_core.request import Request, RequestStatus
from minivllm.engine_core.scheduler import Scheduler
from minivllm.engine_core.step_trace import StepTrace
from minivllm.engine_core.structured_output.manager import StructuredOutputManager
from minivllm.protocol.messages import (
    TRITON_BUILD_S,
    TRITON_KERNELS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
    UtilityMethod,
)

logger = logging.getLogger(__name__)


def _freed_window(config: EngineConfig) -> int | None:
    """The window behind which a request's KV blocks are freed: the model's, when every layer
    has one, unless a draft model shares the blocks (its layers may read the whole context)."""
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        return None
    return config.model.kv_sliding_window


def _phases_line(startup_s: dict[str, float]) -> str:
    """'processes 1.2 s, ..., warm-up 0.0 s; 41 Triton kernels built in 9.1 s of them'."""
    phases = dict(startup_s)
    kernels, build_s = phases.pop(TRITON_KERNELS, None), phases.pop(TRITON_BUILD_S, 0.0)
    line = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
    if kernels is not None:
        line += f"; {int(kernels)} Triton kernels built in {build_s:.1f} s of them"
    return line


def _executor_class(config: EngineConfig) -> type[Executor]:
    backend = config.parallel.distributed_executor_backend
    if backend == "ray":
        from minivllm.engine_core.ray_executor import RayExecutor  # Ray is an optional extra

        return RayExecutor
    if backend == "uni" and config.parallel.tensor_parallel_size != 1:
        raise ValueError(
            "distributed_executor_backend='uni' runs one in-process worker: "
            "tensor_parallel_size must be 1"
        )
    return MultiprocExecutor if backend == "mp" else UniProcExecutor


@dataclass(slots=True)
class _InFlight:
    """A launched step: its rank-0 output once `sample_tokens` has been called for it."""

    scheduler_output: SchedulerOutput
    result: Future[ModelRunnerOutput] | None = None


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        executor_class = executor_class or _executor_class(config)
        start = time.monotonic()
        model, spec = config.model, config.speculative
        self.structured = StructuredOutputManager(
            None if model.skip_tokenizer_init else model.tokenizer,
            model.vocab_size,
            config.scheduler.max_num_seqs,
            0 if spec is None else spec.num_speculative_tokens,
        )
        try:
            self.executor = executor_class(config)
        except BaseException:
            self.structured.shutdown()
            raise
        try:
            self.num_blocks = self.executor.num_blocks
            self.scheduler = Scheduler(
                config.scheduler,
                config.cache,
                self.num_blocks,
                sliding_window=_freed_window(config),
                speculative=config.speculative,
            )
            # steps launched but not yet applied: at most one in flight with async scheduling
            self.batch_queue: deque[_InFlight] = deque()
            self.max_in_flight = 2 if config.scheduler.async_scheduling else 1
            self.trace = StepTrace()
        except BaseException:  # the workers are up: they must not outlive a failed start
            self.structured.shutdown()
            self.executor.shutdown()
            raise
        # requests refused at arrival (or whose grammar failed), answered with an error
        # output on the next step
        self._rejected: dict[int, list[EngineCoreOutput]] = {}
        phases = _phases_line(self.executor.startup_s)
        logger.info(
            "engine core ready in %.1f s (%s): %d KV blocks, async scheduling %s%s",
            time.monotonic() - start,
            phases,
            self.num_blocks,
            "on" if config.scheduler.async_scheduling else "off",
            ""
            if spec is None
            else f", speculative decoding {spec.method} (k={spec.num_speculative_tokens})",
        )

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one the engine can never serve ends at once with an error output."""
        try:
            check_request(request, self.config.model)
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            self.scheduler.check_admission(request.request_id, num_tokens)
            req = Request.from_engine_core_request(request, engine_seed=self.config.model.seed)
            structured = request.sampling_params.structured_outputs
            if structured is not None:
                # the grammar ends at a stop token (with ignore_eos, EOS ends the grammar
                # and the request generates on, unconstrained)
                self.structured.add_request(req, structured.spec(), sorted(req.stop_token_ids))
            self.scheduler.add_request(req)
        except ValueError as e:
            logger.warning("request %s rejected: %s", request.request_id, e)
            out = EngineCoreOutput(
                request.request_id, finish_reason=FinishReason.ERROR, error=str(e)
            )
            self._rejected.setdefault(request.client_id, []).append(out)

    def abort_requests(self, request_ids: list[str], client_id: int | None = None) -> list[str]:
        """Abort requests; with `client_id`, only those held for that client, which are
        returned. No output is sent: the client that aborts already knows."""
        if client_id is not None:
            held = self.scheduler.requests
            request_ids = [r for r in request_ids if r in held and held[r].client_id == client_id]
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return request_ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._rejected)

    def has_work(self) -> bool:
        return self.has_unfinished_requests() or bool(self.batch_queue)

    # ------------------------------------------------------------------ stepping

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, run and apply one step. With async scheduling, the step launched now is
        applied on a later call, after the next one has been launched behind it.

        A step runs as the executor's two calls, `execute_model` then `sample_tokens`. A step
        with structured-output requests is sampled with its token bitmask as soon as the
        matchers have taken every earlier step's tokens: at once when no earlier step is in
        flight, else right after that step is applied. The workers run its forward meanwhile
        and wait for the bitmask only to sample. Any other step is sampled at once."""
        if self.structured.waiting:
            self._poll_grammars()
        if self.scheduler.has_unfinished_requests() and len(self.batch_queue) < self.max_in_flight:
            so = self.scheduler.schedule()
            if so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                if self.trace.enabled:
                    self.trace.launched(so, len(self.structured.waiting))
                self.executor.execute_model(so)
                self.batch_queue.append(_InFlight(so))
                if not so.structured_output_req_ids or len(self.batch_queue) == 1:
                    self._sample(self.batch_queue[-1])
                if len(self.batch_queue) < self.max_in_flight:
                    return self._package({})
            elif not self.batch_queue and self.structured.waiting:
                self.structured.wait(timeout=0.005)  # idle but for grammars: no spinning
        if not self.batch_queue:
            return self._package({})
        done = self.batch_queue.popleft()
        outputs = self.scheduler.update_from_output(done.scheduler_output, done.result.result())
        if self.trace.enabled:
            self.trace.applied(len(self.trace.records) - 1 - len(self.batch_queue))
        if self.batch_queue and self.batch_queue[0].result is None:
            self._sample(self.batch_queue[0])  # its bitmask can be filled now
        return self._package(outputs)

    def _sample(self, step: _InFlight) -> None:
        """The step's second call, with its grammar bitmask if it has structured outputs."""
        so, bitmask = step.scheduler_output, None
        if so.structured_output_req_ids:
            requests, ids = self.scheduler.requests, so.structured_output_req_ids
            drafts = so.scheduled_spec_decode_tokens
            mask = self.structured.fill_bitmask(
                [requests.get(r) for r in ids], [drafts.get(r, []) for r in ids] if drafts else None
            )
            bitmask = GrammarBitmask(so.step_id, mask)
        step.result = self.executor.sample_tokens(bitmask)
        if bitmask is not None and self.trace.enabled:
            self.trace.bitmask_sent()

    def _poll_grammars(self) -> None:
        """Requests whose grammar is compiled may now be scheduled; those whose grammar
        failed end with its error."""
        for request_id, error in self.structured.poll(self.scheduler.requests):
            logger.warning("request %s failed: %s", request_id, error)
            ended = self.scheduler.finish_requests(
                [request_id], RequestStatus.FINISHED_ERROR, error
            )
            for client, outs in ended.items():
                self._rejected.setdefault(client, []).extend(outs)

    def _package(self, outputs: dict[int, list[EngineCoreOutput]]) -> dict[int, EngineCoreOutputs]:
        for client, rejected in self._rejected.items():
            outputs.setdefault(client, []).extend(rejected)
        self._rejected.clear()
        if not outputs:
            return {}
        stats = self.scheduler.make_stats()
        now = time.time()
        return {
            c: EngineCoreOutputs(outputs=o, scheduler_stats=stats, timestamp=now)
            for c, o in outputs.items()
        }

    # ------------------------------------------------------------------ utilities

    def call_utility(self, method: UtilityMethod) -> Any:
        """The utility calls a client may make of the step loop itself (the process wrapper
        handles SHUTDOWN)."""
        if method == UtilityMethod.STATS:
            return self.stats()
        if method == UtilityMethod.RESET_PREFIX_CACHE:
            return self.scheduler.kv_cache_manager.reset_prefix_cache()
        if method == UtilityMethod.HEALTH:
            self.executor.check_health()
            return True
        raise ValueError(f"utility method {method.name} is not served by the step loop")

    def stats(self) -> dict:
        import msgspec

        return msgspec.structs.asdict(self.scheduler.make_stats())

    def shutdown(self) -> None:
        self.trace.write()
        self.structured.shutdown()
        self.executor.shutdown()
