"""The engine-core tells the frontend when each request was queued, scheduled and
preempted (for queue / prefill / decode times); each event is sent once, on the request's
next output."""

from __future__ import annotations

from minivllm.protocol.messages import EngineCoreEventType
from tests.engine_core.scheduler_harness import FakeRunner, make_request, make_scheduler

QUEUED, SCHEDULED, PREEMPTED = (
    EngineCoreEventType.QUEUED,
    EngineCoreEventType.SCHEDULED,
    EngineCoreEventType.PREEMPTED,
)


def test_events_ride_on_the_next_output_once() -> None:
    sched, runner = make_scheduler(budget=32), FakeRunner()
    sched.add_request(make_request("old", list(range(100, 116)), max_tokens=10))
    sched.add_request(make_request("new", list(range(200, 216)), max_tokens=10))
    events: dict[str, list] = {"old": [], "new": []}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for outs in sched.update_from_output(out, runner.execute(out)).values():
            for o in outs:
                events[o.request_id] += o.events or []
    assert sched.make_stats().num_preemptions == 1
    assert [e.type for e in events["old"]] == [QUEUED, SCHEDULED]
    assert [e.type for e in events["new"]] == [QUEUED, SCHEDULED, PREEMPTED, SCHEDULED]
    for evs in events.values():
        stamps = [e.timestamp for e in evs]
        assert stamps == sorted(stamps) and stamps[0] > 1e9  # wall clock, in order
