from collections.abc import Callable

import pytest

from minivllm.engine_core.request import Request, RequestStatus
from minivllm.engine_core.scheduler import Scheduler
from minivllm.protocol.messages import EngineCoreRequest, FinishReason
from minivllm.protocol.sampling_params import SamplingParams
from tests.engine_core.scheduler_harness import (
    EOS,
    FakeRunner,
    Results,
    make_request,
    make_scheduler,
    run_async,
    run_sync,
    step,
)


def test_a_request_runs_to_max_tokens_and_returns_its_blocks():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", [1, 3, 4, 5, 6], max_tokens=3))
    results = run_sync(sched, runner)
    assert results.tokens["a"] == [7, 7, 7]
    assert results.final["a"] == (FinishReason.LENGTH, None, 0)
    assert sched.kv_cache_manager.num_free_blocks == 10
    stats = sched.make_stats()
    assert stats.step_counter == 3 and stats.num_generated_tokens == 3
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_long_prompt_is_chunked_within_the_token_budget():
    sched, runner = make_scheduler(budget=8), FakeRunner()
    sched.add_request(make_request("a", list(range(10, 30)), max_tokens=2))
    results = Results()
    assert step(sched, runner, results).num_scheduled_tokens == {"a": 8}
    assert step(sched, runner, results).num_scheduled_tokens == {"a": 8}
    assert results.tokens == {}  # partial prefill chunks emit nothing
    third = step(sched, runner, results)
    assert third.num_scheduled_tokens == {"a": 4}
    assert third.scheduled_cached_reqs.num_computed_tokens == [16]
    assert results.tokens == {"a": [7]}


def test_running_requests_are_served_before_waiting_ones():
    sched, runner = make_scheduler(budget=8), FakeRunner()
    sched.add_request(make_request("a", [1, 3, 4], max_tokens=5))
    results = Results()
    step(sched, runner, results)
    sched.add_request(make_request("b", list(range(10, 30))))
    out = step(sched, runner, results)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_cached_reqs.req_ids == ["a"]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched, runner = make_scheduler(budget=8, chunked=False), FakeRunner()
    sched.add_request(make_request("a", [1] * 6))
    sched.add_request(make_request("b", [3] * 6))
    results = Results()
    assert step(sched, runner, results).num_scheduled_tokens == {"a": 6}
    assert step(sched, runner, results).num_scheduled_tokens == {"a": 1, "b": 6}


def test_max_num_seqs_is_respected():
    sched, runner = make_scheduler(max_num_seqs=2), FakeRunner()
    for rid in "abc":
        sched.add_request(make_request(rid, [ord(rid)] * 3, max_tokens=2))
    results = Results()
    assert set(step(sched, runner, results).num_scheduled_tokens) == {"a", "b"}
    assert sched.make_stats().num_waiting == 1
    run_sync(sched, runner)
    assert sched.kv_cache_manager.num_free_blocks == 10


def test_newest_request_is_preempted_when_blocks_run_out_and_finishes_later():
    sched, runner = make_scheduler(budget=32), FakeRunner()
    sched.add_request(make_request("old", list(range(100, 116)), max_tokens=10))
    sched.add_request(make_request("new", list(range(200, 216)), max_tokens=10))
    results, outs = Results(), []
    while sched.make_stats().num_preemptions == 0:
        outs.append(step(sched, runner, results))
    preempting = outs[-1]
    assert preempting.preempted_req_ids == ["new"] and preempting.finished_req_ids == []
    assert list(preempting.num_scheduled_tokens) == ["old"]
    new = sched.requests.get("new")
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert sched.waiting[0] is new
    num_out = new.num_output_tokens
    resumed = None
    while resumed is None:
        out = step(sched, runner, results)
        resumed = next((r for r in out.scheduled_new_reqs if r.req_id == "new"), None)
    assert len(resumed.token_ids) == 16 + num_out and resumed.num_prompt_tokens == 16
    while sched.has_unfinished_requests():
        step(sched, runner, results)
    assert results.tokens == {"old": [7] * 10, "new": [7] * 10}
    assert results.final["new"][0] == FinishReason.LENGTH
    assert sched.kv_cache_manager.num_free_blocks == 10


