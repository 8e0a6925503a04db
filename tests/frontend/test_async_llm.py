"""AsyncLLM under uvloop: many streams, cancellation, id reuse, output kinds."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from minivllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams

_LOOP = uvloop.new_event_loop()


@pytest.fixture(scope="module")
def async_llm(qwen3_dir: str):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=qwen3_dir, dtype="float32"))
    yield llm
    llm.shutdown()


def run(coro):
    return _LOOP.run_until_complete(coro)


def test_100_streams_10_cancelled(async_llm: AsyncLLM) -> None:
    async def stream(i: int, cancel_after: int | None, max_tokens: int | None = None) -> int:
        params = SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=max_tokens or 10 + i % 7,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        n = 0
        async for out in async_llm.generate([1, 2, 3, i % 50 + 4], params, request_id=f"req-{i}"):
            n += len(out.outputs[0].token_ids)
            if cancel_after is not None and n >= cancel_after:
                break  # leaving the loop aborts the request
        return n

    async def cancelled_task(i: int) -> None:
        # long enough to be still running when cancelled, however idle the machine
        task = asyncio.create_task(stream(i, None, max_tokens=10_000))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main() -> tuple[list[int], dict]:
        jobs = []
        for i in range(100):
            if i % 20 == 0:
                jobs.append(cancelled_task(i))
            elif i % 20 == 10:
                jobs.append(stream(i, cancel_after=3))
            else:
                jobs.append(stream(i, None))
        counts = await asyncio.gather(*jobs)
        for _ in range(50):  # aborts travel asynchronously
            stats = await async_llm.get_stats()
            if stats["num_running"] == stats["num_waiting"] == 0:
                break
            await asyncio.sleep(0.1)
        return counts, stats

    counts, stats = run(main())
    for i, n in enumerate(counts):
        if i % 20 == 0:
            continue
        expected = 3 if i % 20 == 10 else 10 + i % 7
        assert n == expected, f"request {i}"
    assert stats["kv_cache_usage"] == 0.0

    # every id is reusable once its request ended
    async def reuse() -> list[int]:
        return await asyncio.gather(*[stream(i, None) for i in range(0, 100, 10)])

    assert run(reuse()) == [10 + i % 7 for i in range(0, 100, 10)]


def test_output_kinds_agree(async_llm: AsyncLLM) -> None:
    async def collect(kind: RequestOutputKind) -> list:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind)
        return [o async for o in async_llm.generate("Hello world", params, request_id=str(kind))]

    async def main():
        return await asyncio.gather(*[collect(k) for k in RequestOutputKind])

    cumulative, delta, final = run(main())
    assert len(final) == 1 and final[0].finished
    assert "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text
    assert cumulative[-1].outputs[0].text == final[0].outputs[0].text
    assert sum(len(o.outputs[0].token_ids) for o in delta) == 12


def test_bad_request_is_rejected_and_others_continue(async_llm: AsyncLLM) -> None:
    async def main():
        with pytest.raises(ValueError, match="maximum model length"):
            async for _ in async_llm.generate([1] * 1000, SamplingParams(), request_id="bad"):
                pass
        good = [
            o
            async for o in async_llm.generate(
                "Hello", SamplingParams(max_tokens=5, ignore_eos=True), request_id="good"
            )
        ]
        return good[-1]

    out = run(main())
    assert out.finished and len(out.outputs[0].token_ids) == 5


def test_n_completions(async_llm: AsyncLLM) -> None:
    async def main():
        params = SamplingParams(
            n=3,
            temperature=1.0,
            seed=7,
            max_tokens=6,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        return [o async for o in async_llm.generate("Hello", params, request_id="n3")]

    (out,) = run(main())
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_streamed_logprobs_carry_only_the_new_positions(async_llm: AsyncLLM) -> None:
    """Through the engine-core process: DELTA outputs hold the new tokens' logprobs only,
    the prompt's come once, with the first output, and all of it adds up to the final
    output of the same request."""

    async def collect(kind: RequestOutputKind, request_id: str) -> list:
        params = SamplingParams(
            temperature=0.7, seed=5, max_tokens=9, logprobs=3, prompt_logprobs=2,
            ignore_eos=True, output_kind=kind,
        )  # fmt: skip
        return [o async for o in async_llm.generate([7, 8, 9, 10, 11], params, request_id)]

    deltas = run(collect(RequestOutputKind.DELTA, "delta"))
    (final,) = run(collect(RequestOutputKind.FINAL_ONLY, "final"))
    assert len(final.prompt_logprobs) == 5 and final.prompt_logprobs[0] is None
    assert deltas[0].prompt_logprobs == final.prompt_logprobs
    assert all(not d.prompt_logprobs for d in deltas[1:])
    tokens, logprobs = [], []
    for d in deltas:
        c = d.outputs[0]
        assert len(c.logprobs) == len(c.token_ids)
        tokens += c.token_ids
        logprobs += c.logprobs
    assert tokens == final.outputs[0].token_ids
    assert logprobs == final.outputs[0].logprobs
    assert deltas[-1].outputs[0].cumulative_logprob == final.outputs[0].cumulative_logprob
