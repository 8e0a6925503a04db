"""RoPE scaling: our cos/sin tables against transformers' frequencies and attention factor for
every supported kind, config.json's layouts, the context length each kind gives, and the
errors a user meets (an unknown kind), and Phi-3's sliding window on every layer; the torch
rotation of a partial rotary against transformers' Phi-3, and llama3's table against its."""

from __future__ import annotations

import pytest
import torch

from minivllm.config import EngineArgs
from minivllm.rope_config import SUPPORTED_ROPE_TYPES, long_rope_threshold, rope_parameters
from minivllm.worker.layers.rotary import RotaryEmbedding
from minivllm.worker.ops import rotary

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

POSITIONS = torch.tensor([0, 1, 7, 31, 32, 63, 100, 255])


def hf_rows(config, rope_type: str, positions: torch.Tensor, seq_len: int | None = None):
    """transformers' cos|sin rows, its attention factor applied as its rotary module does
    (dynamic: its frequencies for a sequence within max_position_embeddings)."""
    init = rope_utils.ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention = init(config, "cpu", seq_len=seq_len)
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    return torch.cat([freqs.cos() * attention, freqs.sin() * attention], dim=-1)


def config_dict(config) -> dict:
    """config.json as save_pretrained writes it."""
    return config.to_dict()


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
SCALINGS = [
    pytest.param(YARN, id="yarn"),
    pytest.param({**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False}, id="yarn-betas"),
    pytest.param({**YARN, "attention_factor": 1.3}, id="yarn-attention-factor"),
    pytest.param({**YARN, "mscale": 1.0, "mscale_all_dim": 0.5}, id="yarn-mscale"),
    pytest.param({"rope_type": "linear", "factor": 2.0}, id="linear"),
    pytest.param({"rope_type": "dynamic", "factor": 2.0}, id="dynamic"),
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_scaled_tables_match_transformers(scaling: dict) -> None:
    config = transformers.Qwen3Config(
        head_dim=16, hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )  # fmt: skip
    ours = RotaryEmbedding(16, 256, config_dict(config))
    expected = hf_rows(config, scaling["rope_type"], POSITIONS)
    torch.testing.assert_close(ours.cos_sin_cache[POSITIONS], expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_rows_switch_at_the_original_length(partial: float) -> None:
    """Phi-3's LongRoPE table: its short factors' rows for [0, original), then the long
    factors' rows for every position, which a longer sequence reads at position + original.
    Each set equals transformers' for sequences below and past the original length, with
    its attention factor, over the rotary part of a partially rotated head."""
    from tests.tiny_models import longrope_scaling

    rot = int(32 * partial)
    config = transformers.Phi3Config(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=256,
        original_max_position_embeddings=64, partial_rotary_factor=partial,
        rope_parameters={"rope_theta": 10000.0, **longrope_scaling(rot, seed=1)},
    )  # fmt: skip
    ours = RotaryEmbedding(32, 256, config_dict(config))
    assert ours.rotary_dim == rot and ours.cos_sin_cache.shape == (64 + 256, rot)
    short = POSITIONS[POSITIONS < 64]
    torch.testing.assert_close(ours.cos_sin_cache[short], hf_rows(config, "longrope", short, 64))
    torch.testing.assert_close(
        ours.cos_sin_cache[POSITIONS + 64], hf_rows(config, "longrope", POSITIONS, 65)
    )
    # an engine that runs no sequence past the original length holds the short rows only
    assert RotaryEmbedding(32, 64, config_dict(config)).cos_sin_cache.shape == (64, rot)


def test_config_layouts_and_phi3_spellings() -> None:
    """transformers 5's rope_parameters and the older top-level rope_theta + rope_scaling
    (with "type") read alike; Phi-3's "su" is LongRoPE, its top-level
    original_max_position_embeddings wins, and the factor defaults to the lengths' ratio."""
    new = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0}}
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 2.0}}
    for layout in (new, old):
        params = rope_parameters({"max_position_embeddings": 512, **layout})
        assert params["rope_type"] == "yarn" and params["rope_theta"] == 5e5
        assert params["original_max_position_embeddings"] == 512  # none given: the max length
    # an override of rope_scaling (vLLM's way to turn YaRN on) over transformers 5's layout
    saved = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    params = rope_parameters({**saved, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert params["rope_type"] == "yarn" and params["rope_theta"] == 5e5
    phi3 = {
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 1024,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0],
                         "original_max_position_embeddings": 9},
    }  # fmt: skip
    params = rope_parameters(phi3)
    assert params["rope_type"] == "longrope" and params["partial_rotary_factor"] == 0.5
    assert params["original_max_position_embeddings"] == 1024 and params["factor"] == 4.0
    assert long_rope_threshold(phi3, 4096) == 1024
    assert long_rope_threshold(phi3, 1024) is None  # no sequence can pass the switch
    with pytest.raises(ValueError, match="'longrope' needs long_factor"):
        rope_parameters({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}})


_GEMMA3_ROPE_LAYOUTS = {
    "nested": {
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    },
    # Gemma 3 before transformers 5: the global layers' settings at the top level
    "top-level": {
        "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0,
    },
}


