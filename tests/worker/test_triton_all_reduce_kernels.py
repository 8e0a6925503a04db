"""The TP all-reduce's Triton kernels without a GPU: compiled for Hopper, and run through the
Triton interpreter on CPU buffers laid out as on the GPUs, where the fused kernel's results
must equal the plain all-reduce then the norm kernel, bit for bit. The 2-GPU tests of the
same kernels are in test_tp_all_reduce.py and test_fused_all_reduce_norm.py."""

from __future__ import annotations

import pytest
import torch

from minivllm.worker.distributed import triton_all_reduce as tar
from minivllm.worker.distributed import triton_all_reduce_kernels as kernels
from minivllm.worker.distributed.triton_all_reduce import TritonAllReduce
from minivllm.worker.ops._triton import HAS_TRITON, tl, triton
from minivllm.worker.ops.norm import norm_warps
from tests.hopper_compile import compile_for_hopper
from tests.triton_interpreter import run_interpreted
from tests.worker.test_fused_all_reduce_norm import _assert_bit_equal
from tests.worker.test_tp_all_reduce import EPS


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    "dtype, hidden, world, residual",
    [("bf16", 4096, 2, True), ("fp32", 1024, 4, False), ("bf16", 5120, 8, True)],
)
def test_fused_kernel_compiles_for_hopper(dtype: str, hidden: int, world: int, residual: bool):
    """No GPU needed: the fused kernel as launched for sm_90 assembles, meets its peers with
    release stores and acquire loads at system scope, and uses no NVLink multicast."""
    size = {"bf16": 2, "fp32": 4}[dtype]
    block = 1 << (hidden - 1).bit_length()
    tensors = ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "new_res_ptr")
    fused = compile_for_hopper(
        kernels._one_shot_add_rms_norm_kernel,
        dict.fromkeys(tensors, f"*{dtype}")
        | {"bufs": (f"*{dtype}",) * world, "flag_table": "i64", "my_flags": "i64"}
        | {"epochs": "*i32", "num_rows": "i32", "n_cols": "i32", "eps": "fp32"},
        {
            "RANK": world - 1,
            "WORLD": world,
            "MAX_BLOCKS": 132,
            "LANES": 2 * (2 << 20) // size,  # a 2 MiB buffer
            "LANE": tar.buffer_layout(2 << 20, 132, world)[1] // size,
            "BLOCK": block,
            "HAS_RESIDUAL": residual,
        },
        norm_warps(block),
    )
    _assert_meets_peers(fused)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("dtype, world", [("bf16", 2), ("fp32", 4), ("fp16", 8)])
def test_triton_all_reduce_kernel_compiles_for_hopper(dtype: str, world: int):
    """No GPU needed: the plain kernel as launched for sm_90 assembles and meets its peers."""
    size = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    signature = {
        "x_ptr": f"*{dtype}",
        "out_ptr": f"*{dtype}",
        "bufs": (f"*{dtype}",) * world,
        "flag_table": "i64",
        "my_flags": "i64",
        "epochs": "*i32",
        "num_vectors": "i32",
    }
    constants = {
        "RANK": world - 1,
        "WORLD": world,
        "MAX_BLOCKS": 132,
        "REGION": (2 << 20) // size,
        "SLICE": tar.SLICE_BYTES // size,
        "VECTOR": 16 // size,
    }
    _assert_meets_peers(
        compile_for_hopper(kernels._one_shot_kernel, signature, constants, tar.NUM_WARPS)
    )


def _assert_meets_peers(kernel) -> None:  # noqa: ANN001 - a compiled Triton kernel
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"]
    assert "st.release.sys.global.u32" in ptx and "ld.acquire.sys.global.u32" in ptx
    assert "multimem" not in ptx


