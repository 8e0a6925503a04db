"""Engine-core outputs → RequestOutputs: output kinds, stop strings, n > 1, errors, aborts."""

from __future__ import annotations

import pytest

from minivllm.config import EngineArgs
from minivllm.frontend.input_processor import InputProcessor
from minivllm.frontend.output_processor import OutputProcessor, RequestOutputCollector
from minivllm.frontend.tokenizer import load_tokenizer
from minivllm.outputs import RequestOutput
from minivllm.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Hello world! How are you today?"
CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


@pytest.fixture(scope="module")
def setup(qwen3_dir: str):
    config = EngineArgs(model=qwen3_dir, max_model_len=64, device="cpu").create_engine_config()
    tokenizer = load_tokenizer(qwen3_dir)
    return config.model, tokenizer


@pytest.fixture
def tokenizer(setup):
    return setup[1]


@pytest.fixture
def processors(setup) -> tuple[InputProcessor, OutputProcessor]:
    model_config, tokenizer = setup
    return InputProcessor(model_config, tokenizer), OutputProcessor(tokenizer)


def add(processors, user_id: str, **params) -> list[EngineCoreRequest]:
    input_processor, output_processor = processors
    return output_processor.add_user_request(
        user_id, "Hi", SamplingParams(**params), input_processor
    )


def run(
    output_processor: OutputProcessor,
    request_id: str,
    ids: list[int],
    finish_reason: FinishReason | None = FinishReason.LENGTH,
) -> list[RequestOutput]:
    """Feed one id per step, finishing with `finish_reason` on the last; collect outputs."""
    outputs = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineCoreOutput(request_id, [token_id], finish_reason if last else None)
        processed = output_processor.process_outputs([out])
        assert not processed.errors
        outputs += processed.request_outputs
    return outputs


def test_cumulative_outputs_grow_to_the_full_text(processors, tokenizer):
    (request,) = add(processors, "u", max_tokens=50)
    ids = tokenizer.encode(TEXT)
    outputs = run(processors[1], request.request_id, ids)
    assert len(outputs) == len(ids)
    for i, out in enumerate(outputs):
        assert out.request_id == "u" and out.prompt == "Hi"
        assert out.outputs[0].token_ids == ids[: i + 1]
        assert TEXT.startswith(out.outputs[0].text)
    final = outputs[-1]
    assert final.finished and final.outputs[0].text == TEXT
    assert final.outputs[0].finish_reason == "length"
    assert not processors[1].has_unfinished_requests()


def test_delta_outputs_concatenate_to_the_full_text(processors, tokenizer):
    (request,) = add(processors, "u", output_kind=DELTA, stop=["zzz"])
    ids = tokenizer.encode("你好 😀 " + TEXT)
    outputs = run(processors[1], request.request_id, ids)
    assert [o.finished for o in outputs] == [False] * (len(ids) - 1) + [True]
    assert "".join(o.outputs[0].text for o in outputs) == "你好 😀 " + TEXT
    assert sum((o.outputs[0].token_ids for o in outputs), []) == ids


@pytest.mark.parametrize("stop", [None, ["e y"]])
def test_a_lagging_consumer_gets_the_steps_it_missed_in_one_output(processors, tokenizer, stop):
    """Steps that come before the consumer takes its output extend that output: the same
    text and ids as one output per step, the stop string's cut and finish included."""
    input_processor, output_processor = processors
    queue = RequestOutputCollector(DELTA)
    params = SamplingParams(output_kind=DELTA, stop=stop, max_tokens=50)
    (request,) = output_processor.add_user_request("u", "Hi", params, input_processor, queue=queue)
    ids = tokenizer.encode("你好 😀 " + TEXT)
    taken = []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        processed = output_processor.process_outputs(
            [EngineCoreOutput(request.request_id, [token_id], finish)]
        )
        assert processed.request_outputs == []
        if i % 3 == 2:  # the consumer wakes every third step
            taken.append(queue.get_nowait())
        if not output_processor.has_unfinished_requests():
            break
    if (rest := queue.get_nowait()) is not None:
        taken.append(rest)
    text = "".join(o.outputs[0].text for o in taken)
    assert [o.finished for o in taken] == [False] * (len(taken) - 1) + [True]
    if stop is None:
        assert text == "你好 😀 " + TEXT
        assert sum((o.outputs[0].token_ids for o in taken), []) == ids
        assert taken[-1].outputs[0].finish_reason == "length"
    else:
        assert text == "你好 😀 Hello world! How ar"
        assert (taken[-1].outputs[0].finish_reason, taken[-1].outputs[0].stop_reason) == (
            "stop",
            "e y",
        )


def test_final_only_emits_once(processors, tokenizer):
    (request,) = add(processors, "u", output_kind=FINAL_ONLY)
    ids = tokenizer.encode(TEXT) + [tokenizer.eos_token_id]
    (final,) = run(processors[1], request.request_id, ids, FinishReason.STOP)
    assert final.finished and final.outputs[0].text == TEXT
    assert final.outputs[0].token_ids == ids
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", None)


