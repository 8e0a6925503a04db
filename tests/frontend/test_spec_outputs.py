"""What the frontend does with speculative decoding's steps: several tokens in one output (a
stop string ends them at the token that completes it, as it would one token at a time), and
vLLM's spec-decode metrics (Prometheus counters, the stats log line)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from prometheus_client import generate_latest

from minivllm.config import EngineArgs
from minivllm.frontend.input_processor import InputProcessor
from minivllm.frontend.metrics.loggers import LoggingStatLogger
from minivllm.frontend.metrics.prometheus import PrometheusStatLogger
from minivllm.frontend.metrics.stats import StatsCollector
from minivllm.frontend.output_processor import OutputProcessor
from minivllm.frontend.tokenizer import load_tokenizer
from minivllm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    LogprobsArrays,
    SchedulerStats,
)
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

TEXT = "Hello world! How are you today?"


def stream(qwen3_dir: str, steps: list[list[int]], **params):
    """Feed each step's ids as one output (with a logprobs row each); the outputs and the ids
    the processor asked to abort."""
    config = EngineArgs(model=qwen3_dir, max_model_len=64, device="cpu").create_engine_config()
    tokenizer = load_tokenizer(qwen3_dir)
    inputs, outputs = InputProcessor(config.model, tokenizer), OutputProcessor(tokenizer)
    (req,) = outputs.add_user_request("u", "Hi", SamplingParams(**params), inputs)
    results, aborted = [], []
    for ids in steps:
        n = len(ids)
        rows = LogprobsArrays(
            np.array([[t] for t in ids], dtype=np.int32),
            -np.arange(1, n + 1, dtype=np.float32)[:, None],
            np.ones(n, dtype=np.int32),
        )
        out = EngineCoreOutput(req.request_id, ids, new_logprobs=rows)
        processed = outputs.process_outputs([out])
        results += processed.request_outputs
        aborted += processed.reqs_to_abort
        if results and results[-1].finished:
            break
    return tokenizer, results, aborted, req.request_id


@pytest.mark.parametrize("step_size", [1, 3, 8])
def test_a_stop_string_ends_the_tokens_where_one_token_at_a_time_would(
    qwen3_dir: str, step_size: int
) -> None:
    tokenizer = load_tokenizer(qwen3_dir)
    ids = tokenizer.encode(TEXT)
    steps = [ids[i : i + step_size] for i in range(0, len(ids), step_size)]
    _, results, aborted, rid = stream(
        qwen3_dir, steps, stop=["How"], logprobs=0, output_kind=RequestOutputKind.CUMULATIVE
    )
    final = results[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "How"
    assert final.text == "Hello world! "
    # the ids up to the one whose text completes "How", whatever the step sizes
    cut = next(i for i in range(1, len(ids) + 1) if "How" in tokenizer.decode(ids[:i]))
    assert list(final.token_ids) == ids[:cut]
    assert len(final.logprobs) == cut
    assert aborted == [rid]


def test_delta_outputs_of_several_tokens(qwen3_dir: str) -> None:
    tokenizer = load_tokenizer(qwen3_dir)
    ids = tokenizer.encode(TEXT)
    steps = [ids[:1], ids[1:5], ids[5:]]
    _, results, _, _ = stream(qwen3_dir, steps, stop=["you"], output_kind=RequestOutputKind.DELTA)
    text = "".join(r.outputs[0].text for r in results)
    tokens = [t for r in results for t in r.outputs[0].token_ids]
    assert text == "Hello world! How are "
    assert "you" in tokenizer.decode(tokens) and "you" not in tokenizer.decode(tokens[:-1])


def snapshot(**spec) -> EngineCoreOutputs:
    return EngineCoreOutputs(scheduler_stats=SchedulerStats(1, 0, 0.1, **spec), timestamp=1.0)


def test_metrics_count_drafts_and_acceptance(caplog: pytest.LogCaptureFixture) -> None:
    prom = PrometheusStatLogger("m", 64)  # a daemon's client: k learnt from the stats
    log = LoggingStatLogger("GPU")
    stats = StatsCollector([prom, log])
    stats.record(snapshot())  # an engine without speculation: no counters
    assert b"spec_decode" not in generate_latest(prom.registry)
    first = dict(spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=18)
    stats.record(snapshot(**first, spec_num_accepted_tokens_per_pos=[9, 6, 3]))
    second = dict(spec_num_drafts=12, spec_num_draft_tokens=36, spec_num_accepted_tokens=20)
    stats.record(snapshot(**second, spec_num_accepted_tokens_per_pos=[11, 6, 3]))
    text = generate_latest(prom.registry).decode()
    labels = 'engine="0",model_name="m"'
    assert f"vllm:spec_decode_num_drafts_total{{{labels}}} 12.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 36.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 20.0" in text
    for pos, n in enumerate([11, 6, 3]):
        line = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{pos}"}}'
        assert f"{line} {float(n)}" in text
    with caplog.at_level(logging.DEBUG, logger="minivllm.stats"):  # (no tokens: idle)
        log.log()
    spec_line = next(r.getMessage() for r in caplog.records if "SpecDecoding" in r.getMessage())
    assert spec_line.startswith("Engine 000: SpecDecoding metrics: Mean acceptance length: 2.67, ")
    assert "Accepted: 20 tokens, Drafted: 36 tokens, " in spec_line
    assert "Per-position acceptance rate: 0.917, 0.500, 0.250, " in spec_line
    assert spec_line.endswith("Avg Draft acceptance rate: 55.6%")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="minivllm.stats"):
        log.log()  # nothing verified since: no spec line
    assert not any("SpecDecoding" in r.getMessage() for r in caplog.records)
