"""The model runner driven step by step, as the async engine-core drives it.

The runner leaves the newest step's sampled ids on the device and gathers the next step's
input ids from them, and writes older ones into the host token ids only later; these tests
schedule by hand the cases where that bookkeeping could slip.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.config import EngineArgs
from minivllm.protocol.messages import (
    CachedRequestData,
    GrammarBitmask,
    NewRequestData,
    SchedulerOutput,
)
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.cuda_graphs import (
    PREFILL_GRAPH_SEQS,
    RunnerGraphs,
    StepGraphs,
    capture_sizes,
    prefill_capture_sizes,
)
from minivllm.worker.step_buffers import StepBuffers
from minivllm.worker.worker import Worker
from tests.hf_reference import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
PROMPT_A = [5, 17, 42, 99, 3, 250, 8]
PROMPT_B = [11, 12, 13]


def make_worker(path: str, **kwargs) -> Worker:
    args = EngineArgs(
        model=path, dtype="float32", distributed_executor_backend="uni", block_size=4, **kwargs
    )
    worker = Worker(args.create_engine_config())
    worker.init_device()
    worker.load_model()
    worker.initialize_kv_cache(64)
    return worker


def new_req(req_id: str, prompt: list[int], blocks: list[int]) -> NewRequestData:
    return NewRequestData(req_id, prompt, len(prompt), GREEDY, blocks, 0)


def step(step_id: int, new=(), cached=(), finished=(), preempted=()) -> SchedulerOutput:
    """cached: (req_id, new_block_ids, num_computed_tokens, num_scheduled)."""
    num = {r.req_id: len(r.token_ids) for r in new}
    data = CachedRequestData()
    for req_id, blocks, computed, n in cached:
        data.req_ids.append(req_id)
        data.new_block_ids.append(list(blocks))
        data.num_computed_tokens.append(computed)
        num[req_id] = n
    return SchedulerOutput(
        step_id,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=data,
        num_scheduled_tokens=num,
        total_num_scheduled_tokens=sum(num.values()),
        finished_req_ids=list(finished),
        preempted_req_ids=list(preempted),
    )


def launch(runner, so: SchedulerOutput):  # noqa: ANN001, ANN201
    """A step without structured outputs, as a worker runs it: both calls at once."""
    runner.execute_model(so)
    return runner.sample_tokens()


def test_in_flight_tokens_feed_the_next_steps(qwen3_dir: str) -> None:
    expected_a, expected_b = hf_greedy(qwen3_dir, [PROMPT_A, PROMPT_B], 4)
    runner = make_worker(qwen3_dir).model_runner
    n = len(PROMPT_A)
    # every step is launched before the previous one's output is looked at
    outs = [launch(runner, step(0, new=[new_req("a", PROMPT_A, [0, 1])]))]
    outs.append(launch(runner, step(1, cached=[("a", [], n, 1)])))
    # "a" sits out a step (budget spent elsewhere): its in-flight token is now two steps old
    outs.append(launch(runner, step(2, new=[new_req("b", PROMPT_B, [2])])))
    outs.append(launch(runner, step(3, cached=[("a", [3], n + 1, 1), ("b", [], 3, 1)])))
    outs.append(launch(runner, step(4, cached=[("a", [], n + 2, 1)])))
    got = [o.get() for o in outs]
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for o in got:
        for req_id, sampled in zip(o.req_ids, o.sampled_token_ids, strict=True):
            tokens[req_id] += sampled
    assert tokens["a"] == expected_a
    assert tokens["b"] == expected_b[:2]
    # the host token ids caught up with the steps before the newest two
    state = runner.batch.requests["a"]
    assert state.num_tokens == n + 4 and state.num_host_tokens == n + 2
    assert runner.batch.token_ids[state.row, n : n + 2].tolist() == expected_a[:2]


@pytest.mark.parametrize("gone", ["finished", "preempted"])
def test_a_reused_row_is_not_written_by_a_late_output(qwen3_dir: str, gone: str) -> None:
    # one row only: "b" can run only once "a" is dropped
    runner = make_worker(qwen3_dir, max_num_seqs=1).model_runner
    launch(runner, step(0, new=[new_req("a", PROMPT_A, [0, 1])]))
    # "a" finished (aborted) or was preempted while its token was in flight; "b" takes its row
    launch(runner, step(1, new=[new_req("b", PROMPT_B, [2])], **{gone: ["a"]}))
    row = runner.batch.requests["b"].row
    before = runner.batch.token_ids[row].copy()
    launch(runner, step(2, cached=[("b", [], 3, 1)]))  # applies step 0's output
    assert (runner.batch.token_ids[row] == before).all()
    assert runner.batch.token_ids[row, :3].tolist() == PROMPT_B


def test_a_structured_step_samples_once_its_bitmask_comes(qwen3_dir: str) -> None:
    """The two calls of a step with structured outputs: the forward first, then the sample,
    constrained by the bitmask the second call brings (one token allowed: greedy takes it)."""
    runner = make_worker(qwen3_dir).model_runner
    so = step(0, new=[new_req("a", PROMPT_A, [0, 1])])
    so.structured_output_req_ids = ["a"]
    runner.execute_model(so)
    with pytest.raises(RuntimeError, match="step 1 came before step 0 was sampled"):
        runner.execute_model(step(1, cached=[("a", [], len(PROMPT_A), 1)]))
    allowed = 77
    mask = np.zeros((1, -(-runner.config.model.vocab_size // 32)), dtype=np.int32)
    mask[0, allowed // 32] = 1 << (allowed % 32)
    out = runner.sample_tokens(GrammarBitmask(0, mask)).get()
    assert out.sampled_token_ids == [[allowed]]
    # the next step reads that token as its input, and samples without a bitmask
    out = launch(runner, step(1, cached=[("a", [], len(PROMPT_A), 1)])).get()
    assert out.sampled_token_ids == [hf_greedy(qwen3_dir, [[*PROMPT_A, allowed]], 1)[0]]
    runner.execute_model(step(2, cached=[("a", [], len(PROMPT_A) + 1, 1)]))
    with pytest.raises(RuntimeError, match="0 structured-output requests; .* got a grammar"):
        runner.sample_tokens(GrammarBitmask(2, mask))


def test_step_buffers_views_share_one_buffer() -> None:
    bufs = StepBuffers(8, 32, 5, 4, torch.device("cpu"))
    h = bufs.next_host()
    h.input_ids[:3] = [7, 8, 9]
    h.block_table[1, :2] = [4, 5]
    assert bufs.dev.input_ids[:3].tolist() == [7, 8, 9]
    assert bufs.dev.block_table[1, :2].tolist() == [4, 5]
    assert bufs.offsets["block_table"] + 8 * 5 * 4 <= bufs.nbytes
    assert all(off % 64 == 0 for off in bufs.offsets.values())


@pytest.mark.parametrize("max_num_seqs", [1, 3, 20, 256])
def test_decode_graphs_cover_every_batch_with_little_padding(max_num_seqs: int) -> None:
    graphs = StepGraphs()
    graphs.sizes = capture_sizes(max_num_seqs)  # as `capture` sets them
    for n in range(1, max_num_seqs + 1):
        padded = graphs.padded_size(n)
        assert padded is not None and n <= padded <= max_num_seqs
        assert padded - n < 8 and padded <= 2 * n  # padding rows are wasted work
    assert graphs.padded_size(max_num_seqs + 1) is None  # larger batches run eagerly


def test_steps_pick_the_graph_of_their_shape() -> None:
    graphs = RunnerGraphs(max_num_seqs=256, cascade=True, prefill=True)
    graphs.decode.sizes = capture_sizes(256)  # as `capture` sets them
    graphs.cascade.sizes = [8, 16, 32, 64, 128, 256]
    graphs.prefill.sizes = prefill_capture_sizes(8192)
    assert graphs.pick(n=5, nd=5, total=5, cascade=False) == (graphs.decode, 8, 8)
    assert graphs.pick(n=5, nd=5, total=5, cascade=True) == (graphs.cascade, 8, 8)
    # one 512-token prompt (a batch-1 TTFT): the prefill graph of 512 tokens, 4 sequences
    assert graphs.pick(n=1, nd=0, total=512, cascade=False) == (graphs.prefill, 512, 4)
    assert graphs.pick(n=3, nd=0, total=40, cascade=False) == (graphs.prefill, 64, 4)
    # longer prompts, more prompts than the graphs hold, prompts beside decodes: eager
    assert graphs.pick(n=1, nd=0, total=513, cascade=False) == (None, 513, 1)
    n = PREFILL_GRAPH_SEQS + 1
    assert graphs.pick(n=n, nd=0, total=50, cascade=False) == (None, 50, n)
    assert graphs.pick(n=3, nd=2, total=40, cascade=False) == (None, 40, 3)
    assert graphs.pick(n=300, nd=300, total=300, cascade=False) == (None, 300, 300)
    small = RunnerGraphs(max_num_seqs=2, cascade=False, prefill=True)
    small.prefill.sizes = prefill_capture_sizes(100)
    assert small.prefill.sizes == [16, 32, 64]
    assert small.pick(n=2, nd=0, total=64, cascade=False) == (small.prefill, 64, 2)


def test_attention_backend_is_chosen_by_env(qwen3_dir: str, monkeypatch) -> None:
    args = EngineArgs(model=qwen3_dir, dtype="float32", distributed_executor_backend="uni")
    worker = Worker(args.create_engine_config())
    worker.init_device()
    assert worker.model_runner.attn_backend_name == "cpu"  # the CPU default
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="MINIVLLM_ATTENTION_BACKEND"):
        worker.init_device()
