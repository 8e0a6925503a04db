"""Reading one rank's part of a checkpoint tensor.

A weight loader receives either a tensor or a safetensors slice (`safe_open(...).get_slice`),
which reads only the rows/columns asked for, so no rank materializes a full tensor it shards.
"""

from __future__ import annotations

from typing import Any

import torch

Loaded = Any  # torch.Tensor | safetensors PySafeSlice


def shape_of(loaded: Loaded) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow(loaded: Loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded[..., start:start + length, ...] along dim, as a tensor."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


class _Rows:
    """Rows [start, start + length) of a safetensors slice, still a slice: indexing it reads
    only the rows asked for."""

    def __init__(self, loaded: Loaded, start: int, length: int) -> None:
        self.loaded, self.start, self.length = loaded, start, length

    def get_shape(self) -> list[int]:
        return [self.length, *shape_of(self.loaded)[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        begin, end, step = index[0].indices(self.length)
        assert step == 1, "rows are read in one run"
        return self.loaded[(slice(self.start + begin, self.start + end), *index[1:])]


def lazy_rows(loaded: Loaded, start: int, length: int) -> Loaded:
    """Rows [start, start + length) of `loaded`, as lazy as it is: a checkpoint tensor that
    fuses several parameters' rows (Phi-3's qkv_proj) split into its parts, each of which a
    tensor-parallel rank then reads its own rows of."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(0, start, length)
    return _Rows(loaded, start, length)


def full(loaded: Loaded) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        return loaded
    return loaded[:] if shape_of(loaded) else loaded[...]  # a 0-d scale takes no slice


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str = "weight") -> None:
    """dst.copy_(src) (casting dtype, moving device) after checking the shapes agree."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded: Loaded, shard_id: Any = None) -> None:
    """Replicated parameters (norms, unsharded biases): copy the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"parameter is not stacked, got shard_id {shard_id!r}")
    copy_checked(param.data, full(loaded))


class ExpertSlice:
    """Rows [row0, row0 + rows) of one expert in a 3-D [E, R, C] checkpoint tensor (a tensor
    or a safetensors slice: experts stored fused), usable wherever a 2-D `Loaded` is: it reads
    only the part a weight loader indexes, when it indexes it."""

    def __init__(self, loaded: Loaded, expert: int, row0: int, rows: int) -> None:
        self.loaded, self.expert, self.row0, self.rows = loaded, expert, row0, rows

    def get_shape(self) -> list[int]:
        return [self.rows, shape_of(self.loaded)[2]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = (*index, slice(None))[:2] if isinstance(index, tuple) else (index, slice(None))
        start, stop, _ = rows.indices(self.rows)
        return self.loaded[self.expert, self.row0 + start : self.row0 + stop, cols]
