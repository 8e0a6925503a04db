"""Tiny quantized checkpoints, written here from a tiny float one as the real tools write them,
beside a plain checkpoint of the same weights dequantized (what transformers runs).

Quantizing and packing follow each tool's code, written out independently of the engine's:
FP8 blocks as transformers' FineGrainedFP8 quantizer (max |w| of a 128x128 block -> 448,
`weight_scale_inv`), per-channel FP8 as llm-compressor's FP8_DYNAMIC (`weight_scale` [N, 1]),
AWQ as AutoAWQ's `WQLinear_GEMM.from_linear` (the interleaved order_map loop), GPTQ as
AutoGPTQ's `QuantLinear.pack` (the row loop, zeros stored minus one; act-order: `g_idx` from a
permutation of the columns). The dequantization is the formats' definition, written out.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from minivllm.quantization_config import CHECKPOINT_QUANTIZATION_CONFIGS

FP8 = torch.float8_e4m3fn
# the linear layers a quantized checkpoint quantizes: attention, MLP and experts (Mixtral's
# w1/w2/w3), not a mixture's router (`mlp.gate`)
LINEAR = re.compile(r"\.((q|k|v|o|gate|up|down)_proj|experts\.\d+\.w[123])\.weight$")


def fp8_block(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    blocks = w.reshape(n // 128, 128, k // 128, 128)
    inv = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / inv[:, None, :, None]).to(FP8).reshape(n, k)
    deq = (q.float().reshape(n // 128, 128, k // 128, 128) * inv[:, None, :, None]).reshape(n, k)
    return {"weight": q, "weight_scale_inv": inv}, deq


def fp8_channel(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale).clamp(-448, 448).to(FP8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def fp8_tensor(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-tensor FP8 with a static activation scale (quant_method fp8 without blocks)."""
    scale = w.abs().amax() / 448.0
    q = (w / scale).clamp(-448, 448).to(FP8)
    input_scale = torch.tensor(0.05 + float(w[0, 0].abs()))  # differs per layer: max is taken
    return {"weight": q, "weight_scale": scale, "input_scale": input_scale}, q.float() * scale


def ct_block(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' FP8_BLOCK: the block layout, its scale named weight_scale."""
    parts, deq = fp8_block(w)
    return {"weight": parts["weight"], "weight_scale": parts["weight_scale_inv"]}, deq


def awq(w: torch.Tensor, group: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    max_val, min_val = g.amax(-1, keepdim=True), g.amin(-1, keepdim=True)
    scales = ((max_val - min_val).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(min_val / scales)).clamp(0, 15)
    q = (torch.round(g / scales) + zeros).clamp(0, 15)
    deq = ((q - zeros) * scales).reshape(n, k)
    intweight = q.reshape(n, k).t().contiguous().to(torch.int32)  # [in, out]
    zeros_t = zeros[..., 0].t().contiguous().to(torch.int32)  # [groups, out]
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    qweight = torch.zeros(k, n // 8, dtype=torch.int32)
    qzeros = torch.zeros(k // group, n // 8, dtype=torch.int32)
    for col in range(n // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
            qzeros[:, col] |= zeros_t[:, col * 8 + order_map[i]] << (i * 4)
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales[..., 0].t().half()}
    return tensors, deq


def gptq(
    w: torch.Tensor, group: int = 128, desc_act: bool = False, seed: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    g_idx = torch.arange(k) // group
    if desc_act:  # columns quantized in a permuted order, group i // group for position i
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[order] = torch.arange(k) // group
    scales = torch.zeros(k // group, n)
    for gi in range(k // group):
        cols = w[:, g_idx == gi]
        scales[gi] = (2 * cols.abs().amax(1) / 15).clamp(min=1e-5)
    scales = scales.half().float()
    zero = 8
    s = scales[g_idx].t()  # [out, in]
    q = (torch.round(w / s) + zero).clamp(0, 15)
    deq = (q - zero) * s
    intweight = q.t().contiguous().to(torch.int64)  # [in, out]
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    row = i = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    zeros = torch.full((k // group, n), zero - 1, dtype=torch.int64)  # stored minus one
    qzeros = torch.zeros(k // group, n // 8, dtype=torch.int64)
    col = i = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    tensors = {
        "qweight": _int32(qweight),
        "qzeros": _int32(qzeros),
        "scales": scales.half(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, deq


def _int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values (int64) stored as int32, as numpy's astype(np.int32) does."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


QUANTIZERS = {
    "fp8": fp8_block,
    "fp8-tensor": fp8_tensor,
    "compressed-tensors": fp8_channel,
    "compressed-tensors-block": ct_block,
    "awq": awq,
    "gptq": gptq,
    "gptq-desc-act": lambda w: gptq(w, desc_act=True),
}


def quantization_config(fmt: str) -> dict:
    method = next(m for m in CHECKPOINT_QUANTIZATION_CONFIGS if fmt.startswith(m))
    config = copy.deepcopy(CHECKPOINT_QUANTIZATION_CONFIGS[method])
    if fmt == "gptq-desc-act":
        config["desc_act"] = True
    if fmt == "fp8-tensor":
        config = {"quant_method": "fp8", "activation_scheme": "static"}
    if fmt == "compressed-tensors-block":  # llm-compressor's FP8_BLOCK scheme
        group = config["config_groups"]["group_0"]
        group["weights"].update(strategy="block", block_structure=[128, 128])
        group["input_activations"].update(strategy="group", group_size=128)
    return config


def build_quantized(float_dir: str, out_dir: str, fmt: str) -> tuple[str, str]:
    """(quantized checkpoint, the same weights dequantized in float32) of float_dir's model."""
    quant_dir, deq_dir = os.path.join(out_dir, fmt), os.path.join(out_dir, fmt + "-dequantized")
    for d in (quant_dir, deq_dir):
        shutil.copytree(float_dir, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if not LINEAR.search(name):
            quantized[name] = dequantized[name] = t
            continue
        parts, deq = QUANTIZERS[fmt](t.float())
        module = name.removesuffix(".weight")
        quantized.update({f"{module}.{suffix}": v.contiguous() for suffix, v in parts.items()})
        dequantized[name] = deq.float().contiguous()
    save_file(quantized, os.path.join(quant_dir, "model.safetensors"))
    save_file(dequantized, os.path.join(deq_dir, "model.safetensors"))
    with open(os.path.join(quant_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(fmt)
    with open(os.path.join(quant_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return quant_dir, deq_dir


def channel_dequantized(float_dir: str, out_dir: str) -> str:
    """A copy of float_dir's model whose linear weights (experts' included) are quantized per
    row to e4m3 and dequantized: what online FP8 computes, for transformers to run."""
    shutil.copytree(float_dir, out_dir)
    tensors = load_file(os.path.join(float_dir, "model.safetensors"))
    for name, t in tensors.items():
        if LINEAR.search(name):
            tensors[name] = fp8_channel(t.float())[1].contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir
