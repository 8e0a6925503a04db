"""`python benchmarks/allreduce.py`: all-reduce latency on 2 GPUs: NCCL against the Triton
one-shot kernel over symmetric memory (minivllm.worker.distributed.triton_all_reduce), each
eager and replayed in a CUDA graph.

    python benchmarks/allreduce.py

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
import socket
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.benchmarks import run_script

SIZES = [16 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
METHODS = ("nccl", "triton")
EAGER_REPS, GRAPH_OPS, GRAPH_REPS = 200, 50, 10
NORM_ROWS, HIDDEN, EPS = (1, 64, 256), 4096, 1e-6
PAIRS_PER_STEP = 73  # all-reduce + norm pairs in a Qwen3-8B decode step (36 layers)
TIMEOUT_S = 170


def time_us(fn, calls: int) -> float:
    """GPU time of fn() per call, both ranks starting together."""
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return torch.allclose(got.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


def capture(fn):
    """A CUDA graph of GRAPH_OPS calls of fn (warmed up on a side stream first), replayed
    once; returns it and the last call's output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_OPS):
            out = fn()
    graph.replay()
    return graph, out


def graph_us(graph: torch.cuda.CUDAGraph) -> float:
    """GPU time per captured call, over GRAPH_REPS replays."""
    return time_us(lambda: [graph.replay() for _ in range(GRAPH_REPS)], GRAPH_REPS * GRAPH_OPS)


def same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(
        torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b, strict=True)
    )


def measure_norm(comm, rows: int, rank: int, device: torch.device) -> list[str]:
    """[2-launch µs, 1-launch µs, saved µs, saved per step µs, bit-equal] for the all-reduce
    + add + RMSNorm of bf16 [rows, HIDDEN], each timed in a CUDA graph."""
    from minivllm.worker.ops.norm import fused_add_rms_norm

    gen = torch.Generator(device=device).manual_seed(1000 * rank + rows)
    x = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    alike = torch.Generator(device=device).manual_seed(rows)  # the same on both ranks
    residual = torch.randn(rows, HIDDEN, generator=alike, device=device).to(torch.bfloat16)
    weight = (1 + torch.randn(HIDDEN, generator=alike, device=device) / 4).to(torch.bfloat16)

    def two_launches():
        return fused_add_rms_norm(comm.all_reduce(x), residual, weight, EPS)

    def one_launch():
        return comm.all_reduce_add_rms_norm(x, residual, weight, EPS)

    if not comm.fits_rows(x, residual):
        raise RuntimeError(f"the fused kernel does not take [{rows}, {HIDDEN}]")
    equal = same_bits(two_launches(), one_launch())
    (unfused, unfused_out), (fused, fused_out) = capture(two_launches), capture(one_launch)
    equal = equal and same_bits(unfused_out, fused_out)  # after one replay of each
    two_us, one_us = graph_us(unfused), graph_us(fused)
    equal = equal and same_bits(unfused_out, fused_out)  # after all the replays
    saved = two_us - one_us
    return [
        f"{two_us:.1f}",
        f"{one_us:.1f}",
        f"{saved:.1f} ({100 * saved / two_us:.0f}%)",
        f"{saved * PAIRS_PER_STEP:.0f}",
        "yes" if equal else "NO",
    ]


