"""The Triton all-reduce fused with the residual add and RMSNorm after it, across 2 spawned
ranks on 2 GPUs: bit-equal to all_reduce then fused_add_rms_norm (rms_norm without a
residual), alike on both ranks, the inputs left as they were, interleaved with plain calls
of changing sizes, back to back with one rank late, and in CUDA graphs replayed in changing
orders; what the kernel declines goes to the plain all-reduce, then the norm (also without
a GPU, through a communicator that declines the rows). Without a GPU too: a decoder's fused
ops (layers/fused.py) sum the row-parallel projections' partial sums in the next norm."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.distributed.triton_all_reduce import TritonAllReduce
from minivllm.worker.ops.norm import fused_add_rms_norm, rms_norm
from tests.worker.test_tp_all_reduce import (
    EPS,
    _free_port,
    _join_or_fail,
    _nccl_group,
    _nccl_sum,
)

# The buffer takes the largest case, 256 fp32 rows of 4096.
FUSED_MAX_BYTES = 256 * 4096 * 4
# (rows, hidden, dtype, with a residual)
FUSED_CASES = [
    (rows, hidden, dtype, with_residual)
    for rows in (1, 7, 256)
    for hidden in (1024, 4096)
    for dtype in (torch.bfloat16, torch.float32)
    for with_residual in (True, False)
]
# plain all_reduce calls between the fused ones: (shape, dtype), up to the whole buffer
PLAIN_CASES = [
    ((3, 8), torch.bfloat16),
    ((64, 4096), torch.bfloat16),
    ((7, 1000), torch.float32),
    ((FUSED_MAX_BYTES // 2,), torch.bfloat16),
]
FUSED_TEST_TIMEOUT_S = 240


def _fused_input(
    rank: int, case: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(x, residual, weight): x differs per rank, residual and weight are alike on all."""
    rows, hidden, dtype, with_residual = FUSED_CASES[case]
    gen = torch.Generator().manual_seed(100_000 * seed + 10 * case + rank)
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    shared = torch.Generator().manual_seed(100_000 * seed + 10 * case + 9)
    residual = torch.randn(rows, hidden, generator=shared).to(dtype).to(device)
    weight = (1 + torch.randn(hidden, generator=shared) / 4).to(dtype).to(device)
    return x, residual if with_residual else None, weight


