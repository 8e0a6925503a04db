"""Start-up counts and times the Triton kernels it builds; a build after start-up is logged."""

from __future__ import annotations

import logging

import pytest

from minivllm.engine_core.engine_core import _phases_line
from minivllm.worker.triton_compiles import TritonCompiles


def test_builds_are_counted_and_those_after_start_up_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    compiles = TritonCompiles()
    caplog.set_level(logging.INFO, logger="minivllm.worker.triton_compiles")
    for name in ("_rms_norm", "_attention"):
        assert compiles._before(key=name) is False  # Triton must still compile
        compiles._after(repr=f"{name}[num_warps=4](n: i32)", key=name)
    assert (compiles.count, compiles.after_start_up) == (2, 0)
    assert compiles.seconds >= 0.0
    assert not caplog.records  # start-up's builds only at DEBUG

    compiles.serving()
    compiles._before(key="_sample")
    compiles._after(repr="_sample[num_warps=8](n: i32)", key="_sample")
    assert (compiles.count, compiles.after_start_up) == (3, 1)
    (record,) = caplog.records
    assert "after start-up" in record.getMessage() and "_sample[num_warps=8]" in record.getMessage()


def test_install_hooks_triton_once() -> None:
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    compiles = TritonCompiles()
    try:
        assert compiles.install() and compiles.install()
        assert knobs.runtime.jit_cache_hook == compiles._before
        assert knobs.runtime.jit_post_compile_hook == compiles._after
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before


def test_ready_line_names_the_build_time_apart_from_the_phases() -> None:
    phases = {"processes": 1.24, "profile": 5.0, "Triton kernels": 41.0, "Triton build": 9.06}
    line = _phases_line(phases)
    assert line == "processes 1.2 s, profile 5.0 s; 41 Triton kernels built in 9.1 s of them"
    assert _phases_line({"processes": 1.0}) == "processes 1.0 s"
