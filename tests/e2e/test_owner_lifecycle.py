"""An engine ends with the object that owns it: garbage-collected, or left by `with` /
`async with`; an attached client only detaches, the daemon lives on. `connect` to an ipc
path where nothing listens fails at once. A killed engine-core's run directories go when
its frontend closes."""

from __future__ import annotations

import gc
import os
import signal
import socket
import tempfile
import time

import pytest
import uvloop

from minivllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, EngineStartupError, SamplingParams
from tests.e2e.daemon import greedy, null_tokens
from tests.process_helpers import private_tmpdir, spawned_children, wait_gone
from tests.tiny_models import build_null_checkpoint


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")))


@pytest.fixture
def run_dir_root(monkeypatch: pytest.MonkeyPatch):
    """A temporary directory of this test's own, for this process and the engine's."""
    with private_tmpdir() as path:
        monkeypatch.setenv("TMPDIR", path)
        monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
        yield path


def _new_engine_pids(before: set[int]) -> list[int]:
    """The engine-cores spawned since `before` was taken, and their workers."""
    cores = [p for p in spawned_children(os.getpid()) if p not in before]
    return cores + [w for c in cores for w in spawned_children(c)]


def _generate_once(llm: LLM) -> None:
    out = llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == null_tokens(3, 4)


def test_gc_of_an_llm_stops_its_engine(null_dir: str, run_dir_root: str) -> None:
    before = set(spawned_children(os.getpid()))
    llm = LLM(model=null_dir)
    pids = _new_engine_pids(before)
    assert len(pids) == 2 and os.listdir(run_dir_root)
    _generate_once(llm)
    del llm
    gc.collect()
    assert wait_gone(pids, timeout=10) == []
    assert os.listdir(run_dir_root) == []


def test_with_llm_stops_its_engine(null_dir: str, run_dir_root: str) -> None:
    before = set(spawned_children(os.getpid()))
    with LLM(model=null_dir) as llm:
        pids = _new_engine_pids(before)
        _generate_once(llm)
    assert wait_gone(pids, timeout=10) == []
    assert os.listdir(run_dir_root) == []


def test_async_with_and_gc_of_an_async_llm_stop_its_engine(
    null_dir: str, run_dir_root: str
) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def started(llm: AsyncLLM) -> None:
        async for _ in llm.generate([1, 2, 3], params, request_id="r"):
            pass

    async def main() -> None:
        before = set(spawned_children(os.getpid()))
        async with AsyncLLM.from_engine_args(EngineArgs(model=null_dir)) as llm:
            pids = _new_engine_pids(before)
            await started(llm)
        assert wait_gone(pids, timeout=10) == []
        # collected while its output handler task still waits for outputs
        llm = AsyncLLM.from_engine_args(EngineArgs(model=null_dir))
        pids = _new_engine_pids(before)
        await started(llm)
        del llm
        gc.collect()
        assert wait_gone(pids, timeout=10) == []

    uvloop.run(main())
    assert os.listdir(run_dir_root) == []


def test_leaving_an_attached_client_leaves_the_daemon(null_daemon) -> None:
    with LLM.connect(null_daemon.address) as llm:
        _generate_once(llm)

    async def attached() -> None:
        async with AsyncLLM.connect(null_daemon.address) as llm:
            async for _ in llm.generate([1, 2, 3], greedy(4), request_id="r"):
                pass

    uvloop.run(attached())
    llm = LLM.connect(null_daemon.address)
    del llm  # detaches too
    gc.collect()
    assert null_daemon.proc.poll() is None
    null_daemon.canary()


@pytest.mark.parametrize("connect", [LLM.connect, AsyncLLM.connect], ids=["LLM", "AsyncLLM"])
def test_connect_where_nothing_listens_fails_at_once(connect, tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="/no/such/socket does not exist"):
        connect("ipc:///no/such/socket")
    stale = str(tmp_path / "engine")  # a socket file its daemon left (killed by SIGKILL)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(stale)
    sock.close()
    with pytest.raises(EngineStartupError, match=f"nothing listens on {stale}"):
        connect(f"ipc://{stale}")
    assert time.monotonic() - start < 2.0


def test_killed_engine_core_leaves_no_run_directory(null_dir: str, run_dir_root: str) -> None:
    before = set(spawned_children(os.getpid()))
    llm = LLM(model=null_dir)
    core, worker = _new_engine_pids(before)
    assert len(os.listdir(run_dir_root)) == 2  # the frontend's and the engine-core's
    os.kill(core, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
        _generate_once(llm)
    assert wait_gone([worker], timeout=10) == []
    llm.shutdown()
    assert os.listdir(run_dir_root) == []


def test_a_tokenizer_that_fails_to_load_stops_the_engine_started_beside_it(
    null_dir: str, run_dir_root: str, tmp_path
) -> None:
    """The tokenizer loads while the engine-core starts; when it fails, its error reaches the
    caller and the engine goes with it, for LLM and AsyncLLM alike."""
    bad = tmp_path / "not-a-tokenizer"
    bad.mkdir()
    before = set(spawned_children(os.getpid()))
    with pytest.raises(ValueError, match="tokenizer: cannot load one from .*not-a-tokenizer"):
        LLM(model=null_dir, tokenizer=str(bad))
    with pytest.raises(ValueError, match="tokenizer: cannot load one from .*not-a-tokenizer"):
        AsyncLLM.from_engine_args(EngineArgs(model=null_dir, tokenizer=str(bad)))
    assert wait_gone(_new_engine_pids(before), timeout=10) == []
    gc.collect()
    assert [p for p in spawned_children(os.getpid()) if p not in before] == []
    assert os.listdir(run_dir_root) == []
