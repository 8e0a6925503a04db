from __future__ import annotations

import os

import pytest

from minivllm.benchmarks.null_checkpoint import null_model_env
from tests.tiny_models import (
    LONGROPE_ORIGINAL_LEN,
    build_checkpoint,
    build_window_checkpoints,
    longrope_scaling,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With MINIVLLM_TEST_FAILURES=FILE, each failure's report is appended to FILE as it
    happens: a run cut by a time limit (the GPU suite's) keeps what failed and why, which
    pytest itself prints only at the end."""
    path = os.environ.get("MINIVLLM_TEST_FAILURES")
    # under pytest-xdist the controller writes what its workers report
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of tiny random checkpoints: qwen3 (tied), qwen3-untied, qwen2, llama (sharded);
    phi3 (fused qkv/gate_up, partial rotary as Phi-4-mini's, a sliding window no sequence
    outgrows), phi3-longrope (LongRoPE from 64 tokens); and scaled RoPE: qwen3-yarn (YaRN,
    4x its original 32), llama-linear (2x its 64), llama-dynamic (NTK, factor 2); the
    mixtures qwen3_moe (layer 1 dense: mlp_only_layers) and mixtral (sharded)."""
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
        "phi3": build_checkpoint(
            str(root / "phi3"),
            "phi3",
            hidden_size=96,
            partial_rotary_factor=0.75,
            sliding_window=512,
            seed=4,
        ),  # fmt: skip
        "phi3-longrope": build_checkpoint(
            str(root / "phi3-longrope"),
            "phi3",
            tie_word_embeddings=False,
            seed=5,
            max_position_embeddings=256,
            original_max_position_embeddings=LONGROPE_ORIGINAL_LEN,
            rope_scaling=longrope_scaling(rotary_dim=16, seed=5),
        ),  # fmt: skip
        "qwen3-yarn": build_checkpoint(
            str(root / "qwen3-yarn"),
            "qwen3",
            seed=6,
            max_position_embeddings=128,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),  # fmt: skip
        "llama-linear": build_checkpoint(
            str(root / "llama-linear"),
            "llama",
            tie_word_embeddings=False,
            seed=7,
            max_position_embeddings=64,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),  # fmt: skip
        "llama-dynamic": build_checkpoint(
            str(root / "llama-dynamic"),
            "llama",
            tie_word_embeddings=False,
            seed=8,
            max_position_embeddings=128,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        ),  # fmt: skip
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
def window_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Paths of tiny checkpoints with 8-token sliding windows: gemma3, gemma3-pattern (the
    older config layout), mistral-window, mixtral-window, phi3-window, qwen2-window (see
    tests/tiny_models.py)."""
    return build_window_checkpoints(str(tmp_path_factory.mktemp("window_models")))


@pytest.fixture(scope="session")
def qwen3_dir(tiny_models: dict[str, str]) -> str:
    return tiny_models["qwen3"]


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The null model (minivllm/benchmarks/null_model.py) is the suite's engine without a model:
# every process the tests start, commands and daemons included, registers it as a plugin.
os.environ.update(null_model_env(os.environ))
