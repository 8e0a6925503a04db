"""The model's config: its checkpoint's settings (config.json as a dict) and what the engine
resolved for it (dtype, context length, sampling defaults, quantization)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.sliding_windows import kv_sliding_window, layer_sliding_windows


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    seed: int
    load_format: str
    hf_config: dict[str, Any]  # config.json as a plain dict
    eos_token_ids: tuple[int, ...]  # from generation_config.json, else config.json
    skip_tokenizer_init: bool = False
    # decode batches sharing a cached prefix attend it once per step unless this is set
    disable_cascade_attn: bool = False
    max_logprobs: int = 20  # the most (prompt) logprobs a request may ask; -1: the vocabulary
    logprobs_mode: str = "raw_logprobs"  # what logprobs hold: one of config.LOGPROBS_MODES
    # where the sampling defaults come from ("auto", "vllm" or a directory), and those
    # defaults: SamplingParams fields the model's generation config sets (generation_defaults.py)
    generation_config: str = "auto"
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # the linear layers' quantization method (one of LINEAR_QUANTIZATION_METHODS), from the
    # checkpoint's quantization_config, else online fp8; None: the weights are in `dtype`
    # (a GGUF file's too: dequantized at load)
    quantization: str | None = None
    # frontend: a streamed request's outputs carry this many new tokens each, the first and
    # the last excepted (vLLM's --stream-interval; a request's own stream_interval may raise it)
    stream_interval: int = 1

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or [""]
        return archs[0]

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        hd = self.hf_config.get("head_dim")
        return int(hd) if hd else int(self.hf_config["hidden_size"]) // self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, None where it sees the whole context."""
        return layer_sliding_windows(self.hf_config, self.num_layers, self.max_model_len)

    @property
    def kv_sliding_window(self) -> int | None:
        """Set when every layer attends over a window: the KV blocks behind the largest are
        read by no layer and go back to the pool (engine_core/kv_cache_manager.py)."""
        return kv_sliding_window(self.sliding_windows)

    @property
    def num_experts(self) -> int:
        """Routed experts of each sparse MLP (Qwen3-MoE's num_experts, Mixtral's
        num_local_experts); 0 for a dense model."""
        hf = self.hf_config
        return int(hf.get("num_experts") or hf.get("num_local_experts") or 0)

    @property
    def num_experts_per_tok(self) -> int:
        return int(self.hf_config.get("num_experts_per_tok") or 0)

    @property
    def moe_intermediate_size(self) -> int:
        """Each expert's intermediate size (Mixtral's experts have the dense one)."""
        hf = self.hf_config
        return int(hf.get("moe_intermediate_size") or hf["intermediate_size"])

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a sparse MLP: every decoder_sparse_step-th layer
        (1: all) except those in mlp_only_layers (Qwen3-MoE's knobs; Mixtral sets neither)."""
        hf = self.hf_config
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = hf.get("mlp_only_layers") or ()
        return self.num_experts > 0 and layer_idx not in dense and (layer_idx + 1) % step == 0


def check_moe_sharding(model: ModelConfig, tp: int, expert_parallel: bool) -> None:
    """A mixture of experts splits over the ranks by whole experts (expert parallelism) or
    by each expert's intermediate dimension: either must divide evenly."""
    if not model.num_experts or tp == 1:
        return
    if expert_parallel and model.num_experts % tp:
        raise ValueError(
            f"enable_expert_parallel: tensor_parallel_size ({tp}) must divide the number of "
            f"experts ({model.num_experts})"
        )
    if not expert_parallel and model.moe_intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size ({tp}) must divide the experts' intermediate size "
            f"({model.moe_intermediate_size}); enable_expert_parallel places whole experts "
            "instead"
        )
