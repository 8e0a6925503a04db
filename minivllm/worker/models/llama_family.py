"""One decoder for the Llama family: Llama, Mistral, Qwen2 and Qwen3.

They share pre-norm blocks of GQA attention with rotary embeddings and a SwiGLU MLP; what
differs is a `DecoderVariant`: Qwen2 adds a bias to q/k/v, Qwen3 RMS-normalizes each
query/key head before the rotation. Parameter names follow HF's, except that q/k/v and
gate/up are stacked into `qkv_proj` and `gate_up_proj` so each is one matmul.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.worker.attention.backend import AttentionBackend
from minivllm.worker.attention.kv_scales import KVScaleLoader
from minivllm.worker.attention.layer import PagedAttention, forward_batch
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.layers.activation import SiluAndMul
from minivllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.worker.layers.norm import RMSNorm
from minivllm.worker.layers.rotary import HeadRMSNorm, RotaryEmbedding
from minivllm.worker.layers.weights import Loaded, default_weight_loader


@dataclass(frozen=True)
class DecoderVariant:
    """What sets one architecture of the family apart."""

    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        layer_idx: int,
        tp: TPGroup,
        backend: AttentionBackend,
        params_dtype: torch.dtype,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        hf = config.hf_config
        hidden, head_dim = int(hf["hidden_size"]), config.head_dim
        bias = variant.qkv_bias or bool(hf.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_dim,
            config.num_attention_heads,
            config.num_kv_heads,
            tp,
            bias=bias,
            params_dtype=params_dtype,
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            hidden,
            tp,
            bias=bool(hf.get("attention_bias", False)) and not variant.qkv_bias,
            params_dtype=params_dtype,
        )
        self.rotary_emb = rotary_emb  # shared by all layers
        eps = float(hf["rms_norm_eps"])
        self.q_norm = HeadRMSNorm(head_dim, eps, params_dtype) if variant.qk_norm else None
        self.k_norm = HeadRMSNorm(head_dim, eps, params_dtype) if variant.qk_norm else None
        self.attn = PagedAttention(layer_idx, backend, scale=head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, params_dtype: torch.dtype) -> None:
        super().__init__()
        hf = config.hf_config
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; only 'silu'")
        hidden, inter = int(hf["hidden_size"]), int(hf["intermediate_size"])
        bias = bool(hf.get("mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], tp, bias=bias, params_dtype=params_dtype
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, hidden, tp, bias=bias, params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, tp: TPGroup, params_dtype: torch.dtype, self_attn: Attention
    ) -> None:
        super().__init__()
        hidden, eps = int(config.hf_config["hidden_size"]), float(config.hf_config["rms_norm_eps"])
        self.self_attn = self_attn
        self.mlp = MLP(config, tp, params_dtype)
        self.input_layernorm = RMSNorm(hidden, eps, params_dtype, feeds_linear=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, params_dtype, feeds_linear=True)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's output (with TP a `PartialSum`), or for the first layer
        (residual None) the embeddings. Returns this layer's output and the residual stream,
        carried separately so each norm can fuse the add (and, with TP, the sum over ranks)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return hidden, residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        tp: TPGroup,
        backend: AttentionBackend,
        params_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        hidden = int(config.hf_config["hidden_size"])
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp, params_dtype)
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_model_len, config.hf_config)
        layers = []
        for i in range(config.num_layers):
            attn = Attention(config, variant, i, tp, backend, params_dtype, rotary_emb)
            layers.append(DecoderLayer(config, tp, params_dtype, attn))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, float(config.hf_config["rms_norm_eps"]), params_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# checkpoint name part -> (our stacked parameter's name part, shard id)
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class CausalLM(nn.Module):
    """A decoder-only LM of the Llama family, sharded for one tensor-parallel rank."""

    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        tp: TPGroup,
        attn_backend: AttentionBackend,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(config.hf_config.get("tie_word_embeddings", False))
        self.model = DecoderModel(config, variant, tp, attn_backend, params_dtype)
        hidden = int(config.hf_config["hidden_size"])
        self.lm_head = ParallelLMHead(config.vocab_size, hidden, tp, params_dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.has_kv_scales = False  # whether the checkpoint gave k/v scales (load_weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T]; kv_caches: one per layer. Returns hidden [T, hidden].

        Each layer writes this step's keys/values into its cache at meta.slot_mapping."""
        with forward_batch(meta, kv_caches):
            return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model's dtype, the full vocabulary
        on every rank (the sampler reads 16-bit logits as they are: a float32 copy would
        cost a pass)."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Copy HF-named checkpoint tensors (or safetensors slices) into this rank's params.

        Raises ValueError naming every checkpoint weight with no parameter, and every
        parameter (or stacked shard of one) the checkpoint did not provide."""
        params = dict(self.named_parameters())
        expected = {name: _shards_of(name) for name in params}
        loaded: dict[str, set] = {name: set() for name in params}
        unexpected = []
        kv_scales = KVScaleLoader(self)
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name or kv_scales.load(hf_name, tensor):
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints still store it
            name, shard_id = hf_name, None
            for hf_part, part, sid in _STACKED:
                if hf_part in hf_name:
                    name, shard_id = hf_name.replace(hf_part, part), sid
                    break
            param = params.get(name)
            if param is None:
                unexpected.append(hf_name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"{hf_name}: {e}") from e
            loaded[name].add(shard_id)
        missing = sorted(
            f"{name}[{shard}]" if shard is not None else name
            for name, shards in expected.items()
            for shard in shards - loaded[name]
        )
        if unexpected or missing:
            raise ValueError(
                f"checkpoint does not match {self.config.architecture}: "
                f"missing weights: {missing or 'none'}; unexpected weights: {unexpected or 'none'}"
            )
        self.has_kv_scales = kv_scales.finish()


def _shards_of(param_name: str) -> set:
    shards = {sid for _, part, sid in _STACKED if part in param_name}
    return shards or {None}
