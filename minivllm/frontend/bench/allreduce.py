"""`minivllm bench allreduce`: all-reduce latency on 2 GPUs: NCCL against the Triton
one-shot kernel over symmetric memory (minivllm.worker.distributed.triton_all_reduce), each
eager and replayed in a CUDA graph.

    minivllm bench allreduce

bf16 messages from 16 KiB to 8 MiB (a TP=2 decode step of 256 sequences at hidden 4096
all-reduces 2 MiB). Each path's result is checked against the NCCL sum, eager and after a
graph replay. Prints µs per all-reduce, one row per size; a cell is marked BAD (wrong sum) or
reads ERR (it raised; the errors are printed below the table).

A second table times what a decoder does after a row-parallel layer, for bf16 [rows, 4096]
with a residual (rows 1, 64, 256: decode steps of that many sequences), inside a CUDA graph:
the Triton all-reduce then ops.norm.fused_add_rms_norm (two launches) against
TritonAllReduce.all_reduce_add_rms_norm (one), and checks that the two give the same bits,
eager and after the replays. The whole run is killed after TIMEOUT_S.

NVLink multicast stays off in NCCL, symmetric memory and NVSHMEM (it can take a shared
host's GPUs out of service), set before any CUDA use here and inherited by the ranks.
"""

from __future__ import annotations

import argparse
import os


def main(args: argparse.Namespace) -> int:
    os.environ.update(
        NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
    )
    from minivllm.frontend.bench.allreduce_ranks import launch

    raise SystemExit(launch())
