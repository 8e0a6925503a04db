"""Eight streams against the null model, whose forward here raises once a position reaches
FAIL_AT; prints what each caller got and the engine's pids as one JSON line.

    python tests/e2e/failing_forward.py NULL_MODEL_DIR

The patch runs at import, outside the main guard: multiprocessing's spawn runs this file
again (as `__mp_main__`) in the engine-core and in the worker it starts, so the fault is
injected where the forward runs, and the model itself carries no hook for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import uvloop

from minivllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from minivllm.benchmarks.null_model import NullForCausalLM
from tests.process_helpers import spawned_children

FAIL_AT = 200
_null_forward = NullForCausalLM.forward


def _failing_forward(self, input_ids, positions, *args):
    if int(positions.max()) >= FAIL_AT:
        raise RuntimeError(f"injected failure at position {FAIL_AT}")
    return _null_forward(self, input_ids, positions, *args)


NullForCausalLM.forward = _failing_forward


async def main(model_dir: str) -> None:
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir))
    core = spawned_children(os.getpid())[-1]
    pids = [core, *spawned_children(core)]
    params = SamplingParams(
        temperature=0.0, max_tokens=3000, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def stream(i: int) -> str:
        try:
            async for _ in llm.generate([1, 2, 3, i + 4], params, request_id=f"r{i}"):
                pass
        except Exception as e:  # noqa: BLE001 - the test reads what each caller got
            return f"{type(e).__name__}: {e}"
        return "finished"

    try:
        results = await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(8))), 60)
    finally:
        llm.shutdown()
    print(json.dumps({"results": results, "pids": pids}), flush=True)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
