"""The scheduler's side of speculative decoding, with a fake worker whose "model" continues
each request with fixed tokens: drafts go out in one step with the last token, the worker
keeps those that match and adds one, and the rejected ones' KV slots are taken back."""

from __future__ import annotations

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine_core.request import Request
from minivllm.engine_core.scheduler import Scheduler
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.speculative_config import SpeculativeConfig

NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=2)


def make_scheduler(spec: SpeculativeConfig, num_blocks: int = 40, async_: bool = False):
    return Scheduler(
        SchedulerConfig(8, 64, True, 256, async_scheduling=async_),
        CacheConfig(4, 0.9, None, True, None),
        num_blocks,
        speculative=spec,
    )


class TruthRunner:
    """Each request's i-th output token is `truth[rid][i]`; drafts are checked against it
    (accepted while equal, then the true token). With `drafts`, it also proposes, as a draft
    model would: `drafts(rid, i)` for the tokens after output i."""

    def __init__(self, truth: dict[str, list[int]], drafts=None) -> None:
        self.truth, self.drafts = truth, drafts
        self.num_tokens: dict[str, int] = {}
        self.num_prompt: dict[str, int] = {}
        self.blocks: dict[str, int] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in (*out.finished_req_ids, *out.preempted_req_ids):
            self.num_tokens.pop(rid, None)
        computed = {}
        for new in out.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.token_ids)
            self.num_prompt[new.req_id] = new.num_prompt_tokens
            self.blocks[new.req_id] = len(new.block_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for rid, blocks, n in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            self.blocks[rid] += len(blocks)
            computed[rid] = n
            self.num_tokens[rid] = max(self.num_tokens[rid], n + 1)
        req_ids, sampled, proposals = [], [], []
        for rid, n in out.num_scheduled_tokens.items():
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            # every scheduled token has a KV slot in the request's blocks
            assert computed[rid] + n <= self.blocks[rid] * 4
            req_ids.append(rid)
            if computed[rid] + n - len(drafts) < self.num_tokens[rid]:
                sampled.append([])  # a prompt chunk
                proposals.append([])
                continue
            i = self.num_tokens[rid] - self.num_prompt[rid]
            tokens = []
            for draft in drafts:
                if draft != self.truth[rid][i + len(tokens)]:
                    break
                tokens.append(draft)
            tokens.append(self.truth[rid][i + len(tokens)])
            sampled.append(tokens)
            self.num_tokens[rid] += len(tokens)
            last = i + len(tokens) - 1
            proposals.append(self.drafts(rid, last) if self.drafts else [])
        return ModelRunnerOutput(
            step_id=out.step_id,
            req_ids=req_ids,
            sampled_token_ids=sampled,
            draft_token_ids=proposals if self.drafts else [],
        )


def request(rid: str, prompt: list[int], max_tokens: int = 12) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, [0])


def run(sched: Scheduler, runner: TruthRunner, async_: bool = False):
    """Every request's tokens and the scheduler outputs, in the order they were made; with
    `async_`, each step is scheduled before the previous one's output is applied."""
    tokens: dict[str, list[int]] = {}
    outs, in_flight = [], None

    def apply(out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for outputs in sched.update_from_output(out, result).values():
            for o in outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    for _ in range(200):
        if not sched.has_unfinished_requests() and in_flight is None:
            return tokens, outs
        out = sched.schedule() if sched.has_unfinished_requests() else None
        if out is not None:
            outs.append(out)
        if not async_:
            apply(out, runner.execute(out))
            continue
        if in_flight is not None:
            apply(*in_flight)
        in_flight = None if out is None else (out, runner.execute(out))
    raise AssertionError("requests did not finish")


def test_drafts_are_verified_in_one_step_and_rejected_slots_taken_back() -> None:
    sched = make_scheduler(NGRAM)
    # after the first token (11), "10 11" occurred before: 12 13 14 are proposed; the
    # model's tokens after 11 are 12 13 50: two drafts accepted, 50 returned with them
    truth = {"a": [11, 12, 13, 50, 51, 52, 53, 54, 55, 56, 57, 58]}
    runner = TruthRunner(truth)
    sched.add_request(request("a", [10, 11, 12, 13, 14, 10]))
    first = sched.schedule()
    sched.update_from_output(first, runner.execute(first))
    verify = sched.schedule()
    assert verify.scheduled_spec_decode_tokens == {"a": [12, 13, 14]}
    assert verify.num_scheduled_tokens == {"a": 4}  # the last token and 3 drafts
    assert verify.scheduled_cached_reqs.num_computed_tokens == [6]
    outputs = sched.update_from_output(verify, runner.execute(verify))
    assert outputs[0][0].new_token_ids == [12, 13, 50]
    req = sched.requests["a"]
    assert req.num_computed_tokens == 9 == req.num_tokens - 1  # the rejected slot taken back
    nxt = sched.schedule()
    assert nxt.scheduled_cached_reqs.num_computed_tokens == [9]
    assert "a" not in nxt.scheduled_spec_decode_tokens  # nothing repeats after 50
    stats = sched.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens) == (1, 3)
    assert stats.spec_num_accepted_tokens == 2
    assert stats.spec_num_accepted_tokens_per_pos == [1, 1, 0]


