"""Tensor-parallel layers: each rank's slice of a checkpoint, and a real 2-rank run (gloo)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.worker.layers.rotary import RotaryEmbedding


def ranks(size: int) -> list[TPGroup]:
    # only rank and size are read when loading weights; no torch.distributed needed
    return [TPGroup(rank=r, size=size) for r in range(size)]


@pytest.fixture
def as_slice(tmp_path):
    """Turn a tensor into the lazy safetensors slice the loader hands to weight loaders."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    handles = []

    def convert(t: torch.Tensor):
        path = str(tmp_path / f"t{len(handles)}.safetensors")
        save_file({"t": t.contiguous()}, path)
        handles.append(safe_open(path, framework="pt"))
        return handles[-1].get_slice("t")

    return convert


def test_tp_group_of_one_is_a_no_op() -> None:
    tp = TPGroup()
    x = torch.randn(3, 4)
    assert tp.all_reduce(x) is x
    assert tp.gather(x, dim=-1) is x
    with pytest.raises(ValueError):
        TPGroup(rank=2, size=2)


@pytest.mark.parametrize("lazy", [False, True])
def test_column_and_row_shards_concatenate_to_the_full_weight(lazy: bool, as_slice) -> None:
    w = torch.randn(12, 8)
    b = torch.randn(12)
    load = as_slice if lazy else (lambda t: t)
    cols = [ColumnParallelLinear(8, 12, tp, bias=True) for tp in ranks(2)]
    rows = [RowParallelLinear(12, 8, tp, bias=True) for tp in ranks(2)]
    for layer in cols:
        layer.weight.weight_loader(layer.weight, load(w))
        layer.bias.weight_loader(layer.bias, load(b))
    for layer in rows:
        layer.weight.weight_loader(layer.weight, load(w.T))
        layer.bias.weight_loader(layer.bias, load(b[:8]))
    assert torch.equal(torch.cat([c.weight for c in cols]), w)
    assert torch.equal(torch.cat([c.bias for c in cols]), b)
    assert torch.equal(torch.cat([r.weight for r in rows], dim=1), w.T)
    # column then row: partial sums over ranks equal the unsharded result
    x = torch.randn(5, 8)
    partial = sum(F.linear(c(x), r.weight) for c, r in zip(cols, rows, strict=True))
    torch.testing.assert_close(partial + b[:8], F.linear(F.linear(x, w, b), w.T, b[:8]))


def test_merged_column_puts_each_ranks_gate_and_up_side_by_side() -> None:
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    layers = [MergedColumnParallelLinear(4, [6, 6], tp) for tp in ranks(2)]
    for layer in layers:
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
    for r, layer in enumerate(layers):
        assert torch.equal(layer.weight[:3], gate[3 * r : 3 * r + 3])
        assert torch.equal(layer.weight[3:], up[3 * r : 3 * r + 3])
    assert torch.equal(torch.cat([lay.weight[:3] for lay in layers]), gate)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_qkv_shards_heads_and_replicates_kv_when_tp_exceeds_kv_heads(tp_size: int) -> None:
    head_dim, num_heads, num_kv_heads = 2, 4, 2
    q = torch.randn(num_heads * head_dim, 3)
    k = torch.randn(num_kv_heads * head_dim, 3)
    v = torch.randn(num_kv_heads * head_dim, 3)
    layers = [QKVParallelLinear(3, head_dim, num_heads, num_kv_heads, tp) for tp in ranks(tp_size)]
    for layer in layers:
        for shard_id, t in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, t, shard_id)
    qs = [lay.weight[: lay.q_size] for lay in layers]
    ks = [lay.weight[lay.q_size : lay.q_size + lay.kv_size] for lay in layers]
    vs = [lay.weight[lay.q_size + lay.kv_size :] for lay in layers]
    assert torch.equal(torch.cat(qs), q)
    replicas = tp_size // num_kv_heads if tp_size > num_kv_heads else 1
    # rank r holds kv head r // replicas: dropping the replicas gives back k and v
    assert torch.equal(torch.cat(ks[::replicas]), k)
    assert torch.equal(torch.cat(vs[::replicas]), v)
    if replicas > 1:
        assert torch.equal(ks[0], ks[1]) and torch.equal(vs[2], vs[3])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_fused_checkpoint_tensors_shard_as_their_parts(tp_size: int, as_slice) -> None:
    """Phi-3 stores q, k, v one after another in qkv_proj (gate, up in gate_up_proj): each
    rank takes its q heads, its kv heads (replicated past 2 ranks) and its part of gate and
    of up, exactly as from separate tensors, also from a lazy safetensors slice."""
    head_dim, heads, kv_heads, hidden, inter = 2, 4, 2, 3, 8
    q, k = torch.randn(heads * head_dim, hidden), torch.randn(kv_heads * head_dim, hidden)
    v = torch.randn(kv_heads * head_dim, hidden)
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    for load in (lambda t: t, as_slice):
        for tp in ranks(tp_size):
            fused = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp)
            parts = QKVParallelLinear(hidden, head_dim, heads, kv_heads, tp)
            fused.weight.weight_loader(fused.weight, load(torch.cat([q, k, v])))
            for shard_id, t in (("q", q), ("k", k), ("v", v)):
                parts.weight.weight_loader(parts.weight, t, shard_id)
            assert torch.equal(fused.weight, parts.weight)
            fused_mlp = MergedColumnParallelLinear(hidden, [inter, inter], tp)
            parts_mlp = MergedColumnParallelLinear(hidden, [inter, inter], tp)
            fused_mlp.weight.weight_loader(fused_mlp.weight, load(torch.cat([gate, up])))
            parts_mlp.weight.weight_loader(parts_mlp.weight, gate, 0)
            parts_mlp.weight.weight_loader(parts_mlp.weight, up, 1)
            assert torch.equal(fused_mlp.weight, parts_mlp.weight)
    with pytest.raises(ValueError, match=r"has 14 rows, expected 16 \(0: 8, 1: 8\)"):
        fused_mlp.weight.weight_loader(fused_mlp.weight, torch.randn(14, hidden))


