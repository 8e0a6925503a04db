"""Several engine-cores behind one frontend (data parallelism), blocking or asyncio: each
request routed to one of them, every core's outputs merged into one stream, a dead core's
requests moved to the others (`dp_group.py` says how). `make_client` and `attach_client`
pick the client for a config or for the daemons at some addresses.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import zmq

from minivllm.config import EngineConfig
from minivllm.exceptions import EngineCoreDeadError, EngineDeadError
from minivllm.frontend.clients.core_client import EngineCoreClient
from minivllm.frontend.clients.dp_attach import combine
from minivllm.frontend.clients.dp_group import DEFAULT_FAILOVER_LIMIT, EngineCoreGroup
from minivllm.frontend.clients.mp_client import _POLL_MS, AsyncMPClient, SyncMPClient
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.messages import EngineCoreOutputs, EngineCoreRequest, UtilityMethod

RESTART_POLL_S = 0.2


class DPSyncClient(EngineCoreGroup, EngineCoreClient):
    """Blocking data-parallel client (`LLM`, `LLMEngine`). Deaths are noticed, requests
    moved and restarted cores attached while `get_output` waits for outputs."""

    clients: list[SyncMPClient]
    client_class = SyncMPClient

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ready: deque[EngineCoreOutputs] = deque()  # accounted, to hand on first
        self._deaths: deque[EngineDeadError] = deque()

    def _on_death(self, engine: int, error: BaseException) -> None:
        if engine in self.router.dead:
            return  # known: what it sent later is not delivered
        client = self.clients[engine]
        while client._pending:  # received before it died: delivered, then continued from
            out = client._pending.popleft()
            self._account(engine, out)
            self._ready.append(out)
        moves, err = self._died(engine, error)
        if err is not None:
            self._deaths.append(err)
        try:
            for request in moves:
                self._send([request])
        except EngineDeadError:
            pass  # every core is dead: `_deaths` holds the error every caller gets

    def _send(self, requests: list[EngineCoreRequest]) -> None:
        engine = self._route(requests)
        try:
            self.clients[engine].add_requests(requests)
        except EngineDeadError as e:  # it died just now: they move on with its others
            self._on_death(engine, e)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self.failover.track(requests)
        try:
            self._send(requests)
        except BaseException:
            self._forget([r.request_id for r in requests])
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, ids in self._forget(request_ids).items():
            self.clients[engine].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        poller = zmq.Poller()
        while True:
            if self._ready:
                return self._ready.popleft()
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
            if self.restarts is not None and self.restarts.pending:
                self._poll_restarts()
            for e in alive:
                poller.register(self.clients[e].output_sock, zmq.POLLIN)
            ready = dict(poller.poll(_POLL_MS))
            for e in alive:
                client = self.clients[e]
                poller.unregister(client.output_sock)
                if e in self.router.dead:  # found dead while another one's death was handled
                    continue
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
        if not self.router.alive():
            raise self._dead_engine_error()
        if method == UtilityMethod.HEALTH and (err := self.health_error()) is not None:
            raise err
        return combine(method, results)


class DPAsyncClient(EngineCoreGroup):
    """asyncio data-parallel client (`AsyncLLM`): a task per core moves its outputs into
    one queue; continuations are sent by tasks of their own; restarts are polled by one."""

    clients: list[AsyncMPClient]
    client_class = AsyncMPClient

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        for task in self._tasks:  # a previous event loop's, if any
            task.cancel()
        self._tasks = set()
        self._loop = loop
        self.outputs = asyncio.Queue()
        for e in self.router.alive():
            self._spawn(self._pump(e), f"engine-core-{e}-outputs")
        if self.restarts is not None:
            self._spawn(self._restart_loop(), "engine-core-restarts")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump(self, engine: int) -> None:
        """Move one core's outputs into the shared queue until it dies."""
        assert self.outputs is not None
        client = self.clients[engine]
        try:
            while True:
                out = await client.get_output_async()
                if not self._is_current(engine, client):
                    return  # its requests have moved on from what was delivered
                self._account(engine, out)
                self.outputs.put_nowait(out)
        except EngineDeadError as e:
            if self.clients[engine] is client:
                self._on_death(engine, e)
        except Exception as e:  # a fault here: every caller learns it, none waits forever
            self.outputs.put_nowait(e)

    def _on_death(self, engine: int, error: BaseException) -> None:
        if engine in self.router.dead:
            return  # known: what it sent later is not delivered
        client = self.clients[engine]
        queue = client.outputs
        while queue is not None and self.outputs is not None and not queue.empty():
            out = queue.get_nowait()  # received before it died: delivered first
            if isinstance(out, BaseException):
                queue.put_nowait(out)
                break
            self._account(engine, out)
            self.outputs.put_nowait(out)
        moves, err = self._died(engine, error)
        if err is not None and self.outputs is not None:
            self.outputs.put_nowait(err)
        if moves:
            self._spawn(self._send_moves(moves), f"engine-core-{engine}-failover")

    async def _send_moves(self, moves: list[EngineCoreRequest]) -> None:
        for request in moves:
            if request.request_id not in self.failover.requests:
                continue  # aborted since
            try:
                await self._send([request])
            except EngineDeadError as e:  # every core is dead
                if self.outputs is not None:
                    self.outputs.put_nowait(e)
                return

    async def _send(self, requests: list[EngineCoreRequest]) -> None:
        engine = self._route(requests)
        try:
            await self.clients[engine].add_requests_async(requests)
        except EngineDeadError as e:  # it died just now: they move on with its others
            self._on_death(engine, e)

    async def _restart_loop(self) -> None:
        while True:
            await asyncio.sleep(RESTART_POLL_S)
            if self.restarts.pending:
                self._poll_restarts()

    def _revived(self, engine: int) -> None:
        self._spawn(self._pump(engine), f"engine-core-{engine}-outputs")

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        self._ensure_started()
        self.failover.track(requests)
        try:
            await self._send(requests)
        except BaseException:
            self._forget([r.request_id for r in requests])
            raise

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
        if not self.router.alive():
            raise self._dead_engine_error()
        if method == UtilityMethod.HEALTH and (err := self.health_error()) is not None:
            raise err
        return combine(method, ok)

    def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        super().shutdown()


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
    failover_limit: int = DEFAULT_FAILOVER_LIMIT,
) -> Any:
    """Attach to one daemon, or route over several (a request moving to another when its
    daemon dies, `failover_limit` as `data_parallel_failover_limit`); unless
    `has_tokenizer`, the (first) daemon sends its tokenizer in the handshake."""
    addresses = [address] if isinstance(address, str) else list(address)
    if len(addresses) == 1:
        single = AsyncMPClient if asynchronous else SyncMPClient
        return single.connect(addresses[0], curve, has_tokenizer)
    return (DPAsyncClient if asynchronous else DPSyncClient).connect(
        addresses, curve, has_tokenizer, failover_limit
    )
