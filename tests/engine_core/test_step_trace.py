"""MINIVLLM_STEP_TRACE writes what every step carried and when its output came back."""

from __future__ import annotations

import json

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from tests.tiny_models import build_null_checkpoint


def test_step_trace(tmp_path, monkeypatch) -> None:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("MINIVLLM_STEP_TRACE", str(trace))
    model = build_null_checkpoint(str(tmp_path / "null"))
    args = EngineArgs(model=model, distributed_executor_backend="uni", max_num_batched_tokens=64)
    core = EngineCore(args.create_engine_config())
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i in range(3):
        prompt = list(range(1 + 50 * i, 41 + 50 * i))  # distinct: no prefix-cache hits
        core.add_request(EngineCoreRequest(str(i), prompt, params))
    while core.has_work():
        core.step()
    core.shutdown()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) >= 5  # 120 prompt tokens at 64 a step, then decodes
    assert all(r["applied_ms"] >= r["launched_ms"] for r in records)
    assert sum(r["prefill_tokens"] for r in records) == 3 * 40  # chunked over several steps
    assert sum(r["num_decodes"] for r in records) == 3 * 4  # the other four tokens each
