"""Routing over data-parallel engine-cores: least loaded, prefix affinity unless overloaded,
no routing to the dead; and the GPU slices each core gets."""

from __future__ import annotations

import pytest

from minivllm.frontend.clients.dp_placement import gpu_slices
from minivllm.frontend.clients.dp_router import AFFINITY_SLACK, DPRouter
from minivllm.protocol.messages import SchedulerStats


def _send(router: DPRouter, rid: str, prompt: list[int]) -> int:
    engine = router.choose(prompt)
    router.assign([rid], prompt, engine)
    return engine


def test_a_burst_spreads_evenly_before_any_stats() -> None:
    router = DPRouter(3, block_size=4)
    engines = [_send(router, f"r{i}", [i, i, i]) for i in range(9)]
    assert sorted(engines) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_stats_carry_the_load_of_other_clients() -> None:
    router = DPRouter(2, block_size=4)
    router.update_stats(0, SchedulerStats(num_running=20, num_waiting=5))
    assert [_send(router, f"r{i}", [1]) for i in range(3)] == [1, 1, 1]
    router.update_stats(0, SchedulerStats(num_running=0))
    assert _send(router, "r3", [1]) == 0


def test_prefix_affinity_until_overloaded() -> None:
    router = DPRouter(2, block_size=4)
    shared = list(range(100, 112))  # three full blocks
    assert _send(router, "a", shared + [1]) == 0
    # a request sharing the first blocks follows, though core 1 is idle
    assert _send(router, "b", shared + [2]) == 0
    assert _send(router, "c", [7, 7, 7, 7, 9]) == 1
    # pile load on core 0: past the slack, the same prefix goes to the lighter core
    for i in range(AFFINITY_SLACK + 1):
        router.assign([f"x{i}"], [], 0)
    assert _send(router, "d", shared + [3]) == 1
    # and core 1 now holds it: the next one follows there
    assert _send(router, "e", shared + [4]) == 1


def test_finished_aborted_and_dead() -> None:
    router = DPRouter(2, block_size=4)
    for i in range(4):
        _send(router, f"r{i}", [i])
    assert router.in_flight == [2, 2]
    assert router.finished("r0") == 0 and router.finished("r0") is None
    assert router.by_engine(["r1", "r2", "r3", "gone"]) == {1: ["r1", "r3"], 0: ["r2"]}
    assert router.mark_dead(1, "killed") == ["r1", "r3"]
    assert [_send(router, f"n{i}", [i]) for i in range(3)] == [0, 0, 0]
    router.mark_dead(0, "killed")
    with pytest.raises(LookupError):
        router.choose([1])


def test_gpu_slices() -> None:
    gpus = ["4", "5", "6", "7"]
    assert gpu_slices(2, 2, gpus) == ["4,5", "6,7"]
    assert gpu_slices(4, 1, gpus) == ["4", "5", "6", "7"]
    assert gpu_slices(2, 1, ["0"]) == ["0", "0"]  # two engine-cores share one GPU
    assert gpu_slices(3, 2, gpus) == ["4,5", "6,7", "4,5"]


def test_data_parallel_size_is_checked() -> None:
    from minivllm import EngineArgs

    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineArgs(model="m", data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size > 1 .* not 'uni'"):
        EngineArgs(model="m", data_parallel_size=2, distributed_executor_backend="uni")
