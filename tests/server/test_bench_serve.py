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


def _bench(server, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minivllm.frontend.cli", "bench", "serve", "--base-url"]
    cmd += [server.url, "--num-prompts", "4", "--random-input-len", "16"]
    cmd += ["--random-output-len", "4", "--ignore-eos", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=300)


def test_bench_serve_reads_the_vocabulary_from_the_served_model(null_server) -> None:
    """No --tokenizer: the prompts' ids come from the served model's vocabulary (/v1/models'
    root), so every request succeeds (ids up to 10000 would all be refused)."""
    _, server = null_server
    out = _bench(server)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Successful requests:                     4         " in out.stdout.splitlines()


def test_bench_serve_with_failing_requests_exits_non_zero(null_server) -> None:
    _, server = null_server
    out = _bench(server, "--model", "no-such-model")
    assert out.returncode == 1
    assert "Failed requests:                         4         " in out.stdout.splitlines()
    assert (
        "bench serve: 4 of 4 requests failed; the first error: HTTP 404: "
        '{"error":{"message":"The model `no-such-model` does not exist."'
    ) in out.stderr


def test_bench_serve_names_a_tokenizer_it_cannot_read() -> None:
    import argparse

    from minivllm.benchmarks.serve import tokenizer_dir

    args = argparse.Namespace(tokenizer=None, model="served-name")
    with pytest.raises(SystemExit, match="'/srv/models/x' .* is not readable here.*--tokenizer"):
        tokenizer_dir(args, "/srv/models/x")
