"""Quantized mixtures of experts: Qwen3-MoE and Mixtral checkpoints whose experts (and
attention) are FP8, written here as the tools write them (tests/quantized_models.py, each
expert's gate, up and down quantized on their own), give the greedy tokens transformers
gives on the same weights: transformers loading the block-wise and per-channel FP8
checkpoints itself (dequantized on a CPU), else a plain checkpoint of the dequantized
weights. Under TP each expert's block scales split with its blocks; under expert
parallelism each rank holds whole experts with their scales. Online fp8 quantizes the
experts of a 16-bit checkpoint per row. A format that has no quantized experts (AWQ, GPTQ)
and a split that cuts the scale blocks are refused by name."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests import quantized_models as qm
from tests.hf_reference import hf_greedy, parity_prompts
from tests.tiny_models import build_checkpoint
from tests.worker.test_moe_models import load
from tests.worker.test_quantized_models import _first_logprobs, greedy

# arch, format, whether transformers loads the quantized checkpoint itself
CASES = [
    ("qwen3_moe", "fp8", True),
    ("qwen3_moe", "compressed-tensors", True),
    ("mixtral", "fp8-tensor", False),  # per tensor, static activation scales (Mixtral-FP8)
    ("mixtral", "compressed-tensors-block", False),
]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """arch -> a float checkpoint whose every expert is whole 128-blocks at TP=2 (an
    intermediate size of 256), and (arch, fmt) -> (quantized checkpoint, its reference)."""
    root = tmp_path_factory.mktemp("quantized_moe")
    common = dict(tie_word_embeddings=False, hidden_size=256, num_heads=4, num_kv_heads=2,
                  head_dim=128, seed=5)  # fmt: skip
    out: dict = {
        "qwen3_moe": build_checkpoint(
            str(root / "qwen3_moe"),
            "qwen3_moe",
            num_experts=8,
            moe_intermediate_size=256,
            **common,
        ),  # fmt: skip
        "mixtral": build_checkpoint(
            str(root / "mixtral"), "mixtral", intermediate_size=256, **common
        ),
    }
    for arch, fmt, hf_loads in CASES:
        quant_dir, deq_dir = qm.build_quantized(out[arch], str(root / arch), fmt)
        out[arch, fmt] = (quant_dir, quant_dir if hf_loads else deq_dir)
    return out


@pytest.mark.parametrize(("arch", "fmt"), [case[:2] for case in CASES])
def test_fp8_experts_give_transformers_tokens(moe_checkpoints: dict, arch: str, fmt: str) -> None:
    path, reference = moe_checkpoints[arch, fmt]
    prompts = parity_prompts()[:5]
    got = greedy(path, prompts, distributed_executor_backend="uni")
    assert got == hf_greedy(reference, prompts, 8)
    assert got != hf_greedy(moe_checkpoints[arch], prompts, 8)  # quantizing changed something


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fp8_experts_split_over_two_ranks(moe_checkpoints: dict, expert_parallel: bool) -> None:
    """TP: each expert's intermediate rows and their 128-row scale blocks, 128 per rank;
    EP: four whole experts per rank, with their scales."""
    path, reference = moe_checkpoints["qwen3_moe", "fp8"]
    prompts = parity_prompts()[:4]
    got = greedy(path, prompts, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert got == hf_greedy(reference, prompts, 8)


def test_static_scales_are_the_max_over_every_expert(moe_checkpoints: dict) -> None:
    """Mixtral-FP8's per-tensor weight scales land on their part's rows; each stack's one
    static activation scale is the max over all experts' (on every rank, also under EP)."""
    from minivllm.worker.distributed.parallel_state import TPGroup

    path = moe_checkpoints["mixtral", "fp8-tensor"][0]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    prefix = "model.layers.1.block_sparse_moe.experts"

    def scales(part: str, name: str) -> list[float]:
        return [float(tensors[f"{prefix}.{e}.{part}.{name}"]) for e in range(8)]

    for rank in (0, 1):
        experts = load(path, TPGroup(rank=rank, size=2), True).model.layers[1].mlp.experts
        assert float(experts.w13_input_scale) == max(scales("w1", "input_scale") +
                                                     scales("w3", "input_scale"))  # fmt: skip
        assert float(experts.w2_input_scale) == max(scales("w2", "input_scale"))
        mine = range(4 * rank, 4 * rank + 4)
        want = torch.tensor([[scales(p, "weight_scale")[e]] * 256 for p in ("w1", "w3")
                             for e in mine]).view(2, 4, 256).transpose(0, 1).reshape(4, 512, 1)  # fmt: skip
        assert torch.equal(experts.w13_weight_scale, want)