def test_preempted_request_output_matches_an_unpreempted_run():
    def run(num_blocks: int) -> Results:
        sched = make_scheduler(num_blocks=num_blocks, budget=32)
        runner = FakeRunner(token_fn=lambda rid, i: 10 + i)
        sched.add_request(make_request("x", list(range(100, 116)), max_tokens=10))
        sched.add_request(make_request("y", list(range(200, 216)), max_tokens=10))
        results = run_sync(sched, runner)
        assert sched.kv_cache_manager.num_free_blocks == num_blocks
        return results

    tight, roomy = run(10), run(40)
    assert tight.tokens == roomy.tokens == {"x": list(range(10, 20)), "y": list(range(10, 20))}


def test_prefix_hits_show_in_num_cached_tokens():
    sched, runner = make_scheduler(), FakeRunner()
    prefix = list(range(100, 108))
    sched.add_request(make_request("a", prefix + [1, 3], max_tokens=2))
    run_sync(sched, runner)
    sched.add_request(make_request("b", prefix + [5], max_tokens=2))
    results = Results()
    out = step(sched, runner, results)
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.scheduled_new_reqs[0].block_ids[:2] == [0, 1]
    step(sched, runner, results)
    assert results.final["b"] == (FinishReason.LENGTH, None, 8)
    stats = sched.make_stats()
    assert stats.prefix_cache_hits == 8 and stats.prefix_cache_queries == 10 + 9


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched, runner = make_scheduler(), FakeRunner()
    prompt = list(range(100, 108))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_sync(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    results = Results()
    out = step(sched, runner, results)
    assert out.num_scheduled_tokens == {"b": 4}
    assert results.tokens == {"b": [7]}
    assert results.final["b"] == (FinishReason.LENGTH, None, 4)


def test_eos_stops_unless_ignored_or_before_min_tokens():
    def run(**params) -> tuple[list[int], tuple]:
        sched = make_scheduler()
        runner = FakeRunner(token_fn=lambda rid, i: EOS if i in (1, 3) else 7)
        sched.add_request(make_request("a", [1, 3, 4], **params))
        results = run_sync(sched, runner)
        assert sched.kv_cache_manager.num_free_blocks == 10
        return results.tokens["a"], results.final["a"][:2]

    assert run(max_tokens=10) == ([7, EOS], (FinishReason.STOP, None))
    assert run(max_tokens=10, min_tokens=3) == ([7, EOS, 7, EOS], (FinishReason.STOP, None))
    assert run(max_tokens=5, ignore_eos=True) == (
        [7, EOS, 7, EOS, 7],
        (FinishReason.LENGTH, None),
    )


def test_stop_token_ids_set_the_stop_reason():
    sched = make_scheduler()
    runner = FakeRunner(token_fn=lambda rid, i: 40 + i)
    sched.add_request(make_request("a", [1, 3], max_tokens=10, stop_token_ids=[41, 43]))
    sched.add_request(make_request("b", [1, 4], max_tokens=10, stop_token_ids=[41], min_tokens=3))
    results = run_sync(sched, runner)
    assert results.tokens["a"] == [40, 41] and results.final["a"][:2] == (FinishReason.STOP, 41)
    assert results.tokens["b"] == [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    assert results.final["b"][:2] == (FinishReason.LENGTH, None)


def test_max_model_len_ends_generation_and_bounds_prompts():
    sched, runner = make_scheduler(max_model_len=8), FakeRunner()
    sched.add_request(make_request("a", [1] * 6, max_tokens=None))
    results = run_sync(sched, runner)
    assert results.tokens["a"] == [7, 7] and results.final["a"][0] == FinishReason.LENGTH
    with pytest.raises(ValueError, match="max_model_len"):
        sched.check_admission("long", 9)
    small = make_scheduler(num_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match="needs 3 KV blocks but the cache has only 2"):
        small.check_admission("big", 9)
    with pytest.raises(ValueError, match="empty"):
        small.check_admission("empty", 0)
    small.check_admission("fits", 8)


def test_a_lone_request_never_outgrows_the_cache():
    sched, runner = make_scheduler(num_blocks=3, max_model_len=64), FakeRunner()
    sched.add_request(make_request("a", [1] * 10, max_tokens=100))
    results = run_sync(sched, runner)
    assert len(results.tokens["a"]) == 2 and results.final["a"][0] == FinishReason.LENGTH


@pytest.mark.parametrize("run", [run_sync, run_async])
def test_under_a_sliding_window_requests_outgrow_the_cache(run: Callable) -> None:
    """Every layer windowed (5 tokens): a step holds its window's blocks and its new tokens'
    (at most 4 here), so 60-token sequences (15 blocks) run in 4 blocks, two at once."""
    sched = make_scheduler(num_blocks=4, budget=8, max_model_len=64, sliding_window=5)
    runner = FakeRunner()
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, [1] * 30, max_tokens=30))
    results = run(sched, runner)
    assert {rid: len(t) for rid, t in results.tokens.items()} == {"a": 30, "b": 30}
    assert sched.kv_cache_manager.num_free_blocks == 4
    # a window the cache cannot hold with a step's tokens bounds sequences by the cache
    wide = make_scheduler(num_blocks=4, budget=8, max_model_len=64, sliding_window=9)
    with pytest.raises(ValueError, match="needs 5 KV blocks but the cache has only 4"):
        wide.check_admission("big", 17)


