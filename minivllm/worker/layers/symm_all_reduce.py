"""All-reduce over symmetric (peer-mapped) GPU memory, for the small messages of a decode step.

Every rank owns one buffer of the same size that its peers have mapped into their own
address space (`torch.distributed._symmetric_memory`). A one-shot all-reduce is one kernel:
it copies the local input into this rank's buffer, meets the peers' matching blocks on
signal pads, then every rank loads all the buffers and sums them. For the few MB of a
decode step over NVLink that should take a few µs, against ~18 µs for NCCL
(benchmarks/allreduce_gpu.py measures both). Larger messages go to NCCL (TPGroup decides,
with `fits`).

CUDA graphs: the `torch.ops.symm_mem` kernels launch on the current stream, and after the
first rendezvous of a buffer they neither allocate device memory nor synchronise with the
host (the peer-pointer tables are built once, at rendezvous); their signal pads are back to
zero when a kernel ends. So they are captured and replayed like any kernel, provided the
buffer is allocated and rendezvoused before capture, which the constructor does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from minivllm.worker.layers.triton_all_reduce import TritonAllReduce

logger = logging.getLogger(__name__)

DISABLE_ENV = "MINIVLLM_DISABLE_SYMM_ALL_REDUCE"
CHOICE_ENV = "MINIVLLM_TP_ALL_REDUCE"  # which path sums a decode step's messages
CHOICES = ("triton", "one_shot", "two_shot", "nccl")
# measured on 2 x H200 (NVLink), 2 MiB bf16 inside a CUDA graph: triton 11.0 µs, one_shot
# 21.3, two_shot 18.9, NCCL 37.9; Qwen3-8B geometry at TP=2: 15,227 against 14,514 tok/s
DEFAULT_CHOICE = "triton"
ALGORITHMS = ("one_shot", "two_shot")
_DTYPES = (torch.bfloat16, torch.float32)  # the only dtypes the symm_mem kernels are built for
_ALIGN = 16  # bytes; the kernels' vector width, which input and buffer view must share

T = TypeVar("T")


def create_tp_all_reduce(
    group: Any, device: torch.device, max_bytes: int, choice: str | None = None
) -> SymmMemAllReduce | TritonAllReduce | None:
    """The small-message all-reduce that `choice` (default: $MINIVLLM_TP_ALL_REDUCE, else
    triton) names: "triton" (triton_all_reduce.py), "one_shot" or "two_shot" (the
    torch.ops.symm_mem kernels), or "nccl" (None: everything goes to NCCL). None as well,
    after one log line, where the chosen one cannot be set up. Collective."""
    choice = choice or os.environ.get(CHOICE_ENV) or DEFAULT_CHOICE
    if choice not in CHOICES:
        raise ValueError(f"{CHOICE_ENV} must be one of {CHOICES}, got {choice!r}")
    if choice == "nccl":
        if dist.get_rank(group) == 0:
            logger.info("TP all-reduce on NCCL (%s=nccl)", CHOICE_ENV)
        return None
    if choice == "triton":
        from minivllm.worker.layers.triton_all_reduce import TritonAllReduce

        return TritonAllReduce.create(group, device, max_bytes)
    return SymmMemAllReduce.create(group, device, max_bytes, choice)


class SymmMemUnavailable(RuntimeError):
    """Symmetric memory cannot serve this group (raised on every rank of it alike)."""


class SymmMemAllReduce:
    """Sums tensors of at most `max_bytes` over `group` through one symmetric buffer.

    The constructor is collective: every rank of the group calls it, and if any rank cannot
    set it up, every rank raises SymmMemUnavailable (so no rank is left waiting in a kernel
    the others never launch). `all_reduce` takes only tensors `fits` accepts and, like any
    collective, must be called by every rank in the same order.

    algorithm: "one_shot" (each rank reads every buffer; one kernel, the copy-in fused) or
    "two_shot" (reduce-scatter then all-gather through the buffers; a copy-in and a kernel).
    """

    def __init__(
        self, group: Any, device: torch.device, max_bytes: int, algorithm: str = "one_shot"
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        problem = _problem_on_every_rank(group, device, algorithm)
        if problem:
            raise SymmMemUnavailable(problem)
        self.group = group
        self.group_name = group.group_name
        self.algorithm = algorithm
        self.max_bytes = -(-max_bytes // _ALIGN) * _ALIGN
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        # This module needs only peer loads and stores, never NVLink multicast (NVLS,
        # multimem), which some GPU hosts do not permit: there, creating the multicast
        # object that rendezvous would otherwise set up whenever the driver offers one fails
        # or hangs. Read at allocation and rendezvous time, so set before either.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        from torch.distributed import _symmetric_memory as symm_mem

        # torch >= 2.11 resolves the group by name inside rendezvous; the older
        # enable_symm_mem_for_group registration is deprecated there and not needed.
        devices = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=self.device)
        mine = torch.tensor([index], dtype=torch.int32, device=self.device)
        dist.all_gather_into_tensor(devices, mine, group=group)
        self._on_every_rank(lambda: check_peer_access(index, devices.tolist()))
        self.buffer = self._on_every_rank(
            lambda: symm_mem.empty(self.max_bytes, dtype=torch.uint8, device=self.device)
        )
        self._on_every_rank(lambda: symm_mem.rendezvous(self.buffer, self.group_name))
        self._on_every_rank(self._check_sum)

    @classmethod
    def create(
        cls, group: Any, device: torch.device, max_bytes: int, algorithm: str = "one_shot"
    ) -> SymmMemAllReduce | None:
        """The communicator, or None after one log line saying why (every rank alike)."""
        return create_or_none(
            lambda: cls(group, device, max_bytes, algorithm),
            group,
            f"symmetric-memory {algorithm.replace('_', '-')}",
        )

    def fits(self, x: torch.Tensor) -> bool:
        """Whether all_reduce takes x: small enough, a dtype the kernels have, aligned."""
        nbytes = x.numel() * x.element_size()
        return (
            nbytes <= self.max_bytes
            and nbytes % _ALIGN == 0
            and x.dtype in _DTYPES
            and x.is_contiguous()
            and x.storage_offset() * x.element_size() % _ALIGN == 0
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, in a new tensor; x is left as it was."""
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if self.algorithm == "one_shot":
            return torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                staged, x, "sum", self.group_name, out
            )
        staged.copy_(x)
        return torch.ops.symm_mem.two_shot_all_reduce_out(staged, "sum", self.group_name, out)

    def _check_sum(self) -> None:
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        x = torch.full((64,), rank + 1.0, device=self.device)
        if not bool((self.all_reduce(x) == size * (size + 1) / 2).all()):
            raise RuntimeError("a test all-reduce returned a wrong sum")

    def _on_every_rank(self, step: Callable[[], T]) -> T:
        return on_every_rank(self.group, self.device, step)