# The fused kernel through the Triton interpreter on CPU: no meetings, no peers' memory, but
# the same launches, lanes and rounding steps as on a GPU.
@triton.jit
def _no_meeting(flag_table, my_flags, row, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Stands in for the peers' meeting: the interpreter runs one rank at a time."""


def _interpreted_ranks(world: int, max_bytes: int, max_blocks: int) -> list[TritonAllReduce]:
    """`world` communicators over plain CPU buffers, laid out as the constructor lays out the
    symmetric ones (which needs GPUs and a process group)."""
    flag_bytes, lane_bytes, total = tar.buffer_layout(max_bytes, max_blocks, world)
    buffers = [torch.full((total,), 0xFF, dtype=torch.uint8) for _ in range(world)]
    comms = []
    for rank in range(world):
        comm = object.__new__(TritonAllReduce)
        comm.rank, comm.world_size, comm.device = rank, world, torch.device("cpu")
        comm.max_bytes, comm.max_blocks, comm.lane_bytes = max_bytes, max_blocks, lane_bytes
        comm.buffer, comm._flag_table = buffers[rank], torch.zeros(world, dtype=torch.int64)
        comm._data = {dt: tuple(b[flag_bytes:].view(dt) for b in buffers) for dt in tar.DTYPES}
        comm._epochs = torch.zeros(max_blocks, dtype=torch.int32)
        comm._row_epochs = torch.zeros(max_blocks, dtype=torch.int32)
        comms.append(comm)
    return comms


def _interpreted_collective(comms: list[TritonAllReduce], call) -> list:
    """call(comm) on every rank, twice from the same epochs: the first pass stages every
    rank's input, the second reads them all (the interpreter runs one rank at a time, and
    the meetings are skipped). The second pass's results, in rank order."""
    epochs = [(c._epochs.clone(), c._row_epochs.clone()) for c in comms]
    for _ in range(2):
        results = []
        for comm, (plain, rows) in zip(comms, epochs, strict=True):
            comm._epochs.copy_(plain)
            comm._row_epochs.copy_(rows)
            results.append(call(comm))
    return results


def check_fused_interpreted() -> None:
    """Fused calls of changing shapes between plain ones, on 2 and 3 ranks with 3 programs
    (so programs loop over rows): every rank gets the same bits, and they equal the plain
    kernel then ops/norm.py's kernel, bit for bit (the interpreter rounds to bf16 its own
    way, the same way in both)."""
    from minivllm.worker.ops import norm

    kernels._meet_peers = _no_meeting  # the fused kernel looks it up at each launch
    bf16, fp32 = torch.bfloat16, torch.float32
    calls = [
        (1, 64, bf16, True),
        ((3, 8), bf16),
        (7, 32, fp32, False),
        (5, 48, bf16, True),  # a block of 64 for 48 columns
        ((1000,), fp32),
        (16, 64, fp32, True),  # the whole buffer
        (4, 16, bf16, False),
    ] * 2  # again, from the other parities
    max_bytes, max_blocks = 4096, 3
    for world in (2, 3):
        comms = _interpreted_ranks(world, max_bytes, max_blocks)
        gen = torch.Generator().manual_seed(world)
        for n, call in enumerate(calls):
            what = f"{world} ranks, call {n} {call}"
            if len(call) == 2:
                shape, dtype = call
                xs = [torch.randn(shape, generator=gen).to(dtype) for _ in comms]
                got = _interpreted_collective(comms, lambda c, xs=xs: c.all_reduce(xs[c.rank]))
                torch.testing.assert_close(got[0], sum(x.float() for x in xs).to(dtype))
                assert all(torch.equal(g, got[0]) for g in got), what
                continue
            rows, cols, dtype, with_residual = call
            xs = [torch.randn(rows, cols, generator=gen).to(dtype) for _ in comms]
            residual = torch.randn(rows, cols, generator=gen).to(dtype) if with_residual else None
            weight = torch.randn(cols, generator=gen).to(dtype)
            assert all(c.fits_rows(xs[c.rank], residual) for c in comms), what
            got = _interpreted_collective(
                comms,
                lambda c, xs=xs, r=residual, w=weight: c.all_reduce_add_rms_norm(
                    xs[c.rank], r, w, EPS
                ),
            )

            def two_steps(c, xs=xs, r=residual, w=weight):
                s = c.all_reduce(xs[c.rank])
                if r is None:
                    return norm.rms_norm(s, w, EPS), s
                return norm.fused_add_rms_norm(s, r, w, EPS)

            want = _interpreted_collective(comms, two_steps)
            for rank in range(world):
                _assert_bit_equal(got[rank], want[rank], f"{what}: rank {rank}")
                _assert_bit_equal(got[rank], got[0], f"{what}: rank {rank} against rank 0")


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_fused_kernel_in_the_interpreter_pushes_into_its_lanes_and_equals_the_two_steps() -> None:
    run_interpreted(__file__)


if __name__ == "__main__":
    import warnings

    # the first pass of each collective sums peers' stale regions, which may overflow
    warnings.filterwarnings("ignore", "overflow", RuntimeWarning)
    check_fused_interpreted()
