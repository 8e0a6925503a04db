"""vLLM's generation defaults: the model's generation_config.json sets the sampling params of
`LLM.generate` without params (`--generation-config auto`, the default); "vllm" ignores them;
a directory replaces them; one warning says which are in force."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.generation_defaults import default_sampling_params

# greedy through top_k=1, five tokens, and a penalty that is neutral here
QWEN3_LIKE = {"eos_token_id": [0], "top_k": 1, "max_new_tokens": 5, "repetition_penalty": 1.0}
PROMPT = "The quick brown fox"


def _with_generation_config(src: str, dst: str, config: dict) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "generation_config.json"), "w") as f:
        json.dump(config, f)
    return dst


@pytest.fixture(scope="module")
def model_dir(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _with_generation_config(qwen3_dir, str(tmp_path_factory.mktemp("gc") / "m"), QWEN3_LIKE)


def _llm(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", distributed_executor_backend="uni", **kwargs)


def test_model_defaults_apply_to_generate_without_params(model_dir: str, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        llm = _llm(model_dir)
    try:
        warnings = [r.getMessage() for r in caplog.records if "generation_config" in r.getMessage()]
        assert len(warnings) == 1
        assert "`{'repetition_penalty': 1.0, 'top_k': 1, 'max_tokens': 5}`" in warnings[0]
        assert "--generation-config vllm" in warnings[0]
        defaults = llm.get_default_sampling_params()
        assert (defaults.top_k, defaults.max_tokens, defaults.temperature) == (1, 5, 1.0)
        greedy = SamplingParams(temperature=0, max_tokens=5)
        expected = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
        # no params: the model's top_k=1 at temperature 1 is greedy, and max_new_tokens caps
        for out in llm.generate([PROMPT] * 4, use_tqdm=False):
            assert out.outputs[0].token_ids == expected
        # params of one's own: the model's defaults do not apply (vLLM's LLM)
        own = llm.generate([PROMPT], SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)
        assert len(own[0].outputs[0].token_ids) == 9
    finally:
        llm.shutdown()


def test_generation_config_vllm_ignores_the_model_defaults(model_dir: str, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        llm = _llm(model_dir, generation_config="vllm")
    try:
        assert not [r for r in caplog.records if "generation_config" in r.getMessage()]
        assert llm.get_default_sampling_params() == SamplingParams()
        greedy = SamplingParams(temperature=0, max_tokens=16)
        expected = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
        outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 8, use_tqdm=False)]
        # temperature 1 without top-k, up to 16 tokens: not eight greedy runs of five
        assert any(len(ids) > 5 for ids in outs)
        assert any(ids != expected[: len(ids)] for ids in outs)
    finally:
        llm.shutdown()


def test_a_generation_config_directory_and_overrides(model_dir: str, tmp_path) -> None:
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    hf_config = {"vocab_size": 10}
    assert default_sampling_params(model_dir, str(other), hf_config) == {
        "temperature": 0.6,
        "top_p": 0.9,
    }
    assert default_sampling_params(model_dir, "vllm", hf_config) == {}
    assert default_sampling_params(model_dir, "vllm", hf_config, {"top_k": 3}) == {"top_k": 3}
    # no generation_config.json: the fields of config.json, where old checkpoints kept them
    assert default_sampling_params(str(tmp_path), "auto", {"temperature": 0.7, "x": 1}) == {
        "temperature": 0.7
    }
    config = EngineArgs(
        model=model_dir, generation_config=str(other), override_generation_config={"top_p": 0.5}
    ).create_engine_config()
    assert config.model.default_sampling_params == {"temperature": 0.6, "top_p": 0.5}


def test_bad_generation_config_is_refused_at_start(model_dir: str, tmp_path) -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a dir"):
        EngineArgs(model=model_dir, generation_config=str(tmp_path / "missing"))
    bad = _with_generation_config(model_dir, str(tmp_path / "bad"), {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config \(auto\): top_p must be in"):
        EngineArgs(model=bad).create_engine_config()


def test_server_rules_for_max_tokens(model_dir: str, tmp_path) -> None:
    """vLLM's rules: the model's max_new_tokens is used when a request sets none (bounded by
    the context); that of a generation-config directory caps even a request's own."""
    import dataclasses

    from minivllm.frontend.server.protocol import ChatCompletionRequest
    from minivllm.frontend.server.sampling import ServerDefaults, chat_sampling_params

    model = EngineArgs(model=model_dir).create_engine_config().model
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    asks = ChatCompletionRequest(messages=chat.messages, max_tokens=9, temperature=0.5)

    def params(config, request):
        return chat_sampling_params(request, False, ServerDefaults.of(config))

    assert (params(model, chat).max_tokens, params(model, chat).top_k) == (5, 1)
    assert (params(model, asks).max_tokens, params(model, asks).temperature) == (9, 0.5)
    huge = dataclasses.replace(model, default_sampling_params={"max_tokens": 10**6})
    assert params(huge, chat).max_tokens == model.max_model_len
    capped = dataclasses.replace(model, generation_config=str(tmp_path))
    assert params(capped, asks).max_tokens == 5
