"""Start-up counts and times the Triton kernels it builds; a build after start-up is logged."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import triton
import triton.language as tl

from minivllm.engine_core.engine_core import _phases_line
from minivllm.protocol.messages import TRITON_BUILD_S, TRITON_KERNELS
from minivllm.worker.triton_compiles import (
    TritonCompiles,
    _can_compile_ahead,
    compile_ahead,
    compiles,
    describe,
)

ARGS = ["x_ptr", "n_rows", "stride", "BLOCK"]


def _fn(name: str) -> SimpleNamespace:  # what Triton's hooks get as `fn`
    return SimpleNamespace(name=name, jit_function=SimpleNamespace(arg_names=ARGS))


def _compile(n_rows: int) -> dict:  # what they get as `compile`: one variant's specialization
    constants = {(3,): SimpleNamespace(value=64)}
    if n_rows == 1:
        constants[(1,)] = 1
    aligned = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    if n_rows % 16 == 0:
        aligned[(1,)] = [["tt.divisibility", 16]]
    signature = {"x_ptr": "*bf16", "n_rows": "i32", "stride": "i32", "BLOCK": "constexpr"}
    return {"signature": signature, "constants": constants, "configs": [aligned]}


def test_builds_are_counted_and_those_after_start_up_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    compiles = TritonCompiles()
    caplog.set_level(logging.INFO, logger="minivllm.worker.triton_compiles")
    for name in ("_rms_norm", "_attention"):
        assert compiles._before(key=name) is False  # Triton must still compile
        compiles._after(fn=_fn(name), compile=_compile(7), key=name)
    assert (compiles.count, compiles.after_start_up) == (2, 0)
    assert compiles.seconds >= 0.0
    assert not caplog.records  # start-up's builds only at DEBUG

    compiles.serving()
    compiles._before(key="_sample")
    compiles._after(fn=_fn("_sample"), compile=_compile(32), key="_sample")
    assert (compiles.count, compiles.after_start_up) == (3, 1)
    (record,) = caplog.records
    assert "after start-up" in record.getMessage()
    assert "_sample(BLOCK=64; 16 | n_rows stride)" in record.getMessage()


def test_a_variant_is_told_by_its_constants_and_aligned_integers() -> None:
    assert describe("_k", ARGS, _compile(1)) == "_k(n_rows=1, BLOCK=64; 16 | stride)"
    assert describe("_k", ARGS, _compile(7)) == "_k(BLOCK=64; 16 | stride)"
    assert describe("_k", ARGS, _compile(48)) == "_k(BLOCK=64; 16 | n_rows stride)"


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


def test_this_triton_has_what_compile_ahead_wraps() -> None:
    """The test extras pin the GPU machines' Triton: it must offer the asynchronous compile
    mode and the JIT methods compile_ahead wraps (else start-up builds one by one)."""
    assert _can_compile_ahead()


def test_ready_line_names_the_build_time_apart_from_the_phases() -> None:
    phases = {"processes": 1.24, "profile": 5.0, TRITON_KERNELS: 41.0, TRITON_BUILD_S: 9.06}
    line = _phases_line(phases)
    assert line == "processes 1.2 s, profile 5.0 s; 41 Triton kernels built in 9.1 s of them"
    assert _phases_line({"processes": 1.0}) == "processes 1.0 s"


@triton.jit
def fill(x_ptr, value, N: tl.constexpr):  # a tiny kernel of one variant per N
    offs = tl.arange(0, N)
    tl.store(x_ptr + offs, tl.zeros([N], dtype=tl.float32) + value)


@pytest.mark.gpu
def test_compile_ahead_builds_and_loads_every_variant_without_launching() -> None:
    import torch

    assert compiles.install()
    x = torch.zeros(64, device="cuda")
    before = compiles.count
    with compile_ahead():
        fill[(1,)](x, 3.0, N=64)
        fill[(1,)](x, 3.0, N=64)  # the same variant again: one build
        fill[(1,)](x, 2.0, N=32)
    torch.cuda.synchronize()
    assert x.sum().item() == 0  # nothing ran
    assert compiles.count - before == 2
    cache = fill.device_caches[torch.cuda.current_device()][0]
    assert len(cache) == 2 and all(k.module is not None for k in cache.values())  # loaded
    fill[(1,)](x, 3.0, N=64)
    assert x.sum().item() == 192


def _same_named_modules(tmp_path) -> dict[str, str]:
    """Two C extension modules of one name (as Triton's launchers all are), each in its own
    directory, whose `launch()` says which file it came from: their paths."""
    import subprocess
    import sysconfig

    paths = {}
    for tag in ("A", "B"):
        src = tmp_path / tag / "m.c"
        src.parent.mkdir()
        src.write_text(
            "#include <Python.h>\n"
            f'static PyObject* launch(PyObject* s, PyObject* a) {{ return PyUnicode_FromString("{tag}"); }}\n'
            'static PyMethodDef M[] = {{"launch", launch, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};\n'
            'static struct PyModuleDef D = {PyModuleDef_HEAD_INIT, "__launcher", NULL, -1, M};\n'
            "PyMODINIT_FUNC PyInit___launcher(void) { return PyModule_Create(&D); }\n"
        )
        so = src.parent / f"__launcher{sysconfig.get_config_var('EXT_SUFFIX')}"
        include = sysconfig.get_paths()["include"]
        cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
        subprocess.run(
            [cc, "-shared", "-fPIC", f"-I{include}", str(src), "-o", str(so)], check=True
        )
        paths[tag] = str(so)
    return paths


def test_launchers_loaded_by_threads_keep_their_own_launch(tmp_path) -> None:
    """Loading a module file again hands back the one module of that name with its names
    set to that file's: a launcher read a moment after its load can be another's. The
    loader compile_ahead's threads use returns each load's own names, whatever loads follow."""
    import threading

    from triton.runtime import build

    from minivllm.worker.triton_compiles import loaded_one_at_a_time

    paths = _same_named_modules(tmp_path)
    raw = build._load_module_from_path
    for p in paths.values():  # the first loads of each file
        raw("__launcher", p)
    a = raw("__launcher", paths["A"])
    raw("__launcher", paths["B"])
    assert a.launch() == "B"  # what a launcher read after another thread's load gets

    load = loaded_one_at_a_time(raw)
    a = load("__launcher", paths["A"])
    load("__launcher", paths["B"])
    assert a.launch() == "A"

    wrong: list[str] = []

    def loads(tag: str) -> None:
        for _ in range(200):
            if (got := load("__launcher", paths[tag]).launch()) != tag:
                wrong.append(got)

    threads = [threading.Thread(target=loads, args=("AB"[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
