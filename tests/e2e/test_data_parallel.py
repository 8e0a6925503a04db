"""Data parallelism: several engine-cores behind one frontend give the tokens one gives,
share the requests, and with failover off a dead one takes only its own requests down; the
OpenAI server over two loses no request when one is killed (failover through the Python
APIs: test_failover.py; over daemons: test_failover_daemons.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import uvloop

from minivllm import (
    LLM,
    AsyncLLM,
    EngineArgs,
    EngineDeadError,
    RequestOutputKind,
    SamplingParams,
)
from minivllm.exceptions import EngineCoreDeadError
from tests.hf_reference import parity_prompts
from tests.process_helpers import spawned_children, wait_gone
from tests.tiny_models import build_null_checkpoint


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")))


def _engine_pids() -> list[int]:
    cores = spawned_children(os.getpid())
    return cores + [w for c in cores for w in spawned_children(c)]


def test_dp2_gives_dp1_tokens_and_spreads_requests(qwen3_dir: str) -> None:
    prompts = [{"prompt_token_ids": p} for p in parity_prompts() + parity_prompts(seed=1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = LLM(qwen3_dir, dtype="float32", distributed_executor_backend="uni")  # the same core
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy)]
    finally:
        one.shutdown()

    llm = LLM(qwen3_dir, dtype="float32", data_parallel_size=2)
    try:
        cores = spawned_children(os.getpid())
        assert len(cores) == 2, "one engine-core process per data-parallel rank"
        assert all(len(spawned_children(c)) == 1 for c in cores), "each with its own worker"
        outputs = llm.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        client = llm.llm_engine.engine_core
        balance = client.balance()
        assert all(b["requests"] >= 3 for b in balance), balance
        assert sum(b["output_tokens"] for b in balance) == 8 * len(prompts)

        # the n children of one request stay on one core
        engine = llm.llm_engine
        engine.add_request("fan", [5, 6, 7], SamplingParams(n=3, max_tokens=4, seed=1))
        owners = {client.router.owner[r] for r in engine.output_processor.get_internal_ids("fan")}
        assert len(owners) == 1
        while engine.has_unfinished_requests():
            engine.step()
        assert llm.llm_engine.get_stats()["num_running"] == 0
    finally:
        llm.shutdown()
    assert wait_gone(cores, timeout=15) == []


@pytest.mark.gpu
def test_dp2_on_cuda_gives_dp1_tokens(qwen3_dir: str) -> None:
    """One GPU: two engine-cores share it, each with its own 0.3 of its memory."""
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for dp in (1, 2):
        llm = LLM(qwen3_dir, dtype="float32", data_parallel_size=dp, gpu_memory_utilization=0.3)
        try:
            outputs[dp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
            if dp == 2:
                balance = llm.llm_engine.engine_core.balance()
                assert all(b["requests"] >= 3 for b in balance), balance
        finally:
            llm.shutdown()
    assert outputs[2] == outputs[1]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )


async def _count(llm: AsyncLLM, rid: str, max_tokens: int, started: asyncio.Event):
    """The tokens a stream got, or the EngineDeadError it ended with (its `at` attribute:
    when it arrived)."""
    n = 0
    try:
        async for out in llm.generate([1, 2, 3], _params(max_tokens), request_id=rid):
            n += len(out.outputs[0].token_ids)
            started.set()
    except EngineDeadError as e:
        e.at = time.monotonic()
        return e
    return n


def test_killed_core_fails_only_its_requests_with_failover_off(null_dir: str) -> None:
    args = EngineArgs(model=null_dir, data_parallel_size=2, data_parallel_failover_limit=1)
    llm = AsyncLLM.from_engine_args(args)
    pids = _engine_pids()
    client = llm.client

    async def main():
        events = [asyncio.Event() for _ in range(8)]
        tasks = [asyncio.create_task(_count(llm, f"r{i}", 1500, ev)) for i, ev in enumerate(events)]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), 60)
        owner = {
            f"r{i}": client.router.owner[llm.output_processor.get_internal_ids(f"r{i}")[0]]
            for i in range(8)
        }
        assert sorted(owner.values()) == [0] * 4 + [1] * 4, "least-loaded routing"
        killed_at = time.monotonic()
        os.kill(client.clients[0].proc.pid, signal.SIGKILL)
        done = dict(zip(owner, await asyncio.wait_for(asyncio.gather(*tasks), 60), strict=True))
        failed_at = max(r.at for r in done.values() if isinstance(r, BaseException))
        with pytest.raises(EngineDeadError, match="engine-core 0 .*killed by SIGKILL"):
            await llm.check_health()
        # the survivor takes every new request
        after = await asyncio.gather(*(_count(llm, f"n{i}", 50, asyncio.Event()) for i in range(4)))
        return owner, done, failed_at - killed_at, after

    try:
        owner, done, waited, after = uvloop.run(main())
    finally:
        llm.shutdown()
    for rid, engine in owner.items():
        if engine == 0:
            assert isinstance(done[rid], EngineCoreDeadError), done[rid]
            assert "4 of its requests fail: failover is off" in str(done[rid])
        else:
            assert done[rid] == 1500, done[rid]
    assert waited < 5.0
    assert after == [50] * 4
    assert client.balance()[1]["requests"] == 8
    assert wait_gone(pids, timeout=15) == []


def test_openai_server_over_two_engine_cores_survives_a_killed_one(null_dir: str, tmp_path) -> None:
    import httpx

    from minivllm.frontend.server.launch import ServerProcess
    from tests.server.conftest import descendants, server_env, stop_cleanly

    args = [null_dir, "--data-parallel-size", "2", "--served-model-name", "null"]
    server = ServerProcess(args, str(tmp_path / "server.log"), server_env(), startup_timeout=120)
    try:
        spawned = [p for p in descendants(server) if "spawn_main" in " ".join(p.cmdline())]
        cores = [p for p in spawned if p.ppid() == server.proc.pid]
        assert (len(cores), len(spawned)) == (2, 4), "two engine-cores, each with its worker"
        body = {"model": "null", "prompt": "Hello", "max_tokens": 16, "ignore_eos": True}

        async def main() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as http:
                calls = [http.post(f"{server.url}/v1/completions", json=body) for _ in range(8)]
                return [
                    r.json()["usage"]["completion_tokens"] for r in await asyncio.gather(*calls)
                ]

        assert asyncio.run(main()) == [16] * 8
        assert httpx.get(f"{server.url}/health").status_code == 200
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'vllm:generation_tokens_total{engine="0",model_name="null"} 128.0' in metrics

        # SIGKILL an engine-core while 8 completions stream: every one ends whole
        results = asyncio.run(_stream_and_kill(server.url, lambda: cores[1].kill()))
        assert [tokens for _, tokens in results] == [1500] * 8
        assert len({text for text, _ in results}) == 1, "the null model's text, whole"
        assert httpx.get(f"{server.url}/health").status_code == 503  # one is dead
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        stop_cleanly(server)
    assert _counter(metrics, "vllm:engine_core_deaths_total") == 1
    assert _counter(metrics, "vllm:engine_core_requests_moved_total") >= 1
    assert _counter(metrics, "vllm:engine_core_requests_failed_total") == 0


async def _stream_and_kill(url: str, kill) -> list[tuple[str, int]]:
    """Stream 8 completions of 1500 tokens, call `kill()` once each has a chunk: per
    completion, its text and its usage's completion tokens."""
    import httpx

    body = {"model": "null", "prompt": "Hello", "max_tokens": 1500, "temperature": 0.0}
    body |= {"ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    started = [asyncio.Event() for _ in range(8)]

    async def one(http: httpx.AsyncClient, started: asyncio.Event) -> tuple[str, int]:
        data, text, tokens = b"", "", 0
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for piece in response.aiter_bytes():
                # split on bytes: the text may hold characters str.splitlines breaks at
                *events, data = (data + piece).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue
                    chunk = json.loads(event[len(b"data: ") :])
                    text += "".join(c["text"] for c in chunk["choices"])
                    started.set()
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        return text, tokens

    async with httpx.AsyncClient(timeout=60) as http:
        calls = asyncio.gather(*(one(http, ev) for ev in started))
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
        kill()
        return await calls


def _counter(metrics: str, name: str) -> float:
    """The sum of a counter's series over every engine-core."""
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))
