"""What ignore_eos does, as a user sees it. EOS ends a request unless ignore_eos, which
generates on past it; a stop token id ends it either way (EOS too, when listed there);
min_tokens holds back EOS either way (test_logits_processing.py); a grammar ends at EOS
either way, after which an ignore_eos request generates on, unconstrained. One set of stop
tokens, made once on the engine-core's request, serves all of it, for any client."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest, FinishReason
from tests.hf_reference import parity_prompts

EOS = 0  # the tiny models' EOS
PROMPT = {"prompt_token_ids": parity_prompts()[2]}


@pytest.fixture(scope="module")
def llm(qwen3_dir: str):
    llm = LLM(qwen3_dir, dtype="float32", distributed_executor_backend="uni")
    yield llm
    llm.shutdown()


def generate(llm: LLM, **params):  # noqa: ANN003, ANN201
    params.setdefault("logit_bias", {EOS: 30.0})  # EOS the likeliest token by far
    params.setdefault("max_tokens", 5)
    return llm.generate(PROMPT, SamplingParams(temperature=0, **params))[0]


def test_eos_ends_the_request_unless_ignore_eos(llm: LLM) -> None:
    out = generate(llm).outputs[0]
    assert out.token_ids == [EOS]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = generate(llm, ignore_eos=True).outputs[0]
    assert out.token_ids == [EOS] * 5
    assert (out.finish_reason, out.stop_reason) == ("length", None)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_stop_token_id_ends_the_request_either_way(llm: LLM, ignore_eos: bool) -> None:
    out = generate(llm, ignore_eos=ignore_eos, stop_token_ids=[99], logit_bias={99: 30.0})
    assert out.outputs[0].token_ids == [99]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", 99)
    # EOS listed as a stop token id: it ends the request, with itself as the stop reason
    out = generate(llm, ignore_eos=ignore_eos, stop_token_ids=[EOS]).outputs[0]
    assert out.token_ids == [EOS]
    assert (out.finish_reason, out.stop_reason) == ("stop", EOS if ignore_eos else None)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_ends_at_eos_either_way(llm: LLM, ignore_eos: bool) -> None:
    choice = StructuredOutputsParams(choice=["yes", "no"])
    out = generate(
        llm, ignore_eos=ignore_eos, max_tokens=8, logit_bias=None, structured_outputs=choice
    ).outputs[0]
    end = out.token_ids.index(EOS)  # the only token a finished grammar allows
    assert llm.get_tokenizer().decode(out.token_ids[:end]) in ("yes", "no")
    if ignore_eos:  # then on, unconstrained, to max_tokens
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
    else:
        assert end == len(out.token_ids) - 1 and out.finish_reason == "stop"


def test_min_tokens_holds_back_eos_for_a_client_of_the_core_itself(qwen3_dir: str) -> None:
    """A client that speaks the wire (a daemon's) sends no list of what min_tokens masks:
    the engine-core makes it from the request's stop tokens."""
    args = EngineArgs(model=qwen3_dir, dtype="float32", distributed_executor_backend="uni")
    core = EngineCore(args.create_engine_config())
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=3, logit_bias={EOS: 30.0})
    tokens, finish = [], None
    try:
        core.add_request(EngineCoreRequest("r", PROMPT["prompt_token_ids"], params, [EOS]))
        while core.has_work():
            for outputs in core.step().values():
                for o in outputs.outputs:
                    tokens += o.new_token_ids
                    if o.finish_reason is not None:
                        finish = o.finish_reason
    finally:
        core.shutdown()
    assert EOS not in tokens[:3] and tokens[3:] == [EOS]
    assert finish == FinishReason.STOP
