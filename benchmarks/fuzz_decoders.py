"""The long fuzz run: every decoder of protocol/ against N hypothesis-generated inputs each
(the strategies of the CI property tests: random bytes, valid tags with wrong bodies,
truncated, mutated and oversized encodings, raw pickles, unknown types).

    PYTHONPATH=. python benchmarks/fuzz_decoders.py [--examples 100000] [--json out.json]

A decoder passes if every input is either refused with ProtocolError or decodes to a
message its socket allows, and no pickle was ever executed. Hypothesis shrinks and prints
the first input that breaks this, and the script exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from hypothesis import HealthCheck, given, settings

from minivllm.protocol.serial import MsgDecoder
from tests.protocol.frame_strategies import garbage, refuses
from tests.protocol.test_fuzz_decoders import DIRECTIONS, MAX_IDS


def fuzz(name: str, allowed: tuple[type, ...], examples: int, marker: str) -> dict:
    decoder = MsgDecoder(allowed, max_ids=MAX_IDS)
    counts = {"refused": 0, "decoded": 0}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(frames=garbage(marker, max_ids=MAX_IDS))
    def one(frames: list[bytes]) -> None:
        if refuses(decoder, frames):
            counts["refused"] += 1
        else:
            assert type(decoder.decode(frames)) in allowed
            counts["decoded"] += 1

    start = time.perf_counter()
    one()
    seconds = time.perf_counter() - start
    if os.path.exists(marker):
        raise SystemExit(f"{name}: a pickle was executed")
    total = counts["refused"] + counts["decoded"]
    return {"decoder": name, "inputs": total, **counts, "seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100_000)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    marker = os.path.join(tempfile.mkdtemp(prefix="fuzz-"), "executed")
    print(f"{'decoder':<18} {'inputs':>8} {'refused':>8} {'decoded':>8} {'seconds':>8}")
    results = []
    for name, allowed in DIRECTIONS.items():
        r = fuzz(name, allowed, args.examples, marker)
        results.append(r)
        print(
            f"{name:<18} {r['inputs']:>8} {r['refused']:>8} {r['decoded']:>8} {r['seconds']:>8}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
