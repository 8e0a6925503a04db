"""The padding of steps that replay CUDA graphs, checked on the CPU: the Triton backend runs
in the interpreter and a "replay" runs the captured forward eagerly over the same static
buffers, so what is checked is what a replayed step computes -- padded tokens that store no
KV, padded sequences without queries, the fixed prefill grid -- against plain eager steps.
tests/worker/test_gpu_runner.py checks the graphs themselves on a GPU."""

from __future__ import annotations

import os
import sys

from tests.triton_interpreter import needs_triton, run_interpreted


def tokens(model: str, groups: list[list[list[int]]], graphs: bool) -> tuple[list, list]:
    from minivllm.config import EngineArgs
    from minivllm.engine_core.engine_core import EngineCore
    from minivllm.protocol.sampling_params import SamplingParams
    from tests.engine_groups import run_groups
    from tests.worker.eager_graph_replays import eager_graph_replays

    with eager_graph_replays(graphs) as replayed:
        args = EngineArgs(model=model, distributed_executor_backend="uni", dtype="float32")
        core = EngineCore(args.create_engine_config())
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        tokens = run_groups(core, groups, params)
        core.shutdown()
    return tokens, replayed


def check_padded_steps_give_the_eager_tokens() -> None:
    import random
    import tempfile

    from tests.tiny_models import VOCAB_SIZE, build_checkpoint

    model = build_checkpoint(tempfile.mkdtemp(), "qwen3")
    rng = random.Random(3)
    ps = [[rng.randint(1, VOCAB_SIZE - 1) for _ in range(n)] for n in (5, 40, 70)]
    groups = [[ps[0]], [ps[1], ps[2][:20]], [ps[1] + [7, 8]], ps]
    padded, replayed = tokens(model, groups, graphs=True)
    eager, none = tokens(model, groups, graphs=False)
    assert padded == eager and all(len(t) == 3 for t in eager), (padded, eager)
    assert none == []
    prefill = [size for name, size in replayed if name == "prefill"]
    # 5 tokens; 60; 42 with 32 of them cached (10); 115 (ps[0] and ps[2][:20] cached too)
    assert prefill[:2] == [16, 64] and len(prefill) == 4, replayed
    assert ("decode", 1) in replayed and ("decode", 4) in replayed, replayed


@needs_triton
def test_padded_steps_give_the_eager_tokens_interpreted() -> None:
    run_interpreted(__file__, timeout=400)


if __name__ == "__main__":  # the interpreted run
    os.environ["MINIVLLM_ATTENTION_BACKEND"] = "triton"
    sys.exit(check_padded_steps_give_the_eager_tokens())
