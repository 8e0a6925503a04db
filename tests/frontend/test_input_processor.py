"""Prompt → EngineCoreRequest: the accepted prompt forms, validation errors, ids, chat."""

from __future__ import annotations

import dataclasses
import secrets

import pytest

from minivllm.config import EngineArgs, ModelConfig
from minivllm.frontend.input_processor import InputProcessor
from minivllm.frontend.tokenizer import Tokenizer, load_tokenizer
from minivllm.protocol.sampling_params import SamplingParams

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def model_config(qwen3_dir: str) -> ModelConfig:
    args = EngineArgs(model=qwen3_dir, max_model_len=MAX_MODEL_LEN, device="cpu")
    return args.create_engine_config().model


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir: str) -> Tokenizer:
    return load_tokenizer(qwen3_dir)


@pytest.fixture
def processor(model_config, tokenizer) -> InputProcessor:
    return InputProcessor(model_config, tokenizer)


def test_all_prompt_forms_give_the_same_tokens(processor, tokenizer):
    ids = tokenizer.encode("Hello world!")
    params = SamplingParams(max_tokens=4)
    forms = ["Hello world!", {"prompt": "Hello world!"}, {"prompt_token_ids": ids}, ids]
    results = [processor.process("r", form, params) for form in forms]
    assert [text for text, _ in results] == ["Hello world!", "Hello world!", None, None]
    for _, request in results:
        assert request.prompt_token_ids == ids
        assert request.eos_token_ids == [0]
        assert request.sampling_params.max_tokens == 4


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "prompt: the decoder prompt cannot be empty"),
        ([], "prompt: the decoder prompt cannot be empty"),
        ([1, 2, 384], "prompt_token_ids: token id 384 is out of vocabulary"),
        ([1, -1], "prompt_token_ids: token id -1 is out of vocabulary"),
        ([1, "2"], "prompt_token_ids must be a list of ints"),
        ({"text": "hi"}, "prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'"),
        (3.5, "prompt must be a str"),
    ],
)
def test_bad_prompts_name_the_parameter(processor, prompt, match):
    with pytest.raises(ValueError, match=match):
        processor.process("r", prompt, SamplingParams())


def test_bad_params_name_the_parameter(processor):
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        processor.process("r", "hi", {"max_tokens": 3})
    with pytest.raises(ValueError, match="stop_token_ids: token id 999"):
        processor.process("r", "hi", SamplingParams(stop_token_ids=[999]))


def test_prompt_that_fills_max_model_len_is_rejected(processor):
    with pytest.raises(ValueError) as info:
        processor.process("r", [5] * MAX_MODEL_LEN, SamplingParams())
    assert str(info.value).startswith(
        f"The decoder prompt (length {MAX_MODEL_LEN}) is longer than the maximum model "
        f"length of {MAX_MODEL_LEN}"
    )
    processor.process("r", [5] * (MAX_MODEL_LEN - 1), SamplingParams())  # room for one


@pytest.mark.parametrize(("max_tokens", "expected"), [(None, 22), (100, 22), (5, 5)])
def test_max_tokens_is_capped_to_the_room_left(processor, max_tokens, expected):
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min(max_tokens or 50, 50))
    _, request = processor.process("r", [5] * 10, params)
    assert request.sampling_params.max_tokens == expected
    assert request.sampling_params.min_tokens <= expected
    assert params.max_tokens == max_tokens  # the caller's params are untouched


def test_internal_ids_are_unique_when_a_user_id_is_reused(processor, model_config, tokenizer):
    other_frontend = InputProcessor(model_config, tokenizer)
    ids = [processor.process("same", "hi", SamplingParams())[1].request_id for _ in range(5)]
    ids.append(other_frontend.process("same", "hi", SamplingParams())[1].request_id)
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("same-") for i in ids)


def test_api_processes_never_share_an_internal_id(model_config, tokenizer, monkeypatch):
    """The API processes of one server: their ids differ by their index, even where their
    random part does not."""
    monkeypatch.setattr(secrets, "token_hex", lambda n: "ab" * n)
    processors = [InputProcessor(model_config, tokenizer, client_index=i) for i in range(17)]
    ids = [p.process("same", "hi", SamplingParams())[1].request_id for p in processors]
    ids += [p.process("same", "hi", SamplingParams())[1].request_id for p in processors]
    assert len(set(ids)) == len(ids)


def test_skip_tokenizer_init_takes_token_ids_only(model_config):
    processor = InputProcessor(dataclasses.replace(model_config, skip_tokenizer_init=True), None)
    _, request = processor.process("r", [1, 2, 3], SamplingParams())
    assert request.prompt_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="prompt: a text prompt needs a tokenizer"):
        processor.process("r", "hi", SamplingParams())
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        processor.process("r", [1, 2, 3], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="messages: chat needs a tokenizer"):
        processor.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_renders_a_prompt_for_process(processor, tokenizer):
    messages = [{"role": "user", "content": "Hello world!"}]
    prompt = processor.apply_chat_template(messages)
    assert prompt["prompt"] == "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"
    assert prompt["prompt_token_ids"][0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    text, request = processor.process("r", prompt, SamplingParams())
    assert text == prompt["prompt"]
    assert request.prompt_token_ids == prompt["prompt_token_ids"]
    no_gen = processor.apply_chat_template(messages, add_generation_prompt=False)
    assert not no_gen["prompt"].endswith("assistant\n")
    custom = processor.apply_chat_template(messages, chat_template="{{ messages[0]['content'] }}")
    assert custom["prompt"] == "Hello world!"


def test_bad_messages_name_the_parameter(processor):
    with pytest.raises(ValueError, match="messages must be a list"):
        processor.apply_chat_template([{"content": "no role"}])
