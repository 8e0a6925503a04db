"""`python benchmarks/trace.py FILE`: where a run's time went, step by step, from the
engine's step trace (`MINIVLLM_STEP_TRACE=FILE minivllm bench throughput ...` writes one).

Each step's time is the gap between its output being applied and the previous step's (the
engine's throughput clock); steps are grouped into those carrying prompt tokens and
pure-decode steps by batch size. With structured outputs, also how long after the step
before it was applied each step's grammar bitmask left (the matchers' fill and the send).
"""

from __future__ import annotations

import argparse
import json

from minivllm.benchmarks import run_script

_DECODE_BUCKETS = (8, 32, 64, 128, 192, 256, 1 << 30)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the JSON-lines file the engine wrote")


def summarize(steps: list[dict]) -> dict[str, list[float]]:
    """Milliseconds of each step (all applied), grouped by kind."""
    groups: dict[str, list[float]] = {}
    prev = steps[0]["launched_ms"] if steps else 0.0
    for s in steps:
        gap = s["applied_ms"] - prev
        prev = s["applied_ms"]
        if s["prefill_tokens"]:
            key = "prefill (+decodes)"
        else:
            n = s["num_decodes"]
            key = next(f"decode <= {b}" for b in _DECODE_BUCKETS if n <= b)
        groups.setdefault(key, []).append(gap)
    return groups


def bitmask_gaps(steps: list[dict]) -> list[float]:
    """Milliseconds from the later of the step before being applied and this step's launch
    (a bitmask cannot leave earlier) to this step's bitmask leaving, sorted (all applied)."""
    return sorted(
        s["bitmask_ms"] - max(prev["applied_ms"], s["launched_ms"])
        for prev, s in zip(steps, steps[1:], strict=False)
        if "bitmask_ms" in s
    )


def main(args: argparse.Namespace) -> dict[str, list[float]]:
    with open(args.path) as f:
        steps = [s for s in map(json.loads, f) if s["applied_ms"] is not None]
    groups = summarize(steps)
    total = sum(sum(g) for g in groups.values())
    count = sum(len(g) for g in groups.values())
    print(f"{count} steps, {total / 1e3:.2f} s from the first launch to the last output")
    print(f"{'steps':<20}{'count':>7}{'total s':>10}{'share':>8}{'ms/step':>10}")
    for key, gaps in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        t = sum(gaps)
        print(f"{key:<20}{len(gaps):>7}{t / 1e3:>10.2f}{t / total:>8.1%}{t / len(gaps):>10.2f}")
    gaps = bitmask_gaps(steps)
    if gaps:
        print(
            f"grammar bitmask: {len(gaps)} steps; sent {gaps[len(gaps) // 2]:.2f} ms (median), "
            f"{gaps[int(0.99 * (len(gaps) - 1))]:.2f} ms (p99) after the step before was applied"
        )
    return groups


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
