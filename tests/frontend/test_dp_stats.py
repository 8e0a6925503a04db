"""Several engine-cores' scheduler stats read as one engine's: counts and counters add up,
speculative decoding's per-position counters position by position, KV usage is the mean;
the merge goes on with the outputs at most once an interval, and whenever a core is idle."""

from __future__ import annotations

import pytest

from minivllm.frontend.clients import dp_group
from minivllm.frontend.clients.dp_attach import merge_scheduler_stats
from minivllm.frontend.clients.dp_failover import Failover
from minivllm.frontend.clients.dp_group import EngineCoreGroup
from minivllm.protocol.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


def test_stats_of_several_cores_merge_as_one_engine() -> None:
    a = SchedulerStats(num_running=2, kv_cache_usage=0.5, spec_num_accepted_tokens=3,
                       spec_num_accepted_tokens_per_pos=[2, 1])  # fmt: skip
    b = SchedulerStats(num_running=5, kv_cache_usage=0.25, spec_num_accepted_tokens=4,
                       spec_num_accepted_tokens_per_pos=[3, 1, 0])  # fmt: skip
    merged = merge_scheduler_stats([a, b])
    assert merged.num_running == 7
    assert merged.kv_cache_usage == 0.375
    assert merged.spec_num_accepted_tokens == 7
    assert merged.spec_num_accepted_tokens_per_pos == [5, 2, 0]


def _batch(running: int, generated: int) -> EngineCoreOutputs:
    stats = SchedulerStats(num_running=running, num_generated_tokens=generated)
    return EngineCoreOutputs(outputs=[EngineCoreOutput("r", [1])], scheduler_stats=stats)


def test_merged_stats_go_on_at_most_each_interval_and_whenever_a_core_is_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dp_group, "STATS_MERGE_INTERVAL_S", 3600.0)
    group = EngineCoreGroup([None, None], ["a", "b"], 16, Failover(2, 2))
    first, second, third = _batch(4, 10), _batch(3, 7), _batch(4, 12)
    for engine, batch in ((0, first), (1, second), (0, third)):
        group._account(engine, batch)
    assert first.scheduler_stats is not None and first.scheduler_stats.num_generated_tokens == 10
    assert second.scheduler_stats is None and third.scheduler_stats is None  # not due yet
    assert group.router.reported == [4, 3]  # routing hears every batch's load
    idle = _batch(0, 9)
    group._account(1, idle)
    # the idle core's report goes on at once, merged with the other's latest: the engine's
    # totals, nothing skipped lost
    assert idle.scheduler_stats is not None
    assert (idle.scheduler_stats.num_running, idle.scheduler_stats.num_generated_tokens) == (4, 21)