def _plain_input(rank: int, case: int, seed: int, device: torch.device) -> torch.Tensor:
    shape, dtype = PLAIN_CASES[case]
    gen = torch.Generator().manual_seed(100_000 * seed + 10 * case + rank + 5)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _two_steps(
    comm: TritonAllReduce, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the fused kernel must equal: all_reduce, then the add and the norm."""
    s = comm.all_reduce(x)
    if residual is None:
        return rms_norm(s, weight, EPS), s
    return fused_add_rms_norm(s, residual, weight, EPS)


def _assert_bit_equal(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str
) -> None:
    for g, w, name in zip(got, want, ("normed", "residual"), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {name} {g.shape} {g.dtype}"
        bits = {2: torch.int16, 4: torch.int32}[g.element_size()]
        differ = int((g.view(bits) != w.view(bits)).sum())
        assert differ == 0, f"{what}: {name} differs in {differ} of {g.numel()} elements"


def _assert_alike_on_every_rank(t: torch.Tensor, what: str) -> None:
    mine = t.contiguous().view(torch.uint8).flatten()
    every = torch.empty(2 * mine.numel(), dtype=torch.uint8, device=mine.device)
    dist.all_gather_into_tensor(every, mine)
    assert torch.equal(every[: mine.numel()], every[mine.numel() :]), f"{what}: ranks differ"


def _fused_rank(rank: int, port: int) -> None:
    with _nccl_group(rank, port) as device:
        group = dist.group.WORLD
        comm = TritonAllReduce(group, device, FUSED_MAX_BYTES)  # raises with a reason
        tp = TPGroup(rank=rank, size=2, group=group, fast_all_reduce=comm)
        _eager_cases(comm, tp, rank, device)
        _declined_cases(comm, tp, rank, device)
        _back_to_back(comm, rank, device)
        _graph_replays(comm, rank, device)


def _eager_cases(comm: TritonAllReduce, tp: TPGroup, rank: int, device: torch.device) -> None:
    """Every case eagerly through TPGroup, a plain call of another size between."""
    for i, (_, _, dtype, _) in enumerate(FUSED_CASES):
        x, residual, weight = _fused_input(rank, i, 0, device)
        assert comm.fits_rows(x, residual), FUSED_CASES[i]  # so TPGroup takes the kernel
        before = [t.clone() for t in (x, residual) if t is not None]
        got = tp.all_reduce_add_rms_norm(x, residual, weight, EPS)
        _assert_bit_equal(got, _two_steps(comm, x, residual, weight), f"case {i}")
        assert all(torch.equal(t, b) for t, b in zip((x, residual), before, strict=False))
        for t in got:
            _assert_alike_on_every_rank(t, f"case {i}")
        s = _nccl_sum(x).float() + (0 if residual is None else residual.float())
        torch.testing.assert_close(got[1], s.to(dtype), msg=f"case {i}: not the sum")
        plain = _plain_input(rank, i % len(PLAIN_CASES), 0, device)
        torch.testing.assert_close(comm.all_reduce(plain), _nccl_sum(plain))


def _declined_cases(comm: TritonAllReduce, tp: TPGroup, rank: int, device: torch.device) -> None:
    """What the kernel declines goes to all_reduce, then the norm."""
    case = FUSED_CASES.index((7, 1024, torch.bfloat16, True))
    x, residual, _ = _fused_input(rank, case, 0, device)
    assert residual is not None
    wide = torch.randn(257, 4096, device=device)
    odd = torch.empty(x.numel() + 8, dtype=x.dtype, device=device)[1 : x.numel() + 1]
    declined = {
        "strided": (x[:, ::2], None),
        "hidden not a multiple of 16": (x[:, :1000].contiguous(), None),
        "3-D": (x.view(7, 2, 512), None),
        "above the buffer": (wide, None),
        "misaligned": (odd.view(x.shape), residual),
        "misaligned residual": (x, odd.view(x.shape)),
        "residual of another dtype": (x, residual.float()),
    }
    for what, (y, r) in declined.items():
        assert not comm.fits_rows(y, r), what
    for y in (x[:, :1000].contiguous(), wide):  # to the Triton all_reduce, and to NCCL
        w = torch.ones(y.shape[1], dtype=y.dtype, device=device)
        ref = _nccl_sum(y)
        normed, s = tp.all_reduce_add_rms_norm(y.clone(), None, w, EPS)
        torch.testing.assert_close(s, ref)
        torch.testing.assert_close(normed, rms_norm(ref, w, EPS))


def _back_to_back(comm: TritonAllReduce, rank: int, device: torch.device) -> None:
    """Fused and plain calls of changing sizes (so grids), back to back; rank 0 sometimes
    starts late, so either rank may be the one waiting."""
    calls = []
    for n in range(120):
        if rank == 0 and n % 7 == 0:
            torch.cuda._sleep(20_000 * (1 + n % 5))
        if n % 3 == 2:
            plain = _plain_input(rank, n % len(PLAIN_CASES), n, device)
            calls.append((n, plain, comm.all_reduce(plain)))
        else:
            i = (5 * n) % len(FUSED_CASES)
            inputs = _fused_input(rank, i, n, device)
            calls.append((n, inputs, comm.all_reduce_add_rms_norm(*inputs, EPS)))
    for n, inputs, got in calls:
        if isinstance(inputs, tuple):
            _assert_bit_equal(got, _two_steps(comm, *inputs), f"back-to-back call {n}")
        else:
            torch.testing.assert_close(got, _nccl_sum(inputs), msg=f"back-to-back call {n}")


def _graph_replays(comm: TritonAllReduce, rank: int, device: torch.device) -> None:
    """Two CUDA graphs of fused and plain calls, replayed in changing orders over fresh
    inputs, with eager calls between."""
    picks = [(1, 4096, torch.bfloat16, True), (7, 1024, torch.float32, False)]
    picks += [(256, 4096, torch.bfloat16, True), (256, 1024, torch.float32, True)]
    picks += [(7, 4096, torch.bfloat16, False), (1, 1024, torch.float32, True)]
    graph_cases = [FUSED_CASES.index(c) for c in picks]
    fused_in = {i: _fused_input(rank, i, 0, device) for i in graph_cases}
    plain_in = {k: _plain_input(rank, k, 0, device) for k in range(len(PLAIN_CASES))}
    plans = [  # per graph: ("fused", case) or ("plain", case)
        [("fused", graph_cases[0]), ("plain", 1), ("fused", graph_cases[1])]
        + [("plain", 3), ("fused", graph_cases[2]), ("fused", graph_cases[3])],
        [("fused", graph_cases[4]), ("plain", 0), ("fused", graph_cases[5])]
        + [("plain", 2), ("fused", graph_cases[2])],
    ]

    def run(plan: list[tuple]) -> list[tuple | torch.Tensor]:
        return [
            comm.all_reduce_add_rms_norm(*fused_in[step[1]], EPS)
            if step[0] == "fused"
            else comm.all_reduce(plain_in[step[1]])
            for step in plan
        ]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for plan in plans:
            run(plan)
    torch.cuda.current_stream().wait_stream(side)
    graphs, outputs = [], []
    for plan in plans:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs.append(run(plan))
        graphs.append(graph)
    for seed, order in enumerate(([0, 1], [1, 0, 1], [0, 0, 1], [1, 1, 0, 0]), start=1):
        for i, inputs in fused_in.items():
            for static, fresh in zip(inputs, _fused_input(rank, i, seed, device), strict=True):
                if static is not None:
                    static.copy_(fresh)
        for k, x in plain_in.items():
            x.copy_(_plain_input(rank, k, seed, device))
        for g in order:
            graphs[g].replay()
            eager = _fused_input(rank, (seed + g) % len(FUSED_CASES), 100 + seed, device)
            got = comm.all_reduce_add_rms_norm(*eager, EPS)
            _assert_bit_equal(got, _two_steps(comm, *eager), f"eager after replay {seed}")
        for g, plan in enumerate(plans):
            for step, got in zip(plan, outputs[g], strict=True):
                what = f"graph {g}, replay {seed}, {step}"
                if step[0] == "fused":
                    _assert_bit_equal(got, _two_steps(comm, *fused_in[step[1]]), what)
                else:
                    ref = _nccl_sum(plain_in[step[1]])
                    torch.testing.assert_close(got, ref, msg=what)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fused_all_reduce_add_rms_norm_is_bit_equal_to_the_two_steps() -> None:
    ranks = mp.spawn(_fused_rank, args=(_free_port(),), nprocs=2, join=False)
    _join_or_fail(ranks, FUSED_TEST_TIMEOUT_S)


class _TwiceX:
    """A communicator that takes every message but declines rows; its "sum" is 2 x."""

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def fits_rows(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def test_rows_the_fused_kernel_declines_are_summed_then_normed() -> None:
    tp = TPGroup(rank=0, size=2, fast_all_reduce=_TwiceX())  # type: ignore[arg-type]
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.rand(64)
    normed, s = tp.all_reduce_add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(s, 2 * x + residual)
    torch.testing.assert_close(normed, rms_norm(2 * x + residual, weight, EPS))
    normed, s = tp.all_reduce_add_rms_norm(x, None, weight, EPS)
    torch.testing.assert_close(normed, rms_norm(2 * x, weight, EPS))


class _FusedTwiceX(_TwiceX):
    """Takes the rows too, as the fused kernel would, counting the calls."""

    def __init__(self) -> None:
        self.fused_calls = 0

    def fits_rows(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return True

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.fused_calls += 1
        s = 2 * x if residual is None else 2 * x + residual
        return rms_norm(s, weight, eps), s


@pytest.mark.parametrize("comm", [_TwiceX, _FusedTwiceX])
def test_a_decoder_sums_the_row_parallel_output_in_the_next_norm(comm: type) -> None:
    """Under TP the row-parallel projections return their partial sums; the fused ops after
    them sum over the ranks (through the fused kernel where it takes the rows), add the
    residual, norm and project. The first layer's input, the embeddings, is not summed again."""
    import torch.nn.functional as F

    from minivllm.worker.layers.fused import (
        all_reduce_add_rms_norm,
        rms_norm_linear,
        silu_mul_linear,
    )
    from minivllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
    from minivllm.worker.layers.norm import RMSNorm

    tp = TPGroup(rank=0, size=2, fast_all_reduce=comm())  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    norm = RMSNorm(64, EPS)
    norm.weight.copy_(1 + torch.randn(64, generator=gen) / 4)
    proj = ColumnParallelLinear(64, 32, tp)
    down = RowParallelLinear(128, 32, tp, reduce_results=False)  # [32, 64] on each rank
    summed = RowParallelLinear(128, 32, tp)
    for layer in (proj, down, summed):
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))

    s = 2 * x + residual
    got, new_residual = rms_norm_linear(x, residual, norm, proj, tp)
    torch.testing.assert_close(new_residual, s)
    torch.testing.assert_close(got, F.linear(rms_norm(s, norm.weight, EPS), proj.weight))
    normed, new_residual = all_reduce_add_rms_norm(x, residual, norm, tp)
    torch.testing.assert_close(normed, rms_norm(s, norm.weight, EPS))
    torch.testing.assert_close(new_residual, s)
    assert getattr(tp.fast_all_reduce, "fused_calls", 2) == 2

    got, new_residual = rms_norm_linear(x, None, norm, proj, tp)  # the embeddings
    assert new_residual is x
    torch.testing.assert_close(got, F.linear(rms_norm(x, norm.weight, EPS), proj.weight))

    torch.testing.assert_close(down(x), F.linear(x, down.weight))  # a partial sum
    torch.testing.assert_close(summed(x), 2 * F.linear(x, summed.weight))
    gate_up = torch.randn(3, 128, generator=gen)
    act = F.silu(gate_up[:, :64]) * gate_up[:, 64:]
    torch.testing.assert_close(silu_mul_linear(gate_up, down), F.linear(act, down.weight))
    torch.testing.assert_close(silu_mul_linear(gate_up, summed), 2 * F.linear(act, summed.weight))
