"""Gemma 3 (text): the Llama family's attention and MLP (llama_family.py) in Gemma's block.

What sets it apart, as transformers' Gemma3ForCausalLM computes it:
- four RMSNorms per layer, all Gemma's (the weight stored as its offset from 1, the product
  in float32): before attention (input), after it (post-attention), before the MLP
  (pre-feedforward) and after it (post-feedforward). A block's output is normed before it
  joins the residual stream, so each residual add sits between two norms: the output's and
  the next block's input's, one op (`layers.fused.norm_add_norm`) that also sums the output
  over the TP ranks;
- interleaved layers: the sliding ones attend over `sliding_window` tokens with the local
  RoPE base (`rope_local_base_freq`), the others (every sixth, or as `layer_types` says) the
  whole context with the global base and its scaling (sliding_windows.py);
- per-head q/k norm; the attention scale query_pre_attn_scalar ** -1/2; a GELU-tanh MLP;
- embeddings times sqrt(hidden_size) rounded to the model's dtype; tied LM head by default,
  and the logits soft-capped where `final_logit_softcapping` is set.

Every layer shares one block table, so a global layer keeps every KV block of a sequence: no
block goes back to the pool behind the sliding layers' window (kv_cache_manager.py).

`Gemma3ForConditionalGeneration` (4B and larger: a vision tower beside the text model) is
served as its text model, for text prompts: its config is flattened by
language_model_config.py, its language model's weights are read under their names in
either layout, the vision tower's and the projector's left unread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.rope_config import GLOBAL_LAYER_TYPE
from minivllm.sliding_windows import sliding_layers
from minivllm.worker.attention.backend import AttentionBackend
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.layers.embedding import VocabParallelEmbedding
from minivllm.worker.layers.fused import norm_add_norm
from minivllm.worker.layers.norm import GemmaRMSNorm
from minivllm.worker.layers.quantization import QuantizationConfig
from minivllm.worker.layers.rotary import RotaryEmbedding
from minivllm.worker.layers.weights import Loaded
from minivllm.worker.models.llama_family import MLP, Attention, CausalLM, DecoderVariant

# transformers' RoPE bases for Gemma 3 where config.json leaves them out: the global
# layers' and the local (sliding) layers'
_ROPE_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}


class Gemma3DecoderLayer(nn.Module):
    """Attention and MLP between Gemma's four norms; the input norm and the post-feedforward
    norm run in the ops around the layer (see `Gemma3Model.forward`)."""

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
        self.mlp = MLP(config, variant, tp, params_dtype, layer_idx, quant_config)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, params_dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, params_dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, params_dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, params_dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the layer's input, normed (input_layernorm); residual: the stream. Returns the
        MLP's output before its norm (under TP this rank's partial sum) and the stream."""
        attn, mlp = self.self_attn, self.mlp
        hidden = attn(positions, attn.qkv_proj(x))
        x, residual = norm_add_norm(
            hidden, residual, self.post_attention_layernorm, self.pre_feedforward_layernorm,
            self.tp,
        )  # fmt: skip
        return mlp(mlp.gate_up_proj(x)), residual


class Gemma3Model(nn.Module):
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
        hf = config.hf_config
        hidden, eps = int(hf["hidden_size"]), float(hf["rms_norm_eps"])
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp, params_dtype)
        # as transformers does: sqrt(hidden) rounded to the weights' dtype (55.43 -> 55.5)
        self.embed_scale = float(torch.tensor(hidden**0.5, dtype=params_dtype))
        # each from rope_parameters per layer type (transformers 5), or from the older
        # top-level rope_theta + rope_scaling (global) and rope_local_base_freq (local)
        rope_hf = {**_ROPE_DEFAULTS, **hf}
        global_rope, local_rope = (
            RotaryEmbedding(config.head_dim, config.max_model_len, rope_hf, layer_type)
            for layer_type in (GLOBAL_LAYER_TYPE, "sliding_attention")
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config,
                variant,
                i,
                tp,
                backend,
                params_dtype,
                local_rope if sliding else global_rope,
                quant_config,
            )
            for i, sliding in enumerate(sliding_layers(hf, config.num_layers))
        )
        self.norm = GemmaRMSNorm(hidden, eps, params_dtype)
        # the norm each layer's output goes through after joining the stream: the next
        # layer's input norm, the final norm after the last (plain list: not submodules)
        self._next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual = self.embed_tokens(input_ids) * self.embed_scale
        x, residual = norm_add_norm(residual, None, None, self.layers[0].input_layernorm, self.tp)
        for layer, next_norm in zip(self.layers, self._next_norms, strict=True):
            out, residual = layer(positions, x, residual)
            x, residual = norm_add_norm(
                out, residual, layer.post_feedforward_layernorm, next_norm, self.tp
            )
        return x


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3's text model, sharded for one tensor-parallel rank (weights as HF names them)."""

    model_cls = Gemma3Model

    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        tp: TPGroup,
        attn_backend: AttentionBackend,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(config, variant, tp, attn_backend, params_dtype)
        self.final_logit_softcapping = variant.final_logit_softcapping

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As `CausalLM.compute_logits`, then cap * tanh(logits / cap) where the model caps."""
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# the language model's weights in a multimodal checkpoint: as Google wrote them, as
# transformers >= 4.52 names them in memory (and some checkpoints on disk)
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a Gemma 3 checkpoint with a vision tower, for text prompts."""

    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """As `CausalLM.load_weights`, the language model's weights renamed to the text
        model's names; the vision tower's and the projector's are not read."""
        super().load_weights(_language_model_weights(weights))


def _language_model_weights(
    weights: Iterable[tuple[str, Loaded]],
) -> Iterator[tuple[str, Loaded]]:
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix) :]
                break
        yield name, tensor