def copy_truth(prompt: list[int], n: int) -> list[int]:
    """A "model" that repeats its prompt: what prompt lookup predicts."""
    return [prompt[i % len(prompt)] for i in range(n)]


def test_tokens_are_the_models_whatever_is_accepted_sync_and_async() -> None:
    prompts = {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8, 9, 7, 8], "c": [20, 21, 22, 23, 24, 25]}
    truth = {r: copy_truth(p, 40) for r, p in prompts.items()}
    truth["c"][5:9] = [60, 61, 62, 63]  # a run that no draft predicts
    for async_ in (False, True):
        sched = make_scheduler(NGRAM, async_=async_)
        for rid, p in prompts.items():
            sched.add_request(request(rid, p, max_tokens=14))
        tokens, outs = run(sched, TruthRunner(truth), async_)
        assert tokens == {r: t[:14] for r, t in truth.items()}
        assert sched.kv_cache_manager.num_free_blocks == 40
        stats = sched.make_stats()
        assert stats.spec_num_accepted_tokens >= 15, stats
        # async: a request whose step verifies drafts is never in the step scheduled behind
        # it, before that step's tokens are back
        for before, after in zip(outs, outs[1:], strict=False) if async_ else ():
            verifying = set(before.scheduled_spec_decode_tokens)
            assert not verifying & set(after.num_scheduled_tokens), (before, after)


def test_drafts_never_reach_past_max_tokens() -> None:
    sched = make_scheduler(NGRAM)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    sched.add_request(request("a", prompt, max_tokens=3))
    tokens, outs = run(sched, TruthRunner({"a": copy_truth(prompt[1:], 20)}))
    assert tokens["a"] == [2, 3, 4]
    # after the first token (2) two are left: one draft (3 of 3 4 5) and the token after it
    assert [o.scheduled_spec_decode_tokens for o in outs if o.scheduled_spec_decode_tokens] == [
        {"a": [3]}
    ]


def test_async_request_with_a_step_in_flight_waits_for_fresh_drafts() -> None:
    """Drafts proposed while a step of the request is in flight are stale (one position
    behind) when they come: the request sits out one step and verifies the ones proposed
    after it, which a copying model accepts whole."""
    sched = make_scheduler(NGRAM, async_=True)
    prompt = [30, 31, 32, 33, 34, 35]
    truth = {"a": [36, 37, *copy_truth(prompt, 10)]}
    sched.add_request(request("a", prompt))
    tokens, outs = run(sched, TruthRunner(truth), async_=True)
    assert tokens["a"] == truth["a"]
    assert any(o.total_num_scheduled_tokens == 0 for o in outs)  # the step it sat out
    stats = sched.make_stats()
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_draft_model_proposals_are_scheduled_with_lookahead_slots() -> None:
    spec = SpeculativeConfig("draft_model", 3)
    sched = make_scheduler(spec)
    prompt = [5, 6, 7, 8, 9]
    truth = {"a": list(range(100, 130))}

    def drafts(rid: str, i: int) -> list[int]:  # right twice, then wrong
        return [truth[rid][i + 1], truth[rid][i + 2], 999]

    runner = TruthRunner(truth, drafts)
    sched.add_request(request("a", prompt, max_tokens=10))
    first = sched.schedule()
    kv = sched.kv_cache_manager
    # the prompt's 5 slots and the 3 the proposals write after its first token: 2 blocks
    assert len(kv.req_to_blocks["a"]) == 2
    (out,) = sched.update_from_output(first, runner.execute(first))[0]
    verify = sched.schedule()
    assert verify.scheduled_spec_decode_tokens == {"a": [101, 102, 999]}
    (verified,) = sched.update_from_output(verify, runner.execute(verify))[0]
    assert verified.new_token_ids == [101, 102, 103]
    tokens, _ = run(sched, runner)
    assert out.new_token_ids + verified.new_token_ids + tokens["a"] == truth["a"][:10]
    assert kv.num_free_blocks == 40
    stats = sched.make_stats()
    assert stats.spec_num_accepted_tokens_per_pos[:2] == [stats.spec_num_drafts] * 2
    assert stats.spec_num_accepted_tokens_per_pos[2] == 0


def test_no_block_is_cached_with_a_rejected_drafts_kv() -> None:
    """Only blocks full of known tokens are hashed: the prefix cache holds exactly the
    blocks of the request's real tokens."""
    from minivllm.engine_core.kv_cache_manager import hash_block

    sched = make_scheduler(NGRAM)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    truth = copy_truth(prompt, 30)
    truth[3] = 77  # the drafts of the second step are rejected from here on
    sched.add_request(request("a", prompt, max_tokens=20))
    tokens, _ = run(sched, TruthRunner({"a": truth}))
    all_tokens = prompt + tokens["a"]
    cached = set(sched.kv_cache_manager.block_pool.cached_blocks)
    parent, expected = b"", set()
    for start in range(0, len(all_tokens) - 4 + 1, 4):
        parent = hash_block(parent, all_tokens[start : start + 4])
        expected.add(parent)
    assert cached and cached <= expected
