"""`minivllm bench serve` against `minivllm serve` (the null model): vLLM's result table,
Poisson arrivals at two rates, a concurrency cap, the saved JSON and the plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.conftest import server_env
from tests.tiny_models import build_null_checkpoint

TABLE = [
    "============ Serving Benchmark Result ============",
    "Successful requests:                     12        ",
    "Failed requests:                         0         ",
    "Maximum request concurrency:             4         ",
    "Request rate configured (RPS):           40.00     ",
    "Total input tokens:                      192       ",
    "Total generated tokens:                  96        ",
    "---------------Time to First Token----------------",
    "-----Time per Output Token (excl. 1st token)------",
    "---------------Inter-token Latency----------------",
    "----------------End-to-end Latency----------------",
]


@pytest.fixture(scope="module")
def null_server(server_factory, tmp_path_factory):
    model = build_null_checkpoint(str(tmp_path_factory.mktemp("null")))
    return model, server_factory([model, "--num-gpu-blocks-override", "512"])


def test_bench_serve_table_json_and_plot(null_server, tmp_path) -> None:
    model, server = null_server
    cmd = [sys.executable, "-m", "minivllm.frontend.cli", "bench", "serve"]
    cmd += ["--base-url", server.url, "--tokenizer", model, "--num-prompts", "12"]
    cmd += ["--random-input-len", "16", "--random-output-len", "8", "--ignore-eos"]
    cmd += ["--request-rate", "40", "80", "--max-concurrency", "4", "--temperature", "0"]
    cmd += ["--save-result", "--result-dir", str(tmp_path), "--plot", str(tmp_path / "p.png")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for expected in TABLE:
        assert expected in lines, f"missing {expected!r} in\n{out.stdout}"
    for label in ("Mean", "Median", "P99"):
        for metric in ("TTFT", "TPOT", "ITL", "E2EL"):
            assert any(line.startswith(f"{label} {metric} (ms):") for line in lines)
    results = sorted(tmp_path.glob("openai-*qps-concurrency4-*.json"))
    assert len(results) == 2
    for path, rate in zip(results, ("40.0", "80.0"), strict=True):
        result = json.loads(path.read_text())
        assert str(result["request_rate"]) == rate
        assert result["completed"] == 12 and result["total_output_tokens"] == 96
        assert result["max_concurrency"] == 4 and len(result["ttfts"]) == 12
        assert result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