def test_vocab_shards_pad_the_last_rank_and_lookup_masks(as_slice) -> None:
    w = torch.randn(7, 4)  # 7 rows over 2 ranks: 4 + 3 (+1 zero pad row)
    embs = [VocabParallelEmbedding(7, 4, tp) for tp in ranks(2)]
    for e in embs:
        e.weight.weight_loader(e.weight, as_slice(w))
    assert torch.equal(torch.cat([e.weight for e in embs])[:7], w)
    assert not embs[1].weight[3].any()
    head = ParallelLMHead(7, 4, TPGroup())
    head.weight.weight_loader(head.weight, w)
    x = torch.randn(2, 4)
    torch.testing.assert_close(head.compute_logits(x), x @ w.T)


def test_llama3_rope_scaling_matches_hf() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    config = LlamaConfig(
        head_dim=64,
        hidden_size=512,
        num_attention_heads=8,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    # the older config layout: top-level rope_theta plus rope_scaling
    ours = RotaryEmbedding(64, 4096, {"rope_theta": 500000.0, "rope_scaling": scaling})
    positions = torch.tensor([0, 1, 255, 4095])
    expected = positions[:, None].float() * inv_freq[None, :]
    cos, sin = ours.cos_sin_cache[positions].chunk(2, dim=-1)
    torch.testing.assert_close(cos, expected.cos())
    torch.testing.assert_close(sin, expected.sin())
    with pytest.raises(ValueError, match="'ntk' .*supported: default, linear, dynamic, llama3"):
        RotaryEmbedding(64, 16, {"rope_scaling": {"type": "ntk", "factor": 2.0}})


def _prefill_logits(model_dir: str, tp: TPGroup) -> torch.Tensor:
    from minivllm.config import EngineArgs
    from minivllm.worker.attention.metadata import AttentionMetadata
    from minivllm.worker.attention.torch_attention import TorchAttentionBackend
    from minivllm.worker.model_loader import load_model

    config = EngineArgs(model=model_dir, dtype="float32", device="cpu")
    config = config.create_engine_config().model
    model = load_model(config, torch.device("cpu"), tp, TorchAttentionBackend())
    n, block_size = 10, 4
    kv_heads = max(1, config.num_kv_heads // tp.size)
    kv = [torch.zeros(2, 3, block_size, kv_heads, config.head_dim) for _ in range(2)]
    meta = AttentionMetadata(
        num_tokens=n,
        num_seqs=1,
        num_decodes=0,
        max_query_len=n,
        max_seq_len=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32),
        slot_mapping=torch.arange(n),
        block_size=block_size,
    )
    ids = torch.arange(n) * 37 % config.vocab_size
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), kv, meta))


def _tp_worker(rank: int, size: int, model_dir: str, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a file rendezvous: no port to pick, so parallel test runs cannot collide
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        logits = _prefill_logits(model_dir, TPGroup(rank=rank, size=size))
        torch.save(logits, os.path.join(out_dir, f"logits_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_over_gloo_match_one_rank(tiny_models: dict[str, str], tmp_path) -> None:
    import torch.multiprocessing as mp

    model_dir = tiny_models["llama"]
    mp.spawn(
        _tp_worker, args=(2, model_dir, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True
    )
    full = _prefill_logits(model_dir, TPGroup())
    for rank in range(2):
        # every rank holds the full-vocabulary logits
        logits = torch.load(tmp_path / f"logits_{rank}.pt")
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=1e-4)
