"""One decoder for the Llama family: Llama, Mistral, Qwen2, Qwen3 and Phi-3 (Phi-4), and the
mixtures of experts built on them, Qwen3-MoE and Mixtral.

They share pre-norm blocks of GQA attention with rotary embeddings and a SwiGLU MLP; what
differs is a `DecoderVariant`: Qwen2 adds a bias to q/k/v, Qwen3 RMS-normalizes each
query/key head before the rotation, Phi-3 stores q/k/v and gate/up fused in its checkpoint
(its partial rotary and LongRoPE are the rotary table's: layers/rotary.py). In Qwen3-MoE and
Mixtral the MLP of the layers that `ModelConfig.is_moe_layer` names is a router and routed
experts (models/sparse_moe.py). Parameter names follow HF's, except that q/k/v and gate/up
are stacked into `qkv_proj` and `gate_up_proj` so each is one matmul (Phi-3's own names),
and each layer's experts into two 3-D tensors.

Where one kernel does the work of several, the model calls that fused op by name
(layers/fused.py, which decides when the kernel can run): each norm runs inside the
projection after it and, under TP, sums the row-parallel projection before it over the ranks;
the per-head norm, the rotation and the KV-cache store are one kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.worker.attention.backend import AttentionBackend
from minivllm.worker.attention.kv_scales import KVScaleLoader
from minivllm.worker.attention.layer import PagedAttention, forward_batch
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.worker.layers.fused import (
    all_reduce_add_rms_norm,
    gelu_tanh_mul_linear,
    qk_norm_rope_store_kv,
    rms_norm_linear,
    silu_mul_linear,
)
from minivllm.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.worker.layers.norm import GemmaRMSNorm, RMSNorm
from minivllm.worker.layers.quantization import QuantizationConfig, get_quantization_config
from minivllm.worker.layers.rotary import RotaryEmbedding
from minivllm.worker.layers.weights import Loaded, default_weight_loader
from minivllm.worker.models.sparse_moe import (
    SparseMoeBlock,
    expert_checkpoint_name,
    moe_targets,
)


@dataclass(frozen=True)
class DecoderVariant:
    """What sets one architecture of the family apart: every knob the layers read. The
    registry gives each architecture its own; `for_checkpoint` adds those that config.json
    sets, so the layers read nothing else of it but the geometry."""

    qkv_bias: bool = False  # Qwen2; Llama and Qwen3 with attention_bias
    o_proj_bias: bool = False  # Llama and Qwen3 with attention_bias
    mlp_bias: bool = False  # Llama with mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head
    tie_word_embeddings: bool = False  # the LM head is the embedding matrix
    norm_offset: bool = False  # Gemma: every RMSNorm multiplies by 1 + weight
    sandwich_norms: bool = False  # Gemma: a norm after attention and after the MLP too
    hidden_act: str = "silu"  # the MLP's gate activation: silu, or gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None  # Gemma: the attention scale is its -1/2 power
    final_logit_softcapping: float | None = None  # Gemma: logits = cap * tanh(logits / cap)
    # the checkpoint stores q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3)
    fused_checkpoint: bool = False
    norm_topk_prob: bool = False  # MoE: top-k routing weights renormalized to sum to 1
    # MoE: each rank holds whole experts (EngineArgs.enable_expert_parallel) rather than a
    # slice of every expert; not of the checkpoint but of the engine (load_model sets it)
    expert_parallel: bool = False

    def for_checkpoint(self, hf_config: dict[str, Any]) -> DecoderVariant:
        """This architecture's variant with the knobs of a checkpoint's config.json."""
        act = hf_config.get("hidden_activation") or hf_config.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden activation {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
            )
        for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if hf_config.get(name):
                raise ValueError(f"{name}={hf_config[name]!r} is not supported")
        attention_bias = bool(hf_config.get("attention_bias", False))
        scalar, cap = (
            hf_config.get("query_pre_attn_scalar"),
            hf_config.get("final_logit_softcapping"),
        )
        return replace(
            self,
            qkv_bias=self.qkv_bias or attention_bias,
            # Qwen2's q/k/v always carry a bias, its o_proj never does
            o_proj_bias=self.o_proj_bias or (attention_bias and not self.qkv_bias),
            mlp_bias=self.mlp_bias or bool(hf_config.get("mlp_bias", False)),
            # Gemma's config class ties them unless it says otherwise, Llama's and Qwen's not
            tie_word_embeddings=bool(
                hf_config.get("tie_word_embeddings", self.tie_word_embeddings)
            ),
            hidden_act=act,
            query_pre_attn_scalar=float(scalar) if scalar is not None else None,
            final_logit_softcapping=float(cap) if cap else None,
            norm_topk_prob=self.norm_topk_prob or bool(hf_config.get("norm_topk_prob", False)),
        )


# the MLP's gate activation -> its fused op (layers/fused.py): act(gate) * up, then down_proj
_ACTIVATIONS = {"silu": silu_mul_linear, "gelu_pytorch_tanh": gelu_tanh_mul_linear}


class Attention(nn.Module):
    """Self-attention from its qkv projection on (the decoder layer runs qkv_proj, fused with
    the norm before it): per-head q/k norm (Qwen3, Gemma), rotary, the KV-cache store, paged
    attention (over the layer's sliding window, if it has one), and o_proj, whose output
    under TP is this rank's partial sum."""

    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        layer_idx: int,
        tp: TPGroup,
        backend: AttentionBackend,
        params_dtype: torch.dtype,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        hidden, head_dim = int(config.hf_config["hidden_size"]), config.head_dim
        prefix = f"model.layers.{layer_idx}.self_attn."
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_dim,
            config.num_attention_heads,
            config.num_kv_heads,
            tp,
            bias=variant.qkv_bias,
            params_dtype=params_dtype,
            quant_config=quant_config,
            checkpoint_names=[prefix + p for p in ("q_proj", "k_proj", "v_proj")],
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            hidden,
            tp,
            bias=variant.o_proj_bias,
            params_dtype=params_dtype,
            reduce_results=False,  # summed by the next norm
            quant_config=quant_config,
            checkpoint_names=[prefix + "o_proj"],
        )
        self.rotary_emb = rotary_emb  # shared by all layers (of its kind)
        eps = float(config.hf_config["rms_norm_eps"])
        norm_cls = GemmaRMSNorm if variant.norm_offset else RMSNorm
        self.q_norm = norm_cls(head_dim, eps, params_dtype) if variant.qk_norm else None
        self.k_norm = norm_cls(head_dim, eps, params_dtype) if variant.qk_norm else None
        scalar = variant.query_pre_attn_scalar
        self.attn = PagedAttention(
            layer_idx,
            backend,
            scale=(scalar if scalar is not None else head_dim) ** -0.5,
            sliding_window=config.sliding_windows[layer_idx],
        )

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """positions [T]; qkv [T, q_size + 2 * kv_size] -> [T, hidden]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        q, k = qk_norm_rope_store_kv(
            positions, q, k, v, self.q_norm, self.k_norm, self.rotary_emb, self.attn
        )
        o = self.attn(q)
        return self.o_proj(o.flatten(1))


class MLP(nn.Module):
    """SwiGLU (GeGLU) from its gate_up projection on (the decoder layer runs gate_up_proj,
    fused with the norm before it): down_proj(act(gate) * up), act silu (gelu_tanh), under
    TP this rank's partial sum."""

    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        tp: TPGroup,
        params_dtype: torch.dtype,
        layer_idx: int = 0,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        hidden, inter = (
            int(config.hf_config["hidden_size"]),
            int(config.hf_config["intermediate_size"]),
        )
        bias, prefix = variant.mlp_bias, f"model.layers.{layer_idx}.mlp."
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], tp, bias=bias, params_dtype=params_dtype,
            quant_config=quant_config, checkpoint_names=[prefix + "gate_proj", prefix + "up_proj"],
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            inter, hidden, tp, bias=bias, params_dtype=params_dtype, reduce_results=False,
            quant_config=quant_config, checkpoint_names=[prefix + "down_proj"],
        )  # fmt: skip
        self.act_mul_linear = _ACTIVATIONS[variant.hidden_act]

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2 * intermediate] -> [T, hidden]."""
        return self.act_mul_linear(gate_up, self.down_proj)


class DecoderLayer(nn.Module):
    """Pre-norm: h + attn(norm(h)), then h + mlp(norm(h)). The residual stream h travels beside
    the layer's output, so that each norm adds it in its own kernel (under TP also summing the
    output over the ranks) and runs inside the projection after it."""

    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        layer_idx: int,
        tp: TPGroup,
        backend: AttentionBackend,
        params_dtype: torch.dtype,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = int(config.hf_config["hidden_size"]), float(config.hf_config["rms_norm_eps"])
        self.tp = tp
        self.self_attn = Attention(
            config, variant, layer_idx, tp, backend, params_dtype, rotary_emb, quant_config
        )
        self.mlp = (
            SparseMoeBlock(config, variant, tp, params_dtype, layer_idx, quant_config)
            if config.is_moe_layer(layer_idx)
            else MLP(config, variant, tp, params_dtype, layer_idx, quant_config)
        )
        self.input_layernorm = RMSNorm(hidden, eps, params_dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, params_dtype)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's output (under TP this rank's partial sum), or, with
        residual None, the embeddings. Returns this layer's output, alike, and the residual
        stream."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = rms_norm_linear(
            hidden, residual, self.input_layernorm, attn.qkv_proj, self.tp
        )
        hidden = attn(positions, qkv)
        norm = self.post_attention_layernorm
        if isinstance(mlp, SparseMoeBlock):  # the router and the experts read the normed rows
            x, residual = all_reduce_add_rms_norm(hidden, residual, norm, self.tp)
            return mlp(x), residual
        gate_up, residual = rms_norm_linear(hidden, residual, norm, mlp.gate_up_proj, self.tp)
        return mlp(gate_up), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        tp: TPGroup,
        backend: AttentionBackend,
        params_dtype: torch.dtype,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        hidden = int(config.hf_config["hidden_size"])
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp, params_dtype)
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_model_len, config.hf_config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, variant, i, tp, backend, params_dtype, rotary_emb, quant_config)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(hidden, float(config.hf_config["rms_norm_eps"]), params_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = all_reduce_add_rms_norm(hidden, residual, self.norm, self.tp)
        return hidden


# checkpoint name part -> (our stacked parameter's name part, shard id); a checkpoint
# tensor named as the stacked parameter itself (Phi-3's qkv_proj, gate_up_proj) holds every
# shard, fused, and loads with shard id None
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


class CausalLM(nn.Module):
    """A decoder-only LM of the Llama family, sharded for one tensor-parallel rank."""

    model_cls: type[nn.Module] = DecoderModel  # the stack of layers under the LM head

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
        self.tie_word_embeddings = variant.tie_word_embeddings
        # the linear layers' format (embeddings, norms and the LM head stay in params_dtype)
        self.quant_config = get_quantization_config(config)
        self.model = self.model_cls(
            config, variant, tp, attn_backend, params_dtype, self.quant_config
        )
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
        Positions are read only as rows of the rotary table (a LongRoPE sequence past the
        threshold: its positions plus the threshold, see layers/rotary.py).

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
        expected = {
            name: getattr(p, "shards", None) or _shards_of(name) for name, p in params.items()
        }
        loaded: dict[str, set] = {name: set() for name in params}
        unexpected = []
        kv_scales = KVScaleLoader(self)
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name or kv_scales.load(hf_name, tensor):
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints still store it
            targets = _checkpoint_targets(hf_name, tensor)
            if targets[0][0] not in params:
                unexpected.append(hf_name)
                continue
            for name, shard_id, part in targets:
                param = params[name]
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    loader(param, part, shard_id)
                except ValueError as e:
                    raise ValueError(f"{hf_name}: {e}") from e
                loaded[name].update(expected[name] if shard_id is None else (shard_id,))
        arch = self.config.architecture
        missing = sorted(
            _checkpoint_name(name, shard, arch)
            for name, shards in expected.items()
            for shard in shards - loaded[name]
        )
        if unexpected or missing:
            raise ValueError(
                f"checkpoint does not match {self.config.architecture}: "
                f"missing weights: {missing or 'none'}; unexpected weights: {unexpected or 'none'}"
            )
        self.has_kv_scales = kv_scales.finish()
        for module in self.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


def _checkpoint_name(param_name: str, shard: object, architecture: str) -> str:
    """The checkpoint tensor that fills `shard` of our parameter `param_name`."""
    if isinstance(shard, tuple):  # (expert, part)
        return expert_checkpoint_name(param_name, shard, architecture)
    for hf_part, part, sid in _STACKED:
        if part in param_name and sid == shard:
            return param_name.replace(part, hf_part)
    return param_name


def _checkpoint_targets(hf_name: str, tensor: Loaded) -> list[tuple[str, object, Loaded]]:
    """(parameter name, shard id, tensor) for each parameter (part) the checkpoint tensor
    fills: an expert weight or the router of a sparse MLP, a stacked shard, or one parameter
    of the same name."""
    targets = moe_targets(hf_name, tensor)
    if targets is not None:
        return targets
    for hf_part, part, sid in _STACKED:
        if hf_part in hf_name:
            return [(hf_name.replace(hf_part, part), sid, tensor)]
    return [(hf_name, None, tensor)]


def _shards_of(param_name: str) -> set:
    shards = {sid for _, part, sid in _STACKED if part in param_name}
    return shards or {None}
