"""Several engine-cores behind one frontend (data parallelism): one client per core, each
request routed by `DPRouter`, every core's outputs merged into one stream.

A core that dies fails only the requests it held, with `EngineCoreDeadError` (raised once,
from `get_output`, naming them); the frontend stops routing to it and keeps serving with
the rest. Only when every core is dead does the client report a dead engine, as a single
engine-core client does. `check_health` raises while any core is dead, naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any, Self

import msgspec
import zmq

from minivllm.config import EngineConfig, ModelConfig
from minivllm.exceptions import EngineCoreDeadError, EngineDeadError, EngineStartupError
from minivllm.frontend.clients.core_client import EngineCoreClient
from minivllm.frontend.clients.core_launch import EngineCoreLaunch
from minivllm.frontend.clients.dp_placement import engine_configs
from minivllm.frontend.clients.dp_router import DPRouter
from minivllm.frontend.clients.mp_client import _POLL_MS, AsyncMPClient, SyncMPClient, _MPClient
from minivllm.frontend.tokenizer import Tokenizer
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.messages import (
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    UtilityMethod,
)

DEFAULT_BLOCK_SIZE = 16  # prefix affinity's block when attached to daemons of unknown size


def _attach_all(
    client_class,
    targets: list[str] | list[EngineCoreLaunch],
    curve: CurveClientKeys | None = None,
    has_tokenizer: bool = True,
) -> tuple[list[Any], list[str]]:
    """Attach a client to each engine-core, spawned (its start-ups overlap the attaches
    before it) or a daemon at an address; all must serve the same model. If any fails, stop
    them all and raise, naming the rank. Returns the clients and their input addresses.
    Unless `has_tokenizer`, the first asks its daemon for the tokenizer."""
    clients: list[Any] = []
    try:
        for i, target in enumerate(targets):
            try:
                own = has_tokenizer or i > 0
                clients.append(client_class(address=target, curve=curve, has_tokenizer=own))
            except EngineStartupError as e:
                raise EngineStartupError(f"engine-core {i} of {len(targets)}: {e}") from e
        addresses = [
            t if isinstance(t, str) else c.info.input_address
            for c, t in zip(clients, targets, strict=True)
        ]
        _check_same_model([c.info for c in clients], addresses)
    except BaseException:
        for c in clients:
            c.shutdown()
        for target in targets[len(clients) + 1 :]:
            if isinstance(target, EngineCoreLaunch):
                target.cancel()
        raise
    return clients, addresses


_SAME_MODEL_FIELDS = ("model", "tokenizer", "max_model_len")


def _check_same_model(infos: list[EngineCoreInfo], addresses: list[str]) -> None:
    first = infos[0]
    for info, address in zip(infos[1:], addresses[1:], strict=True):
        if any(getattr(info, f) != getattr(first, f) for f in _SAME_MODEL_FIELDS):
            raise EngineStartupError(
                f"the engine-cores at {addresses[0]} and {address} serve different models "
                f"({first.model!r}, {first.max_model_len} tokens vs {info.model!r}, "
                f"{info.max_model_len} tokens)"
            )


def merge_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """`SchedulerStats` of several cores as one engine's: counts and cumulative counters add
    up (so their deltas stay right), the KV cache usage is the mean."""
    merged = {k: sum(getattr(s, k) for s in stats) for k in SchedulerStats.__struct_fields__}
    merged["kv_cache_usage"] /= len(stats)
    return SchedulerStats(**merged)


class _DPClient:
    """What the sync and async data-parallel clients share: the router and the bookkeeping
    of outputs and deaths. `start` spawns the engine-cores of a config, `connect` attaches
    to running daemons."""

    clients: list[_MPClient]
    client_class: type[_MPClient]

    def __init__(self, clients: list[_MPClient], addresses: list[str], block_size: int) -> None:
        self.clients = clients
        self.addresses = addresses
        self.router = DPRouter(len(clients), block_size)
        self.output_tokens = [0] * len(clients)
        self.latest_stats: list[SchedulerStats | None] = [None] * len(clients)

    @classmethod
    def start(cls, config: EngineConfig) -> Self:
        launches = [EngineCoreLaunch.start(c) for c in engine_configs(config)]
        return cls(*_attach_all(cls.client_class, launches), config.cache.block_size)

    @classmethod
    def connect(
        cls, addresses: list[str], curve: CurveClientKeys | None = None, has_tokenizer: bool = False
    ) -> Self:
        clients, bound = _attach_all(cls.client_class, list(addresses), curve, has_tokenizer)
        return cls(clients, bound, DEFAULT_BLOCK_SIZE)

    def attached_model(self, tokenizer: str | None = None) -> tuple[ModelConfig, Tokenizer | None]:
        """The daemons' model config and tokenizer (they serve the same model)."""
        return self.clients[0].attached_model(tokenizer)

    def _account(self, engine: int, out: EngineCoreOutputs) -> None:
        """Learn from one output batch of `engine` before it is handed on, its scheduler
        stats replaced by the whole engine's (every live core's latest, merged), so that
        metrics read one engine however many cores serve."""
        if out.scheduler_stats is not None:
            self.router.update_stats(engine, out.scheduler_stats)
            self.latest_stats[engine] = out.scheduler_stats
            live = [s for e, s in enumerate(self.latest_stats) if e not in self.router.dead]
            out.scheduler_stats = merge_scheduler_stats([s for s in live if s is not None])
        for o in out.outputs:
            self.output_tokens[engine] += len(o.new_token_ids)
            if o.finish_reason is not None:
                self.router.finished(o.request_id)

    def _died(self, engine: int, error: BaseException) -> EngineDeadError | None:
        """Stop routing to `engine`: the error its requests get (None if already known)."""
        if engine in self.router.dead:
            return None
        lost = self.router.mark_dead(engine, str(error))
        alive = len(self.router.alive())
        if not alive:
            return EngineDeadError(f"every engine-core is dead; the last: {error}")
        return EngineCoreDeadError(
            f"engine-core {engine} of {len(self.clients)} died ({alive} still serving): {error}",
            engine,
            lost,
        )

    def _route(self, requests: list[EngineCoreRequest]) -> int:
        """The core to send `requests` (one user request) to; a core found dead on the way
        is marked so, and the next one chosen."""
        prompt = requests[0].prompt_token_ids
        while True:
            try:
                engine = self.router.choose(prompt)
            except LookupError:
                raise EngineDeadError(
                    f"the engine is dead: every engine-core died: {self.router.dead}"
                ) from None
            try:
                self.clients[engine]._check_alive()
            except EngineDeadError as e:
                self._on_death(engine, e)
                continue
            self.router.assign([r.request_id for r in requests], prompt, engine)
            return engine

    def _on_death(self, engine: int, error: BaseException) -> None:
        raise NotImplementedError

    def _forget(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Stop tracking aborted requests; their ids by the live core that holds them."""
        by_engine = self.router.by_engine(request_ids)
        for r in request_ids:
            self.router.finished(r)
        return {e: ids for e, ids in by_engine.items() if e not in self.router.dead}

    def health_error(self) -> EngineDeadError | None:
        """An error naming every dead core, or None while all live."""
        dead = self.router.dead
        if not dead:
            return None
        named = "; ".join(
            f"engine-core {e} ({self.addresses[e]}): {why}" for e, why in dead.items()
        )
        return EngineDeadError(
            f"{len(dead)} of {len(self.clients)} engine-cores dead, "
            f"{len(self.clients) - len(dead)} serving: {named}"
        )

    def balance(self) -> list[dict[str, Any]]:
        """Per core: requests routed to it, output tokens it produced, and whether it lives."""
        return [
            {
                "requests": self.router.routed[e],
                "output_tokens": self.output_tokens[e],
                "alive": e not in self.router.dead,
            }
            for e in range(len(self.clients))
        ]

    def shutdown(self) -> None:
        for c in self.clients:  # the engine-cores stop side by side, not one after another
            if c.launch is not None:
                c.launch.request_stop()
        for c in self.clients:
            with contextlib.suppress(Exception):
                c.shutdown()


class DPSyncClient(_DPClient, EngineCoreClient):
    """Blocking data-parallel client (`LLM`, `LLMEngine`)."""

    clients: list[SyncMPClient]
    client_class = SyncMPClient

    def __init__(self, clients: list[SyncMPClient], addresses: list[str], block_size: int) -> None:
        super().__init__(clients, addresses, block_size)
        self._deaths: deque[EngineDeadError] = deque()

    def _on_death(self, engine: int, error: BaseException) -> None:
        err = self._died(engine, error)
        if err is not None:
            self._deaths.append(err)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.clients[self._route(requests)].add_requests(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, ids in self._forget(request_ids).items():
            self.clients[engine].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        poller = zmq.Poller()
        while True:
            alive = self.router.alive()
            for e in alive:
                pending = self.clients[e]._pending
                if pending:
                    out = pending.popleft()
                    self._account(e, out)
                    return out
            if self._deaths:  # every later caller learns of a dead engine too
                err = self._deaths[0]
                if isinstance(err, EngineCoreDeadError):
                    self._deaths.popleft()
                raise err
            for e in alive:
                poller.register(self.clients[e].output_sock, zmq.POLLIN)
            ready = dict(poller.poll(_POLL_MS))
            for e in alive:
                client = self.clients[e]
                poller.unregister(client.output_sock)
                try:
                    if client.output_sock in ready:
                        client._recv_one()
                    else:
                        client._check_alive()
                except EngineDeadError as err:
                    self._on_death(e, err)

    def call_utility(self, method: UtilityMethod) -> Any:
        if method == UtilityMethod.HEALTH and (err := self.health_error()) is not None:
            raise err
        results = []
        for e in self.router.alive():
            try:
                results.append(self.clients[e].call_utility(method))
            except EngineDeadError as err:
                self._on_death(e, err)
                if method == UtilityMethod.HEALTH:
                    raise self.health_error() from err
        return _combine(method, results)


class DPAsyncClient(_DPClient):
    """asyncio data-parallel client (`AsyncLLM`): a task per core moves its outputs into
    one queue."""

    clients: list[AsyncMPClient]
    client_class = AsyncMPClient

    def __init__(self, clients: list[AsyncMPClient], addresses: list[str], block_size: int) -> None:
        super().__init__(clients, addresses, block_size)
        self.outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        for task in self._tasks:  # a previous event loop's, if any
            task.cancel()
        self._loop = loop
        self.outputs = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._pump(e), name=f"engine-core-{e}-outputs")
            for e in self.router.alive()
        ]

    async def _pump(self, engine: int) -> None:
        """Move one core's outputs into the shared queue until it dies."""
        assert self.outputs is not None
        client = self.clients[engine]
        try:
            while True:
                out = await client.get_output_async()
                self._account(engine, out)
                self.outputs.put_nowait(out)
        except EngineDeadError as e:
            self._on_death(engine, e)

    def _on_death(self, engine: int, error: BaseException) -> None:
        err = self._died(engine, error)
        if err is not None and self.outputs is not None:
            self.outputs.put_nowait(err)

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        self._ensure_started()
        await self.clients[self._route(requests)].add_requests_async(requests)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for engine, ids in self._forget(request_ids).items():
            await self.clients[engine].abort_requests_async(ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self.outputs is not None
        msg = await self.outputs.get()
        if isinstance(msg, EngineCoreDeadError):
            raise msg  # once: it ends only the requests it names
        if isinstance(msg, BaseException):
            self.outputs.put_nowait(msg)  # every later caller learns it too
            raise msg
        return msg

    async def call_utility_async(self, method: UtilityMethod) -> Any:
        self._ensure_started()
        if method == UtilityMethod.HEALTH and (err := self.health_error()) is not None:
            raise err
        alive = self.router.alive()
        results = await asyncio.gather(
            *(self.clients[e].call_utility_async(method) for e in alive), return_exceptions=True
        )
        ok = []
        for e, result in zip(alive, results, strict=True):
            if isinstance(result, EngineDeadError):
                self._on_death(e, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                ok.append(result)
        if method == UtilityMethod.HEALTH and (err := self.health_error()) is not None:
            raise err
        return _combine(method, ok)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        super().shutdown()


def _combine(method: UtilityMethod, results: list[Any]) -> Any:
    """One answer from every live core's."""
    if method == UtilityMethod.STATS:
        if not results:
            return {}
        merged = merge_scheduler_stats([SchedulerStats(**r) for r in results])
        return msgspec.structs.asdict(merged)
    return all(results)


def make_client(config: EngineConfig, asynchronous: bool) -> Any:
    """Spawn the engine-core(s) of `config`: one, or `data_parallel_size` behind a router."""
    if config.parallel.data_parallel_size > 1:
        return (DPAsyncClient if asynchronous else DPSyncClient).start(config)
    return (AsyncMPClient if asynchronous else SyncMPClient)(config)


def attach_client(
    address: str | list[str],
    curve: CurveClientKeys | None,
    asynchronous: bool,
    has_tokenizer: bool = False,
) -> Any:
    """Attach to one daemon, or route over several; unless `has_tokenizer`, the (first)
    daemon sends its tokenizer in the handshake."""
    addresses = [address] if isinstance(address, str) else list(address)
    if len(addresses) == 1:
        single = AsyncMPClient if asynchronous else SyncMPClient
        return single.connect(addresses[0], curve, has_tokenizer)
    return (DPAsyncClient if asynchronous else DPSyncClient).connect(
        addresses, curve, has_tokenizer
    )
