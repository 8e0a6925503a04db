"""Attaching to several engine-cores at once, and answering for them as one engine: their
scheduler stats merged, one reply to a utility call from each core's."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from minivllm.exceptions import EngineStartupError
from minivllm.frontend.clients.core_launch import EngineCoreLaunch
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.messages import EngineCoreInfo, SchedulerStats, UtilityMethod


def attach_all(
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
    merged: dict[str, Any] = {}
    for k in SchedulerStats.__struct_fields__:
        values = [getattr(s, k) for s in stats]
        if isinstance(values[0], list):  # counters per draft position: added position-wise
            merged[k] = [sum(col) for col in itertools.zip_longest(*values, fillvalue=0)]
        else:
            merged[k] = sum(values)
    merged["kv_cache_usage"] /= len(stats)
    return SchedulerStats(**merged)


def combine(method: UtilityMethod, results: list[Any]) -> Any:
    """One answer from every live core's."""
    if method == UtilityMethod.STATS:
        if not results:
            return {}
        merged = merge_scheduler_stats([SchedulerStats(**r) for r in results])
        return msgspec.structs.asdict(merged)
    return all(results)
