"""Restarting dead data-parallel engine-cores (`data_parallel_restart`): the same config,
so the same GPUs, started again; its client replaces the dead one's once it is ready.

The first restart of a core starts at once; if the core dies again before it has served
`STABLE_S`, each further restart waits `backoff_s`, doubling each time (at most
`MAX_BACKOFF_S`), so a core that cannot live does not spin. Restarts are polled (`poll`)
by the client that owns them: the async client every 0.2 s, the sync client while it waits
for outputs.
"""

from __future__ import annotations

import logging
import time

from minivllm.config import EngineConfig
from minivllm.frontend.clients.core_launch import EngineCoreLaunch
from minivllm.process_utils import describe_exit

logger = logging.getLogger(__name__)

STABLE_S = 300.0  # a core that served this long starts its back-off afresh when it dies
MAX_BACKOFF_S = 300.0


class EngineCoreRestarts:
    """Which dead engine-cores restart when, and the launches under way."""

    def __init__(self, configs: list[EngineConfig], backoff_s: float) -> None:
        self.configs = configs
        self.backoff_s = backoff_s
        self.due: dict[int, float] = {}  # engine index -> when to start it (monotonic)
        self.starting: dict[int, EngineCoreLaunch] = {}
        self.failures = [0] * len(configs)  # deaths in a row, each before it was stable
        self.started_at: list[float | None] = [None] * len(configs)  # when it last came up

    def died(self, engine: int) -> float:
        """Schedule the restart of `engine`, which just died (or failed to start); returns
        the delay."""
        now = time.monotonic()
        up = self.started_at[engine]
        if up is not None and now - up >= STABLE_S:
            self.failures[engine] = 0
        self.started_at[engine] = None
        n = self.failures[engine]
        delay = 0.0 if n == 0 else min(self.backoff_s * 2 ** (n - 1), MAX_BACKOFF_S)
        self.failures[engine] = n + 1
        self.due[engine] = now + delay
        logger.info("engine-core %d restarts in %.1f s", engine, delay)
        return delay

    def poll(self) -> list[tuple[int, EngineCoreLaunch]]:
        """Start the restarts that are due; return the launches that are ready to attach
        (their owner attaches a client, then calls `attached` or `died`)."""
        now = time.monotonic()
        for engine, when in list(self.due.items()):
            if now >= when:
                del self.due[engine]
                logger.info("engine-core %d: restarting", engine)
                self.starting[engine] = EngineCoreLaunch.start(self.configs[engine])
        ready = []
        for engine, launch in list(self.starting.items()):
            if launch.ready.poll(0):
                del self.starting[engine]
                ready.append((engine, launch))
            elif not launch.proc.is_alive():
                del self.starting[engine]
                logger.warning(
                    "engine-core %d failed to restart: %s", engine, describe_exit(launch.proc)
                )
                launch.cancel()
                self.died(engine)
        return ready

    def attached(self, engine: int) -> None:
        """`engine` is back in routing."""
        self.started_at[engine] = time.monotonic()

    @property
    def pending(self) -> bool:
        return bool(self.due or self.starting)

    def cancel(self) -> None:
        """Stop every restart under way (the client shuts down, or the whole engine died)."""
        self.due.clear()
        for launch in self.starting.values():
            launch.cancel()
        self.starting.clear()
