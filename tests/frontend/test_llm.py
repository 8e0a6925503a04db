"""The offline API as a vLLM user drives it (in-process engine for speed)."""

from __future__ import annotations

import pytest

from minivllm import LLM, EngineArgs, LLMEngine, SamplingParams
from tests.tiny_models import build_checkpoint


@pytest.fixture(scope="module")
def llm(qwen3_dir: str):
    llm = LLM(qwen3_dir, dtype="float32", distributed_executor_backend="uni")
    yield llm
    llm.shutdown()


def test_prompt_forms_and_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok("Hello world")["input_ids"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(
        ["Hello world", {"prompt_token_ids": ids}, ids, {"prompt": "Hello world"}], greedy
    )
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)
    single = llm.generate(ids, greedy)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    # one params object per prompt
    per = llm.generate(["Hello world"] * 2, [greedy, SamplingParams(temperature=0, max_tokens=3)])
    assert [len(o.outputs[0].token_ids) for o in per] == [8, 3]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [greedy])


def test_seeded_sampling_ignores_the_rest_of_the_batch(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    alone = llm.generate("The quick brown fox", params)[0].outputs[0].token_ids
    crowd = ["Hello world", "The quick brown fox", "Numbers: 0 1 2", "A paged KV cache"]
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(crowd, [other, params, other, other])
    assert outs[1].outputs[0].token_ids == alone
    again = llm.generate("The quick brown fox", params)[0].outputs[0].token_ids
    assert again == alone


def test_prefix_cache_hits_show_in_num_cached_tokens(llm: LLM) -> None:
    prompt = list(range(20, 60))  # 40 tokens: two full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate({"prompt_token_ids": prompt}, params)[0]
    second = llm.generate({"prompt_token_ids": prompt + [5]}, params)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True  # as vLLM's: the cached blocks are dropped
    third = llm.generate({"prompt_token_ids": prompt + [5]}, params)[0]
    assert third.num_cached_tokens == 0


def test_eos_ids_from_generation_config_list(tmp_path, qwen3_dir: str) -> None:
    probe = LLM(qwen3_dir, dtype="float32", distributed_executor_backend="uni")
    free = probe.generate(
        "Hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0]
    probe.shutdown()
    stop_id = free.outputs[0].token_ids[4]
    first = free.outputs[0].token_ids.index(stop_id)
    # same weights (same seed), but generation_config.json lists two EOS ids
    path = build_checkpoint(str(tmp_path / "eos"), "qwen3", eos_token_ids=[0, stop_id])
    llm = LLM(path, dtype="float32", distributed_executor_backend="uni")
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    llm.shutdown()
    assert out.finish_reason == "stop"
    assert out.token_ids == free.outputs[0].token_ids[: first + 1]


def test_llm_engine_step_loop(qwen3_dir: str) -> None:
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=qwen3_dir, dtype="float32", distributed_executor_backend="uni")
    )
    engine.add_request("a", "Hello world", SamplingParams(temperature=0, max_tokens=6))
    engine.add_request(
        "b", [1, 2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    engine.add_request("c", "Numbers", SamplingParams(max_tokens=30, ignore_eos=True))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("a", "again", SamplingParams())
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 3:
            engine.abort_request("c")
    assert set(finished) == {"a", "b"}
    assert len(finished["b"].outputs[0].token_ids) == 30
    assert engine.get_stats()["kv_cache_usage"] == 0.0
    engine.shutdown()


def test_bad_engine_args_name_the_parameter(qwen3_dir: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        EngineArgs(model=qwen3_dir, dtype="float64")
    with pytest.raises(ValueError, match="max_model_len"):
        EngineArgs(model=qwen3_dir, max_model_len=10**6).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(model=qwen3_dir, tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(model=qwen3_dir, gpu_memory_utilization=1.5)
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(qwen3_dir, max_num_seq=4)