def measure(name: str, op, data: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """[eager µs, graph µs] as printed cells; " BAD" marks a wrong sum."""
    cells = []
    ok = close(op(data.clone()), ref)
    x = torch.zeros_like(data)  # NCCL sums in place: zeros stay finite over calls
    for _ in range(10):
        op(x)
    us = time_us(lambda: [op(x) for _ in range(EAGER_REPS)], EAGER_REPS)
    cells.append(f"{us:.1f}" + ("" if ok else " BAD"))

    graph, y = capture(lambda: op(x))
    us = graph_us(graph)
    ok = True
    if name != "nccl":  # out of place: one replay over fresh input must give the sum
        x.copy_(data)
        graph.replay()
        ok = close(y, ref)
    cells.append(f"{us:.1f}" + ("" if ok else " BAD"))
    return cells


def run(rank: int, port: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device
    )
    from minivllm.worker.distributed.triton_all_reduce import TritonAllReduce

    group = dist.group.WORLD

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    ops, errors = {"nccl": nccl}, []  # name -> op
    triton_comm = None  # kept alive to the end
    try:
        triton_comm = TritonAllReduce(group, device, max(SIZES))
        ops["triton"] = triton_comm.all_reduce
    except Exception as e:
        errors.append(f"triton setup: {type(e).__name__}: {e}")
    if rank == 0:
        print(f"{torch.cuda.get_device_name(device)} x 2, torch {torch.__version__}")
        cells = ["size"] + [
            f"{m.replace('_', '-')} {k}" for m in METHODS for k in ("eager", "graph")
        ]
        print("  ".join(f"{c:>15}" for c in cells), flush=True)
    for size in SIZES:
        gen = torch.Generator(device=device).manual_seed(1000 * rank + size)
        data = torch.randn(size // 2, generator=gen, device=device).to(torch.bfloat16)
        ref = nccl(data.clone())
        cells = [f"{size >> 10} KiB"]
        for name in METHODS:
            try:
                cells += measure(name, ops[name], data, ref) if name in ops else ["ERR", "ERR"]
            except Exception as e:
                errors.append(f"{name} {size >> 10} KiB: {type(e).__name__}: {e}")
                cells += ["ERR", "ERR"]
        if rank == 0:
            print("  ".join(f"{c:>15}" for c in cells), flush=True)
    if rank == 0:
        print(
            f"µs per all-reduce. eager: {EAGER_REPS} back-to-back calls; graph: {GRAPH_REPS} "
            f"replays of a graph of {GRAPH_OPS}. Triton writes a new output and includes the "
            "copy into its buffer; NCCL sums in place. Eager Triton times include its Python "
            "launch."
        )
    norm_table(triton_comm, rank, device, errors)
    if rank == 0:
        for error in errors:
            print(f"rank 0 error: {error}")
    dist.destroy_process_group()


def norm_table(comm, rank: int, device: torch.device, errors: list[str]) -> None:
    """The second table: all-reduce + add + RMSNorm in two launches against one."""
    if rank == 0:
        print(
            f"\nall-reduce + residual add + RMSNorm, bf16 [rows, {HIDDEN}], in a CUDA graph "
            f"(µs per call; per step: saved x {PAIRS_PER_STEP} pairs of a Qwen3-8B step)"
        )
        cells = ["shape", "bytes", "2 launches", "fused", "saved", "per step", "bit-equal"]
        print("  ".join(f"{c:>13}" for c in cells), flush=True)
    for rows in NORM_ROWS:
        cells = [f"[{rows}, {HIDDEN}]", f"{rows * HIDDEN * 2 >> 10} KiB"]
        try:
            if comm is None:
                raise RuntimeError("no Triton all-reduce (see its setup error)")
            cells += measure_norm(comm, rows, rank, device)
        except Exception as e:
            errors.append(f"fused [{rows}, {HIDDEN}]: {type(e).__name__}: {e}")
            cells += ["ERR"] * 5
        if rank == 0:
            print("  ".join(f"{c:>13}" for c in cells), flush=True)


def launch() -> int:
    """Both ranks in spawned processes; the exit status of the worse one."""
    if torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA devices, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run, args=(rank, port)) for rank in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    if any(p.is_alive() for p in procs):
        for p in procs:
            p.kill()
        print(f"timed out after {TIMEOUT_S} s: a path hung at the size after the last row")
        return 1
    return max(abs(p.exitcode or 0) for p in procs)


def main(args: argparse.Namespace) -> NoReturn:
    os.environ.update(
        NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
    )
    raise SystemExit(launch())


if __name__ == "__main__":
    run_script(__doc__, None, main)
