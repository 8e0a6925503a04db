"""`minivllm bench`: the workloads' totals, the memory floor, and end-to-end runs (with
benchmarks/grammar.py, which reads the structured-outputs workload)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from minivllm.benchmarks.floor import ExpertTraffic, memory_floor
from minivllm.benchmarks.geometry import (
    GEOMETRIES,
    expert_parameters,
    num_parameters,
    sparse_layers,
)
from minivllm.benchmarks.workloads import random_workload, reference_workload

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_reference_workload_totals():
    w = reference_workload()
    assert len(w.prompts) == len(w.output_lens) == 256
    assert w.num_prompt_tokens == 142_827
    assert w.num_output_tokens == 133_966
    assert w.max_model_len <= 4096
    assert all(0 <= t <= 10000 for p in w.prompts for t in p)


def test_random_workload_fixed_shapes():
    w = random_workload(4, 16, 8, seed=3)
    assert [len(p) for p in w.prompts] == [16] * 4
    assert w.output_lens == [8] * 4
    assert w.prompts == random_workload(4, 16, 8, seed=3).prompts
    with pytest.raises(ValueError):
        random_workload(0, 16, 8)


def test_qwen3_parameter_counts():
    assert num_parameters(GEOMETRIES["qwen3-0.6b"]) == 596_049_920  # Qwen3-0.6B's published count
    assert num_parameters(GEOMETRIES["qwen3-8b"]) == 8_190_735_360  # Qwen3-8B's card: 8.2B


def test_floor_matches_the_published_model():
    """Published: 13.87 TB of KV + 1.22 TB of weights -> 5.0 s at 3.02 TB/s."""
    w = reference_workload()
    cfg = GEOMETRIES["qwen3-0.6b"]
    floor = memory_floor(
        [len(p) for p in w.prompts],
        w.output_lens,
        num_layers=cfg["num_hidden_layers"],
        num_kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        param_bytes=2 * num_parameters(cfg),
    )
    assert floor.kv_bytes / 1e12 == pytest.approx(13.87, rel=0.01)
    assert floor.weight_bytes / 1e12 == pytest.approx(1.22, rel=0.01)
    assert floor.seconds(3.02e12) == pytest.approx(5.0, rel=0.01)


def test_moe_parameter_counts():
    assert num_parameters(GEOMETRIES["qwen3-30b-a3b"]) == 30_532_122_624  # the card: 30.5B
    assert num_parameters(GEOMETRIES["mixtral-8x7b"]) == 46_702_792_704  # the card: 46.7B
    assert expert_parameters(GEOMETRIES["qwen3-30b-a3b"]) == 3 * 2048 * 768
    assert sparse_layers(GEOMETRIES["qwen3-30b-a3b"]) == 48
    assert sparse_layers({**GEOMETRIES["qwen3-30b-a3b"], "mlp_only_layers": [0, 5]}) == 46
    assert sparse_layers(GEOMETRIES["qwen3-8b"]) == 0


def test_moe_floor_reads_the_experts_a_step_routes_to():
    # one request: every step routes its one token to k experts of each sparse layer
    experts = ExpertTraffic(expert_bytes=100, num_experts=128, top_k=8, num_layers=2)
    floor = memory_floor(
        [3], [4], num_layers=2, num_kv_heads=1, head_dim=1, param_bytes=10_000 + 128 * 200,
        experts=experts,
    )  # fmt: skip
    assert floor.expert_bytes == pytest.approx(4 * 8 * 100 * 2)
    assert floor.weight_bytes == pytest.approx(4 * 10_000 + floor.expert_bytes)
    # 256 requests decoding together touch every expert: the whole model each step
    floor = memory_floor(
        [3] * 256, [4] * 256, num_layers=2, num_kv_heads=1, head_dim=1,
        param_bytes=10_000 + 128 * 200, experts=experts,
    )  # fmt: skip
    assert floor.weight_bytes == pytest.approx(4 * (10_000 + 128 * 200), rel=1e-6)


def test_floor_counts_context_per_output_token():
    # one request, 3-token prompt, 2 outputs: contexts 3 and 4 tokens; 2 decode steps
    floor = memory_floor([3], [2], num_layers=1, num_kv_heads=1, head_dim=1, param_bytes=10)
    assert floor.kv_bytes == (3 + 4) * 2 * 2
    assert floor.weight_bytes == 2 * 10


def test_bench_throughput_end_to_end(qwen3_dir: str):
    cmd = [sys.executable, "-m", "minivllm.frontend.cli", "bench", "throughput"]
    cmd += ["--model", qwen3_dir, "--num-prompts", "4", "--input-len", "16", "--output-len", "8"]
    cmd += ["--distributed-executor-backend", "uni", "--device", "cpu"]
    cmd += ["--kv-cache-memory-bytes", str(50 << 20)]
    env = {**os.environ, "PYTHONPATH": _REPO}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = re.search(
        r"^Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s$",
        proc.stdout,
        re.M,
    )
    assert line, proc.stdout
    assert float(line.group(3)) > 0
    assert "Total num prompt tokens:  64" in proc.stdout
    assert "Total num output tokens:  32" in proc.stdout


def test_bench_structured_outputs_end_to_end(qwen3_dir: str, tmp_path):
    """The throughput comparison and the grammar costs, on the tiny model's own tokenizer."""
    env = {**os.environ, "PYTHONPATH": _REPO}
    base = [sys.executable, "-m", "minivllm.frontend.cli", "bench"]
    cmd = base + ["throughput", "--structured-outputs", "--model", qwen3_dir, "--device", "cpu"]
    cmd += ["--num-prompts", "4", "--input-len", "16", "--output-len", "16"]
    cmd += ["--distributed-executor-backend", "uni", "--kv-cache-memory-bytes", str(50 << 20)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^json-schema: \d+ of 4 outputs completed the schema", proc.stdout, re.M)
    assert re.search(r"^json-schema: \d+ output tok/s = [\d.]+% of plain$", proc.stdout, re.M)

    cmd = [sys.executable, os.path.join(_REPO, "benchmarks", "grammar.py"), "--model", qwen3_dir]
    cmd += ["--tokenizer", qwen3_dir, "--device", "cpu"]
    cmd += ["--rows", "8", "--steps", "4", "--num-requests", "8", "--input-len", "16"]
    cmd += ["--output-len", "48", "--num-new-schemas", "3"]
    trace = {"MINIVLLM_STEP_TRACE": str(tmp_path / "trace.jsonl")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env | trace, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the 8-field schema compiled in" in proc.stdout
    assert re.search(r"^  fill +[\d.]+ +[\d.]+$", proc.stdout, re.M), proc.stdout
    # the trace's summary, by the script that reads it
    cmd = [
        sys.executable,
        os.path.join(_REPO, "benchmarks", "trace.py"),
        trace["MINIVLLM_STEP_TRACE"],
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(
        r"^\d+ steps, [\d.]+ s from the first launch to the last output$", proc.stdout, re.M
    )
    assert re.search(r"^grammar bitmask: \d+ steps; sent ", proc.stdout, re.M), proc.stdout
