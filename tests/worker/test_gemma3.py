"""Gemma 3 against transformers' Gemma3ForCausalLM (fp32, CPU): logits of prompts longer than
its 8-token window, over a prefill and decode steps; what its config may ask that is refused."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from minivllm.config import EngineArgs, ModelConfig
from minivllm.worker.attention.cpu_attention import CpuAttentionBackend
from minivllm.worker.attention.torch_attention import TorchAttentionBackend
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.model_loader import load_model
from tests.worker.test_models import BLOCKS, build_step, new_kv_caches


def model_config(path: str, **overrides) -> ModelConfig:
    args = EngineArgs(model=path, dtype="float32", device="cpu", **overrides)
    return args.create_engine_config().model


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend])
@pytest.mark.parametrize("name", ["gemma3", "gemma3-pattern"])
def test_prefill_and_decode_logits_match_transformers(
    window_models: dict[str, str], name: str, backend: type
) -> None:
    path = window_models[name]
    config = model_config(path)
    assert None in config.sliding_windows and 8 in config.sliding_windows
    model = load_model(config, torch.device("cpu"), TPGroup(), backend())
    hf = _hf(path)
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (13, 19, 11)]
    kv = new_kv_caches(config)
    # a prefill of the first 10 (or all) tokens, then a chunk and decodes of one token
    cuts = [10, 19, 3]
    seqs = [(BLOCKS[i], 0, t[:c]) for i, (t, c) in enumerate(zip(tokens, cuts, strict=True))]
    steps = [seqs]
    steps.append([(BLOCKS[0], 10, tokens[0][10:11]), (BLOCKS[2], 3, tokens[2][3:])])
    steps.append([(BLOCKS[0], 11, tokens[0][11:12])])
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    for step in steps:
        input_ids, positions, meta = build_step(step)
        with torch.no_grad():
            logits = model.compute_logits(model(input_ids, positions, kv, meta))
        bounds = meta.query_start_loc.tolist()
        for (blocks, _, _), a, b in zip(step, bounds[:-1], bounds[1:], strict=True):
            got[BLOCKS.index(blocks)].append(logits[a:b])
    for i, t in enumerate(tokens):
        mine = torch.cat(got[i])
        with torch.no_grad():
            want = hf(torch.tensor([t[: len(mine)]])).logits[0]
        torch.testing.assert_close(mine, want, atol=1e-4, rtol=1e-4, msg=f"sequence {i}")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden activation 'gelu' is not supported"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            "layer_types \\['chunked_attention'\\] are not supported",
        ),
    ],
)
def test_what_it_cannot_serve_is_refused_by_name(
    window_models: dict[str, str], tmp_path, change: dict, message: str
) -> None:
    for name in os.listdir(window_models["gemma3"]):
        shutil.copy(os.path.join(window_models["gemma3"], name), tmp_path / name)
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**hf, **change}, f)
    with pytest.raises(ValueError, match=message):
        config = model_config(str(tmp_path))
        load_model(config, torch.device("cpu"), TPGroup(), TorchAttentionBackend())


def test_dummy_weights_load_and_give_finite_logits(window_models: dict[str, str]) -> None:
    config = dataclasses.replace(
        model_config(window_models["gemma3"], load_format="dummy"), dtype="bfloat16"
    )
    model = load_model(config, torch.device("cpu"), TPGroup(), TorchAttentionBackend())
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]
    assert len(norms) == 3 * 6 + 1 and all(not p.any() for p in norms)  # Gemma's offset 0
    input_ids, positions, meta = build_step([(BLOCKS[0], 0, list(range(1, 12)))])
    kv = [c.bfloat16() for c in new_kv_caches(config)]
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, positions, kv, meta))
    assert torch.isfinite(logits).all() and logits.shape == (11, config.vocab_size)


def test_text_model_defaults_are_transformers() -> None:
    """What a Hub config of Gemma3ForConditionalGeneration leaves out of its text_config."""
    from transformers import Gemma3TextConfig

    from minivllm.language_model_config import GEMMA3_TEXT_DEFAULTS as ours

    hf = Gemma3TextConfig().to_dict()
    rope = hf["rope_parameters"]
    theirs = {
        **hf,
        "rope_theta": rope["full_attention"]["rope_theta"],
        "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
        "sliding_window_pattern": hf["_sliding_window_pattern"],
    }
    assert {k: theirs[k] for k in ours} == ours