def test_abort_mid_prefill_and_while_waiting_returns_every_block():
    sched, runner = make_scheduler(budget=8), FakeRunner()
    sched.add_request(make_request("a", list(range(10, 30)), client_id=3))
    sched.add_request(make_request("b", [1, 3]))
    results = Results()
    step(sched, runner, results)
    assert sched.kv_cache_manager.num_free_blocks < 10
    aborted = sched.finish_requests(["a", "b", "unknown"])
    assert [o.request_id for o in aborted[3]] == ["a"] and aborted[3][0].finish_reason == 2
    assert [o.request_id for o in aborted[0]] == ["b"]
    assert sched.kv_cache_manager.num_free_blocks == 10
    assert not sched.has_unfinished_requests()
    assert sched.finish_requests(["a"]) == {}
    assert sorted(sched.schedule().finished_req_ids) == ["a", "b"]


def test_abort_with_two_steps_scheduled_before_any_update():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", [1, 3, 4], max_tokens=10))
    sched.add_request(make_request("b", [5, 6], max_tokens=10))
    first = sched.schedule()
    first_out = runner.execute(first)
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    second_out = runner.execute(second)
    sched.finish_requests(["a"])
    results = Results()
    results.add(sched.update_from_output(first, first_out))
    results.add(sched.update_from_output(second, second_out))
    assert "a" not in results.tokens and results.tokens["b"] == [7, 7]
    assert "a" in sched.schedule().finished_req_ids
    sched.finish_requests(["b"])
    assert sched.kv_cache_manager.num_free_blocks == 10


def test_async_stop_drops_the_token_of_the_step_in_flight():
    sched = make_scheduler()
    runner = FakeRunner(token_fn=lambda rid, i: EOS if i == 1 else 7)
    sched.add_request(make_request("a", [1, 3, 4], max_tokens=10))
    results = run_async(sched, runner)
    assert results.tokens["a"] == [7, EOS]
    assert sched.kv_cache_manager.num_free_blocks == 10


def test_async_does_not_schedule_past_max_tokens():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", [1, 3, 4], max_tokens=1))
    first = sched.schedule()
    second = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 3} and second.num_scheduled_tokens == {}
    results = Results()
    results.add(sched.update_from_output(first, runner.execute(first)))
    assert results.tokens["a"] == [7] and results.final["a"][0] == FinishReason.LENGTH


