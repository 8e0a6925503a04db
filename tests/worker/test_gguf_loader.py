"""GGUF files written here from tiny random checkpoints, every supported tensor type among
their matrices: greedy tokens equal transformers' on the same dequantized weights, and
what is not supported says what is."""

from __future__ import annotations

import json
import os
import random

import gguf
import numpy as np
import pytest
from transformers import AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.gguf_file import SUPPORTED_TENSOR_TYPES
from tests.gguf_files import TINY_GEOMETRY, build_tiny_gguf, write_gguf
from tests.hf_reference import hf_greedy, parity_prompts
from tests.tiny_models import build_checkpoint

TEXT = "Hello world! How are you today?"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """arch -> (HF directory, GGUF file). Llama and Qwen3 carry their tokenizer in the
    file; the Qwen2 file has none (its tokenizer is given as a directory, as vLLM advises)."""
    root = str(tmp_path_factory.mktemp("gguf"))
    return {
        arch: (
            os.path.join(root, arch),
            build_tiny_gguf(root, arch, seed=seed, with_tokenizer=arch != "qwen2"),
        )
        for seed, arch in enumerate(("llama", "qwen2", "qwen3"))
    }


def test_the_files_hold_every_supported_type(checkpoints) -> None:
    for _, path in checkpoints.values():
        types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
        assert types == set(SUPPORTED_TENSOR_TYPES)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    checkpoints: dict[str, tuple[str, str]], arch: str
) -> None:
    hf_dir, path = checkpoints[arch]
    tokenizer = hf_dir if arch == "qwen2" else None
    prompts = parity_prompts()[:4]
    llm = LLM(path, tokenizer=tokenizer, dtype="float32", distributed_executor_backend="uni")
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        text_ids = llm.get_tokenizer()(TEXT)["input_ids"]
        chat = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": TEXT}], tokenize=False, add_generation_prompt=True
        )
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(
        path + ".reference", prompts, 8
    )
    # the vocabulary and chat template read back from the file are the checkpoint's own
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    assert text_ids == hf_tok(TEXT)["input_ids"]
    assert chat == hf_tok.apply_chat_template(
        [{"role": "user", "content": TEXT}], tokenize=False, add_generation_prompt=True
    )


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path) -> None:
    """Llama 3.1 files carry their RoPE scaling as per-frequency factors (rope_freqs): read
    back as HF's "llama3" scaling, long prompts give transformers' tokens."""
    hf_dir = build_checkpoint(str(tmp_path / "llama31"), "llama", seed=5, **TINY_GEOMETRY)
    config_path = os.path.join(hf_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with open(config_path, "w") as f:
        json.dump(config, f)
    path = write_gguf(hf_dir, str(tmp_path / "llama31.gguf"))
    rng = random.Random(0)
    prompts = [[rng.randint(1, 300) for _ in range(n)] for n in (300, 480)]
    llm = LLM(path, dtype="float32", distributed_executor_backend="uni")
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(
        path + ".reference", prompts, 8
    )


def test_a_file_without_a_tokenizer_asks_for_one(checkpoints) -> None:
    _, path = checkpoints["qwen2"]
    with pytest.raises(ValueError, match="tokenizer: cannot build one from the GGUF file.*pass"):
        LLM(path, dtype="float32", distributed_executor_backend="uni")


def test_dummy_load_format_keeps_the_files_geometry(checkpoints) -> None:
    _, path = checkpoints["llama"]
    prompt = parity_prompts()[0]
    llm = LLM(path, load_format="dummy", dtype="float32", distributed_executor_backend="uni")
    try:
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert len(out.outputs[0].token_ids) == 8
    assert list(out.outputs[0].token_ids) != hf_greedy(path + ".reference", [prompt], 8)[0]


@pytest.mark.parametrize("arg", ["load_format", "quantization"])
def test_gguf_needs_a_gguf_file(checkpoints, arg: str) -> None:
    hf_dir, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match=f"{arg}='gguf' needs model to be a GGUF file"):
        LLM(hf_dir, distributed_executor_backend="uni", **{arg: "gguf"})


def _write(
    path: str, arch: str, tensors: dict[str, tuple[np.ndarray, str]], split_count: int = 0
) -> str:
    """A GGUF file of `arch` with a tiny Llama-shaped config and these tensors."""
    writer = gguf.GGUFWriter(path, arch)
    if split_count:
        writer.add_uint16("split.count", split_count)
    for key, value in (
        ("context_length", 64),
        ("embedding_length", 64),
        ("block_count", 1),
        ("feed_forward_length", 64),
        ("attention.head_count", 2),
        ("attention.layer_norm_rms_epsilon", 1e-6),
        ("vocab_size", 32),
    ):
        adder = writer.add_float32 if isinstance(value, float) else writer.add_uint32
        adder(f"{arch}.{key}", value)
    for name, (values, type_name) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        data = gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_tensor_type_names_the_supported_ones(tmp_path) -> None:
    embed = np.random.default_rng(0).standard_normal((32, 256)).astype(np.float32)
    path = _write(str(tmp_path / "tq.gguf"), "llama", {"token_embd.weight": (embed, "TQ2_0")})
    with pytest.raises(ValueError) as err:
        LLM(path, distributed_executor_backend="uni")
    message = str(err.value)
    assert "'token_embd.weight' has type TQ2_0, which is not supported" in message
    assert f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}" in message


def test_unsupported_architecture_names_the_supported_ones(tmp_path) -> None:
    embed = np.zeros((32, 64), dtype=np.float32)
    path = _write(str(tmp_path / "phi.gguf"), "phi3", {"token_embd.weight": (embed, "F32")})
    with pytest.raises(
        ValueError,
        match="GGUF architecture 'phi3' is not supported; supported: llama, qwen2, qwen3",
    ):
        LLM(path, distributed_executor_backend="uni")


def test_a_tensor_without_counterpart_is_named(tmp_path) -> None:
    embed = np.zeros((32, 64), dtype=np.float32)
    tensors = {"token_embd.weight": (embed, "F32"), "blk.0.ffn_gate_inp.weight": (embed, "F32")}
    path = _write(str(tmp_path / "moe.gguf"), "llama", tensors)
    with pytest.raises(
        ValueError, match=r"no counterpart in LlamaForCausalLM: \['blk.0.ffn_gate_inp"
    ):
        LLM(path, distributed_executor_backend="uni")


def test_rope_factors_of_another_scaling_are_refused(tmp_path) -> None:
    """Factors that no "llama3" scaling gives would be applied wrong: refused."""
    freqs = np.linspace(1.0, 3.0, 16, dtype=np.float32)  # head_dim 32: 16 frequencies
    path = _write(str(tmp_path / "rope.gguf"), "llama", {"rope_freqs.weight": (freqs, "F32")})
    with pytest.raises(ValueError, match="'rope_freqs.weight' holds RoPE factors that are not"):
        LLM(path, distributed_executor_backend="uni")


def test_one_part_of_a_split_file_is_refused(tmp_path) -> None:
    embed = np.zeros((32, 64), dtype=np.float32)
    tensors = {"token_embd.weight": (embed, "F32")}
    path = _write(str(tmp_path / "m-00001-of-00002.gguf"), "llama", tensors, split_count=2)
    with pytest.raises(ValueError, match="one part of a split model.*merge the parts"):
        LLM(path, distributed_executor_backend="uni")
