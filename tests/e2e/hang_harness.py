"""Streams through an engine whose worker is made to stall: its first step by SLOW_FIRST_S
seconds, and the step HANG_AT for good. Run as a script; prints one JSON line with the
engine's pids, then one with what each stream got.

The stall is injected here, not in the engine: spawned processes import the script that
started them (multiprocessing's spawn re-imports __main__), so the worker runs this module's
top level, which wraps its step.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time

from minivllm.worker.worker import Worker

HANG_AT = int(os.environ.get("HANG_AT", "-1"))
SLOW_FIRST_S = float(os.environ.get("SLOW_FIRST_S", "0"))
_steps = itertools.count()
_execute = Worker.execute_model


def hanging(self, *args, **kwargs):
    step = next(_steps)
    if step == 0:
        time.sleep(SLOW_FIRST_S)  # the first step compiles: no time limit applies to it
    if step == HANG_AT:
        time.sleep(3600)  # a kernel that never returns
    return _execute(self, *args, **kwargs)


Worker.execute_model = hanging


async def stream(llm, i: int) -> str:
    from minivllm import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    count = 0
    try:
        async for out in llm.generate([1, 2, 3, i + 4], params, request_id=f"r{i}"):
            count += len(out.outputs[0].token_ids)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__} after {count} tokens: {e}"
    return f"finished with {count} tokens"


async def main(model: str, timeout: float) -> None:
    from minivllm import AsyncLLM, EngineArgs
    from tests.process_helpers import spawned_children

    llm = AsyncLLM.from_engine_args(EngineArgs(model=model, execute_timeout=timeout))
    core = spawned_children(os.getpid())[-1]
    print(json.dumps({"core": core, "workers": spawned_children(core)}), flush=True)
    start = time.monotonic()
    first = await stream(llm, 0)  # through the slow first step
    results = await asyncio.gather(*[stream(llm, i) for i in range(1, 5)])
    elapsed = time.monotonic() - start
    print(json.dumps({"first": first, "results": results, "elapsed": elapsed}), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
