"""Quantized checkpoints, each written here from a tiny float model as its tool writes it
(tests/quantized_models.py), give the greedy tokens transformers gives on the same weights:
transformers loading the FP8 checkpoints itself (it dequantizes them on a CPU), and, for AWQ
and GPTQ, which it loads only through gptqmodel's GPU kernels, a plain checkpoint of the
weights dequantized from each format's definition. On the CPU the engine's path is the
dequantizing reference (W dequantized to the compute dtype, then a plain matmul)."""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, EngineArgs, SamplingParams
from tests import quantized_models as qm
from tests.hf_reference import hf_greedy, parity_prompts
from tests.tiny_models import build_checkpoint

FORMATS = ["fp8", "fp8-tensor", "compressed-tensors", "compressed-tensors-block", "awq", "gptq",
           "gptq-desc-act"]  # fmt: skip
# transformers loads these itself (dequantized on a CPU); the others' reference is our
# dequantization of them
HF_LOADS = ("fp8", "compressed-tensors", "compressed-tensors-block")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """fmt -> (quantized checkpoint, what transformers runs); "float" -> the float model.
    Every shard of q/k/v, gate/up and o, down is a whole number of 128-blocks at TP=2."""
    root = tmp_path_factory.mktemp("quantized")
    float_dir = build_checkpoint(
        str(root / "float"), "qwen3", tie_word_embeddings=False, hidden_size=256,
        num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=512, seed=5,
    )  # fmt: skip
    out = {"float": (float_dir, float_dir)}
    for fmt in FORMATS:
        quant_dir, deq_dir = qm.build_quantized(float_dir, str(root), fmt)
        out[fmt] = (quant_dir, quant_dir if fmt in HF_LOADS else deq_dir)
    return out


