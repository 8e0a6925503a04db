"""Where a run's time goes, step by step, from a MINIVLLM_STEP_TRACE file.

    MINIVLLM_STEP_TRACE=trace.jsonl minivllm bench throughput
    python benchmarks/step_trace_summary.py trace.jsonl

Each step's time is the gap between its output being applied and the previous step's (the
engine's throughput clock); steps are grouped into those carrying prefill tokens and
pure-decode steps by batch size.
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    with open(path) as f:
        steps = [s for s in map(json.loads, f) if s["applied_ms"] is not None]
    groups: dict[str, list[float]] = {}
    prev = steps[0]["launched_ms"]
    for s in steps:
        gap = s["applied_ms"] - prev
        prev = s["applied_ms"]
        if s["prefill_tokens"]:
            key = "prefill (+decodes)"
        else:
            n = s["num_decodes"]
            key = next(f"decode <= {b}" for b in (8, 32, 64, 128, 192, 256, 1 << 30) if n <= b)
        groups.setdefault(key, []).append(gap)
    total = sum(sum(g) for g in groups.values())
    print(f"{len(steps)} steps, {total / 1e3:.2f} s from the first launch to the last output")
    print(f"{'steps':<20}{'count':>7}{'total s':>10}{'share':>8}{'ms/step':>10}")
    for key, gaps in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        t = sum(gaps)
        print(f"{key:<20}{len(gaps):>7}{t / 1e3:>10.2f}{t / total:>8.1%}{t / len(gaps):>10.2f}")
    # structured outputs: a step's bitmask leaves once the step before it is applied (or
    # at its launch when none is in flight); the gap is the matchers' bitmask fill + send
    waits = sorted(
        s["bitmask_ms"] - max(p["applied_ms"], s["launched_ms"])
        for p, s in zip(steps, steps[1:], strict=False)
        if "bitmask_ms" in s
    )
    if waits:
        print(
            f"grammar bitmask: {len(waits)} steps; sent {waits[len(waits) // 2]:.2f} ms "
            f"(median), {waits[int(0.99 * (len(waits) - 1))]:.2f} ms (p99) after the step "
            "before was applied"
        )


if __name__ == "__main__":
    main(sys.argv[1])
