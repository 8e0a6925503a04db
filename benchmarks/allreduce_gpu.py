"""All-reduce latency on 2 GPUs: NCCL against the symmetric-memory one-shot and two-shot
paths (minivllm.worker.layers.symm_all_reduce) and the Triton one-shot kernel
(minivllm.worker.layers.triton_all_reduce), each eager and replayed in a CUDA graph.

    python benchmarks/allreduce_gpu.py

bf16 messages from 16 KiB to 8 MiB (a TP=2 decode step of 256 sequences at hidden 4096
all-reduces 2 MiB). The Triton kernel runs twice: "triton" copies the input into its buffer,
"triton-ip" sums a message its producer wrote straight into the buffer (`buffer_for`). Each
path's result is checked against the NCCL sum, eager and after a graph replay. Prints µs per
all-reduce, one row per size; a cell is marked BAD (wrong sum) or reads ERR (it raised; the
errors are printed below the table). The whole run is killed after TIMEOUT_S.
"""

from __future__ import annotations

import os

# before any CUDA or torch.distributed use, here and in the spawned ranks: no NVLink
# multicast anywhere (NCCL's NVLS, symmetric memory's multimem, NVSHMEM's NVLS)
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SIZES = [16 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20]
METHODS = ("nccl", "one_shot", "two_shot", "triton", "triton_ip")
EAGER_REPS, GRAPH_OPS, GRAPH_REPS = 200, 50, 10
TIMEOUT_S = 110


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


def measure(name: str, op, stage, data: torch.Tensor, ref: torch.Tensor) -> list[str]:
    """[eager µs, graph µs] as printed cells; " BAD" marks a wrong sum. stage(t) returns
    the tensor op is given, holding t's values (t itself, or a view of the op's buffer)."""
    cells = []
    ok = close(op(stage(data.clone())), ref)
    x = stage(torch.zeros_like(data))  # NCCL sums in place: zeros stay finite over calls
    for _ in range(10):
        op(x)
    us = time_us(lambda: [op(x) for _ in range(EAGER_REPS)], EAGER_REPS)
    cells.append(f"{us:.1f}" + ("" if ok else " BAD"))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream before capture
        op(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_OPS):
            y = op(x)
    graph.replay()
    us = time_us(lambda: [graph.replay() for _ in range(GRAPH_REPS)], GRAPH_REPS * GRAPH_OPS)
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
    from minivllm.worker.layers.symm_all_reduce import SymmMemAllReduce
    from minivllm.worker.layers.triton_all_reduce import TritonAllReduce

    group = dist.group.WORLD

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    def itself(x: torch.Tensor) -> torch.Tensor:
        return x

    # name -> (op, stage); the communicators are kept alive to the end
    ops, comms, errors = {"nccl": (nccl, itself)}, [], []
    for algorithm in ("one_shot", "two_shot", "triton"):
        try:
            if algorithm == "triton":
                comm = TritonAllReduce(group, device, max(SIZES))
                ops["triton_ip"] = (
                    comm.all_reduce,
                    lambda t, comm=comm: comm.buffer_for(t.shape, t.dtype).copy_(t),
                )
            else:
                comm = SymmMemAllReduce(group, device, max(SIZES), algorithm)
            comms.append(comm)
            ops[algorithm] = (comm.all_reduce, itself)
        except Exception as e:
            errors.append(f"{algorithm} setup: {type(e).__name__}: {e}")
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
                cells += measure(name, *ops[name], data, ref) if name in ops else ["ERR", "ERR"]
            except Exception as e:
                errors.append(f"{name} {size >> 10} KiB: {type(e).__name__}: {e}")
                cells += ["ERR", "ERR"]
        if rank == 0:
            print("  ".join(f"{c:>15}" for c in cells), flush=True)
    if rank == 0:
        print(
            f"µs per all-reduce. eager: {EAGER_REPS} back-to-back calls; graph: {GRAPH_REPS} "
            f"replays of a graph of {GRAPH_OPS}. The symmetric-memory paths write a new output "
            "and, but for triton-ip, include the copy into their buffer; NCCL sums in place. "
            "Eager Triton times include its Python launch."
        )
        for error in errors:
            print(f"rank 0 error: {error}")
    dist.destroy_process_group()


def main() -> int:
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


if __name__ == "__main__":
    sys.exit(main())
