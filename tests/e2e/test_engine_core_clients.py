"""Sixteen clients attached to one engine-core: each gets the outputs of its own requests
and nothing else, however many the engine-core serves (`minivllm bench clients`, small)."""

from __future__ import annotations

import argparse

from minivllm.frontend.bench import clients as bench_clients


def test_each_output_goes_only_to_its_client() -> None:
    args = argparse.Namespace(num_requests=48, output_len=12, clients=[1, 3, 16])
    runs = bench_clients.main(args)["runs"]
    assert [r["clients"] for r in runs] == [1, 3, 16]
    for run in runs:
        assert run["tokens"] == 48 * 12  # every client got every token of its own
        assert run["foreign_outputs"] == 0  # and none of another's
        assert run["idle_client_outputs"] == 0  # a client without requests gets nothing