@pytest.mark.parametrize("layout", list(_GEMMA3_ROPE_LAYOUTS))
def test_settings_per_layer_type(layout: str) -> None:
    """Gemma 3's sliding and full-attention layers rotate differently: transformers 5 nests
    rope_parameters by layer type, older configs give the global layers' rope_theta and
    rope_scaling and the sliding layers' rope_local_base_freq. Each layer type's rotary reads
    its own; none named is refused rather than guessed."""
    hf = {"max_position_embeddings": 256, **_GEMMA3_ROPE_LAYOUTS[layout]}
    local = RotaryEmbedding(16, 256, hf, "sliding_attention").cos_sin_cache
    torch.testing.assert_close(local, RotaryEmbedding(16, 256, {"rope_theta": 1e4}).cos_sin_cache)
    full = RotaryEmbedding(16, 256, hf, "full_attention").cos_sin_cache
    scaled = {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6}
    torch.testing.assert_close(full, RotaryEmbedding(16, 256, scaled).cos_sin_cache)
    with pytest.raises(ValueError, match="per layer type .*sliding_attention, full_attention"):
        RotaryEmbedding(16, 256, hf)
    assert config_dict(transformers.Gemma3TextConfig(**hf))["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }  # as transformers reads either layout
    # the scaled length is max_position_embeddings already: not scaled again
    from minivllm.rope_config import max_len_with_scaling

    assert max_len_with_scaling(hf) == 256


def test_unknown_rope_type_is_refused_naming_the_supported_ones(
    tiny_models: dict[str, str],
) -> None:
    args = EngineArgs(
        model=tiny_models["llama"], device="cpu", hf_overrides={"rope_scaling": {"type": "ntk"}}
    )
    with pytest.raises(ValueError) as info:
        args.create_engine_config()
    message = str(info.value)
    assert "rope type 'ntk'" in message
    assert all(kind in message for kind in SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize(
    ("model", "longest"),
    [("qwen3-yarn", 128), ("llama-linear", 128), ("llama-dynamic", 128), ("phi3-longrope", 256)],
)
def test_scaling_sets_the_longest_context(
    tiny_models: dict[str, str], model: str, longest: int
) -> None:
    """YaRN: its original length (32) times its factor; linear: max_position_embeddings (64)
    times its factor; dynamic NTK and LongRoPE: max_position_embeddings (128; 256)."""
    config = EngineArgs(model=tiny_models[model], device="cpu").create_engine_config()
    assert config.model.max_model_len == longest
    threshold = config.scheduler.long_rope_threshold
    assert threshold == (64 if model == "phi3-longrope" else None)
    with pytest.raises(ValueError, match=f"larger than the model's .*\\({longest}\\)"):
        EngineArgs(model=tiny_models[model], max_model_len=longest + 1).create_engine_config()


def test_phi3_sliding_window_is_a_window_on_every_layer(tiny_models: dict[str, str]) -> None:
    """Phi-3-mini-4k sets a window of 2047: every layer attends over it, as transformers
    does, at any max_model_len (the blocks behind it go back to the pool); a window no
    sequence outgrows masks nothing."""

    def model_config(**kwargs):
        args = EngineArgs(model=tiny_models["phi3"], device="cpu", **kwargs)
        return args.create_engine_config().model

    windowed = model_config(hf_overrides={"sliding_window": 100})
    assert windowed.max_model_len == 512
    assert windowed.sliding_windows == (100,) * windowed.num_layers
    assert windowed.kv_sliding_window == 100
    within = model_config(hf_overrides={"sliding_window": 100}, max_model_len=100)
    assert within.sliding_windows == (None,) * within.num_layers
    assert model_config().kv_sliding_window is None  # its 512, max_model_len 512


def test_partial_rotary_matches_transformers() -> None:
    """The torch path against transformers' Phi-3 rotation: the first rotary dims of each
    head rotate (rotate_half within them), the rest pass through."""
    phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    gen = torch.Generator().manual_seed(9)
    t, d, rot = 5, 24, 18
    q, k = torch.randn(t, 4, d, generator=gen), torch.randn(t, 2, d, generator=gen)
    positions = torch.tensor([0, 3, 17, 40, 63])
    cos_sin = rotary.build_cos_sin_cache(64, rot, 10000.0, torch.float32, "cpu")
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    # transformers: [batch, heads, tokens, dim], cos/sin [batch, tokens, rot] (halves repeated)
    ref_q, ref_k = phi3.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None],
        torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None],
    )  # fmt: skip
    rotary.qk_norm_rope_torch(q, k, None, None, cos_sin, positions, 0.0, False)
    torch.testing.assert_close(q, ref_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, ref_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_llama3_rope_matches_transformers() -> None:
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(head_dim=128, hidden_size=4096, num_attention_heads=32)
    config.rope_parameters = {"rope_theta": 500000.0, **scaling}
    inv_freq, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    cache = rotary.build_cos_sin_cache(16384, 128, 500000.0, torch.float32, "cpu", scaling)
    pos = torch.tensor([0, 1, 1000, 16383])
    freqs = pos[:, None].float() * inv_freq[None, :].float()
    torch.testing.assert_close(cache[pos], torch.cat([freqs.cos(), freqs.sin()], -1))
