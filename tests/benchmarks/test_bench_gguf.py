"""`minivllm bench throughput --model FILE.gguf`: the GGUF file is the model, as for `LLM`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.gguf_files import build_tiny_gguf

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_throughput_on_a_gguf_file(tmp_path) -> None:
    path = build_tiny_gguf(str(tmp_path), "qwen3")
    cmd = [sys.executable, "-m", "minivllm.frontend.cli", "bench", "throughput", "--model", path]
    cmd += ["--num-prompts", "4", "--input-len", "16", "--output-len", "8"]
    cmd += ["--distributed-executor-backend", "uni", "--device", "cpu"]
    cmd += ["--kv-cache-memory-bytes", str(50 << 20)]
    env = {**os.environ, "PYTHONPATH": _REPO}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(rf"^Model: model {re.escape(path)}; 2 layers, hidden 256,", proc.stdout, re.M)
    line = re.search(r"^Throughput: .* ([\d.]+) output tokens/s$", proc.stdout, re.M)
    assert line and float(line.group(1)) > 0, proc.stdout
