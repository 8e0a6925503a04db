"""Embedding the engine in a service: the caller's process keeps its own settings, and a
client whose event loop stalls is told the truth about it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import uvloop

from minivllm import AsyncLLM, EngineArgs, EngineDeadError, RequestOutputKind, SamplingParams
from tests.e2e.daemon import env, null_tokens
from tests.tiny_models import build_null_checkpoint

PROCESS_STATE = """
import gc, json, os, signal, sys
def state():
    return {"frozen": gc.get_freeze_count(), "switch": sys.getswitchinterval(),
            "gc": gc.isenabled(), "env": sorted(os.environ),
            "sig": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)]}
before = state()
from minivllm import LLM, AsyncLLM, EngineArgs, SamplingParams
import asyncio
llm = LLM(sys.argv[1])
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
during_sync = state()
llm.shutdown()
allm = AsyncLLM.from_engine_args(EngineArgs(model=sys.argv[1]))
async def main():
    async for _ in allm.generate([1, 2, 3], SamplingParams(max_tokens=4), request_id="a"):
        pass
asyncio.run(main())  # (asyncio.run's own SIGINT handler is gone again once it returns)
during_async = state()
allm.shutdown()
print(json.dumps([before, during_sync, during_async]))
"""


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")))


def test_the_callers_process_keeps_its_settings(null_dir: str) -> None:
    import json

    out = subprocess.run(
        [sys.executable, "-c", PROCESS_STATE, null_dir],
        capture_output=True,
        text=True,
        timeout=180,
        env=env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    before, during_sync, during_async = json.loads(out.stdout.strip().splitlines()[-1])
    assert before["frozen"] == 0
    assert during_sync == before, "LLM changed process-wide state"
    assert during_async == before, "AsyncLLM changed process-wide state"


async def _stream_with_stall(
    llm: AsyncLLM, request_id: str, stall_s: float, max_tokens: int
) -> list[int]:
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    tokens: list[int] = []
    async for out in llm.generate([1, 2, 3], params, request_id=request_id):
        if not tokens:
            time.sleep(stall_s)  # the event loop is blocked: no heartbeat leaves
        tokens += out.outputs[0].token_ids
    return tokens


def test_a_stalled_client_hears_it_was_dropped(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MINIVLLM_CLIENT_TIMEOUT", "6")  # read by the engine-core it spawns
    # room for a request that outlasts the stall
    model = build_null_checkpoint(str(tmp_path / "null"), max_position_embeddings=1 << 17)
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model, max_num_seqs=4))

    async def main() -> tuple[list[int], BaseException]:
        # longer than the client's own silence limit (3 s), shorter than the engine's
        survived = await _stream_with_stall(llm, "short-stall", 4.0, max_tokens=60)
        time.sleep(4.0)  # and a request sent right after a stall is not refused
        survived += await _stream_with_stall(llm, "after-stall", 0.0, max_tokens=5)
        with pytest.raises(EngineDeadError) as dropped:
            await _stream_with_stall(llm, "long-stall", 9.0, max_tokens=100_000)
        with pytest.raises(EngineDeadError):  # and every later call hears it too
            await llm.generate([1], SamplingParams(max_tokens=2), request_id="after").__anext__()
        return survived, dropped.value

    try:
        survived, dropped = uvloop.run(asyncio.wait_for(main(), 120))
    finally:
        llm.shutdown()
    assert survived == null_tokens(3, 60) + null_tokens(3, 5)
    message = str(dropped)
    assert "the engine-core dropped this client: it sent nothing for" in message
    assert "client timeout of 6 s" in message and "its requests were aborted" in message
    assert "silent" not in message and "engine is dead" not in message


def test_a_client_that_starts_its_loop_late_is_not_dropped(tmp_path, monkeypatch) -> None:
    """An application may attach (AsyncLLM) and start its event loop seconds later (its own
    imports, say): silence counts only once the client has started talking."""
    monkeypatch.setenv("MINIVLLM_CLIENT_TIMEOUT", "2")
    model = build_null_checkpoint(str(tmp_path / "null"))
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model, max_num_seqs=4))
    try:
        time.sleep(4.0)  # attached, no event loop yet: no heartbeat leaves
        tokens = uvloop.run(asyncio.wait_for(_stream_with_stall(llm, "late", 0.0, 5), 60))
    finally:
        llm.shutdown()
    assert tokens == null_tokens(3, 5)
