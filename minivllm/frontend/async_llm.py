"""`AsyncLLM`: the asyncio API. `generate()` is an async generator of `RequestOutput`s;
cancelling the task that consumes it (or leaving the loop early) aborts the request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncGenerator
from concurrent.futures import Future

from minivllm.config import EngineArgs, EngineConfig, ModelConfig
from minivllm.exceptions import EngineCoreDeadError, EngineDeadError
from minivllm.frontend.clients.dp_client import DPAsyncClient, attach_client, make_client
from minivllm.frontend.clients.dp_group import DEFAULT_FAILOVER_LIMIT
from minivllm.frontend.clients.mp_client import AsyncMPClient
from minivllm.frontend.input_processor import InputProcessor, PromptType
from minivllm.frontend.metrics.stats import StatLogger, StatsCollector
from minivllm.frontend.output_processor import OutputProcessor, RequestOutputCollector
from minivllm.frontend.tokenizer import Tokenizer, load_tokenizer_meanwhile, resolve_tokenizer
from minivllm.outputs import RequestOutput
from minivllm.process_utils import on_release
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.messages import EngineCoreOutputs, UtilityMethod
from minivllm.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Spawns its own engine-core(s) (`from_engine_args`; `data_parallel_size` of them) or
    attaches to one or several daemons (`connect`). With `stat_loggers`, request timings and
    scheduler stats are fed to them (metrics/).

    The engine it spawned stops, or the daemons it attached to are left, on `shutdown()`, on
    leaving `async with`, when nothing refers to the AsyncLLM any more, or at interpreter
    exit: a script that never calls `shutdown()` still ends."""

    def __init__(
        self,
        model_config: ModelConfig,
        client: AsyncMPClient | DPAsyncClient,
        stat_loggers: list[StatLogger] | None = None,
        tokenizer: Tokenizer | Future[Tokenizer | None] | None = None,
        client_index: int = 0,
    ) -> None:
        """`tokenizer`: None loads the model's (unless `skip_tokenizer_init`), a future is
        waited for (a failed load stops the engine). `client_index`: this frontend's index
        among the API processes of one server (vLLM's name), which keeps their request ids
        apart."""
        self.client = client
        self._tasks: list[asyncio.Task] = []  # the output handler, once started
        self._release = on_release(self, _shutdown, client, self._tasks)
        try:
            self.model_config = model_config
            self.stats = StatsCollector(stat_loggers) if stat_loggers else None
            self.tokenizer = resolve_tokenizer(
                tokenizer, model_config.tokenizer, model_config.skip_tokenizer_init
            )
            self.input_processor = InputProcessor(model_config, self.tokenizer, client_index)
            self.output_processor = OutputProcessor(self.tokenizer, model_config.stream_interval)
        except BaseException:
            self._release()
            raise
        self._queues: dict[str, RequestOutputCollector] = {}  # by user request id
        self.dead: EngineDeadError | None = None
        # No gc.freeze() here: this is the caller's process. A service that streams a lot
        # may call process_utils.freeze_startup_heap() itself once it has started.

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, stat_loggers: list[StatLogger] | None = None
    ) -> AsyncLLM:
        config: EngineConfig = engine_args.create_engine_config()
        model = config.model
        tokenizer = load_tokenizer_meanwhile(None if model.skip_tokenizer_init else model.tokenizer)
        return cls(model, make_client(config, asynchronous=True), stat_loggers, tokenizer)

    @classmethod
    def connect(
        cls,
        address: str | list[str],
        stat_loggers: list[StatLogger] | None = None,
        curve: CurveClientKeys | None = None,
        tokenizer: str | None = None,
        data_parallel_failover_limit: int = DEFAULT_FAILOVER_LIMIT,
    ) -> AsyncLLM:
        """Attach to a running `minivllm engine-core` daemon at `address`, or to several
        (a list: one serving frontend over all, requests routed as with data parallelism;
        a request whose daemon dies goes on on another, unless
        `data_parallel_failover_limit` daemons have died holding it).
        `curve`: the keys a daemon on a network address asks for
        (`CurveClientKeys.load(server_key, secret_key)`). The model's config and tokenizer
        come from the daemon, so no model files are needed here; `tokenizer`: a directory
        to load the tokenizer from instead."""
        client = attach_client(
            address,
            curve,
            asynchronous=True,
            has_tokenizer=bool(tokenizer),
            failover_limit=data_parallel_failover_limit,
        )
        try:
            model_config, loaded = client.attached_model(tokenizer)
        except BaseException:
            client.shutdown()
            raise
        return cls(model_config, client, stat_loggers, loaded)

    @property
    def errored(self) -> bool:
        return self.dead is not None

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request; raises ValueError for bad input and
        EngineDeadError if the engine dies meanwhile."""
        if self.dead is not None:
            raise self.dead
        self._ensure_handler()
        # the output processor puts this request's outputs straight into its queue
        queue = RequestOutputCollector(sampling_params.output_kind)
        requests = self.output_processor.add_user_request(
            request_id, prompt, sampling_params, self.input_processor, queue=queue
        )
        self._queues[request_id] = queue
        if self.stats is not None:
            self.stats.add_requests(requests)
        finished = False
        try:
            await self.client.add_requests_async(requests)
            while not finished:
                out = queue.get_nowait()
                if out is None:
                    out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for r in ids:
            self._abort_now(r)
            queue = self._queues.pop(r, None)
            if queue is not None:
                queue.put(asyncio.CancelledError(f"request {r} was aborted"))

    def _abort_now(self, request_id: str) -> None:
        internal = self.output_processor.abort_user_requests([request_id])
        if self.stats is not None:
            self.stats.abort(internal)
        if internal and self.dead is None:
            task = asyncio.ensure_future(self.client.abort_requests_async(internal))
            task.add_done_callback(_log_failure)

    def _ensure_handler(self) -> None:
        if not self._tasks or self._tasks[0].done():
            # the task holds this object only while it handles a batch, so an AsyncLLM that
            # nobody refers to is collected (and its engine stopped) though the task waits
            handler = _output_handler(weakref.ref(self), self.client)
            self._tasks[:] = [asyncio.create_task(handler, name="output-handler")]

    async def _handle(self, outputs: EngineCoreOutputs) -> None:
        """Process one step's outputs: the output processor puts them into the queues of
        the requests they belong to, errors are raised into them here."""
        processed = self.output_processor.process_outputs(outputs.outputs)
        if self.stats is not None:
            self.stats.record(outputs, processed.reqs_to_abort)
        for request_id, error in processed.errors.items():
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put(ValueError(f"request {request_id} failed: {error}"))
        if processed.reqs_to_abort:
            await self.client.abort_requests_async(processed.reqs_to_abort)

    def _lost(self, error: EngineCoreDeadError) -> None:
        """One of several cores died, and these of its requests could not move on: they
        end with `error`."""
        for request_id in self.output_processor.forget_lost(error.request_ids):
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put(error)

    def _fail(self, error: Exception) -> None:
        if not isinstance(error, EngineDeadError):  # a bug here must not leave callers hanging
            logger.error("output handler failed", exc_info=error)
            error = EngineDeadError(f"the frontend's output handler failed: {error}")
        self.dead = error
        for queue in self._queues.values():
            queue.put(error)

    def do_log_stats(self) -> None:
        """Have the stat loggers report (the periodic log line)."""
        if self.stats is not None:
            self.stats.log()

    async def get_stats(self) -> dict:
        return await self.client.call_utility_async(UtilityMethod.STATS)

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async(UtilityMethod.RESET_PREFIX_CACHE)

    async def check_health(self) -> None:
        if self.dead is not None:
            raise self.dead
        await self.client.call_utility_async(UtilityMethod.HEALTH)

    def shutdown(self) -> None:
        """Stop the engine this AsyncLLM spawned, or detach from the daemons it attached to."""
        self._release()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()


async def _output_handler(
    ref: weakref.ref[AsyncLLM], client: AsyncMPClient | DPAsyncClient
) -> None:
    """Hand each step's outputs to the AsyncLLM behind `ref`, for as long as it lives."""
    try:
        while True:
            try:
                outputs: EngineCoreOutputs | EngineCoreDeadError = await client.get_output_async()
            except EngineCoreDeadError as e:  # one of several cores: the requests it names
                outputs = e
            llm = ref()
            if llm is None:
                return
            if isinstance(outputs, EngineCoreDeadError):
                llm._lost(outputs)
            else:
                await llm._handle(outputs)
            llm = None  # not held while waiting for the next outputs
    except Exception as e:  # cancellation (a BaseException) passes
        if (llm := ref()) is not None:
            llm._fail(e)


def _shutdown(client: AsyncMPClient | DPAsyncClient, tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        with contextlib.suppress(RuntimeError):  # its event loop is closed: it is gone too
            task.cancel()
    client.shutdown()


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("could not send an abort: %s", task.exception())
