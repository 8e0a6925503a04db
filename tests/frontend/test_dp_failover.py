"""Failover bookkeeping without engines: which requests move when an engine-core dies and
with which tokens, which fail and why, the restart back-off, and the settings refused."""

from __future__ import annotations

import argparse

import pytest

from minivllm import EngineArgs, SamplingParams
from minivllm.frontend import cli
from minivllm.frontend.clients.dp_failover import Failover
from minivllm.frontend.clients.dp_restart import MAX_BACKOFF_S, STABLE_S, EngineCoreRestarts
from minivllm.frontend.server.serve import add_serve_parser, build_state
from minivllm.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from tests.tiny_models import build_null_checkpoint


def _request(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=10, seed=4))


def _output(rid: str, tokens: list[int], finished: bool = False) -> EngineCoreOutput:
    reason = FinishReason.LENGTH if finished else None
    return EngineCoreOutput(rid, tokens, finish_reason=reason, num_cached_tokens=16)


def test_a_dead_cores_requests_move_with_the_tokens_streamed_so_far() -> None:
    failover = Failover(limit=2, num_engines=3)
    failover.track([_request("a"), _request("b"), _request("done")])
    failover.record([_output("a", [7, 8])])
    failover.record([_output("a", [9])])
    failover.record([_output("done", [5], finished=True)])
    moves, failed, _ = failover.take_lost(1, ["a", "b"])
    assert [(m.request_id, m.output_token_ids) for m in moves] == [("a", [7, 8, 9]), ("b", [])]
    assert moves[0].sampling_params == _request("a").sampling_params
    assert failed == []
    # what the second core says of a moved request: its tokens, not its own prompt's cache
    later = _output("a", [10])
    failover.record([later])
    assert later.num_cached_tokens == 0
    moves, failed, why = failover.take_lost(2, ["a", "b"])
    assert failed == ["a", "b"] and moves == []
    assert "engine-cores 1 and 2 died holding it (data_parallel_failover_limit=2" in why
    assert (failover.stats.deaths, failover.stats.moved) == ([0, 1, 1], [0, 2, 0])
    assert failover.stats.failed == [0, 0, 2]


def test_an_aborted_request_does_not_move() -> None:
    failover = Failover(limit=3, num_engines=2)
    failover.track([_request("a"), _request("b")])
    failover.forget(["a"])
    moves, failed, _ = failover.take_lost(0, ["b"])
    assert [m.request_id for m in moves] == ["b"] and failed == []


def test_failover_off_fails_with_the_first_death() -> None:
    failover = Failover(limit=1, num_engines=2)
    failover.track([_request("a")])
    moves, failed, why = failover.take_lost(0, ["a"])
    assert (moves, failed) == ([], ["a"])
    assert why == "failover is off (data_parallel_failover_limit=1)"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("data_parallel_failover_limit", 0, "data_parallel_failover_limit must be a positive"),
        ("data_parallel_restart_backoff_s", -1.0, "data_parallel_restart_backoff_s must be a"),
        ("data_parallel_restart", True, "data_parallel_restart restarts a dead engine-core of"),
    ],
)
def test_bad_failover_settings_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="m", **{field: value})


def test_restart_back_off_doubles_and_starts_afresh_after_a_stable_run(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("minivllm.frontend.clients.dp_restart.time.monotonic", lambda: now[0])
    restarts = EngineCoreRestarts([None, None], backoff_s=5.0)
    delays = []
    for _ in range(8):
        delays.append(restarts.died(1))
        restarts.attached(1)  # back up, and dies again at once
    assert delays == [0.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, MAX_BACKOFF_S]
    now[0] += STABLE_S
    assert restarts.died(1) == 0.0, "a core that served long enough restarts at once"
    assert restarts.due == {1: now[0]} and restarts.pending
    restarts.cancel()
    assert not restarts.pending


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="minivllm")
    sub = parser.add_subparsers(dest="command", required=True)
    cli._add_engine_core(sub)
    add_serve_parser(sub)
    return parser.parse_args(list(argv))


def test_restart_is_refused_where_no_engine_core_is_started(tmp_path) -> None:
    args = _parse("serve", "--connect", "ipc:///a,ipc:///b", "--data-parallel-restart")
    with pytest.raises(SystemExit, match="with --connect, restart the daemons where they run"):
        build_state(args)
    args = _parse("serve", "--connect", "ipc:///a,ipc:///b", "--data-parallel-failover-limit=0")
    with pytest.raises(SystemExit, match="data_parallel_failover_limit must be an integer >= 1"):
        build_state(args)
    model = build_null_checkpoint(str(tmp_path / "null"))
    address = f"ipc://{tmp_path}/engine"
    args = _parse("engine-core", "--model", model, "--address", address, "--data-parallel-restart")
    with pytest.raises(SystemExit, match="a daemon is restarted by whatever runs it"):
        cli._run_engine_core(args)
