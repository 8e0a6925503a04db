"""A model from outside the package, for the model registry's tests: it predicts the token
after the one it reads (id + 1, round the vocabulary), so greedy tokens count up from the
prompt's last one. `register` is its plugin (MINIVLLM_PLUGINS=tests.out_of_tree_model:register)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from minivllm.model_registry import ModelRegistry

ARCHITECTURE = "CountingForCausalLM"


class CountingForCausalLM(nn.Module):
    def __init__(self, model_config, variant, tp, attn_backend, params_dtype=None) -> None:
        super().__init__()
        self.vocab_size = model_config.vocab_size

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return input_ids.to(torch.float32)[:, None]  # the "hidden state" is the token

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        after = (hidden[:, 0].long() + 1) % self.vocab_size
        return nn.functional.one_hot(after, self.vocab_size).to(torch.float32)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        pass  # nothing to load


def register() -> None:
    ModelRegistry.register_model(ARCHITECTURE, CountingForCausalLM)
