"""Qwen3-MoE and Mixtral beyond the parity tests: the checkpoint layouts they load from,
the experts each rank holds under tensor and expert parallelism, the router's options, and
the errors a mismatched checkpoint or an uneven split gives."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from minivllm.config import EngineArgs
from minivllm.worker.attention.torch_attention import TorchAttentionBackend
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.model_loader import load_model
from tests.worker.test_models import (
    BLOCKS,
    hf_logits,
    model_config,
    new_kv_caches,
    prompts,
    run_step,
)

MOE = ["qwen3_moe", "mixtral"]


def load(path: str, tp: TPGroup | None = None, expert_parallel: bool = False, **overrides):
    config = model_config(path, **overrides)
    backend = TorchAttentionBackend()
    return load_model(config, torch.device("cpu"), tp or TPGroup(), backend, expert_parallel)


def assert_matches_hf(model, hf_path: str) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    seqs = [(BLOCKS[i], 0, p) for i, p in enumerate(prompts())]
    logits = run_step(model, new_kv_caches(model.config), seqs)
    for ours, (_, _, tokens) in zip(logits, seqs, strict=True):
        torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", MOE)
def test_fused_expert_layout_loads(tiny_models: dict[str, str], arch: str, tmp_path) -> None:
    """The layout transformers 5 holds in memory (`save_original_format=False`: the experts
    of a layer as two 3-D tensors, Mixtral's under `mlp.` too) gives the same model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32)
    hf.save_pretrained(str(tmp_path), save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny_models[arch], name), tmp_path / name)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    fused, per_expert = load(str(tmp_path)), load(tiny_models[arch])
    for (name, a), b in zip(fused.named_parameters(), per_expert.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert_matches_hf(fused, str(tmp_path))


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_each_rank_holds_its_share_of_the_experts(
    tiny_models: dict[str, str], arch: str, load_format: str
) -> None:
    """TP: every expert, sliced along its intermediate dimension; expert parallelism: half
    the experts, whole. Dummy weights slice the same model."""
    whole = load(tiny_models[arch], load_format=load_format).model.layers[0].mlp.experts
    num, inter = whole.num_experts, whole.w2_weight.shape[2]
    for rank in (0, 1):
        tp = TPGroup(rank=rank, size=2)
        sliced = load(tiny_models[arch], tp, load_format=load_format).model.layers[0].mlp.experts
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        gate, up = whole.w13_weight[:, :inter][:, half], whole.w13_weight[:, inter:][:, half]
        assert torch.equal(sliced.w13_weight, torch.cat([gate, up], dim=1))
        assert torch.equal(sliced.w2_weight, whole.w2_weight[:, :, half])
        ep = load(tiny_models[arch], tp, True, load_format=load_format).model.layers[0].mlp.experts
        mine = slice(rank * num // 2, (rank + 1) * num // 2)
        assert (ep.first_expert, ep.num_local_experts) == (mine.start, num // 2)
        assert torch.equal(ep.w13_weight, whole.w13_weight[mine])
        assert torch.equal(ep.w2_weight, whole.w2_weight[mine])


def test_router_options_match_hf(tmp_path) -> None:
    """Qwen3-MoE with norm_topk_prob off and every second layer sparse
    (decoder_sparse_step), and Mixtral's top-2 (always renormalized) with top-3."""
    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(
        str(tmp_path / "q"), "qwen3_moe", tie_word_embeddings=True, seed=7, num_layers=4,
        norm_topk_prob=False, decoder_sparse_step=2, num_experts=12, num_experts_per_tok=3,
    )  # fmt: skip
    model = load(path)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "MLP", "SparseMoeBlock", "MLP", "SparseMoeBlock",
    ]  # fmt: skip
    assert not model.model.layers[1].mlp.experts.renormalize
    assert_matches_hf(model, path)
    path = build_checkpoint(str(tmp_path / "m"), "mixtral", seed=8, num_experts_per_tok=3)
    assert_matches_hf(load(path), path)


def test_missing_and_unexpected_expert_weights_are_named(
    tiny_models: dict[str, str], tmp_path
) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_models["qwen3_moe"]
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    del tensors["model.layers.0.mlp.gate.weight"]
    # layer 1 is dense (mlp_only_layers): it has no experts
    tensors["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load(str(tmp_path))
    message = str(err.value)
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in message
    assert "model.layers.0.mlp.gate.weight" in message
    assert "unexpected weights: ['model.layers.1.mlp.experts.0.gate_proj.weight']" in message
    tensors["model.layers.2.mlp.experts.16.up_proj.weight"] = torch.zeros(32, 64)  # of 16
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"experts\.16\.up_proj\.weight: expert 16 is not in 0\.\.15"
    ):
        load(str(tmp_path))


def test_uneven_splits_are_refused_by_name(tiny_models: dict[str, str]) -> None:
    path = tiny_models["qwen3_moe"]  # 16 experts of intermediate size 32
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(4\) must divide the number of experts \(6\)"
    ):
        EngineArgs(
            model=path, device="cpu", tensor_parallel_size=4, enable_expert_parallel=True,
            hf_overrides={"num_local_experts": 6},
        ).create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match=r"must divide the experts' intermediate size \(30\)"):
        EngineArgs(
            model=path, device="cpu", tensor_parallel_size=4,
            hf_overrides={"moe_intermediate_size": 30},
        ).create_engine_config()  # fmt: skip
