"""Run a test module's checks through the Triton interpreter, on CPU tensors.

TRITON_INTERPRET must be set before triton is first imported, and this pytest process has
imported it already, so the module runs again as a script in a subprocess with the
variable set (its `if __name__ == "__main__":` block does the checks).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def run_interpreted(script: str, *args: str, timeout: float = 240) -> None:
    """`python script *args` with TRITON_INTERPRET=1; fails the test with its output."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
