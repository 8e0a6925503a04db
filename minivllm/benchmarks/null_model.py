"""A model that costs nothing: for measuring the engine around the model.

`architectures: ["MiniVllmNullForCausalLM"]` in a config.json selects it, once registered
(`null_checkpoint.register_null_model`). Every step still goes through scheduling, the wire,
input preparation, sampling and detokenization; only the forward pass is gone. The token it
"predicts" at position p is a fixed function of p.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

_FIRST_ID = 16  # stay clear of special tokens at the bottom of small vocabularies


class NullForCausalLM(nn.Module):
    def __init__(self, model_config, variant, tp, attn_backend, params_dtype=None) -> None:
        super().__init__()
        self.vocab_size = model_config.vocab_size
        # one-hot logits rows, reused: allocating and zeroing [N, V] every step costs more
        # than the rest of the worker's step; only last step's ones are cleared
        self._logits: torch.Tensor | None = None
        self._hot: torch.Tensor | None = None  # the previous step's token per row

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return positions.to(torch.float32)[:, None]  # the "hidden state" is the position

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """One-hot rows, [N, vocab]. The tensor is reused by the next call."""
        n = hidden.shape[0]
        span = max(self.vocab_size - _FIRST_ID, 1)
        token = (hidden[:, 0].long() * 7919) % span + _FIRST_ID
        buf = self._logits
        if buf is None or buf.shape[0] < n or buf.device != hidden.device:
            buf = torch.zeros(max(n, 256), self.vocab_size, device=hidden.device)
            self._logits, self._hot = buf, None
        elif self._hot is not None:
            buf[: len(self._hot)].scatter_(1, self._hot[:, None], 0.0)
        self._hot = token
        return buf[:n].scatter_(1, token[:, None], 1.0)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        pass  # nothing to load
