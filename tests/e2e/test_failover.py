"""Failover across spawned data-parallel engine-cores: SIGKILL one while a batch streams and
every request still ends with the tokens a run without the kill gives (greedy and seeded
sampling token for token, `n > 1` children and logprobs too), the dead core's requests
going on on the other within a second; with `data_parallel_restart`, the dead core comes
back and is routed to again."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import uvloop

from minivllm import LLM, AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from tests.process_helpers import spawned_children, wait_gone

MAX_TOKENS = 400  # with the longest prompt, within the model's 512 positions
_rng = random.Random(0)
# shorter than a block: no prefix affinity, so requests spread by load alone
PROMPTS = [{"prompt_token_ids": [_rng.randint(1, 300) for _ in range(4 + i)]} for i in range(8)]
DIED = "engine-core {} of 2 died (the engine is dead: engine-core (pid {}) was killed by SIGKILL)"


def _params(kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> list[SamplingParams]:
    """Greedy requests, then one seeded sampled request and one of two seeded children with
    logprobs, all of MAX_TOKENS tokens."""
    greedy = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind
    )
    seeded = SamplingParams(
        temperature=1.0, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind
    )
    children = SamplingParams(
        n=2, temperature=0.8, seed=3, logprobs=2, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    return [greedy] * (len(PROMPTS) - 2) + [seeded, children]


def _results(outputs) -> list[list[tuple[int, ...]]]:
    return [[tuple(c.token_ids) for c in o.outputs] for o in outputs]


def _logprobs(outputs) -> list[float]:
    """The sampled tokens' logprobs of the request with logprobs, child after child."""
    return [next(iter(d.values())).logprob for c in outputs[-1].outputs for d in c.logprobs]


class _Killer(threading.Thread):
    """SIGKILL engine-core `engine` once it has delivered `after` output tokens."""

    def __init__(self, client, engine: int, after: int) -> None:
        super().__init__(daemon=True)
        self.client, self.engine, self.after = client, engine, after
        self.pid = client.clients[engine].proc.pid
        self.delivered_at_kill: int | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 120
        while self.client.output_tokens[self.engine] < self.after:
            if time.monotonic() > deadline:
                return
            time.sleep(0.002)
        self.delivered_at_kill = self.client.output_tokens[self.engine]
        os.kill(self.pid, signal.SIGKILL)


def test_generate_loses_no_token_when_a_core_is_killed(qwen3_dir: str, caplog) -> None:
    llm = LLM(qwen3_dir, dtype="float32", data_parallel_size=2)
    client = llm.llm_engine.engine_core
    pids = spawned_children(os.getpid())
    try:
        expected = llm.generate(PROMPTS, _params(), use_tqdm=False)
        before = client.balance()
        killer = _Killer(client, engine=1, after=before[1]["output_tokens"] + 100)
        killer.start()
        with caplog.at_level(logging.WARNING, logger="minivllm.frontend.clients.dp_group"):
            outputs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        killer.join()
        after = client.balance()
    finally:
        llm.shutdown()
    assert _results(outputs) == _results(expected)
    np.testing.assert_allclose(_logprobs(outputs), _logprobs(expected), atol=1e-4)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]
    # engine-core 1 was killed mid-stream, and everything it had not delivered came from 0
    on_killed = after[1]["requests"] - before[1]["requests"]
    delivered = killer.delivered_at_kill - before[1]["output_tokens"]
    assert 0 < delivered < on_killed * MAX_TOKENS, (delivered, on_killed)
    produced = sum(
        a["output_tokens"] - b["output_tokens"] for a, b in zip(after, before, strict=True)
    )
    assert produced == (len(PROMPTS) + 1) * MAX_TOKENS, "no token repeated or lost"
    assert client.failover.stats.moved == [0, on_killed]
    assert client.failover.stats.deaths == [0, 1]
    assert client.failover.stats.failed == [0, 0]
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert died == [
        DIED.format(1, killer.pid) + f": {on_killed} requests moved to engine-cores [0], 0 failed"
    ]
    assert wait_gone(pids, timeout=15) == []