def test_stop_string_finishes_the_request_and_asks_for_an_abort(processors, tokenizer):
    (request,) = add(processors, "u", stop=["e y"])
    output_processor = processors[1]
    ids = tokenizer.encode(TEXT)
    outs = [EngineCoreOutput(request.request_id, [t]) for t in ids]
    processed = output_processor.process_outputs(outs[:11])  # "e y" ends in the 11th token
    assert processed.reqs_to_abort == [request.request_id]
    final = processed.request_outputs[-1]
    assert final.finished and final.outputs[0].text == "Hello world! How ar"
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", "e y")
    assert not output_processor.has_unfinished_requests()
    late = output_processor.process_outputs(outs[11:])  # the core had not heard yet
    assert late.request_outputs == [] and late.reqs_to_abort == []


@pytest.mark.parametrize("seed", [None, 7])
def test_n_fans_out_into_children_with_their_own_ids_and_seeds(processors, seed):
    requests = add(processors, "u", n=3, seed=seed)
    assert len({r.request_id for r in requests}) == 3
    assert all(r.sampling_params.n == 1 for r in requests)
    expected = [None] * 3 if seed is None else [7, 8, 9]
    assert [r.sampling_params.seed for r in requests] == expected
    assert processors[1].get_internal_ids("u") == [r.request_id for r in requests]


def test_n_final_only_gives_n_completions_once(processors, tokenizer):
    requests = add(processors, "u", n=3, output_kind=FINAL_ONLY)
    texts = ["Hello", "world", "today"]
    outputs = []
    for request, text in zip(requests, texts, strict=True):
        outputs += run(processors[1], request.request_id, tokenizer.encode(text))
    (final,) = outputs
    assert final.finished and final.request_id == "u"
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == texts


def test_n_cumulative_shows_all_children_and_delta_only_the_updated_one(processors, tokenizer):
    cumulative = add(processors, "c", n=3, max_tokens=8)
    delta = add(processors, "d", n=3, output_kind=DELTA, max_tokens=8)
    output_processor = processors[1]
    step = [EngineCoreOutput(r.request_id, tokenizer.encode("Hi")) for r in cumulative + delta]
    step[1].finish_reason = FinishReason.LENGTH
    outputs = output_processor.process_outputs(step).request_outputs
    assert [o.request_id for o in outputs] == ["c"] * 3 + ["d"] * 3
    assert [len(o.outputs) for o in outputs] == [3, 3, 3, 1, 1, 1]
    assert [c.text for c in outputs[2].outputs] == ["Hi", "Hi", "Hi"]
    assert [c.finished() for c in outputs[2].outputs] == [False, True, False]
    assert [o.outputs[0].index for o in outputs[3:]] == [0, 1, 2]
    assert not any(o.finished for o in outputs)
    for r in cumulative + delta:
        if r.request_id != step[1].request_id:
            done = EngineCoreOutput(r.request_id, [5], FinishReason.LENGTH)
            outputs = output_processor.process_outputs([done]).request_outputs
    assert outputs[-1].finished  # the last child of "d" finished the parent
    assert not output_processor.has_unfinished_requests()


def test_errors_surface_and_end_the_whole_request(processors):
    requests = add(processors, "u", n=2)
    output_processor = processors[1]
    failed = EngineCoreOutput(requests[0].request_id, [], FinishReason.ERROR, error="boom")
    processed = output_processor.process_outputs([failed])
    assert processed.errors == {"u": "boom"}
    assert processed.reqs_to_abort == [requests[1].request_id]  # the sibling, in the core
    (out,) = processed.request_outputs
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert not output_processor.has_unfinished_requests()


def test_abort_user_requests_returns_the_internal_ids(processors):
    requests = add(processors, "u", n=2)
    internal = processors[1].abort_user_requests(["u", "unknown"])
    assert internal == [r.request_id for r in requests]
    assert processors[1].get_num_unfinished_requests() == 0


def test_a_user_id_is_reusable_once_finished_not_while_running(processors):
    (first,) = add(processors, "u")
    with pytest.raises(ValueError, match="request_id 'u' is already running"):
        add(processors, "u")
    processors[1].process_outputs([EngineCoreOutput(first.request_id, [5], FinishReason.LENGTH)])
    (second,) = add(processors, "u")
    assert second.request_id != first.request_id


def test_without_a_tokenizer_outputs_carry_token_ids_only(setup):
    model_config, _ = setup
    input_processor, output_processor = InputProcessor(model_config, None), OutputProcessor(None)
    (request,) = output_processor.add_user_request(
        "u", [1, 2, 3], SamplingParams(), input_processor
    )
    (out,) = run(output_processor, request.request_id, [7], FinishReason.LENGTH)
    assert out.prompt is None and out.prompt_token_ids == [1, 2, 3]
    assert (out.outputs[0].text, out.outputs[0].token_ids) == ("", [7])


def test_reprs_read_like_vllm(processors, tokenizer):
    (request,) = add(processors, "u")
    out = run(processors[1], request.request_id, tokenizer.encode("Hi"))[-1]
    assert repr(out).startswith("RequestOutput(request_id=u, prompt='Hi', prompt_token_ids=")
    assert "CompletionOutput(index=0, text='Hi', token_ids=" in repr(out)
    assert "finish_reason=length, stop_reason=None)" in repr(out)
