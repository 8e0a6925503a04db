"""Scripts as a user writes them, run as scripts: they end on their own (no `shutdown()`),
keep their exit code, end on one Ctrl-C, and leave no process and no run directory behind,
whichever way they end."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.process_helpers import (
    LOG_LINE,
    ROOT,
    Watched,
    private_tmpdir,
    python_env,
    python_script,
)
from tests.tiny_models import build_null_checkpoint

STARTUP_S = 120  # a script's whole run, engine start included, on a busy CPU machine
EXIT_S = 10  # from a script's last output to its exit
STOP_S = 10  # from one SIGINT to the end of every process (about 1 s on an idle machine)


def _readme_scripts() -> list[str]:
    """The README's Python examples that are whole scripts."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    return [b for b in blocks if 'if __name__ == "__main__":' in b]


README_SCRIPTS = _readme_scripts()


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")))


@pytest.fixture
def run_dir_root():
    with private_tmpdir() as path:
        yield path


def _env(tmpdir: str) -> dict[str, str]:
    return {**python_env(), "TMPDIR": tmpdir, "MINIVLLM_LOG_LEVEL": "INFO"}


def _assert_nothing_left(run: Watched, tmpdir: str) -> None:
    assert run.descendants, "the script started no process: the test is not testing"
    assert run.survivors() == [], f"processes outlived the script:\n{run.stderr}"
    assert os.listdir(tmpdir) == [], "run directories left behind"


def test_readme_has_the_examples_run_here() -> None:
    assert len(README_SCRIPTS) >= 2
    assert any("LLM(model=" in s for s in README_SCRIPTS)
    assert any("asyncio.run(main())" in s and "AsyncLLM" in s for s in README_SCRIPTS)


@pytest.mark.parametrize(
    "source", README_SCRIPTS, ids=[f"example{i}" for i in range(len(README_SCRIPTS))]
)
def test_readme_example_ends_on_its_own(
    source: str, qwen3_dir: str, tmp_path, run_dir_root: str
) -> None:
    assert "shutdown" not in source  # as a user writes it
    cmd = python_script(str(tmp_path / "example.py"), source.replace("path/to/model", qwen3_dir))
    run = Watched(cmd, _env(run_dir_root))
    assert run.wait(STARTUP_S) == 0, run.stderr
    assert run.stdout.strip(), "the example printed no text"
    assert run.exited_at - run.last_stdout_at < EXIT_S
    assert "Traceback" not in run.stderr, run.stderr
    _assert_nothing_left(run, run_dir_root)
    # every process logs in one format, with a timestamp
    lines = [
        line
        for line in re.split(r"[\r\n]", run.stderr)
        if line.strip() and "Processed prompts" not in line
    ]
    assert lines and all(LOG_LINE.match(line) for line in lines), lines
    assert any("[engine-core " in line for line in lines)
    assert any("[worker-rank0 " in line for line in lines)


RAISES_AFTER_GENERATE = """
    from minivllm import LLM, SamplingParams

    if __name__ == "__main__":
        dp = LLM(model={model!r}, data_parallel_size=2)
        inproc = LLM(model={model!r}, distributed_executor_backend="uni")
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        for llm in (dp, inproc):
            out = llm.generate(["Hello"] * 3, params, use_tqdm=False)
            print(len(out[0].outputs[0].token_ids), flush=True)
        raise ValueError("the script's own error")
"""


def test_script_that_raises_keeps_its_exit_code(null_dir: str, tmp_path, run_dir_root: str) -> None:
    """Data parallelism and the in-process client, neither shut down, and an exception."""
    source = RAISES_AFTER_GENERATE.format(model=null_dir)
    run = Watched(python_script(str(tmp_path / "raises.py"), source), _env(run_dir_root))
    assert run.wait(STARTUP_S) == 1, run.stderr
    assert run.stdout.split() == ["8", "8"]
    # its own traceback, and only that
    assert run.stderr.count("Traceback") == 1, run.stderr
    assert run.stderr.rstrip().endswith("ValueError: the script's own error")
    assert len(run.descendants) >= 4  # two engine-cores and their workers
    _assert_nothing_left(run, run_dir_root)


GENERATES_UNTIL_INTERRUPTED = """
    from minivllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model={model!r})
        print("READY", flush=True)
        params = SamplingParams(max_tokens=4000, ignore_eos=True)
        llm.generate([[1, 2, 3, i] for i in range(64)], params, use_tqdm=False)
        print("FINISHED", flush=True)
"""


@pytest.mark.parametrize("group", [False, True], ids=["main-process", "process-group"])
def test_one_sigint_during_generate_ends_everything(
    group: bool, null_dir: str, tmp_path, run_dir_root: str
) -> None:
    """A Ctrl-C reaches the script only (kill -INT) or its whole process group (a
    terminal's); either way it ends in seconds with the script's own KeyboardInterrupt."""
    source = GENERATES_UNTIL_INTERRUPTED.format(model=null_dir)
    run = Watched(python_script(str(tmp_path / "generate.py"), source), _env(run_dir_root))
    run.wait_for("READY")
    time.sleep(1.0)  # well inside generate
    sent = run.signal(signal.SIGINT, group=group)
    code = run.wait(30)
    took = time.monotonic() - sent
    assert "FINISHED" not in run.stdout, "generate ended before the signal: not tested"
    assert code == -signal.SIGINT  # Python's exit after an uncaught KeyboardInterrupt
    assert took < STOP_S, f"{took:.1f} s after the signal"
    assert run.stderr.count("Traceback") == 1, run.stderr  # the script's, no child's
    assert run.stderr.rstrip().endswith("KeyboardInterrupt")
    _assert_nothing_left(run, run_dir_root)


def test_sigkill_of_the_script_leaves_nothing_behind(
    null_dir: str, tmp_path, run_dir_root: str
) -> None:
    """The engine-core notices its frontend died, stops its workers and removes the run
    directories (the frontend's included), which the frontend could not."""
    source = GENERATES_UNTIL_INTERRUPTED.format(model=null_dir)
    run = Watched(python_script(str(tmp_path / "generate.py"), source), _env(run_dir_root))
    run.wait_for("READY")
    time.sleep(1.0)
    assert os.listdir(run_dir_root), "no run directory while running: not tested"
    run.signal(signal.SIGKILL)
    assert run.wait(30) == -signal.SIGKILL
    _assert_nothing_left(run, run_dir_root)