async def _stream_all(llm: AsyncLLM, tag: str, arrivals: dict | None = None) -> dict:
    """Stream every request (delta outputs) into `arrivals`, which a watcher may read
    meanwhile: per request, its (arrival time, token) pairs."""
    arrivals = {} if arrivals is None else arrivals

    async def one(i: int, prompt, params: SamplingParams) -> None:
        got = arrivals.setdefault(f"{tag}{i}", [])
        async for out in llm.generate(prompt, params, request_id=f"{tag}{i}"):
            got += [(time.monotonic(), t) for t in out.outputs[0].token_ids]

    params = _params(RequestOutputKind.DELTA)[:-1]  # n > 1 and logprobs: the sync test's
    await asyncio.gather(
        *(one(i, p, sp) for i, (p, sp) in enumerate(zip(PROMPTS[:-1], params, strict=True)))
    )
    return arrivals


def _tokens(arrivals: dict[str, list[tuple[float, int]]]) -> list[list[int]]:
    return [[t for _, t in a] for a in arrivals.values()]


async def _kill_when_streaming(llm: AsyncLLM, arrivals: dict, engine: int) -> tuple:
    """Once every stream has 20 tokens, SIGKILL `engine`: when, and the streams it held."""
    while len(arrivals) < len(PROMPTS) - 1 or min(map(len, arrivals.values())) < 20:
        await asyncio.sleep(0.002)
    owner = llm.client.router.owner
    held = [r for r in arrivals if owner.get(llm.output_processor.get_internal_ids(r)[0]) == engine]
    os.kill(llm.client.clients[engine].proc.pid, signal.SIGKILL)
    return time.monotonic(), held


async def _restarted(client, engine: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while client.failover.stats.restarts[engine] == 0:
        assert time.monotonic() < deadline, "the dead engine-core did not come back"
        await asyncio.sleep(0.1)


def test_async_streams_move_within_a_second_and_the_core_restarts(qwen3_dir: str) -> None:
    args = EngineArgs(
        model=qwen3_dir, dtype="float32", data_parallel_size=2, data_parallel_restart=True
    )
    llm = AsyncLLM.from_engine_args(args)
    client = llm.client
    first_pids = spawned_children(os.getpid())

    async def main():
        expected = _tokens(await _stream_all(llm, "a"))
        arrivals: dict[str, list[tuple[float, int]]] = {}
        killing = asyncio.create_task(_kill_when_streaming(llm, arrivals, engine=0))
        streamed = _tokens(await _stream_all(llm, "b", arrivals))
        killed_at, held = await killing
        # the first token each moved stream got after the kill
        waits = [min(t for t, _ in arrivals[r] if t > killed_at) - killed_at for r in held]
        await _restarted(client, engine=0)
        before = client.balance()
        again = _tokens(await _stream_all(llm, "c"))
        return expected, streamed, again, held, waits, before, client.balance()

    try:
        expected, streamed, again, held, waits, before, after = uvloop.run(main())
        pids = spawned_children(os.getpid())
    finally:
        llm.shutdown()
    assert streamed == expected and again == expected
    assert held and max(waits) < 1.0, waits
    assert client.failover.stats.moved == [len(held), 0]
    assert client.failover.stats.restarts == [1, 0]
    # routed to again: the restarted core took its share of the new requests
    assert after[0]["requests"] - before[0]["requests"] >= 2, (before, after)
    assert after[0]["alive"] and after[1]["alive"]
    assert len(pids) == 2 and first_pids[0] not in pids, "one new engine-core in its place"
    assert wait_gone(first_pids + pids, timeout=15) == []


@pytest.fixture(autouse=True)
def _no_leftover_engines():
    yield
    assert wait_gone(spawned_children(os.getpid()), timeout=15) == []
