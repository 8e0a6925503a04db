"""The scheduler's tests without a GPU: a fake runner that mimics a worker from the diffs it
receives, and the outputs clients would see, stepped as the sync and overlapping engine
loops step."""

from __future__ import annotations

from collections.abc import Callable

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine_core.request import Request
from minivllm.engine_core.scheduler import Scheduler
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams

EOS = 2


def make_scheduler(
    num_blocks: int = 10,
    block_size: int = 4,
    budget: int = 16,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    chunked: bool = True,
    caching: bool = True,
    sliding_window: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, budget, chunked, max_model_len, async_scheduling=False),
        CacheConfig(block_size, 0.9, None, caching, None),
        num_blocks,
        sliding_window=sliding_window,
    )


def make_request(rid: str, prompt: list[int], client_id: int = 0, **params) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(rid, prompt, SamplingParams(**params), [EOS], client_id=client_id)


class FakeRunner:
    """Mimics a worker: tracks each request's tokens and blocks from the diffs it receives,
    and samples `token_fn(req_id, output_index)` (7 by default) when a step reaches the end
    of a request's known tokens."""

    def __init__(self, block_size: int = 4, token_fn: Callable[[str, int], int] | None = None):
        self.block_size = block_size
        self.token_fn = token_fn or (lambda rid, i: 7)
        self.num_tokens: dict[str, int] = {}
        self.num_prompt: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in (*out.finished_req_ids, *out.preempted_req_ids):
            self.num_tokens.pop(rid, None)
            self.blocks.pop(rid, None)
        computed = {}
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.num_tokens
            self.num_tokens[new.req_id] = len(new.token_ids)
            self.num_prompt[new.req_id] = new.num_prompt_tokens
            self.blocks[new.req_id] = list(new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, block_ids, n in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            self.blocks[rid] += block_ids
            computed[rid] = n
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            assert computed[rid] + n <= len(self.blocks[rid]) * self.block_size
            req_ids.append(rid)
            if computed[rid] + n >= self.num_tokens[rid]:
                i = self.num_tokens[rid] - self.num_prompt[rid]
                sampled.append([self.token_fn(rid, i)])
                self.num_tokens[rid] += 1
            else:
                sampled.append([])
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        return ModelRunnerOutput(step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled)


class Results:
    """What clients see: tokens per request and exactly one final output each."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, tuple] = {}
        self.clients: dict[str, int] = {}

    def add(self, outputs: dict) -> None:
        for client_id, outs in outputs.items():
            for o in outs:
                assert o.request_id not in self.final, f"{o.request_id} emitted after finishing"
                self.clients[o.request_id] = client_id
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.final[o.request_id] = (o.finish_reason, o.stop_reason, o.num_cached_tokens)


def step(sched: Scheduler, runner: FakeRunner, results: Results) -> SchedulerOutput:
    out = sched.schedule()
    results.add(sched.update_from_output(out, runner.execute(out)))
    return out


def run_sync(sched: Scheduler, runner: FakeRunner, max_steps: int = 200) -> Results:
    results = Results()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return results
        step(sched, runner, results)
    raise AssertionError("requests did not finish")


def run_async(sched: Scheduler, runner: FakeRunner, max_steps: int = 200) -> Results:
    """Schedule step N+1 before updating from step N, as the overlapping engine loop does."""
    results, in_flight = Results(), None
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and in_flight is None:
            return results
        out = sched.schedule() if sched.has_unfinished_requests() else None
        if in_flight is not None:
            results.add(sched.update_from_output(*in_flight))
        in_flight = (out, runner.execute(out)) if out is not None else None
    raise AssertionError("requests did not finish")
