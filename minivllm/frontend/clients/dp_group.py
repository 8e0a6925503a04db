"""The engine-cores of a data-parallel client, and what its sync and async forms share:
one client per core, each request routed by `DPRouter`, every core's outputs accounted.

A core that dies loses no request (`dp_failover.py`): each of its unfinished requests goes
on, as a continuation carrying the tokens streamed so far, on a core that lives; the
caller's stream goes on as if nothing happened. A request fails, with
`EngineCoreDeadError` naming it (raised once, from `get_output`), only when
`data_parallel_failover_limit` cores have died holding it; the engine is dead only when
every core is. Outputs a dead core had sent are delivered before its continuations go
out; anything later from it is dropped, so no token is repeated or missing. With
`data_parallel_restart`, a dead core this frontend spawned is started again
(`dp_restart.py`) and routed to once ready. `check_health` raises while any core is dead
(restarting or not), naming it, though the others serve.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Self

from minivllm.config import EngineConfig, ModelConfig
from minivllm.exceptions import EngineCoreDeadError, EngineDeadError, EngineStartupError
from minivllm.frontend.clients.core_launch import EngineCoreLaunch
from minivllm.frontend.clients.dp_attach import attach_all, merge_scheduler_stats
from minivllm.frontend.clients.dp_failover import Failover
from minivllm.frontend.clients.dp_placement import engine_configs
from minivllm.frontend.clients.dp_restart import EngineCoreRestarts
from minivllm.frontend.clients.dp_router import DPRouter
from minivllm.frontend.clients.mp_client import _MPClient
from minivllm.frontend.tokenizer import Tokenizer
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # prefix affinity's block when attached to daemons of unknown size
DEFAULT_FAILOVER_LIMIT = 2
# counters of SchedulerStats that only grow: a dead core's last values stay in the sums
_CUMULATIVE = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
_CUMULATIVE += ("step_counter", "num_generated_tokens")
# the merged scheduler stats go on with a core's output at most this often (and whenever a
# core reports itself idle); the merge costs more than a small output batch's handling
STATS_MERGE_INTERVAL_S = 0.05


class EngineCoreGroup:
    """What the sync and async data-parallel clients share: routing, the bookkeeping of
    outputs, deaths, failover and restarts. `start` spawns the engine-cores of a config,
    `connect` attaches to running daemons."""

    clients: list[_MPClient]
    client_class: type[_MPClient]

    def __init__(
        self,
        clients: list[_MPClient],
        addresses: list[str],
        block_size: int,
        failover: Failover,
        restarts: EngineCoreRestarts | None = None,
    ) -> None:
        self.clients = clients
        self.addresses = addresses
        self.router = DPRouter(len(clients), block_size)
        self.failover = failover
        self.restarts = restarts
        self.output_tokens = [0] * len(clients)
        self.latest_stats: list[SchedulerStats | None] = [None] * len(clients)
        self.retired = SchedulerStats()  # the cumulative counters of cores that died
        self._next_merge = 0.0  # time.monotonic() from which the next batch carries a merge

    @classmethod
    def start(cls, config: EngineConfig) -> Self:
        parallel = config.parallel
        failover = Failover(parallel.data_parallel_failover_limit, parallel.data_parallel_size)
        configs = engine_configs(config)
        restarts = None
        if parallel.data_parallel_restart:
            restarts = EngineCoreRestarts(configs, parallel.data_parallel_restart_backoff_s)
        launches = [EngineCoreLaunch.start(c) for c in configs]
        clients, addresses = attach_all(cls.client_class, launches)
        return cls(clients, addresses, config.cache.block_size, failover, restarts)

    @classmethod
    def connect(
        cls,
        addresses: list[str],
        curve: CurveClientKeys | None = None,
        has_tokenizer: bool = False,
        failover_limit: int = DEFAULT_FAILOVER_LIMIT,
    ) -> Self:
        failover = Failover(failover_limit, len(addresses))  # checks the limit first
        clients, bound = attach_all(cls.client_class, list(addresses), curve, has_tokenizer)
        return cls(clients, bound, DEFAULT_BLOCK_SIZE, failover)

    def attached_model(self, tokenizer: str | None = None) -> tuple[ModelConfig, Tokenizer | None]:
        """The daemons' model config and tokenizer (they serve the same model)."""
        return self.clients[0].attached_model(tokenizer)

    # ------------------------------------------------------------------ outputs

    def _account(self, engine: int, out: EngineCoreOutputs) -> None:
        """Learn from one output batch of `engine` before it is handed on: its tokens (for
        failover) and its load (for routing). Its scheduler stats are replaced by the whole
        engine's (every live core's latest, merged, plus the counters of the dead), so that
        metrics read one engine however many cores serve; between merges (each
        `STATS_MERGE_INTERVAL_S`, and whenever a core reports itself idle) a batch carries
        none: the counters are cumulative and the gauges latest, so nothing is lost."""
        stats = out.scheduler_stats
        if stats is not None:
            self.router.update_stats(engine, stats)
            self.latest_stats[engine] = stats
            now = time.monotonic()
            if now >= self._next_merge or not (stats.num_running or stats.num_waiting):
                self._next_merge = now + STATS_MERGE_INTERVAL_S
                out.scheduler_stats = self._merged_stats()
            else:
                out.scheduler_stats = None
        outputs = out.outputs
        self.failover.record(outputs)
        router, produced = self.router, 0
        for o in outputs:
            produced += len(o.new_token_ids)
            if o.finish_reason is not None:
                router.finished(o.request_id)
        self.output_tokens[engine] += produced

    def _merged_stats(self) -> SchedulerStats:
        """The whole engine's scheduler stats: every live core's latest report merged, plus
        the cumulative counters of the cores that died."""
        live = [s for e, s in enumerate(self.latest_stats) if e not in self.router.dead]
        merged = merge_scheduler_stats([s for s in live if s is not None] + [self.retired])
        merged.kv_cache_usage = sum(s.kv_cache_usage for s in live if s) / max(len(live), 1)
        return merged

    def _is_current(self, engine: int, client: _MPClient) -> bool:
        """Whether outputs read from `client` are still to be delivered: once its core is
        known dead (or replaced) its requests have moved on, with the tokens delivered."""
        return engine not in self.router.dead and self.clients[engine] is client

    # ------------------------------------------------------------------ routing

    def _route(self, requests: list[EngineCoreRequest]) -> int:
        """The core to send `requests` (one user request, or one continuation) to; a core
        found dead on the way is handled as dead, and the next one chosen. Raises
        EngineDeadError once every core is dead."""
        prompt = requests[0].prompt_token_ids
        while True:
            try:
                engine = self.router.choose(prompt)
            except LookupError:
                raise self._dead_engine_error() from None
            try:
                self.clients[engine]._check_alive()
            except EngineDeadError as e:
                self._on_death(engine, e)
                continue
            self.router.assign([r.request_id for r in requests], prompt, engine)
            return engine

    def _forget(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Stop tracking aborted requests; their ids by the live core that holds them."""
        by_engine = self.router.by_engine(request_ids)
        for r in request_ids:
            self.router.finished(r)
        self.failover.forget(request_ids)
        return {e: ids for e, ids in by_engine.items() if e not in self.router.dead}

    # ------------------------------------------------------------------ deaths

    def _on_death(self, engine: int, error: BaseException) -> None:
        """Deliver what `engine` sent before it died, then move or fail its requests."""
        raise NotImplementedError

    def _died(
        self, engine: int, error: BaseException
    ) -> tuple[list[EngineCoreRequest], EngineDeadError | None]:
        """Stop routing to `engine`: the continuations of its requests to send elsewhere,
        and the error of those that fail (None if none does, or the death was known)."""
        router, n = self.router, len(self.clients)
        if engine in router.dead:
            return [], None
        lost = router.mark_dead(engine, str(error))
        stats = self.latest_stats[engine]
        if stats is not None:
            for name in _CUMULATIVE:
                setattr(self.retired, name, getattr(self.retired, name) + getattr(stats, name))
            self.latest_stats[engine] = None
        alive = router.alive()
        if not alive:
            if self.restarts is not None:
                self.restarts.cancel()
            self.failover.take_lost(engine, [])
            self.failover.stats.failed[engine] += len(lost)
            logger.error(
                "engine-core %d of %d died (%s): no engine-core is left, %d requests fail",
                engine, n, error, len(lost),
            )  # fmt: skip
            return [], EngineDeadError(f"every engine-core is dead; the last: {error}")
        moves, failed, why = self.failover.take_lost(engine, lost)
        logger.warning(
            "engine-core %d of %d died (%s): %d requests moved to engine-cores %s, %d failed",
            engine, n, error, len(moves), alive, len(failed),
        )  # fmt: skip
        if self.restarts is not None:
            self.restarts.died(engine)
        if not failed:
            return moves, None
        message = (
            f"engine-core {engine} of {n} died ({len(alive)} still serving): {error}; "
            f"{len(failed)} of its requests fail: {why}"
        )
        return moves, EngineCoreDeadError(message, engine, failed)

    def health_error(self) -> EngineDeadError | None:
        """An error naming every dead core (restarting or not), or None while all live."""
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

    def _dead_engine_error(self) -> EngineDeadError:
        named = "; ".join(
            f"engine-core {e} ({self.addresses[e]}): {why}" for e, why in self.router.dead.items()
        )
        return EngineDeadError(f"the engine is dead: every engine-core died: {named}")

    # ------------------------------------------------------------------ restarts

    def _poll_restarts(self) -> None:
        """Attach to the restarted cores that are ready and route to them again."""
        for engine, launch in self.restarts.poll():
            try:
                client = self.client_class(address=launch, has_tokenizer=True)
            except EngineStartupError as e:
                logger.warning("engine-core %d failed to restart: %s", engine, e)
                self.restarts.died(engine)
                continue
            old, self.clients[engine] = self.clients[engine], client
            old.shutdown()
            self.addresses[engine] = client.info.input_address
            self.router.revive(engine)
            self.restarts.attached(engine)
            self.failover.stats.restarts[engine] += 1
            logger.info(
                "engine-core %d restarted (pid %d) and routed to again", engine, launch.proc.pid
            )
            self._revived(engine)

    def _revived(self, engine: int) -> None:
        """A restarted core's client is in place (the async client reads it from here on)."""

    # ------------------------------------------------------------------ reports

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
        if self.restarts is not None:
            self.restarts.cancel()
        for c in self.clients:  # the engine-cores stop side by side, not one after another
            if c.launch is not None:
                c.launch.request_stop()
        for c in self.clients:
            try:
                c.shutdown()
            except Exception:  # noqa: BLE001 - the others must stop too
                logger.debug("stopping an engine-core client failed", exc_info=True)
