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