def create_or_none(make: Callable[[], T], group: Any, name: str) -> T | None:
    """`make()` (a collective communicator constructor), or None after one log line saying
    why: disabled by DISABLE_ENV, or any setup failure (the group still works on NCCL, so
    the engine never fails for it). A ValueError (bad arguments) still raises."""
    rank = dist.get_rank(group)
    if os.environ.get(DISABLE_ENV) == "1":
        if rank == 0:
            logger.info("symmetric-memory all-reduce disabled by %s=1", DISABLE_ENV)
        return None
    try:
        comm = make()
    except ValueError:
        raise
    except Exception as e:  # whatever the cause, the group still works: never fail for it
        backend = dist.get_backend(group)
        logger.warning("rank %d: all-reduce stays on %s: %s", rank, backend, e)
        return None
    if rank == 0:
        logger.info(
            "%s all-reduce for messages up to %.2f MiB, NCCL above",
            name,
            comm.max_bytes / 2**20,
        )
    return comm


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


def symm_mem_problem(group: Any, device: torch.device) -> str | None:
    """A reason symmetric memory cannot serve `group` on `device` that every rank finds
    alike (no collective): no CUDA device, a backend other than NCCL, or a torch build
    without symmetric memory. Each communicator adds its own reasons after these."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"no CUDA device (device {device})"
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:
        return f"the process group's backend is {backend}, not NCCL"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"this torch build has no symmetric memory ({e})"
    return None


def _problem_on_every_rank(group: Any, device: torch.device, algorithm: str) -> str | None:
    """A reason the symm_mem kernels cannot work that every rank finds alike (no collective)."""
    if problem := symm_mem_problem(group, device):
        return problem
    size = dist.get_world_size(group)
    if algorithm == "two_shot" and size not in (2, 4, 8):
        return f"two-shot all-reduce needs 2, 4 or 8 ranks, not {size}"
    try:
        for op in ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_out"):
            getattr(torch.ops.symm_mem, op)
    except (AttributeError, RuntimeError) as e:
        return f"this torch build has no symmetric memory ops ({e})"
    return None


def check_peer_access(index: int, devices: list[int]) -> None:
    """Every other rank's GPU must be another device that this one can reach directly."""
    if devices.count(index) > 1:
        raise RuntimeError(f"two ranks share GPU {index}")
    for peer in devices:
        if peer != index and not torch.cuda.can_device_access_peer(index, peer):
            raise RuntimeError(f"GPU {index} has no peer access to GPU {peer}")
