"""Several engine-cores' scheduler stats read as one engine's: counts and counters add up,
speculative decoding's per-position counters position by position, KV usage is the mean."""

from __future__ import annotations

from minivllm.frontend.clients.dp_attach import merge_scheduler_stats
from minivllm.protocol.messages import SchedulerStats


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
