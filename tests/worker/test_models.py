"""The Llama-family decoder against HF transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from minivllm.config import EngineArgs, ModelConfig
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.torch_attention import TorchAttentionBackend
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.model_loader import load_model
from minivllm.worker.models.llama_family import CausalLM

BLOCK_SIZE = 4
NUM_BLOCKS = 32
ARCHS = ["qwen3", "qwen3-untied", "qwen2", "llama", "phi3", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def checkpoints(tiny_models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny checkpoints with their 1-D weights (norms, biases) made non-trivial, so a
    mix-up of norm weights or a dropped q/k/v bias changes the logits."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("perturbed")
    out = {}
    for i, name in enumerate(ARCHS):
        hf = AutoModelForCausalLM.from_pretrained(tiny_models[name], dtype=torch.float32)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in hf.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3)
        path = str(root / name)
        shard = {"max_shard_size": "100KB"} if name == "llama" else {}
        hf.save_pretrained(path, safe_serialization=True, **shard)
        out[name] = (path, hf.eval())
    return out


def model_config(path: str, **overrides) -> ModelConfig:
    args = EngineArgs(model=path, dtype="float32", device="cpu", **overrides)
    return args.create_engine_config().model


def new_kv_caches(config: ModelConfig) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    return [torch.zeros(shape) for _ in range(config.num_layers)]


def build_step(seqs: list[tuple[list[int], int, list[int]]]):
    """seqs: (block ids, tokens already cached, new tokens) per sequence, decodes first.
    Returns input_ids, positions and AttentionMetadata for one step."""
    input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
    for blocks, cached, new in seqs:
        for j, token in enumerate(new):
            pos = cached + j
            input_ids.append(token)
            positions.append(pos)
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + len(new))
        seq_lens.append(cached + len(new))
    width = max(len(b) for b, _, _ in seqs)
    table = [b + [0] * (width - len(b)) for b, _, _ in seqs]
    q_lens = [len(new) for _, _, new in seqs]
    num_decodes = 0
    while num_decodes < len(seqs) and q_lens[num_decodes] == 1:
        num_decodes += 1
    meta = AttentionMetadata(
        num_tokens=len(input_ids),
        num_seqs=len(seqs),
        num_decodes=num_decodes,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=BLOCK_SIZE,
        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    return torch.tensor(input_ids), torch.tensor(positions), meta


def run_step(model: CausalLM, kv_caches, seqs) -> list[torch.Tensor]:
    """Per sequence, the logits of its new tokens."""
    input_ids, positions, meta = build_step(seqs)
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, kv_caches, meta))
    assert logits.dtype == model.lm_head.weight.dtype  # the sampler reads them as they are
    bounds = meta.query_start_loc.tolist()
    return [logits[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (5, 11, 14)]


# blocks deliberately scattered and interleaved between sequences
BLOCKS = [[3, 9, 1, 20], [7, 2, 15, 11, 4], [12, 0, 18, 6, 25, 13]]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_batch_matches_hf(checkpoints, arch: str) -> None:
    path, hf = checkpoints[arch]
    config = model_config(path)
    model = load_model(config, torch.device("cpu"), TPGroup(), TorchAttentionBackend())
    kv = new_kv_caches(config)
    seqs = [(BLOCKS[i], 0, p) for i, p in enumerate(prompts())]
    for ours, (_, _, tokens) in zip(run_step(model, kv, seqs), seqs, strict=True):
        torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_and_chunked_prefill_match_hf(checkpoints, arch: str) -> None:
    path, hf = checkpoints[arch]
    config = model_config(path)
    model = load_model(config, torch.device("cpu"), TPGroup(), TorchAttentionBackend())
    kv = new_kv_caches(config)
    a, b, c = prompts()
    # step 1: prefill a and b, first chunk of c
    out = run_step(model, kv, [(BLOCKS[0], 0, a), (BLOCKS[1], 0, b), (BLOCKS[2], 0, c[:6])])
    a.append(int(out[0][-1].argmax()))
    b.append(int(out[1][-1].argmax()))
    # step 2: decode a and b; second chunk of c attends over its cached first chunk
    out = run_step(
        model,
        kv,
        [(BLOCKS[0], len(a) - 1, a[-1:]), (BLOCKS[1], len(b) - 1, b[-1:]), (BLOCKS[2], 6, c[6:])],
    )
    torch.testing.assert_close(out[0], hf_logits(hf, a)[-1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], hf_logits(hf, b)[-1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[2], hf_logits(hf, c)[6:], atol=1e-4, rtol=1e-4)
    # step 3: everyone decodes
    for seq, logits in zip((a, b, c), out, strict=True):
        seq.append(int(logits[-1].argmax()))
    out = run_step(model, kv, [(BLOCKS[i], len(s) - 1, s[-1:]) for i, s in enumerate((a, b, c))])
    for seq, logits in zip((a, b, c), out, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, seq)[-1:], atol=1e-4, rtol=1e-4)


def test_llama_biases_from_the_config_match_hf(tmp_path) -> None:
    """attention_bias (q/k/v and o_proj) and mlp_bias (gate/up/down) set in config.json reach
    the layers: the logits equal transformers', and dummy weights carry the biases too."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import build_checkpoint

    path = build_checkpoint(
        str(tmp_path / "llama"), "llama", tie_word_embeddings=False, seed=4,
        attention_bias=True, mlp_bias=True,
    )  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:  # biases start at zero
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.3)
    hf.save_pretrained(path, safe_serialization=True)
    config = model_config(path)
    model = load_model(config, torch.device("cpu"), TPGroup(), TorchAttentionBackend())
    seqs = [(BLOCKS[i], 0, p) for i, p in enumerate(prompts())]
    for ours, (_, _, tokens) in zip(
        run_step(model, new_kv_caches(config), seqs), seqs, strict=True
    ):
        torch.testing.assert_close(ours, hf_logits(hf.eval(), tokens), atol=1e-4, rtol=1e-4)
    dummy = load_model(
        model_config(path, load_format="dummy"), torch.device("cpu"), TPGroup(),
        TorchAttentionBackend(),
    )  # fmt: skip
    assert dummy.model.layers[0].mlp.down_proj.bias is not None


