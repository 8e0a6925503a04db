"""Cascade attention end to end: decode steps whose requests share a cached prefix attend it
once, and produce the tokens plain attention produces (the kernels against a dense
reference: test_triton_attention.py)."""

from __future__ import annotations

import os
import sys

from minivllm.worker.attention.cascade import use_cascade
from tests.triton_interpreter import needs_triton, run_interpreted


def test_cost_rule() -> None:
    assert not use_cascade(256, 128)  # too short a prefix to pay for two more kernels
    assert not use_cascade(8, 512)  # 3,584 tokens saved per kv head: not enough
    assert use_cascade(32, 512)
    assert use_cascade(256, 2048)  # the shared-prefix benchmark
    assert not use_cascade(1, 4096)  # nothing is read twice


def shared_prefix_run(
    engine_args,
    prompts: list[list[int]],
    max_tokens: int,  # noqa: ANN001 - EngineArgs
) -> tuple[list[list[int]], list[int], int]:
    """Greedy tokens of prompts[1:], run together after prompts[0] has cached the prefix they
    share; the cascade prefix length the runner chose at every step; and how many steps
    replayed a cascade CUDA graph."""
    from minivllm.engine_core.engine_core import EngineCore
    from minivllm.protocol.messages import EngineCoreRequest
    from minivllm.protocol.sampling_params import SamplingParams
    from minivllm.worker import model_runner

    core = EngineCore(engine_args.create_engine_config())
    runner = core.executor.worker.model_runner
    chosen: list[int] = []
    plan_forward, replay, replays = model_runner.plan_forward, runner.graphs.cascade.replay, []

    def spy(*args):  # noqa: ANN002, ANN202
        plan = plan_forward(*args)
        chosen.append(plan.cascade_prefix_len)
        return plan

    def count(size):  # noqa: ANN001, ANN202
        replays.append(size)
        return replay(size)

    model_runner.plan_forward, runner.graphs.cascade.replay = spy, count
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got: dict[str, list[int]] = {}
    try:
        for i, prompt in enumerate(prompts):
            core.add_request(EngineCoreRequest(str(i), prompt, params))
            while i == 0 and core.has_work():  # the first request caches the prefix
                core.step()
        while core.has_work():
            for outs in core.step().values():
                for o in outs.outputs:
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
    finally:
        model_runner.plan_forward = plan_forward
        core.shutdown()
    return [got[str(i)] for i in range(1, len(prompts))], chosen, len(replays)


def check_tokens_equal_with_cascade_on_and_off() -> None:
    import tempfile

    from minivllm.config import EngineArgs
    from minivllm.worker.attention import cascade
    from tests.tiny_models import build_checkpoint

    # the tiny model's batches are far below the real thresholds
    cascade.MIN_PREFIX_TOKENS = cascade.MIN_SAVED_TOKENS = 32
    model = build_checkpoint(tempfile.mkdtemp(), "qwen3")
    prefix = list(range(1, 50))  # three whole blocks of 16 and one token
    prompts = [prefix + [60]] + [prefix + [60 + i] * i for i in range(1, 4)]
    runs = [
        shared_prefix_run(
            EngineArgs(
                model=model, distributed_executor_backend="uni", dtype="float32",
                disable_cascade_attn=disable,
            ),
            prompts,
            max_tokens=4,
        )
        for disable in (False, True)
    ]  # fmt: skip
    (on, used, _), (off, unused, _) = runs
    assert on == off and len(on) == 3 and all(len(t) == 4 for t in on), (on, off)
    assert 48 in used and set(used) <= {0, 48}, used  # three whole blocks, read once a step
    assert set(unused) == {0}


@needs_triton
def test_tokens_equal_with_cascade_on_and_off_interpreted() -> None:
    """The runner with the Triton backend on the CPU (interpreter): the cascade path runs for
    the decode steps of the three requests that share the first one's cached prefix."""
    run_interpreted(__file__, timeout=400)


if __name__ == "__main__":  # the interpreted run
    os.environ["MINIVLLM_ATTENTION_BACKEND"] = "triton"
    sys.exit(check_tokens_equal_with_cascade_on_and_off())
