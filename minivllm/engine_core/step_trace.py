"""An optional per-step trace of the engine-core: what each step carried and when its
output came back. `MINIVLLM_STEP_TRACE=FILE` turns it on; the file gets one JSON object per
step when the engine shuts down. Cheap enough to leave on for a benchmark run."""

from __future__ import annotations

import json
import time

from minivllm import envs
from minivllm.protocol.messages import SchedulerOutput


class StepTrace:
    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else envs.step_trace_path()
        self.records: list[list[float]] = []

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def launched(self, so: SchedulerOutput) -> None:
        counts = so.num_scheduled_tokens.values()
        decodes = sum(1 for n in counts if n == 1)
        self.records.append(
            [time.perf_counter(), 0.0, len(so.num_scheduled_tokens), decodes,
             so.total_num_scheduled_tokens - decodes]
        )  # fmt: skip

    def applied(self, step_index: int) -> None:
        self.records[step_index][1] = time.perf_counter()

    def write(self) -> None:
        if not self.path or not self.records:
            return
        start = self.records[0][0]
        with open(self.path, "w") as f:
            for launched, applied, seqs, decodes, prefill_tokens in self.records:
                f.write(json.dumps({
                    "launched_ms": round((launched - start) * 1e3, 3),
                    "applied_ms": round((applied - start) * 1e3, 3) if applied else None,
                    "num_seqs": seqs, "num_decodes": decodes, "prefill_tokens": prefill_tokens,
                }) + "\n")  # fmt: skip
