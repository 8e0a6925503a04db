from __future__ import annotations

import os

import pytest

from tests.tiny_models import build_checkpoint, build_window_checkpoints


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
    """Paths of tiny random checkpoints: qwen3 (tied), qwen3-untied, qwen2, llama (sharded)."""
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
    }


@pytest.fixture(scope="session")
def window_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of tiny checkpoints with 8-token sliding windows: gemma3, gemma3-pattern (the
    older config layout), mistral-window, qwen2-window (see tests/tiny_models.py)."""
    return build_window_checkpoints(str(tmp_path_factory.mktemp("window_models")))


@pytest.fixture(scope="session")
def qwen3_dir(tiny_models: dict[str, str]) -> str:
    return tiny_models["qwen3"]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
