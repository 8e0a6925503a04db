"""A frontend that falls behind its engine (an event loop busy elsewhere while steps come
in) catches up in one go: the steps that waited are read back to back, and a stream gets
their tokens as one delta, none lost, instead of one step per turn of the loop."""

from __future__ import annotations

import asyncio
import time

from minivllm.config import EngineArgs
from minivllm.frontend.async_llm import AsyncLLM
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

MAX_TOKENS = 40


def test_a_stream_behind_its_engine_gets_the_waiting_steps_at_once(qwen3_dir: str) -> None:
    async def stream(block_s: float) -> list[list[int]]:
        args = EngineArgs(model=qwen3_dir, max_model_len=128, device="cpu")
        params = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        deltas = []
        async with AsyncLLM.from_engine_args(args) as llm:
            async for out in llm.generate("Hello", params, "r"):
                deltas.append(out.outputs[0].token_ids)
                if len(deltas) == 1:
                    time.sleep(block_s)  # the engine runs on; its steps wait in the socket
        return deltas

    steady, behind = asyncio.run(stream(0.0)), asyncio.run(stream(1.0))
    assert sum(behind, []) == sum(steady, []) and len(sum(steady, [])) == MAX_TOKENS
    # a second is many steps of this model: they arrive together, not one per loop turn
    assert len(behind[1]) >= 8, [len(d) for d in behind]
