"""Several daemons behind one client (`AsyncLLM.connect([a, b, c])`, `LLM.connect`): requests
spread over them; SIGKILL the daemon under some streams and they go on on the others with
every token; a request whose second daemon dies too fails with an error that names both,
while the rest finish. The three daemons serve the whole module: the last test kills two."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import uvloop

from minivllm import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from minivllm.exceptions import EngineCoreDeadError
from tests.e2e.daemon import Daemon, greedy, null_tokens
from tests.tiny_models import build_null_checkpoint

MAX_TOKENS = 3000
NUM_STREAMS = 6


@pytest.fixture(scope="module")
def daemons(tmp_path_factory):
    root = tmp_path_factory.mktemp("daemons")
    model = build_null_checkpoint(str(root / "null"))
    started = [
        Daemon(
            model,
            f"ipc://{root}/engine{i}",
            str(root / f"daemon{i}.log"),
            "--distributed-executor-backend",
            "uni",  # no worker process: a quicker start
        )
        for i in range(3)
    ]
    try:
        for d in started:
            d.wait_listening()
        yield started
    finally:
        for d in started:
            d.stop()


def test_requests_spread_over_connected_daemons(daemons: list[Daemon]) -> None:
    llm = AsyncLLM.connect([d.address for d in daemons])
    streams = _Streams(llm, max_tokens=20)
    try:
        uvloop.run(streams.run())
        assert all(b["requests"] >= 1 for b in llm.client.balance()), "each daemon serves"
    finally:
        llm.shutdown()
    assert streams.errors == {}
    for i in range(NUM_STREAMS):
        assert streams.tokens(f"s{i}") == null_tokens(3 + i, 20), f"s{i}"
    sync = LLM.connect([d.address for d in daemons])
    try:
        outs = sync.generate([[1, 2, 3]] * 4, greedy(5), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == [null_tokens(3, 5)] * 4
        time.sleep(4)  # idle longer than a silent engine is given: the heartbeats waited
        out = sync.generate([1, 2, 3], greedy(5), use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == null_tokens(3, 5)
    finally:
        sync.shutdown()
    assert all(d.proc.poll() is None for d in daemons), "the daemons outlive their clients"


class _Streams:
    """NUM_STREAMS greedy streams of distinct prompt lengths; per stream the (arrival time,
    token) pairs it got, and the exception it ended with, if any."""

    def __init__(self, llm: AsyncLLM, max_tokens: int = MAX_TOKENS) -> None:
        self.llm = llm
        self.max_tokens = max_tokens
        self.arrivals: dict[str, list[tuple[float, int]]] = {}
        self.errors: dict[str, BaseException] = {}

    async def run(self) -> None:
        await asyncio.gather(*(self._one(i) for i in range(NUM_STREAMS)))

    async def _one(self, i: int) -> None:
        rid = f"s{i}"
        got = self.arrivals.setdefault(rid, [])
        params = SamplingParams(
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        try:
            async for out in self.llm.generate(list(range(1, 4 + i)), params, request_id=rid):
                got += [(time.monotonic(), t) for t in out.outputs[0].token_ids]
        except EngineCoreDeadError as e:
            self.errors[rid] = e

    def owner(self, rid: str) -> int | None:
        ids = self.llm.output_processor.get_internal_ids(rid)
        return self.llm.client.router.owner.get(ids[0]) if ids else None

    def tokens(self, rid: str) -> list[int]:
        return [t for _, t in self.arrivals[rid]]

    async def until(self, condition, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.002)


def test_connected_daemons_fail_over_and_a_request_fails_on_its_second_death(
    daemons: list[Daemon], caplog
) -> None:
    assert all(d.proc.poll() is None for d in daemons)
    llm = AsyncLLM.connect([d.address for d in daemons])
    streams = _Streams(llm)

    async def main():
        running = asyncio.create_task(streams.run())
        await streams.until(
            lambda: (
                len(streams.arrivals) == NUM_STREAMS
                and min(map(len, streams.arrivals.values())) >= 20
            )
        )
        first = streams.owner("s0")
        held = [r for r in streams.arrivals if streams.owner(r) == first]
        killed_at = time.monotonic()
        daemons[first].proc.kill()
        # s0 goes on on another daemon; kill that one too, while s0 streams there
        await streams.until(lambda: streams.owner("s0") not in (None, first))
        second = streams.owner("s0")
        await streams.until(lambda: streams.arrivals["s0"][-1][0] > killed_at)
        daemons[second].proc.kill()
        await asyncio.wait_for(running, 120)
        waits = [min(t for t, _ in streams.arrivals[r] if t > killed_at) - killed_at for r in held]
        return first, second, held, waits

    try:
        with caplog.at_level(logging.WARNING, logger="minivllm.frontend.clients.dp_group"):
            first, second, held, waits = uvloop.run(main())
        stats = llm.client.failover.stats
    finally:
        llm.shutdown()
    error = streams.errors.pop("s0")
    assert f"engine-cores {first} and {second} died holding it" in str(error), error
    assert "data_parallel_failover_limit=2" in str(error)
    assert streams.errors == {}, "only the request whose two daemons died fails"
    assert streams.tokens("s0") == null_tokens(3, MAX_TOKENS)[: len(streams.tokens("s0"))]
    for i in range(1, NUM_STREAMS):
        assert streams.tokens(f"s{i}") == null_tokens(3 + i, MAX_TOKENS), f"s{i}"
    assert len(held) == 2 and max(waits) < 3.0, waits  # a daemon's death is probed for
    assert stats.deaths[first] == stats.deaths[second] == 1
    assert stats.moved[first] == 2 and stats.failed == [int(e == second) for e in range(3)]
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 2 and "2 requests moved" in died[0] and "1 failed" in died[1], died
    third = ({0, 1, 2} - {first, second}).pop()
    assert daemons[third].proc.poll() is None, "the daemons outlive their client"
