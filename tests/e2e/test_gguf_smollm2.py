"""A real model from a GGUF file: SmolLM2-135M-Instruct, Q4_1, with the tokenizer and chat
template the file carries, loaded once (the engine in-process: `minivllm serve` of a GGUF
file runs the multiprocess one, tests/server/test_gguf_serve.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from tests.gguf_files import smollm2_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM(smollm2_gguf(), dtype="float32", device="cpu", distributed_executor_backend="uni")
    yield llm
    llm.shutdown()


def test_greedy_tokens_equal_transformers_reading_the_same_file(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf()
    directory, name = os.path.dirname(path), os.path.basename(path)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)

    hf_tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = hf_tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False
            )
        assert list(out.outputs[0].token_ids) == ref[0, len(ids) :].tolist()


def test_chat_answers_sensibly(llm: LLM) -> None:
    japan = [{"role": "user", "content": "What is the capital of Japan?"}]
    outs = llm.chat([CAPITAL, japan], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    france, japan = (o.outputs[0] for o in outs)
    assert "Paris" in france.text
    assert "Tokyo" in japan.text
    # the file's EOS, <|im_end|>, ends each answer
    assert france.finish_reason == japan.finish_reason == "stop"


def test_structured_choice_compiles_against_the_files_vocabulary(llm: LLM) -> None:
    """The engine-core builds its grammar compiler from the GGUF file's tokenizer too."""
    cities = ["London", "Paris", "Berlin"]
    choice = StructuredOutputsParams(choice=cities)
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice)
    free = SamplingParams(temperature=0, max_tokens=8)
    constrained, unconstrained = llm.chat([CAPITAL, CAPITAL], [params, free], use_tqdm=False)
    assert constrained.outputs[0].text in cities
    assert unconstrained.outputs[0].text not in cities
