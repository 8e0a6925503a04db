"""The tensor-parallel all-reduce across 2 spawned ranks: the Triton one-shot kernel over
symmetric memory on 2 GPUs (sums equal NCCL's, eager, replayed in CUDA graphs and back to
back; messages above the buffer go to NCCL), and gloo on CPU, where the Triton all-reduce
declines without raising. The all-reduce fused with the add and RMSNorm is tested in
test_fused_all_reduce_norm.py; the kernels' checks that need no GPU (compiled for Hopper, run
through the Triton interpreter) in test_triton_all_reduce_kernels.py."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.worker.distributed.parallel_state import TPGroup, _fast_all_reduce
from minivllm.worker.distributed.triton_all_reduce import TritonAllReduce
from minivllm.worker.ops.norm import rms_norm

MAX_BYTES = 64 << 10
EPS = 1e-6
SHAPES = [((1, 4096), torch.bfloat16), ((3, 1024), torch.float32), ((16, 4096), torch.bfloat16)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _input(rank: int, case: int, seed: int, device: torch.device) -> torch.Tensor:
    shape, dtype = SHAPES[case]
    gen = torch.Generator().manual_seed(1000 * seed + 10 * case + rank)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _expected(case: int, seed: int, device: torch.device) -> torch.Tensor:
    parts = [_input(rank, case, seed, device).float() for rank in range(2)]
    return (parts[0] + parts[1]).to(SHAPES[case][1])


@contextlib.contextmanager
def _nccl_group(rank: int, port: int) -> Iterator[torch.device]:
    """This rank's GPU in a 2-rank NCCL group, torn down after the block."""
    # no NVLink multicast anywhere (NCCL's NVLS, symmetric memory's multimem, NVSHMEM's
    # NVLS): where a host does not permit it, setting it up can hang or take the GPUs out of
    # service. Read when NCCL and symmetric memory start, so set before either.
    os.environ.update(
        NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
    )
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("nccl", init_method=url, rank=rank, world_size=2, device_id=device)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def _join_or_fail(ranks, timeout_s: float) -> None:
    """Wait for spawned ranks; kill them and fail (instead of hanging the suite) past the
    deadline. `join` raises with a rank's traceback if one failed."""
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail(f"the ranks hung for {timeout_s} s (a collective never completed)")


def _gloo_rank(rank: int, port: int) -> None:
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=2)
    try:
        group = dist.group.WORLD
        assert _fast_all_reduce(group, torch.device("cpu"), MAX_BYTES) is None
        tp = TPGroup(rank=rank, size=2, group=group)
        cpu = torch.device("cpu")
        for i in range(len(SHAPES)):
            torch.testing.assert_close(tp.all_reduce(_input(rank, i, 0, cpu)), _expected(i, 0, cpu))
        x, residual, weight = _input(rank, 1, 0, cpu), _input(0, 1, 1, cpu), _input(0, 1, 2, cpu)
        s = _expected(1, 0, cpu) + residual
        normed, got = tp.all_reduce_add_rms_norm(x, residual, weight[0], EPS)
        torch.testing.assert_close(got, s)
        torch.testing.assert_close(normed, rms_norm(s, weight[0], EPS))
        gathered = tp.gather(torch.full((2, 2), float(rank)), dim=-1)
        assert gathered.tolist() == [[0.0, 0.0, 1.0, 1.0]] * 2
    finally:
        dist.destroy_process_group()


def test_tp_group_over_gloo_declines_symmetric_memory_and_still_sums() -> None:
    mp.spawn(_gloo_rank, args=(_free_port(),), nprocs=2, join=True)


# The Triton one-shot path. Its buffer holds more 16 KiB slices than an H100 or H200 has SMs,
# so the largest message makes every program loop.
TRITON_MAX_BYTES = (5 << 20) + (48 << 10)
# (shape, dtype, whether the Triton path takes it)
TRITON_CASES = [
    ((1, 4096), torch.bfloat16, True),  # 8 KiB: one program
    ((3, 8), torch.bfloat16, True),  # 48 bytes
    ((64, 4096), torch.bfloat16, True),  # 512 KiB: 32 programs
    ((7, 1000), torch.float32, True),  # a slice and a part
    ((2, 64), torch.float16, True),
    ((TRITON_MAX_BYTES // 2,), torch.bfloat16, True),  # exactly the buffer
    ((TRITON_MAX_BYTES // 2 + 8,), torch.bfloat16, False),  # above the buffer: NCCL
    ((3, 5), torch.bfloat16, False),  # 30 bytes, not 16-byte aligned: NCCL
]
TAKEN = [i for i, (_, _, takes) in enumerate(TRITON_CASES) if takes]
TRITON_TEST_TIMEOUT_S = 240


def _triton_input(rank: int, case: int, seed: int, device: torch.device) -> torch.Tensor:
    shape, dtype, _ = TRITON_CASES[case]
    gen = torch.Generator().manual_seed(100_000 * seed + 10 * case + rank)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    ref = x.clone()
    dist.all_reduce(ref)
    return ref


def _triton_rank(rank: int, port: int) -> None:
    with _nccl_group(rank, port) as device:
        group = dist.group.WORLD
        comm = TritonAllReduce(group, device, TRITON_MAX_BYTES)  # raises with a reason
        chosen = _fast_all_reduce(group, device, MAX_BYTES)
        assert isinstance(chosen, TritonAllReduce)  # kept alive: buffers are never freed
        tp = TPGroup(rank=rank, size=2, group=group, fast_all_reduce=comm)

        for i, (_, _, takes) in enumerate(TRITON_CASES):
            x = _triton_input(rank, i, 0, device)
            assert comm.fits(x) == takes, TRITON_CASES[i]
            ref = _nccl_sum(x)
            torch.testing.assert_close(tp.all_reduce(x.clone()), ref)
            if takes:
                x_before = x.clone()
                torch.testing.assert_close(comm.all_reduce(x), ref)
                assert torch.equal(x, x_before)  # the input is left as it was

        # a CUDA graph, replayed over fresh inputs, with eager calls between
        static = {i: _triton_input(rank, i, 0, device) for i in TAKEN}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for x in static.values():
                comm.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            summed = {i: comm.all_reduce(x) for i, x in static.items()}
        for seed in (1, 2, 3):
            for i, x in static.items():
                x.copy_(_triton_input(rank, i, seed, device))
            graph.replay()
            for i, x in static.items():
                ref = _nccl_sum(x)
                torch.testing.assert_close(summed[i], ref, msg=f"replay {seed}, case {i}")
            between = _triton_input(rank, 2, seed, device)
            torch.testing.assert_close(comm.all_reduce(between), _nccl_sum(between))

        # 100 calls back to back: sizes (so grids) change from call to call, and rank 0
        # sometimes starts late, so either rank may be the one that waits
        inputs, outputs = [], []
        for n in range(100):
            i = TAKEN[n % len(TAKEN)]
            x = _triton_input(rank, i, 10 + n, device)
            if rank == 0 and n % 7 == 0:
                torch.cuda._sleep(20_000 * (1 + n % 5))
            outputs.append(comm.all_reduce(x))
            inputs.append(x)
        for n, (x, out) in enumerate(zip(inputs, outputs, strict=True)):
            torch.testing.assert_close(out, _nccl_sum(x), msg=f"back-to-back call {n}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_triton_all_reduce_sums_like_nccl_eager_in_graphs_and_back_to_back() -> None:
    ranks = mp.spawn(_triton_rank, args=(_free_port(),), nprocs=2, join=False)
    _join_or_fail(ranks, TRITON_TEST_TIMEOUT_S)
