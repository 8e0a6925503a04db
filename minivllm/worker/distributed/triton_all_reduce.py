"""The TP all-reduce of a decode step's messages on 2-8 GPUs of one host, in Triton over
symmetric (peer-mapped) GPU memory: a one-shot all-reduce, and the same all-reduce fused with
the residual add and RMSNorm that follow it in a decoder (`all_reduce_add_rms_norm`). Larger
messages go to NCCL (TPGroup decides, with `fits` and `fits_rows`). On 2 x H200, 2 MiB of
bf16 in a CUDA graph: 11.0 µs against NCCL's 37.9 (`benchmarks/allreduce.py`).

Every rank owns one symmetric buffer; its peers have it mapped and read or write it directly.
The plain kernel cuts the message into 16 KiB slices, and slice s always belongs to program
s % max_blocks (at most one program per SM, so a launch never waits for its own programs to
finish). A program:

  1. copies its slices of the local input into this rank's buffer;
  2. meets the same program on every peer: one thread per peer stores the program's epoch
     into that peer's flag for (program, this rank) with release semantics at system scope,
     then spins with acquire loads on its own flag for (program, that peer);
  3. loads its slices from every rank's buffer (16-byte vector loads), sums them in fp32 in
     rank order (so every rank gets the same bits) and writes the sum to a new tensor.

The fused kernel takes [T, H] rows, as the norm needs whole rows: row t always belongs to
program t % max_blocks. It pushes instead of pulling: the program stores its rows, one after
another, into its own lane of every peer's buffer (a lane per sender and program, holding
its share of a max_bytes message and a row of 16 KiB more), so the slow traffic over NVLink
is posted stores that nothing waits on until the meeting; it meets the peers as in step 2,
whose release now also publishes those stores; then it reads what every peer pushed from
its own memory and per row sums in rank order exactly as step 3, rounds to the dtype,
adds the residual (rounded to the dtype: the new residual), and normalises in fp32 with the
rounding steps of ops/norm.py, whose kernel it mirrors (same block, warps and reduction
layout), so its outputs are bit-equal to `all_reduce` then `ops.norm.fused_add_rms_norm`. It
has its own flags, its own epochs and its own two staging regions: the two kernels share
nothing but the peer mappings, so each one's argument below holds for its own calls,
whatever the other does in between.

Epochs: each program keeps a counter in device memory (`epochs`, one per program and kernel),
raised by one per call that runs it. All ranks make the same calls with the same shapes, so
program b's counter is equal on every rank, and a flag that has reached the caller's epoch
means the peer has arrived. A peer may be one call ahead (it may pass this program's barrier
and enter its next call), so a waiter accepts any flag >= its epoch (32-bit wraparound
compare); it can never be two calls ahead, as that needs this rank's next signal. Nothing is
reset and the host keeps no count, so back-to-back calls, eager calls between CUDA graph
replays and several graphs replayed in any order all work.

Buffer reuse needs no second barrier, because each kernel alternates between two staging
regions by the parity of the program's epoch. The bytes a program stages to are its own
whatever the shape (its slices in its own buffer; its lane, as a sender, in a peer's buffer,
which no other program touches), and a rank writes them again, in the same region, only two
of that program's calls later; the call between ends on this rank only after the reader's
same program signalled in it, i.e. after the reader's previous kernel, the one that read the
region, had finished. (Staging rows at their offset in the message would break this: after
a change of row length, a program could write bytes that another program, whose epoch had
the same parity, staged in the call before and a peer is still reading.)

Contract: every rank calls `all_reduce` and `all_reduce_add_rms_norm` in the same order with
the same shapes and dtypes, on one stream (or inside CUDA graphs captured from one stream).
Launches never allocate beyond their outputs and never synchronise with the host; the grid
depends only on the shape. NVLink multicast (multimem) is never used: some GPU hosts do not
permit it, and setting it up there fails or hangs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from minivllm.worker.distributed.triton_all_reduce_kernels import (
    _one_shot_add_rms_norm_kernel,
    _one_shot_kernel,
)
from minivllm.worker.ops._triton import HAS_TRITON, next_power_of_2
from minivllm.worker.ops.norm import norm_warps

T = TypeVar("T")

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_WORLD_SIZE = 8
SLICE_BYTES = 16 << 10  # what one program sums per round: 512 threads x 2 vectors per rank
NUM_WARPS = 16
_VECTOR = 16  # bytes per load and store; inputs, outputs and regions are aligned to it
_FLAG_ALIGN = 4096  # the flags lead the buffer; the data regions start on this boundary
MAX_ROW = 16384  # the longest row all_reduce_add_rms_norm takes: one program's block
_ROW_ROOM = 16 << 10  # bytes a lane holds beyond its share of max_bytes: any row up to this
_LANE_ALIGN = 1024


class SymmMemUnavailable(RuntimeError):
    """Symmetric memory cannot serve this group (raised on every rank of it alike)."""


def buffer_layout(max_bytes: int, max_blocks: int, world_size: int) -> tuple[int, int, int]:
    """(flag bytes, lane bytes, total bytes) of each rank's buffer. The flags lead it: a row
    per program for each kernel's meeting (the plain kernel's, then the fused kernel's). Then
    the data: regions 0 and 1 (by parity) of max_bytes for the plain kernel; regions 2 and 3
    (by parity) of world_size x max_blocks lanes (by sender, then program) for the fused one,
    a lane holding its program's share of a max_bytes message and a row of up to _ROW_ROOM
    bytes more."""
    flag_bytes = -(-2 * max_blocks * world_size * 4 // _FLAG_ALIGN) * _FLAG_ALIGN
    share, room = -(-max_bytes // max_blocks), min(max_bytes, _ROW_ROOM)
    lane_bytes = sum(-(-n // _LANE_ALIGN) * _LANE_ALIGN for n in (share, room))
    return (
        flag_bytes,
        lane_bytes,
        flag_bytes + 2 * max_bytes + 2 * world_size * max_blocks * lane_bytes,
    )


class TritonAllReduce:
    """Sums tensors of at most `max_bytes` over `group` with the one-shot Triton kernel.

    The constructor is collective: every rank of the group calls it, and if any rank cannot
    set it up, every rank raises SymmMemUnavailable. `all_reduce` takes only tensors `fits`
    accepts, `all_reduce_add_rms_norm` only rows `fits_rows` accepts; like any collective,
    both must be called by every rank in the same order.
    """

    def __init__(self, group: Any, device: torch.device, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        problem = _problem_on_every_rank(group, device)
        if problem:
            raise SymmMemUnavailable(problem)
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.max_bytes = -(-max_bytes // _VECTOR) * _VECTOR
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        # peer loads and stores only: rendezvous would otherwise set up NVLink multicast
        # wherever the driver offers it. Read at allocation and rendezvous, so set before
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        from torch.distributed import _symmetric_memory as symm_mem

        # every rank's GPU and SM count (programs run one per SM at most, the same on all)
        facts = self._gather(index, torch.cuda.get_device_properties(index).multi_processor_count)
        self._agree(lambda: check_peer_access(index, [f[0] for f in facts]))
        self.max_blocks = min(f[1] for f in facts)
        flag_bytes, self.lane_bytes, total = buffer_layout(
            self.max_bytes, self.max_blocks, self.world_size
        )
        self.buffer = self._agree(
            lambda: symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        )
        self._agree(lambda: self._zero_flags(flag_bytes))
        handle = self._agree(lambda: symm_mem.rendezvous(self.buffer, group.group_name))
        self._handle = handle  # keeps the peer mappings alive
        # handles address the allocation, which may hold the buffer at an offset (a pool)
        offset = self._agree(lambda: self.buffer.data_ptr() - handle.buffer_ptrs[self.rank])
        offsets = [f[0] for f in self._gather(offset)]
        peers = self._agree(lambda: self._map_peers(handle, offsets, total))
        self._flag_table = torch.tensor(
            [p.data_ptr() for p in peers], dtype=torch.int64, device=self.device
        )
        self._data = {dtype: tuple(p[flag_bytes:].view(dtype) for p in peers) for dtype in DTYPES}
        self._epochs = torch.zeros(self.max_blocks, dtype=torch.int32, device=self.device)
        self._row_epochs = torch.zeros(self.max_blocks, dtype=torch.int32, device=self.device)
        self._agree(self._check_sum)

    def _aligned(self, x: torch.Tensor) -> bool:
        """x on this device, a dtype the kernels have, contiguous and 16-byte aligned."""
        return (
            x.dtype in DTYPES
            and x.device == self.device
            and x.is_contiguous()
            and x.data_ptr() % _VECTOR == 0
        )

    def fits(self, x: torch.Tensor) -> bool:
        """Whether all_reduce takes x: small enough, a dtype it has, 16-byte aligned."""
        nbytes = x.numel() * x.element_size()
        return 0 < nbytes <= self.max_bytes and nbytes % _VECTOR == 0 and self._aligned(x)

    def fits_rows(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether all_reduce_add_rms_norm takes x [T, H] (and residual, alike): a dtype it
        has, contiguous and 16-byte aligned, at most max_bytes, H a multiple of 16 up to
        MAX_ROW, and each program's rows within its lane."""
        if x.dim() != 2 or not self._aligned(x):
            return False
        rows, cols = x.shape
        row_bytes = cols * x.element_size()
        residual_alike = residual is None or (
            (residual.shape, residual.dtype) == (x.shape, x.dtype) and self._aligned(residual)
        )
        return (
            rows > 0
            and 0 < cols <= MAX_ROW
            and cols % 16 == 0  # norm.py's row stride is then 16-divisible: the same layout
            and rows * row_bytes <= self.max_bytes
            and -(-rows // self.max_blocks) * row_bytes <= self.lane_bytes
            and residual_alike
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, in a new tensor; x is left as it was."""
        out = torch.empty_like(x)
        size = x.element_size()
        nbytes = x.numel() * size
        grid = (min(-(-nbytes // SLICE_BYTES), self.max_blocks),)
        _one_shot_kernel[grid](
            x, out, self._data[x.dtype], self._flag_table.data_ptr(), self.buffer.data_ptr(),
            self._epochs, nbytes // _VECTOR,
            RANK=self.rank, WORLD=self.world_size, MAX_BLOCKS=self.max_blocks,
            REGION=self.max_bytes // size, SLICE=SLICE_BYTES // size, VECTOR=_VECTOR // size,
            num_warps=NUM_WARPS,
        )  # fmt: skip
        return out

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(s) * weight, s) with s = the sum of x over the group (+ residual), in new
        tensors and one launch; bit-equal to all_reduce(x) then ops.norm.fused_add_rms_norm (or
        ops.norm.rms_norm, and s itself, without a residual). Takes only what fits_rows accepts;
        x and residual are left as they were."""
        rows, cols = x.shape
        if weight.shape != (cols,) or not weight.is_contiguous() or weight.device != x.device:
            raise ValueError(f"the norm weight must be [{cols}] contiguous on {x.device}")
        out, new_residual = torch.empty_like(x), torch.empty_like(x)
        size = x.element_size()
        block = next_power_of_2(cols)
        _one_shot_add_rms_norm_kernel[(min(rows, self.max_blocks),)](
            x, x if residual is None else residual, weight, out, new_residual,
            self._data[x.dtype], self._flag_table.data_ptr(), self.buffer.data_ptr(),
            self._row_epochs, rows, cols, eps,
            RANK=self.rank, WORLD=self.world_size, MAX_BLOCKS=self.max_blocks,
            LANES=2 * self.max_bytes // size, LANE=self.lane_bytes // size, BLOCK=block,
            HAS_RESIDUAL=residual is not None, num_warps=norm_warps(block),
        )  # fmt: skip
        return out, new_residual

    def _zero_flags(self, flag_bytes: int) -> None:
        self.buffer[:flag_bytes].zero_()
        torch.cuda.synchronize(self.device)  # done before any peer can signal into them

    def _map_peers(self, handle: Any, offsets: list[int], nbytes: int) -> list[torch.Tensor]:
        """Every rank's buffer as mapped here, through this handle; the buffers must sit at the
        same offset in every rank's allocation."""
        if handle.rank != self.rank or handle.world_size != self.world_size:
            raise RuntimeError("the symmetric-memory handle disagrees with the process group")
        if len(set(offsets)) != 1 or offsets[0] < 0:
            raise RuntimeError(f"the buffers sit at different offsets: {offsets}")
        peers = [
            handle.get_buffer(r, (nbytes,), torch.uint8, offsets[0]) for r in range(len(offsets))
        ]
        if peers[self.rank].data_ptr() != self.buffer.data_ptr():
            raise RuntimeError("the handle does not map this buffer where it lies")
        return peers

    def _check_sum(self) -> None:
        size = self.world_size
        for dtype in DTYPES:  # two programs' worth where the buffer has room
            numel = min(SLICE_BYTES + 256, self.max_bytes) // dtype.itemsize
            x = torch.full((numel,), self.rank + 1.0, dtype=dtype, device=self.device)
            got = self.all_reduce(x)
            if not bool((got == size * (size + 1) / 2).all()):
                raise RuntimeError(f"a test all-reduce of {dtype} returned a wrong sum")
        # the fused kernel: a constant row c normalises to c / sqrt(c^2 + eps), about 1
        x = torch.full((2, 64), self.rank + 1.0, device=self.device)
        residual, weight = torch.ones_like(x), torch.ones(64, device=self.device)
        if self.fits_rows(x, residual):
            normed, s = self.all_reduce_add_rms_norm(x, residual, weight, 1e-6)
            if not bool((s == size * (size + 1) / 2 + 1).all() and (normed - 1).abs().max() < 1e-3):
                raise RuntimeError("a test all-reduce + RMSNorm returned a wrong result")

    def _agree(self, step: Callable[[], T]) -> T:
        return on_every_rank(self.group, self.device, step)

    def _gather(self, *values: int) -> list[list[int]]:
        """Every rank's values, in rank order."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        every = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        return every.view(self.world_size, len(values)).tolist()


def on_every_rank(group: Any, device: torch.device, step: Callable[[], T]) -> T:
    """Run step here, then agree with the other ranks: raise SymmMemUnavailable everywhere
    if it failed anywhere, so all ranks go on to the next (possibly collective) step or none
    does."""
    error: Exception | None = None
    result: Any = None
    try:
        result = step()
    except Exception as e:
        error = e
    ok = torch.tensor([error is None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if error is not None:
        raise SymmMemUnavailable(f"{type(error).__name__}: {error}") from error
    if not ok.item():
        raise SymmMemUnavailable("symmetric-memory setup failed on another rank")
    return result


def check_peer_access(index: int, devices: list[int]) -> None:
    """Every other rank's GPU must be another device that this one can reach directly."""
    if devices.count(index) > 1:
        raise RuntimeError(f"two ranks share GPU {index}")
    for peer in devices:
        if peer != index and not torch.cuda.can_device_access_peer(index, peer):
            raise RuntimeError(f"GPU {index} has no peer access to GPU {peer}")


def _problem_on_every_rank(group: Any, device: torch.device) -> str | None:
    """A reason this cannot work that every rank finds alike (no collective)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"no CUDA device (device {device})"
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:
        return f"the process group's backend is {backend}, not NCCL"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"this torch build has no symmetric memory ({e})"
    if not HAS_TRITON:
        return "triton is not installed"
    if not 2 <= dist.get_world_size(group) <= MAX_WORLD_SIZE:
        return f"the Triton all-reduce serves 2 to {MAX_WORLD_SIZE} ranks"
    return None
