"""Which data-parallel engine-core takes a request: the least loaded, or the one that has
recently seen the request's first blocks (its prefix cache likely still holds them),
unless that one is overloaded.

Load is learned without polling: every output batch carries the core's `SchedulerStats`
(running + waiting requests at that step, every client's), and the router adds what it
sent since. What this frontend itself has in flight on a core is a floor under that guess:
a burst of requests sent before any stats come back still spreads evenly.
"""

from __future__ import annotations

from collections import OrderedDict

from minivllm.protocol.messages import SchedulerStats

AFFINITY_BLOCKS = 4  # prefixes of up to this many full blocks are remembered
AFFINITY_ENTRIES = 8192  # most recent prefixes kept (each maps to one core)
# an affine core is overloaded when its load exceeds the lightest one's by more than
# max(AFFINITY_SLACK, AFFINITY_RATIO x the lightest load)
AFFINITY_SLACK = 8
AFFINITY_RATIO = 0.25


class DPRouter:
    """Routing state over `num_engines` cores. Not thread-safe: the client that owns it
    calls it from one thread (the sync client) or one event loop (the async client)."""

    def __init__(self, num_engines: int, block_size: int) -> None:
        self.num_engines = num_engines
        self.block_size = block_size
        self.dead: dict[int, str] = {}  # engine index -> why it died
        self.reported = [0] * num_engines  # running + waiting at the latest stats
        self.sent_since_stats = [0] * num_engines
        self.owner: dict[str, int] = {}  # internal request id -> engine index, until it ends
        self.in_flight = [0] * num_engines  # this frontend's unfinished requests per core
        self.routed = [0] * num_engines  # requests ever routed (a benchmark's balance)
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # prefix hash -> engine index

    # ------------------------------------------------------------------ choosing

    def load(self, engine: int) -> int:
        return max(self.reported[engine] + self.sent_since_stats[engine], self.in_flight[engine])

    def alive(self) -> list[int]:
        return [e for e in range(self.num_engines) if e not in self.dead]

    def choose(self, prompt_token_ids: list[int]) -> int:
        """The core for a request with this prompt (raises LookupError if none is alive)."""
        alive = self.alive()
        if not alive:
            raise LookupError("no engine-core is alive")
        lightest = min(alive, key=lambda e: (self.load(e), self.in_flight[e], e))
        hashes = self._prefix_hashes(prompt_token_ids)
        for h in reversed(hashes):  # the longest remembered prefix first
            engine = self._prefixes.get(h)
            if engine is None or engine in self.dead:
                continue
            floor = self.load(lightest)
            if self.load(engine) <= floor + max(AFFINITY_SLACK, AFFINITY_RATIO * floor):
                return engine
            break
        return lightest

    def _prefix_hashes(self, token_ids: list[int]) -> list[int]:
        """Hashes of the prompt's first 1..AFFINITY_BLOCKS full blocks."""
        bs = self.block_size
        n = min(len(token_ids) // bs, AFFINITY_BLOCKS)
        return [hash(tuple(token_ids[: (i + 1) * bs])) for i in range(n)]

    # ------------------------------------------------------------------ bookkeeping

    def assign(self, request_ids: list[str], prompt_token_ids: list[int], engine: int) -> None:
        """Record that these requests (one user request: n > 1 children together) went to
        `engine`, and that it now holds their prompt's prefix."""
        for r in request_ids:
            self.owner[r] = engine
        k = len(request_ids)
        self.in_flight[engine] += k
        self.sent_since_stats[engine] += k
        self.routed[engine] += k
        for h in self._prefix_hashes(prompt_token_ids):
            self._prefixes[h] = engine
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > AFFINITY_ENTRIES:
            self._prefixes.popitem(last=False)

    def finished(self, request_id: str) -> int | None:
        """Forget a request that ended (finished, failed or aborted); its core, if known."""
        engine = self.owner.pop(request_id, None)
        if engine is not None:
            self.in_flight[engine] -= 1
        return engine

    def update_stats(self, engine: int, stats: SchedulerStats) -> None:
        self.reported[engine] = stats.num_running + stats.num_waiting
        self.sent_since_stats[engine] = 0

    def by_engine(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The ids grouped by the core that owns them (unknown ids are left out)."""
        groups: dict[int, list[str]] = {}
        for r in request_ids:
            engine = self.owner.get(r)
            if engine is not None:
                groups.setdefault(engine, []).append(r)
        return groups

    def mark_dead(self, engine: int, reason: str) -> list[str]:
        """Stop routing to `engine`; returns (and forgets) the requests it held."""
        self.dead[engine] = reason
        lost = [r for r, e in self.owner.items() if e == engine]
        for r in lost:
            self.finished(r)
        for h in [h for h, e in self._prefixes.items() if e == engine]:
            del self._prefixes[h]
        return lost

    def revive(self, engine: int) -> None:
        """Route to `engine` again (restarted): it holds nothing yet."""
        self.dead.pop(engine, None)
        self.reported[engine] = self.sent_since_stats[engine] = self.in_flight[engine] = 0