def test_online_fp8_quantizes_the_experts(moe_checkpoints: dict, tmp_path) -> None:
    """quantization="fp8" on a 16-bit mixture: every expert's rows to e4m3 at load, as the
    attention's (the reference: those weights quantized per row, dequantized)."""
    float_dir = moe_checkpoints["qwen3_moe"]
    reference = qm.channel_dequantized(float_dir, str(tmp_path / "channel-dequantized"))
    prompts = parity_prompts()[:4]
    got = greedy(float_dir, prompts, quantization="fp8", distributed_executor_backend="uni")
    assert got == hf_greedy(reference, prompts, 8)
    experts = load(float_dir, quantization="fp8").model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float8_e4m3fn


def test_dummy_fp8_experts(moe_checkpoints: dict) -> None:
    """load_format="dummy" with quantization="fp8": the experts in 128x128 blocks, the same
    model at TP=1 and 2, close to the unquantized one."""
    path = moe_checkpoints["qwen3_moe"]
    tp1, tp2 = (_first_logprobs(path, "fp8", tp) for tp in (1, 2))
    assert [list(s) for s in tp1] == [list(s) for s in tp2]
    plain, first = _first_logprobs(path)[0], tp1[0]
    assert len(set(plain) & set(first)) >= 3, (plain, first)
    assert all(abs(plain[t] - first[t]) < 0.3 for t in set(plain) & set(first))
    experts = load(path, load_format="dummy", quantization="fp8").model.layers[0].mlp.experts
    assert experts.w13_weight_scale_inv.shape == (8, 4, 2)  # 512 rows, 256 columns


def test_block_scales_of_experts_that_are_not_whole_blocks(tiny_models: dict[str, str]) -> None:
    """Experts of intermediate size 32 (and hidden 64): up starts inside gate's 128-row
    block, so w13 keeps a scale row per weight row, each its block's; every expert reads
    back as its gate, up and down each quantized in blocks (dummy weights: the same float
    weights as the unquantized load)."""
    from minivllm.worker.ops import fp8_gemm as ops
    from minivllm.worker.ops.fused_moe import DequantizedExperts

    path = tiny_models["qwen3_moe"]
    plain = load(path, load_format="dummy").model.layers[0].mlp.experts
    experts = load(path, load_format="dummy", quantization="fp8").model.layers[0].mlp.experts
    assert experts.w13_weight_scale_inv.shape == (16, 64, 1)  # a row per weight row
    w13, w2 = experts.quant_method.experts(experts)[:2]
    d13, d2 = DequantizedExperts(w13, torch.float32), DequantizedExperts(w2, torch.float32)
    for e in range(16):
        want = torch.cat([ops.dequantize_block(*ops.quantize_weight_block(p), torch.float32)
                          for p in plain.w13_weight[e].split(32)])  # fmt: skip
        assert torch.equal(d13[e], want)
        down = ops.quantize_weight_block(plain.w2_weight[e])
        assert torch.equal(d2[e], ops.dequantize_block(*down, torch.float32))


def test_unsupported_quantized_experts_are_named(moe_checkpoints: dict, tmp_path) -> None:
    from minivllm.worker.distributed.parallel_state import TPGroup

    awq = qm.build_quantized(moe_checkpoints["qwen3_moe"], str(tmp_path), "awq")[0]
    with pytest.raises(ValueError, match=r"awq: quantized experts \(model.layers.0.mlp.experts\) "
                       "are not supported"):  # fmt: skip
        load(awq)
    path = moe_checkpoints["qwen3_moe", "fp8"][0]
    with pytest.raises(ValueError, match=r"64 intermediate features per rank are not whole "
                       r"128-blocks.*enable_expert_parallel"):  # fmt: skip
        load(path, TPGroup(rank=0, size=4))
    missing = str(tmp_path / "missing-scale")
    shutil.copytree(path, missing)
    tensors = load_file(os.path.join(missing, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(missing, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.1.mlp.experts.3."
                       r"up_proj.weight_scale_inv'\]"):  # fmt: skip
        load(missing)
    mixtral = str(tmp_path / "mixtral-missing-scale")
    shutil.copytree(moe_checkpoints["mixtral", "fp8-tensor"][0], mixtral)
    tensors = load_file(os.path.join(mixtral, "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.6.w2.weight_scale"]
    save_file(tensors, os.path.join(mixtral, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.0.block_sparse_moe."
                       r"experts.6.w2.weight_scale'\]"):  # fmt: skip
        load(mixtral)
