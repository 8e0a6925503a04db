"""A continuation (what the frontend sends when the engine-core that ran a request died):
the request with the tokens it already produced, which the engine-core takes as outputs.
What it generates next is what the request would have generated had it never moved: the
same tokens (greedy, seeded, and unseeded with the same engine seed and id), logprobs,
penalties, min_tokens, max_tokens and grammar; a continuation with nothing left to do ends
alone with an error."""

from __future__ import annotations

import numpy as np
import pytest

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest, FinishReason
from minivllm.protocol.sampling_params import SamplingParams
from tests.structured_cases import check_text, constraints

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64]
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def core(qwen3_dir: str):
    args = EngineArgs(
        model=qwen3_dir,
        distributed_executor_backend="uni",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        max_num_batched_tokens=32,  # a continuation's prefill runs in chunks
    )
    core = EngineCore(args.create_engine_config())
    yield core
    core.shutdown()


def run(core: EngineCore, *requests: EngineCoreRequest) -> dict[str, dict]:
    """Step until idle: per request its tokens, logprobs rows, prompt logprobs, finish."""
    for r in requests:
        core.add_request(r)
    results = {
        r.request_id: {"tokens": [], "logprobs": [], "prompt_logprobs": None} for r in requests
    }
    for _ in range(10_000):
        if not core.has_work():
            return results
        for outputs in core.step().values():
            for out in outputs.outputs:
                r = results[out.request_id]
                r["tokens"] += out.new_token_ids
                if out.new_logprobs is not None:
                    r["logprobs"] += out.new_logprobs.logprobs.tolist()
                if out.new_prompt_logprobs is not None:
                    r["prompt_logprobs"] = out.new_prompt_logprobs.logprobs.tolist()
                r["finish"], r["error"] = out.finish_reason, out.error
    raise AssertionError("the engine did not finish")


def continued(core: EngineCore, params: SamplingParams, k: int, req_id: str = "a") -> tuple:
    """The request run whole, and again as a continuation after its first k tokens (the
    same id, as the frontend sends it)."""
    whole = run(core, EngineCoreRequest(req_id, PROMPT, params, eos_token_ids=[0]))[req_id]
    assert len(whole["tokens"]) > k, whole
    cont = EngineCoreRequest(
        req_id, PROMPT, params, eos_token_ids=[0], output_token_ids=whole["tokens"][:k]
    )
    return whole, run(core, cont)[req_id]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=60, ignore_eos=True),
        # no seed: the engine derives one from its seed and the request id, both unchanged
        SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            seed=3,
            presence_penalty=0.8,
            frequency_penalty=0.6,
            repetition_penalty=1.4,
            max_tokens=60,
            ignore_eos=True,
        ),
        SamplingParams(
            temperature=0.9, top_k=20, min_p=0.05, seed=11, max_tokens=60, ignore_eos=True
        ),
    ],
    ids=["greedy", "seeded", "unseeded", "penalties", "top-k-min-p"],
)
def test_continuation_generates_what_the_request_would_have(core, params) -> None:
    for k in (1, 23, 45):
        whole, cont = continued(core, params, k)
        assert cont["tokens"] == whole["tokens"][k:], k
        assert cont["finish"] == FinishReason.LENGTH  # max_tokens counts the carried ones


def test_logprobs_continue_and_prompt_logprobs_are_not_sent_again(core) -> None:
    params = SamplingParams(
        temperature=0.7, seed=1, logprobs=3, prompt_logprobs=2, max_tokens=30, ignore_eos=True
    )
    whole, cont = continued(core, params, 12)
    assert len(whole["logprobs"]) == 30 and whole["prompt_logprobs"] is not None
    np.testing.assert_allclose(cont["logprobs"], whole["logprobs"][12:], atol=1e-5)
    assert cont["prompt_logprobs"] is None  # sent with the first token, before the move
    # a continuation of nothing yet is the request anew: its prompt logprobs come
    _, fresh = continued(core, params, 0)
    np.testing.assert_allclose(fresh["prompt_logprobs"], whole["prompt_logprobs"], atol=1e-5)


def test_min_tokens_counts_the_carried_outputs(core) -> None:
    base = SamplingParams(temperature=0.0, min_tokens=20, max_tokens=60, ignore_eos=True)
    tokens = run(core, EngineCoreRequest("m", PROMPT, base))["m"]["tokens"]
    # a stop token that the output first holds between 20 and 35: min_tokens keeps it from
    # ending the request before 20 outputs, and no later
    stop = next(t for t in tokens[20:35] if t not in tokens[:20])
    params = SamplingParams(temperature=0.0, min_tokens=20, max_tokens=60, stop_token_ids=[stop])
    whole, cont = continued(core, params, 15, req_id="m")
    assert whole["tokens"][-1] == stop and 20 < len(whole["tokens"]) <= 35
    assert whole["finish"] == FinishReason.STOP
    assert cont["tokens"] == whole["tokens"][15:]
    assert cont["finish"] == FinishReason.STOP


def test_structured_output_continues_under_its_grammar(core) -> None:
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=200, structured_outputs=constraints()["json"]
    )
    whole = run(core, EngineCoreRequest("s", PROMPT, params, eos_token_ids=[0]))["s"]
    assert whole["finish"] == FinishReason.STOP
    k = len(whole["tokens"]) // 2
    cont = EngineCoreRequest("s", PROMPT, params, [0], output_token_ids=whole["tokens"][:k])
    again = run(core, cont)["s"]
    assert again["tokens"] == whole["tokens"][k:] and again["finish"] == FinishReason.STOP
    tokenizer = AutoTokenizer.from_pretrained(core.config.model.tokenizer)
    check_text("json", tokenizer.decode(whole["tokens"][:k] + again["tokens"][:-1]))


def test_continuation_the_grammar_refuses_fails_alone(core) -> None:
    pytest.importorskip("xgrammar")
    params = SamplingParams(
        temperature=0.0, max_tokens=10, structured_outputs=constraints()["choice"]
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(core.config.model.tokenizer)
    letters = tokenizer.encode("abc")  # no choice starts so
    results = run(
        core,
        EngineCoreRequest("bad", PROMPT, params, [0], output_token_ids=letters),
        EngineCoreRequest("good", PROMPT, SamplingParams(temperature=0.0, max_tokens=5)),
    )
    assert results["bad"]["finish"] == FinishReason.ERROR
    assert "refuses the output_token_ids" in results["bad"]["error"]
    assert len(results["good"]["tokens"]) == 5


@pytest.mark.parametrize(
    ("max_tokens", "outputs", "message"),
    [
        (10, [7] * 10, "10 tokens already, max_tokens is 10: nothing is left"),
        (None, [7] * (MAX_MODEL_LEN - len(PROMPT)), "leave no room within max_model_len"),
        (10, [7, 10_000], "output_token_ids: token ids must be in 0..383"),
    ],
)
def test_continuation_with_nothing_to_do_ends_alone(core, max_tokens, outputs, message) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = run(
        core,
        EngineCoreRequest("bad", PROMPT, params, output_token_ids=outputs),
        EngineCoreRequest("good", PROMPT, SamplingParams(temperature=0.0, max_tokens=5)),
    )
    assert results["bad"]["finish"] == FinishReason.ERROR
    assert message in results["bad"]["error"]
    assert len(results["good"]["tokens"]) == 5