def greedy(path: str, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(path, dtype="float32", **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_tokens_equal_transformers(quantized: dict, fmt: str) -> None:
    path, reference = quantized[fmt]
    prompts = parity_prompts()[:5]
    got = greedy(path, prompts, distributed_executor_backend="uni")
    assert got == hf_greedy(reference, prompts, GREEDY.max_tokens)
    assert len({t for row in got for t in row}) > 5  # not a degenerate constant stream


@pytest.mark.parametrize("fmt", ["fp8", "gptq-desc-act"])
def test_tp2_splits_the_quantized_weights(quantized: dict, fmt: str) -> None:
    """Block scales split with their blocks; act-order GPTQ's row-parallel layers keep every
    group's scales and read each row's group from g_idx."""
    path, reference = quantized[fmt]
    prompts = parity_prompts()[:4]
    assert greedy(path, prompts, tensor_parallel_size=2) == hf_greedy(reference, prompts, 8)


def test_block_scales_of_shards_that_start_mid_block(tmp_path) -> None:
    """k and v of 64 rows each (and their TP=2 halves) start inside a 128-row scale block:
    those layers keep a scale row per weight row, read from the checkpoint's blocks."""
    float_dir = build_checkpoint(
        str(tmp_path / "float"), "qwen3", hidden_size=256, num_heads=4, num_kv_heads=2,
        head_dim=64, intermediate_size=512, seed=6,
    )  # fmt: skip
    path, _ = qm.build_quantized(float_dir, str(tmp_path), "fp8")
    prompts = parity_prompts()[:3]
    assert greedy(path, prompts, tensor_parallel_size=2) == hf_greedy(path, prompts, 8)


def test_the_engine_dequantizes_as_each_format_defines(quantized: dict, tmp_path) -> None:
    """Weight by weight: each layer's W (its matmul of the identity) equals the format's
    dequantization written out in tests/quantized_models.py, and the dummy-weight packers
    write the same bytes as the tools' pack loops."""
    from minivllm.worker.attention.torch_attention import TorchAttentionBackend
    from minivllm.worker.distributed.parallel_state import TPGroup
    from minivllm.worker.layers.quantization.awq import awq_checkpoint_tensors
    from minivllm.worker.layers.quantization.gptq import gptq_checkpoint_tensors
    from minivllm.worker.model_loader import load_model
    from minivllm.worker.ops.fp8_gemm import quantize_weight_block

    for fmt in ("awq", "gptq", "gptq-desc-act"):
        path = quantized[fmt][0]
        deq = load_file(os.path.join(path + "-dequantized", "model.safetensors"))
        config = EngineArgs(model=path, dtype="float32").create_engine_config().model
        model = load_model(config, torch.device("cpu"), TPGroup(), TorchAttentionBackend())
        mlp = model.model.layers[1].mlp
        eye = torch.eye(256)
        want = torch.cat([deq[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        assert torch.equal(mlp.gate_up_proj(eye).T, want), fmt
        eye = torch.eye(512)
        assert torch.equal(mlp.down_proj(eye).T, deq["model.layers.1.mlp.down_proj.weight"])
    # per-tensor FP8: each shard's scale on its rows; one static input scale, the max of q/k/v's
    path = quantized["fp8-tensor"][0]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    config = EngineArgs(model=path, dtype="float32").create_engine_config().model
    qkv = load_model(config, torch.device("cpu"), TPGroup(), TorchAttentionBackend())
    qkv = qkv.model.layers[0].self_attn.qkv_proj
    prefix = "model.layers.0.self_attn."
    rows = {"q": 512, "k": 256, "v": 256}
    want = torch.cat([tensors[f"{prefix}{p}_proj.weight_scale"].expand(n) for p, n in rows.items()])
    assert torch.equal(qkv.weight_scale.view(-1), want)
    inputs = [tensors[f"{prefix}{p}_proj.input_scale"] for p in "qkv"]
    assert float(qkv.input_scale) == max(map(float, inputs)) and len(set(map(float, inputs))) > 1
    w = torch.randn(256, 384) * 0.1
    for ours, theirs in ((awq_checkpoint_tensors(w, 128), qm.awq(w)[0]),
                         (gptq_checkpoint_tensors(w, 128), qm.gptq(w)[0])):  # fmt: skip
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    q, scale = quantize_weight_block(w)
    theirs = qm.fp8_block(w)[0]
    assert torch.equal(q.view(torch.uint8), theirs["weight"].view(torch.uint8))
    assert torch.equal(scale, theirs["weight_scale_inv"])


def test_online_fp8_quantizes_a_float_checkpoint_per_channel(quantized: dict, tmp_path) -> None:
    """--quantization fp8 on a 16-bit checkpoint: W per row to e4m3 at load (the reference:
    llm-compressor's per-channel quantization of the same weights, dequantized)."""
    float_dir = quantized["float"][0]
    reference = qm.channel_dequantized(float_dir, str(tmp_path / "channel-dequantized"))
    prompts = parity_prompts()[:4]
    got = greedy(float_dir, prompts, quantization="fp8", distributed_executor_backend="uni")
    assert got == hf_greedy(reference, prompts, 8)
    assert got != hf_greedy(float_dir, prompts, 8)  # the quantization changed something


@functools.cache
def _first_logprobs(path: str, quantization: str | None = None, tp: int = 1) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    backend = "uni" if tp == 1 else "mp"
    llm = LLM(path, dtype="float32", load_format="dummy", quantization=quantization,
              tensor_parallel_size=tp, distributed_executor_backend=backend)  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [{t: lp.logprob for t, lp in step.items()} for step in outs[0].outputs[0].logprobs]


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors", "awq", "gptq"])
def test_dummy_weights_in_each_format(quantized: dict, method: str) -> None:
    """load_format="dummy" with quantization=...: the same random model, its linear weights
    quantized into the format its tool writes; alike at TP=1 and TP=2 (benchmarks compare
    them), and close to the unquantized one."""
    path = quantized["float"][0]
    tp1, tp2 = (_first_logprobs(path, method, tp) for tp in (1, 2))
    assert [list(s) for s in tp1] == [list(s) for s in tp2]
    for a, b in zip(tp1, tp2, strict=True):
        assert all(abs(a[t] - b[t]) < 1e-3 for t in a)
    plain = _first_logprobs(path)[0]
    first = tp1[0]
    # the first step's distribution: the same best candidates, logprobs within quantization's
    assert len(set(plain) & set(first)) >= 3, (plain, first)
    assert all(abs(plain[t] - first[t]) < 0.3 for t in set(plain) & set(first))


def _write_config(path: str, quantization_config: dict | None) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    if quantization_config is None:
        del config["quantization_config"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_unsupported_formats_and_missing_scales_are_named(quantized: dict, tmp_path) -> None:
    float_dir = quantized["float"][0]
    with pytest.raises(ValueError, match=r"quantization='awq' loads checkpoints quantized"):
        EngineArgs(model=float_dir, quantization="awq").create_engine_config()
    with pytest.raises(ValueError, match="supported: fp8, compressed-tensors, awq, gptq"):
        EngineArgs(model=float_dir, quantization="bitsandbytes")

    bnb = str(tmp_path / "bnb")
    shutil.copytree(float_dir, bnb)
    _write_config(bnb, {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match=r"quant_method 'bitsandbytes' is not supported "
                       r"\(supported: fp8, compressed-tensors, awq, gptq\)"):  # fmt: skip
        LLM(bnb, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="does not match the checkpoint's quantization method"):
        EngineArgs(model=quantized["awq"][0], quantization="gptq").create_engine_config()

    int8 = str(tmp_path / "int8")
    shutil.copytree(quantized["compressed-tensors"][0], int8)
    config = qm.quantization_config("compressed-tensors")
    config["config_groups"]["group_0"]["weights"].update(type="int", strategy="channel")
    _write_config(int8, config)
    with pytest.raises(ValueError, match="compressed-tensors: scheme not supported .* supported: "
                       "FP8 weights"):  # fmt: skip
        LLM(int8, dtype="float32", distributed_executor_backend="uni")

    missing = str(tmp_path / "missing-scale")
    shutil.copytree(quantized["fp8"][0], missing)
    tensors = load_file(os.path.join(missing, "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(missing, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing weights: \['model.layers.1.self_attn.k_proj"
                       r".weight_scale_inv'\]"):  # fmt: skip
        LLM(missing, dtype="float32", distributed_executor_backend="uni")
