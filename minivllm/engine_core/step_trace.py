"""An optional per-step trace of the engine-core: what each step carried and when its
output came back. `MINIVLLM_STEP_TRACE=FILE` turns it on; the file gets one JSON object per
step when the engine shuts down. Cheap enough to leave on for a benchmark run.

Steps with structured outputs also record when their token bitmask left for the workers
(`bitmask_ms`) and how many grammars were compiling when they were launched."""

from __future__ import annotations

import json
import time

from minivllm import envs
from minivllm.protocol.messages import SchedulerOutput

# record fields: launched, applied, sequences, decodes, prefill tokens, bitmask sent, compiling
_LAUNCHED, _APPLIED, _BITMASK = 0, 1, 5


class StepTrace:
    def __init__(self, path: str | None = None) -> None:
        self.path = path if path is not None else envs.step_trace_path()
        self.records: list[list[float]] = []

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def launched(self, so: SchedulerOutput, num_compiling: int = 0) -> None:
        counts = so.num_scheduled_tokens.values()
        decodes = sum(1 for n in counts if n == 1)
        self.records.append(
            [time.perf_counter(), 0.0, len(so.num_scheduled_tokens), decodes,
             so.total_num_scheduled_tokens - decodes, 0.0, num_compiling]
        )  # fmt: skip

    def applied(self, step_index: int) -> None:
        self.records[step_index][_APPLIED] = time.perf_counter()

    def bitmask_sent(self) -> None:
        """The newest launched step's bitmask has left (it is always the newest's)."""
        self.records[-1][_BITMASK] = time.perf_counter()

    def write(self) -> None:
        if not self.path or not self.records:
            return
        start = self.records[0][_LAUNCHED]

        def ms(t: float) -> float | None:
            return round((t - start) * 1e3, 3) if t else None

        with open(self.path, "w") as f:
            for launched, applied, seqs, decodes, prefill, bitmask, compiling in self.records:
                record = {
                    "launched_ms": ms(launched), "applied_ms": ms(applied), "num_seqs": seqs,
                    "num_decodes": decodes, "prefill_tokens": prefill,
                }  # fmt: skip
                if bitmask:
                    record["bitmask_ms"] = ms(bitmask)
                if compiling:
                    record["grammars_compiling"] = compiling
                f.write(json.dumps(record) + "\n")
