"""The CUDA-graph steps of speculative decoding, checked on the CPU as test_graph_padding.py
checks the others: the Triton backend in the interpreter, and a "replay" that runs the
captured forward eagerly over the same static buffers. Verification steps (n-gram drafts)
replay the verify graphs, B requests of up to 1 + k tokens with the padding after them; a
draft model (here the target itself) replays its own graphs over the target's step and its
decode graphs for its proposals; every step gives the tokens of plain eager steps without
speculation.
tests/worker/test_gpu_spec_decode.py checks the graphs themselves on a GPU."""

from __future__ import annotations

import os
import sys

from tests.triton_interpreter import needs_triton, run_interpreted

K = 3


def tokens(model: str, prompts: list[list[int]], graphs: bool, spec: dict | None) -> tuple:
    from minivllm.config import EngineArgs
    from minivllm.engine_core.engine_core import EngineCore
    from minivllm.protocol.sampling_params import SamplingParams
    from tests.engine_groups import run_groups
    from tests.worker.eager_graph_replays import eager_graph_replays

    with eager_graph_replays(graphs) as replayed:
        args = EngineArgs(
            model=model, distributed_executor_backend="uni", dtype="float32", max_num_seqs=8,
            max_num_batched_tokens=64, speculative_config=spec,
        )  # fmt: skip
        core = EngineCore(args.create_engine_config())
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got = run_groups(core, [prompts], params)
        stats = core.stats()
        core.shutdown()
    return got, replayed, stats


def check_verification_graphs_give_the_eager_tokens() -> None:
    import random
    import tempfile

    from tests.tiny_models import VOCAB_SIZE, build_checkpoint

    root = tempfile.mkdtemp()
    model = build_checkpoint(os.path.join(root, "target"), "qwen3")
    prompts = []
    for seed in (53, 50, 57):  # repeated blocks whose continuations prompt lookup finds
        rng = random.Random(seed)
        n = rng.choice([3, 4, 5, 6, 7])
        prompts.append([rng.randint(1, VOCAB_SIZE - 1) for _ in range(n)] * rng.randint(2, 4))
    expected, none, _ = tokens(model, prompts, graphs=False, spec=None)
    assert none == [] and all(len(t) == 10 for t in expected)

    ngram = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2,
             "prompt_lookup_min": 1}  # fmt: skip
    got, replayed, stats = tokens(model, prompts, graphs=True, spec=ngram)
    assert got == expected, (got, expected)
    assert stats["spec_num_accepted_tokens"] > 0, stats
    verify = [size for name, size in replayed if name == "verify"]
    # B requests x (1 + k) tokens: B is a captured batch size (1, 2, 4, 8)
    assert verify and all(size % (1 + K) == 0 for size in verify), replayed

    # the target as its own draft model: every draft accepted
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": K}
    got, replayed, stats = tokens(model, prompts, graphs=True, spec=spec)
    assert got == expected, (got, expected)
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0, stats
    names = {name for name, _ in replayed}
    # the target's and the draft's verify and decode graphs, and their prefill graphs
    assert {"verify", "decode", "prefill"} <= names, replayed
    # (each proposal is K one-token passes of every sampling request at once)
    assert len([r for r in replayed if r[0] == "decode"]) >= K, replayed


@needs_triton
def test_verification_graphs_give_the_eager_tokens_interpreted() -> None:
    run_interpreted(__file__, timeout=600)


if __name__ == "__main__":  # the interpreted run
    os.environ["MINIVLLM_ATTENTION_BACKEND"] = "triton"
    sys.exit(check_verification_graphs_give_the_eager_tokens())
