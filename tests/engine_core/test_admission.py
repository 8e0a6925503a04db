"""A request that reaches the engine-core without the frontend's checks (a client of a
daemon speaks the wire directly) ends alone with an error; the others keep their tokens."""

from __future__ import annotations

import pytest

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest, FinishReason
from minivllm.protocol.sampling_params import SamplingParams
from tests.e2e.daemon import greedy, null_tokens
from tests.tiny_models import VOCAB_SIZE, build_null_checkpoint


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    model = build_null_checkpoint(str(tmp_path_factory.mktemp("null")))
    args = EngineArgs(model=model, distributed_executor_backend="uni", max_model_len=256)
    core = EngineCore(args.create_engine_config())
    yield core
    core.shutdown()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([1, VOCAB_SIZE], greedy(4), "prompt_token_ids: token ids must be in 0..383"),
        ([1, -1], greedy(4), "prompt_token_ids"),
        ([1] * 257, greedy(4), "longer than max_model_len"),
        ([1], SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), "logit_bias"),
        ([1], SamplingParams(allowed_token_ids=[0, 10_000]), "allowed_token_ids"),
        ([1], SamplingParams(logprobs=21), "logprobs: at most 20, got 21"),
        ([1], SamplingParams(prompt_logprobs=-1), "prompt_logprobs: at most 20"),
    ],
)
def test_request_the_model_cannot_serve_ends_alone(core, prompt, params, message) -> None:
    core.add_request(EngineCoreRequest("good", [1, 2, 3], greedy(6)))
    core.add_request(EngineCoreRequest("bad", prompt, params))
    tokens: list[int] = []
    errors = {}
    while core.has_work():
        for outputs in core.step().values():
            for out in outputs.outputs:
                if out.request_id == "good":
                    tokens += out.new_token_ids
                elif out.finish_reason is not None:
                    errors[out.request_id] = (out.finish_reason, out.error)
    assert tokens == null_tokens(3, 6)
    reason, error = errors["bad"]
    assert reason == FinishReason.ERROR and message in error
