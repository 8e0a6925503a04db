from __future__ import annotations

import os

import pytest

from tests.tiny_models import build_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of tiny random checkpoints: qwen3 (tied), qwen3-untied, qwen2, llama (sharded),
    qwen3_moe (layer 1 dense: mlp_only_layers) and mixtral (sharded)."""
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen3": build_checkpoint(str(root / "qwen3"), "qwen3", tie_word_embeddings=True),
        "qwen3-untied": build_checkpoint(
            str(root / "qwen3-untied"), "qwen3", tie_word_embeddings=False, seed=1
        ),
        "qwen2": build_checkpoint(str(root / "qwen2"), "qwen2", tie_word_embeddings=False, seed=2),
        "llama": build_checkpoint(
            str(root / "llama"), "llama", tie_word_embeddings=False, seed=3, max_shard_size="100KB"
        ),
        "qwen3_moe": build_checkpoint(
            str(root / "qwen3_moe"),
            "qwen3_moe",
            tie_word_embeddings=False,
            seed=5,
            num_layers=3,
            mlp_only_layers=[1],
        ),  # fmt: skip
        "mixtral": build_checkpoint(
            str(root / "mixtral"),
            "mixtral",
            tie_word_embeddings=False,
            seed=6,
            max_shard_size="200KB",
        ),  # fmt: skip
    }


@pytest.fixture(scope="session")
def qwen3_dir(tiny_models: dict[str, str]) -> str:
    return tiny_models["qwen3"]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
