"""The tensor-parallel all-reduce across 2 spawned ranks: over symmetric memory on 2 GPUs
(sums equal torch's, eager and replayed in a CUDA graph; messages above the buffer go to
NCCL), and over gloo on CPU, where the symmetric-memory setup declines without raising."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.worker.layers.parallel_state import TPGroup
from minivllm.worker.layers.symm_all_reduce import SymmMemAllReduce

MAX_BYTES = 64 << 10
# (shape, dtype, whether the symmetric-memory path takes it)
CASES = [
    ((1, 4096), torch.bfloat16, True),
    ((8, 4096), torch.bfloat16, True),  # exactly the buffer
    ((3, 1024), torch.float32, True),
    ((16, 4096), torch.bfloat16, False),  # twice the buffer: NCCL
    ((3, 5), torch.bfloat16, False),  # 30 bytes, not 16-byte aligned: NCCL
    ((2, 64), torch.float16, False),  # no symmetric-memory kernel for fp16: NCCL
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _input(rank: int, case: int, seed: int, device: torch.device) -> torch.Tensor:
    shape, dtype, _ = CASES[case]
    gen = torch.Generator().manual_seed(1000 * seed + 10 * case + rank)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _expected(case: int, seed: int, device: torch.device) -> torch.Tensor:
    parts = [_input(rank, case, seed, device).float() for rank in range(2)]
    return (parts[0] + parts[1]).to(CASES[case][1])


def _gpu_rank(rank: int, port: int) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("nccl", init_method=url, rank=rank, world_size=2, device_id=device)
    try:
        group = dist.group.WORLD
        comms = []  # kept alive: the engine never frees its buffer either
        for algorithm in ("one_shot", "two_shot"):
            comm = SymmMemAllReduce(group, device, MAX_BYTES, algorithm)  # raises with a reason
            comms.append(comm)
            tp = TPGroup(rank=rank, size=2, group=group, symm_all_reduce=comm)
            for i, (_, _, takes) in enumerate(CASES):
                x = _input(rank, i, 0, device)
                assert comm.fits(x) == takes, (algorithm, CASES[i])
                torch.testing.assert_close(tp.all_reduce(x), _expected(i, 0, device))

            static = [_input(rank, i, 0, device) for i in range(len(CASES))]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [tp.all_reduce(x) for x in static]
            for seed in (1, 2):  # each replay sums what the inputs hold now
                for i, x in enumerate(static):
                    x.copy_(_input(rank, i, seed, device))
                graph.replay()
                for i, out in enumerate(outs):
                    torch.testing.assert_close(out, _expected(i, seed, device))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_symm_all_reduce_sums_like_torch_eager_and_in_graphs() -> None:
    mp.spawn(_gpu_rank, args=(_free_port(),), nprocs=2, join=True)


def _gloo_rank(rank: int, port: int) -> None:
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
    try:
        group = dist.group.WORLD
        symm = SymmMemAllReduce.create(group, torch.device("cpu"), MAX_BYTES)
        assert symm is None
        tp = TPGroup(rank=rank, size=2, group=group, symm_all_reduce=symm)
        cpu = torch.device("cpu")
        for i in (0, 2, 3):
            torch.testing.assert_close(tp.all_reduce(_input(rank, i, 0, cpu)), _expected(i, 0, cpu))
        gathered = tp.gather(torch.full((2, 2), float(rank)), dim=-1)
        assert gathered.tolist() == [[0.0, 0.0, 1.0, 1.0]] * 2
    finally:
        dist.destroy_process_group()


def test_tp_group_over_gloo_declines_symmetric_memory_and_still_sums() -> None:
    mp.spawn(_gloo_rank, args=(_free_port(),), nprocs=2, join=True)
