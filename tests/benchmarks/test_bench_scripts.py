"""`minivllm bench` has vLLM's three commands; the other tools are scripts in benchmarks/
whose every flag says what it does, and which run as `python benchmarks/NAME.py`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from types import ModuleType

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BENCHMARKS = os.path.join(_REPO, "benchmarks")
TOOLS = ["allreduce", "grammar", "kernels", "kv_accuracy", "overhead", "step", "tp_equality"]
TOOLS += ["trace", "frontend", "clients", "ab_trees"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/NAME.py imported as `python benchmarks/NAME.py` would (its directory first
    on the path: kernels.py imports moe_kernels.py), without running it."""
    monkeypatch.syspath_prepend(_BENCHMARKS)
    spec = importlib.util.spec_from_file_location(
        f"benchmark_script_{name}", f"{_BENCHMARKS}/{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def test_bench_lists_vllms_three_commands() -> None:
    cmd = [sys.executable, "-m", "minivllm", "bench", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^\s+\{throughput,latency,serve\}$", out.stdout, re.M), out.stdout
    cmd = [sys.executable, "-m", "minivllm", "bench", "kernels"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 2 and "invalid choice: 'kernels'" in out.stderr


@pytest.mark.parametrize("name", TOOLS)
def test_every_script_flag_says_what_it_does(name: str, monkeypatch) -> None:
    module = _script(name, monkeypatch)
    assert module.__doc__.startswith(f"`python benchmarks/{name}.py")
    parser = argparse.ArgumentParser()
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            assert action.help, f"benchmarks/{name}.py {action.dest} has no help"


def test_a_script_runs_from_its_file(tmp_path) -> None:
    """The engine overhead behind all three processes, on the null model: the model is
    registered by the benchmark's side, and reaches the worker process."""
    cmd = [sys.executable, os.path.join(_BENCHMARKS, "overhead.py"), "--num-requests", "8"]
    cmd += ["--output-len", "32", "--health-calls", "20", "--skip-sync"]
    cmd += ["--output-json", str(tmp_path / "overhead.json")]
    env = {
        k: v for k, v in _env().items() if k != "MINIVLLM_PLUGINS"
    }  # no plugin: the script's own
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "8 requests x 32 output tokens" in out.stdout
    assert re.search(
        r"^IPC round trip \(health utility, 20 calls\): median \d+ µs", out.stdout, re.M
    )
    assert "WARNING" not in out.stdout  # every stream got its 32 tokens
    assert (tmp_path / "overhead.json").exists()


def test_two_trees_run_side_by_side(tmp_path) -> None:
    """ab_trees.py with this tree as both: each tree's engine in its own process, on its
    own PYTHONPATH, answering alternating rounds."""
    cmd = [sys.executable, os.path.join(_BENCHMARKS, "ab_trees.py"), _REPO, _REPO]
    cmd += ["--tiny", "--rounds", "2"]
    env = {**_env(), "OUT": str(tmp_path)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rounds = re.findall(r"^round (\d) (base|new): [\d,]+ output tok/s", out.stdout, re.M)
    assert rounds == [("1", "base"), ("1", "new"), ("2", "new"), ("2", "base")], out.stdout
    assert re.search(r"^new/base: throughput \d+\.\d+, TPOT \d", out.stdout, re.M)
    assert len(json.loads((tmp_path / "ab_trees.json").read_text())["new"]) == 2


def test_each_engine_core_output_goes_only_to_its_client(monkeypatch) -> None:
    """benchmarks/clients.py, small: sixteen clients attached to one engine-core, each gets
    the outputs of its own requests and nothing else, however many the engine-core serves."""
    clients = _script("clients", monkeypatch)
    args = argparse.Namespace(num_requests=48, output_len=12, clients=[1, 3, 16])
    runs = clients.main(args)["runs"]
    assert [r["clients"] for r in runs] == [1, 3, 16]
    for run in runs:
        assert run["tokens"] == 48 * 12  # every client got every token of its own
        assert run["foreign_outputs"] == 0  # and none of another's
        assert run["idle_client_outputs"] == 0  # a client without requests gets nothing


def test_frontend_cost_per_token_runs(monkeypatch, capsys) -> None:
    """benchmarks/frontend.py, small: every stream's tokens go through the API process's
    stream path and the CPU per token is printed."""
    frontend = _script("frontend", monkeypatch)
    parser = argparse.ArgumentParser()
    frontend.add_arguments(parser)
    args = parser.parse_args(["--num-requests", "8", "--output-len", "16", "--runs", "1"])
    figures = frontend.main(args)
    assert figures["tokens"] == 8 * 16
    assert figures["runs"][0]["bytes"] > 8 * 16  # an SSE chunk for every token at least
    assert re.search(r"^Best: \d+\.\d+ µs CPU per output token", capsys.readouterr().out, re.M)