def test_unknown_architecture_is_named(qwen3_dir: str) -> None:
    config = model_config(qwen3_dir)
    bad = dataclasses.replace(
        config, hf_config={**config.hf_config, "architectures": ["GPT2LMHeadModel"]}
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        load_model(bad, torch.device("cpu"), TPGroup(), TorchAttentionBackend())


def test_missing_and_unexpected_weights_are_named(qwen3_dir: str, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    for name in os.listdir(qwen3_dir):
        shutil.copy(os.path.join(qwen3_dir, name), tmp_path / name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_model(
            model_config(str(tmp_path)), torch.device("cpu"), TPGroup(), TorchAttentionBackend()
        )
    # named as the checkpoint names it, not as the stacked parameter it fills
    assert "missing weights: ['model.layers.1.self_attn.k_proj.weight']" in str(err.value)
    assert "model.layers.1.self_attn.extra.weight" in str(err.value)


def test_dummy_weights_are_deterministic_and_finite_in_bf16(qwen3_dir: str) -> None:
    config = model_config(qwen3_dir, load_format="dummy")
    config = dataclasses.replace(config, dtype="bfloat16")
    models = [
        load_model(config, torch.device("cpu"), TPGroup(), TorchAttentionBackend())
        for _ in range(2)
    ]
    for (name, p0), p1 in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert p0.dtype == torch.bfloat16
        assert torch.equal(p0, p1), name
    kv = [c.bfloat16() for c in new_kv_caches(config)]
    logits = run_step(models[0], kv, [(BLOCKS[0], 0, prompts()[0])])[0]
    assert torch.isfinite(logits).all()
    assert logits.shape == (5, config.vocab_size)


@pytest.mark.parametrize("model", ["qwen3", "qwen3-untied", "qwen2", "llama", "phi3"])
def test_dummy_weights_are_named_and_shaped_as_the_checkpoint(
    tiny_models: dict[str, str], model: str
) -> None:
    """Dummy weights go through the checkpoint's loading path, Phi-3's fused qkv_proj and
    gate_up_proj included: every tensor a real checkpoint holds, of its shape, no other."""
    from minivllm.worker.dummy_weights import hf_weight_shapes
    from minivllm.worker.layers.weights import shape_of
    from minivllm.worker.model_loader import iter_safetensors
    from minivllm.worker.models.registry import resolve_architecture

    config = model_config(tiny_models[model])
    _, variant = resolve_architecture(config)
    on_disk = {name: shape_of(t) for name, t in iter_safetensors(tiny_models[model])}
    assert hf_weight_shapes(config, variant) == on_disk
