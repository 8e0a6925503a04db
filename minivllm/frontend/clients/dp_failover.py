"""Failover across data-parallel engine-cores: what the frontend keeps of each request so
that, when the engine-core holding it dies, it can go on on another one.

Everything a request needs is already in the frontend: the `EngineCoreRequest` it sent and
every token the dead core streamed back. The continuation is that request with those
tokens as `output_token_ids`; the engine-core takes them as outputs (as after a
preemption), so penalties, min_tokens, max_tokens, stop tokens and the grammar count them,
and the next token is sampled at its position with the request's seed. Greedy and seeded
requests therefore continue token for token, and so do unseeded ones where both cores have
the same `seed` setting (the engine derives the request's seed from it and the request id,
which the continuation keeps); between daemons of different seeds they continue validly.

A request fails instead once `limit` engine-cores have died while holding it: a request
that kills its engine-core would otherwise kill them all, one after another.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec

from minivllm.protocol.messages import EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger(__name__)


@dataclass
class FailoverStats:
    """Counters of one data-parallel client, by engine-core index (the metrics' source)."""

    num_engines: int
    deaths: list[int] = field(init=False)  # times each engine-core died
    moved: list[int] = field(init=False)  # requests moved off it to another
    failed: list[int] = field(init=False)  # requests that failed with it
    restarts: list[int] = field(init=False)  # times it was restarted and routed to again

    def __post_init__(self) -> None:
        self.deaths = [0] * self.num_engines
        self.moved = [0] * self.num_engines
        self.failed = [0] * self.num_engines
        self.restarts = [0] * self.num_engines


@dataclass(slots=True)
class _Tracked:
    request: EngineCoreRequest  # as first sent
    output_token_ids: list[int] = field(default_factory=list)  # every token streamed back
    died_on: list[int] = field(default_factory=list)  # engine-cores that died holding it


class Failover:
    """The unfinished requests of a data-parallel client, their output so far, and the
    engine-cores that died under them. Not thread-safe: its client calls it from one thread
    or one event loop."""

    def __init__(self, limit: int, num_engines: int) -> None:
        """`limit`: a request fails when this many engine-cores have died holding it (1: it
        fails with the first, as without failover)."""
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"data_parallel_failover_limit must be an integer >= 1, got {limit!r}")
        self.limit = limit
        self.stats = FailoverStats(num_engines)
        self.requests: dict[str, _Tracked] = {}  # by engine-internal id
        self.moved: set[str] = set()  # continuations that carried an output

    @property
    def enabled(self) -> bool:
        return self.limit > 1

    def track(self, requests: list[EngineCoreRequest]) -> None:
        """Requests just sent (a user request's n children)."""
        if self.enabled:
            for r in requests:
                self.requests[r.request_id] = _Tracked(r)

    def record(self, outputs: list[EngineCoreOutput]) -> None:
        """One batch of outputs on its way to the output processor: their tokens are their
        requests' from now on. A moved request's outputs leave out what only its first
        engine-core could say (its prompt's cache hits, its queueing events)."""
        requests, moved = self.requests, self.moved
        if not requests:  # failover is off, or nothing is unfinished
            return
        for out in outputs:
            tracked = requests.get(out.request_id)
            if tracked is None:
                continue
            tracked.output_token_ids += out.new_token_ids
            if moved and out.request_id in moved:
                out.num_cached_tokens = 0  # the output processor keeps the first core's count
                out.events = None
            if out.finish_reason is not None:
                del requests[out.request_id]
                moved.discard(out.request_id)

    def forget(self, request_ids: list[str]) -> None:
        """Requests that ended (finished, aborted or failed)."""
        for r in request_ids:
            if self.requests.pop(r, None) is not None:
                self.moved.discard(r)

    def take_lost(
        self, engine: int, request_ids: list[str]
    ) -> tuple[list[EngineCoreRequest], list[str], str]:
        """The requests engine-core `engine` held when it died: the continuations to send to
        another engine-core, the ids of those that fail here, and why they fail."""
        stats = self.stats
        stats.deaths[engine] += 1
        moves, failed, why = [], [], ""
        for r in request_ids:
            tracked = self.requests.pop(r, None)
            if tracked is None:  # failover is off
                failed.append(r)
                why = "failover is off (data_parallel_failover_limit=1)"
                continue
            tracked.died_on.append(engine)
            if len(tracked.died_on) >= self.limit:
                self.moved.discard(r)
                failed.append(r)
                why = (
                    f"engine-cores {_names(tracked.died_on)} died holding it "
                    f"(data_parallel_failover_limit={self.limit}: a request fails once that "
                    "many engine-cores have died holding it, as it may be what kills them)"
                )
                continue
            self.requests[r] = tracked
            outputs = tracked.output_token_ids
            if outputs:
                self.moved.add(r)
            moves.append(msgspec.structs.replace(tracked.request, output_token_ids=list(outputs)))
        stats.moved[engine] += len(moves)
        stats.failed[engine] += len(failed)
        return moves, failed, why


def _names(engines: list[int]) -> str:
    """'0 and 1', '0, 1 and 2'."""
    names = [str(e) for e in engines]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
