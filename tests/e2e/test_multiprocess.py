"""The default LLM runs three kinds of process and still matches transformers exactly."""

from __future__ import annotations

import os

import pytest

from minivllm import LLM, SamplingParams
from tests.hf_reference import hf_greedy, parity_prompts
from tests.process_helpers import spawned_children, wait_gone

MAX_TOKENS = 12


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({}, id="default"),
        pytest.param(
            dict(
                max_num_batched_tokens=16,
                num_gpu_blocks_override=24,
                block_size=4,
                max_model_len=96,
            ),
            id="chunked-and-preempted",
        ),
    ],
)
def test_greedy_parity_through_processes(qwen3_dir: str, engine_kwargs: dict) -> None:
    prompts = parity_prompts()
    expected = hf_greedy(qwen3_dir, prompts, MAX_TOKENS)
    llm = LLM(qwen3_dir, dtype="float32", **engine_kwargs)
    try:
        core_pids = spawned_children(os.getpid())
        assert len(core_pids) == 1, "one engine-core process"
        worker_pids = spawned_children(core_pids[0])
        assert len(worker_pids) == 1, "one worker process"
        assert len({os.getpid(), core_pids[0], worker_pids[0]}) == 3

        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        stats = llm.llm_engine.get_stats()
        assert stats["kv_cache_usage"] == 0.0
        if engine_kwargs:
            assert stats["num_preemptions"] >= 1
        else:
            assert stats["prefix_cache_hits"] > 0
    finally:
        llm.shutdown()
    assert wait_gone(core_pids + worker_pids, timeout=15) == []


def test_text_prompts_eos_and_stop_strings(qwen3_dir: str) -> None:
    llm = LLM(qwen3_dir, dtype="float32")
    try:
        tok = llm.get_tokenizer()
        free = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20))[0]
        text = free.outputs[0].text
        assert free.outputs[0].text == tok.decode(
            free.outputs[0].token_ids, skip_special_tokens=True
        )
        assert free.prompt == "Hello world"
        stop = text[3:5]
        cut = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
        out = cut[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: text.index(stop)]
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        with pytest.raises(ValueError, match="maximum model length"):
            llm.generate({"prompt_token_ids": [1] * 600}, SamplingParams(max_tokens=4))
        # the engine is unharmed by the bad request
        again = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20))[0]
        assert again.outputs[0].token_ids == free.outputs[0].token_ids
    finally:
        llm.shutdown()
