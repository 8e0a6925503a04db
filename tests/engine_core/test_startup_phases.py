"""The engine-core's ready line says where its start-up time went, phase by phase, for
workers in this process and in their own processes."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from tests.tiny_models import build_null_checkpoint


@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_ready_line_breaks_start_up_into_phases(tmp_path, caplog, backend: str) -> None:
    model = build_null_checkpoint(str(tmp_path / "null"))
    args = EngineArgs(model=model, distributed_executor_backend=backend, skip_tokenizer_init=True)
    with caplog.at_level(logging.INFO, logger="minivllm.engine_core.engine_core"):
        core = EngineCore(args.create_engine_config())
    core.shutdown()
    phases = core.executor.startup_s
    expected = ["device", "load", "profile", "KV cache"]
    if backend == "mp":  # spawning the worker and its imports come first
        expected.insert(0, "processes")
    assert list(phases) == expected
    assert all(0.0 <= s < 120.0 for s in phases.values())
    ready = [r.getMessage() for r in caplog.records if "engine core ready" in r.getMessage()]
    assert len(ready) == 1
    assert all(f"{name} " in ready[0] for name in expected), ready[0]


def test_the_engine_core_starts_its_workers_without_importing_torch(tmp_path) -> None:
    """An engine-core with its workers in their own processes imports neither torch nor the
    model code itself: the workers import them (on a GPU host torch alone takes 3-6 s, which
    the engine-core paid before it spawned them). The device is given, as the frontend has
    resolved it by the time it starts the engine-core."""
    model = build_null_checkpoint(str(tmp_path / "null"))
    code = (
        "import sys\n"
        "from minivllm.config import EngineArgs\n"
        "from minivllm.engine_core.engine_core import EngineCore\n"
        f"args = EngineArgs(model={model!r}, distributed_executor_backend='mp', device='cpu',\n"
        "                  skip_tokenizer_init=True)\n"
        "core = EngineCore(args.create_engine_config())\n"
        "core.shutdown()\n"
        "heavy = ('torch', 'transformers', 'triton', 'minivllm.worker.worker_process')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
