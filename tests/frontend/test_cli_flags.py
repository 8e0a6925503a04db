"""vLLM's flags and spellings on the command line, and as `LLM(...)` keywords: bad values are
refused before any engine starts (argparse's exit 2, or a message naming the cause), every
flag says what it does and its default, `--version`, `python -m minivllm`."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from importlib import metadata

import pytest

from minivllm import LLM, EngineArgs, SamplingParams
from minivllm.benchmarks import add_bench_parser
from minivllm.frontend import cli
from minivllm.frontend.arg_utils import engine_args_from
from minivllm.frontend.server.serve import add_serve_parser, load_chat_template
from tests.server.conftest import server_env


def _minivllm(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "minivllm", *args],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=timeout,
    )
    return out, time.monotonic() - start


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm")
    sub = parser.add_subparsers(dest="command", required=True)
    cli._add_engine_core(sub)
    cli._add_keygen(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _subparsers(child, (*path, name))


def test_version_through_python_m() -> None:
    out, _ = _minivllm("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"minivllm {metadata.version('minivllm')}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--uvicorn-log-level", "bogus"], "argument --uvicorn-log-level: invalid choice: 'bogus'"),
        (["--kv-cache-dtype", "fp16"], "argument --kv-cache-dtype: invalid choice: 'fp16'"),
        (["-q", "int8"], "argument --quantization/-q: 'int8' is not supported (supported: fp8, "),
        (["-tp", "two"], "argument --tensor-parallel-size/-tp: invalid int value: 'two'"),
    ],
)
def test_bad_serve_arguments_exit_2_before_any_engine(args: list[str], message: str) -> None:
    out, took = _minivllm("serve", "no-such-model", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert took < 60  # argparse's answer, not an engine's start-up


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--chat-template", "/no/such/template.jinja"],
            "minivllm serve: --chat-template: '/no/such/template.jinja' looks like a file "
            "path, but it failed to be opened: No such file or directory",
        ),
        (["--revision", "v2"], "revision='v2': models load from local directories"),
    ],
)
def test_serve_refuses_what_it_cannot_do(args: list[str], message: str, qwen3_dir: str) -> None:
    out, took = _minivllm("serve", qwen3_dir, "--host", "127.0.0.1", "--port", "0", *args)
    assert out.returncode == 1 and message in out.stderr, out.stderr
    assert "http://" not in out.stdout and took < 60


def test_chat_template_is_a_file_or_the_template_itself(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{% for m in messages %}x{% endfor %}") == (
        "{% for m in messages %}x{% endfor %}"
    )
    assert load_chat_template("a\\nb {{ x }}") == "a\nb {{ x }}"  # vLLM unescapes inline ones
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template("templates/missing.jinja")


def test_every_flag_says_what_it_does_and_its_default() -> None:
    parser = _parser()
    for path, sub in _subparsers(parser):
        for action in sub._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.help, f"{' '.join(path)} {action.option_strings[0]} has no help"
    serve = " ".join(dict(_subparsers(parser))[("serve",)].format_help().split())
    assert "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE" in serve
    assert "{critical,error,warning,info,debug,trace}" in serve
    assert "(default: 0.9)" in serve  # gpu_memory_utilization
    assert "no remote code is ever run" in serve
    throughput = dict(_subparsers(parser))[("bench", "throughput")].format_help()
    compact = " ".join(throughput.split())
    assert "--temperature TEMPERATURE of every request (default: 0.6)" in compact
    assert "128 on the CPU" in compact and "256 on the CPU" in compact
    # the defaults a benchmark really uses: token-id prompts need no tokenizer
    assert "outputs carry no text" not in compact
    assert "prompts are token ids (vLLM's benchmarks too) (default: True)" in compact


def test_vllm_spellings_parse_into_engine_args() -> None:
    args = _parser().parse_args(
        ["serve", "m", "-tp", "2", "-dp", "3", "--trust-remote-code", "--dtype", "half"]
        + ["--generation-config", "vllm", "--override-generation-config", '{"top_k": 5}']
        + ["--disable-log-requests", "--max-num-batched-tokens", "4096", "--enforce-eager"]
        + ["--enable-expert-parallel"]
    )
    engine = engine_args_from(args, model="m")
    assert (engine.tensor_parallel_size, engine.data_parallel_size) == (2, 3)
    assert engine.trust_remote_code and engine.enforce_eager and engine.dtype == "float16"
    assert engine.generation_config == "vllm"
    assert engine.override_generation_config == {"top_k": 5}
    assert engine.max_num_batched_tokens == 4096 and args.enable_log_requests is False
    assert engine.enable_expert_parallel


def test_the_same_names_as_llm_keywords(qwen3_dir: str) -> None:
    with pytest.raises(ValueError, match=r"quantization='bitsandbytes' is not supported \(suppo"):
        LLM(qwen3_dir, quantization="bitsandbytes")
    with pytest.raises(ValueError, match="revision='main': models load from local directories"):
        EngineArgs(model=qwen3_dir, revision="main")
    llm = LLM(
        qwen3_dir,
        trust_remote_code=True,
        dtype="float",
        tokenizer=qwen3_dir,
        enforce_eager=True,
        max_num_batched_tokens=1024,
        kv_cache_dtype="auto",
        generation_config="vllm",
        distributed_executor_backend="uni",
    )
    try:
        out = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
