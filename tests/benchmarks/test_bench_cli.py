"""`minivllm bench`: the workloads' totals, the memory floor, and end-to-end runs (with
benchmarks/grammar.py, which reads the structured-outputs workload)."""

from __future__ import annotations

import json
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
    weight_bytes,
    write_geometry,
)
from minivllm.benchmarks.workloads import random_workload, reference_workload
from minivllm.frontend.arg_utils import EngineArgs

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


def test_quantized_weight_bytes():
    """Qwen3-8B: 6.95B parameters in its linear layers, the rest (embeddings, LM head) 16-bit."""
    cfg = GEOMETRIES["qwen3-8b"]
    bf16 = weight_bytes(cfg, 2, None)
    assert bf16 == 2 * num_parameters(cfg)
    linear = bf16 / 2 - 2 * 151936 * 4096 - 36 * 2 * 4096 - 4096 - 36 * 2 * 128
    assert linear == pytest.approx(6.95e9, rel=0.01)
    assert weight_bytes(cfg, 2, "fp8") == pytest.approx(bf16 - linear, rel=0.001)
    assert weight_bytes(cfg, 2, "awq") == pytest.approx(bf16 - 1.4765625 * linear, rel=0.001)
    # Qwen3-30B-A3B: its 48 x 128 experts (29.0B) and attention (1.3B) in FP8
    cfg = GEOMETRIES["qwen3-30b-a3b"]
    experts = 48 * 128 * expert_parameters(cfg)
    attention = 48 * 2048 * (2 * 32 + 2 * 4) * 128
    fp8 = (experts + attention) * (1 + 4 / 128**2)
    assert weight_bytes(cfg, 2, "fp8") == pytest.approx(
        2 * num_parameters(cfg) - 2 * (experts + attention) + fp8, rel=1e-6
    )


def test_bench_quantized_end_to_end():
    """Dummy weights of the CPU geometry in FP8 blocks: the throughput run, and the top-1
    agreement of FP8 weights with the same weights in float32 (benchmarks/kv_accuracy.py)."""
    env = {**os.environ, "PYTHONPATH": _REPO}
    base = [sys.executable, "-m", "minivllm.frontend.cli", "bench"]
    common = ["--quantization", "fp8", "--device", "cpu", "--input-len", "32"]
    cmd = base + ["throughput", *common, "--num-prompts", "4", "--output-len", "8"]
    cmd += ["--distributed-executor-backend", "uni"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dtype float32, weights fp8" in proc.stdout
    assert "Total num output tokens:  32" in proc.stdout
    cmd = [sys.executable, os.path.join(_REPO, "benchmarks", "kv_accuracy.py"), *common]
    cmd += ["--num-prompts", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = re.search(r"^fp8 weights vs model dtype: top-1 agreement ([\d.]+)% of 64 positions",
                     proc.stdout, re.M)  # fmt: skip
    assert line, proc.stdout
    assert 80 < float(line.group(1)) <= 100


def test_bench_throughput_runs_the_workload_again_with_the_prefix_cache_emptied(tmp_path):
    """--num-runs 3: three timed runs on one engine, each printed; at temperature 0 they
    give the same tokens (the prefix cache is emptied between them)."""
    env = {**os.environ, "PYTHONPATH": _REPO}
    out = tmp_path / "runs.json"
    cmd = [sys.executable, "-m", "minivllm.frontend.cli", "bench", "throughput", "--device"]
    cmd += ["cpu", "--num-prompts", "4", "--input-len", "48", "--output-len", "4"]
    cmd += ["--temperature", "0", "--num-runs", "3", "--output-json", str(out)]
    cmd += ["--distributed-executor-backend", "uni"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    digests = re.findall(r"output token digest: (\w+)", proc.stdout)
    assert len(digests) == 3 and len(set(digests)) == 1, proc.stdout
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if line.startswith("Run ")] == [
        "Run 1", "Run 2", "Run 3", "Run 1 against run 3"
    ]  # fmt: skip
    assert len(json.loads(out.read_text())["runs"]) == 3


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


def test_gemma3_geometry_and_its_windowed_floor(tmp_path) -> None:
    cfg = GEOMETRIES["gemma3-1b"]
    assert num_parameters(cfg) == 999_885_952  # Gemma 3 1B's count
    # every 6th of its 26 layers global, the others over 512 tokens
    path = write_geometry("gemma3-1b", str(tmp_path))
    args = EngineArgs(model=path, device="cpu", load_format="dummy", skip_tokenizer_init=True)
    model = args.create_engine_config().model
    assert [i for i, w in enumerate(model.sliding_windows) if w is None] == [5, 11, 17, 23]
    assert {w for w in model.sliding_windows if w is not None} == {512}
    # a 3-token prompt, 4 outputs (3, 4, 5, 6 cached tokens); a layer windowed over 5 tokens
    # reads at most the 4 before each query: 3 + 4 + 4 + 4
    floor = memory_floor(
        [3], [4], num_layers=2, num_kv_heads=1, head_dim=1, param_bytes=10,
        sliding_windows=[5, None],
    )  # fmt: skip
    assert floor.kv_bytes == ((3 + 4 + 4 + 4) + (3 + 4 + 5 + 6)) * 2 * 2
    # a prompt longer than the window: every output reads window - 1
    floor = memory_floor([30], [2], num_layers=1, num_kv_heads=1, head_dim=1, param_bytes=10,
                         sliding_windows=[5])  # fmt: skip
    assert floor.kv_bytes == 2 * 4 * 2 * 2
    with pytest.raises(ValueError, match="sliding_windows has 1 entries for 2 layers"):
        memory_floor([3], [2], num_layers=2, num_kv_heads=1, head_dim=1, param_bytes=10,
                     sliding_windows=[5])  # fmt: skip


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


def test_bench_latency_with_a_speculative_config(qwen3_dir: str, tmp_path):
    """The target as its own draft at temperature 0: the bench prints and writes vLLM's
    acceptance figures, every draft accepted."""
    spec = json.dumps({"model": qwen3_dir, "num_speculative_tokens": 2})
    cmd = [sys.executable, "-m", "minivllm.frontend.cli", "bench", "latency"]
    cmd += ["--model", qwen3_dir, "--device", "cpu", "--distributed-executor-backend", "uni"]
    cmd += ["--batch-size", "1", "--input-len", "8", "--output-len", "9", "--temperature", "0"]
    cmd += ["--num-iters-warmup", "1", "--num-iters", "2", "--speculative-config", spec]
    cmd += ["--kv-cache-memory-bytes", str(50 << 20), "--output-json", str(tmp_path / "f.json")]
    env = {**os.environ, "PYTHONPATH": _REPO}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^SpecDecoding: Mean acceptance length: 3\.00, ", proc.stdout, re.M)
    assert "Avg Draft acceptance rate: 100.0%" in proc.stdout
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["spec_acceptance_rate"] == 100.0
    assert figures["spec_num_draft_tokens"] == 2 * figures["spec_num_drafts"] > 0