@pytest.mark.parametrize("num_blocks", [10, 40])
def test_async_scheduling_produces_the_same_outputs_as_sync(num_blocks: int):
    def token_fn(rid: str, i: int) -> int:
        return EOS if (rid, i) == ("c", 3) else 10 + i

    def workload(sched: Scheduler) -> None:
        sched.add_request(make_request("a", list(range(100, 118)), max_tokens=9))
        sched.add_request(make_request("b", list(range(100, 108)) + [1], max_tokens=12))
        sched.add_request(make_request("c", [5, 6, 7], max_tokens=8, client_id=1))
        sched.add_request(make_request("d", list(range(300, 311)), max_tokens=6, min_tokens=2))

    runs = []
    for driver in (run_sync, run_async):
        sched = make_scheduler(num_blocks=num_blocks, budget=8)
        workload(sched)
        runs.append(driver(sched, FakeRunner(token_fn=token_fn)))
        assert sched.kv_cache_manager.num_free_blocks == num_blocks
        assert (sched.make_stats().num_preemptions > 0) == (num_blocks == 10)
    sync, async_ = runs
    assert sync.tokens == async_.tokens
    assert sync.final == async_.final
    assert sync.tokens["c"] == [10, 11, 12, EOS]
    assert sync.tokens["a"] == list(range(10, 19))
    assert sync.clients == async_.clients == {"a": 0, "b": 0, "c": 1, "d": 0}


def test_step_ids_increase_and_finished_ids_are_reported_once():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", [1, 3], max_tokens=1))
    results = Results()
    assert step(sched, runner, results).step_id == 0
    assert results.final["a"][0] == FinishReason.LENGTH
    second = sched.schedule()
    assert second.step_id == 1 and second.finished_req_ids == ["a"]
    assert sched.schedule().finished_req_ids == []


def test_reset_prefix_cache_waits_for_idle_blocks():
    sched, runner = make_scheduler(), FakeRunner()
    sched.add_request(make_request("a", list(range(9)), max_tokens=3))
    step(sched, runner, Results())
    assert sched.kv_cache_manager.reset_prefix_cache() is False
    run_sync(sched, runner)
    assert sched.kv_cache_manager.reset_prefix_cache() is True


def test_duplicate_request_ids_are_refused():
    sched = make_scheduler()
    sched.check_admission("a", 1)
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in use"):
        sched.check_admission("a", 1)


def test_sample_seed_is_the_user_seed_or_distinct_per_request():
    assert make_request("a", [1], seed=1234).sample_seed == 1234
    seeds = {make_request(str(i), [1]).sample_seed for i in range(100)}
    assert len(seeds) == 100


def test_request_from_engine_core_request():
    wire = EngineCoreRequest("r1", [1, 2], SamplingParams(ignore_eos=True), [EOS], 5.0, 7)
    request = Request.from_engine_core_request(wire, engine_seed=3)
    assert request.client_id == 7
    assert request.num_cached_tokens == -1 and request.status == RequestStatus.WAITING
    other = Request.from_engine_core_request(wire, engine_seed=4)
    assert request.sample_seed != other.sample_seed


def test_the_blocks_all_running_requests_share_are_announced():
    """Requests sharing a cached prompt prefix: the workers hear how many leading blocks
    every running request holds (for cascade attention); a newcomer that shares less lowers it."""
    sched = make_scheduler(num_blocks=20, budget=64)
    runner = FakeRunner()
    prefix = list(range(10, 22))  # three full blocks
    sched.add_request(make_request("a", prefix + [1], max_tokens=8))
    out = sched.schedule()
    assert out.num_common_prefix_blocks == 4  # alone: every block of its own
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("b", prefix + [2], max_tokens=8))
    out = sched.schedule()  # b hits a's three cached blocks
    assert out.num_common_prefix_blocks == 3
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("c", prefix[:4] + [3], max_tokens=8))
    out = sched.schedule()
    assert out.num_common_prefix_blocks == 1
