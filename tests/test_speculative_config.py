"""vLLM's `speculative_config` on EngineArgs, LLM and the command line: what it resolves
to, and errors that name the key at fault."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from minivllm import LLM, EngineArgs
from minivllm.frontend.arg_utils import add_engine_args, engine_args_from
from tests.tiny_models import build_checkpoint


def resolve(model: str, spec: dict, **kw):
    args = EngineArgs(model=model, dtype="float32", speculative_config=spec, **kw)
    return args.create_engine_config().speculative


def test_ngram_defaults_are_vllms(qwen3_dir: str) -> None:
    spec = resolve(qwen3_dir, {"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = resolve(
        qwen3_dir, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = resolve(
        qwen3_dir, {"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2}
    )
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 2, 2)
    assert spec.num_lookahead_tokens == 0
    assert EngineArgs(model=qwen3_dir).create_engine_config().speculative is None


def test_draft_model_resolves_like_the_target(tiny_models: dict[str, str]) -> None:
    target, draft = tiny_models["qwen3"], tiny_models["qwen3-untied"]
    relative = os.path.relpath(draft)
    spec = resolve(target, {"model": relative, "num_speculative_tokens": 4}, max_model_len=256)
    assert spec.method == "draft_model"  # vLLM infers it from a model that is no n-gram
    assert spec.draft.model == os.path.abspath(draft)  # a daemon's clients run elsewhere
    assert spec.draft.max_model_len == 256 and spec.draft.dtype == "float32"
    assert spec.draft.tokenizer == target  # the target's tokenizer, whatever the draft's
    assert spec.num_lookahead_tokens == 4  # the slots its proposals write


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([], "speculative_config must be a dict"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens",
        ),
        ({"method": "ngram", "num_speculative_tokens": 17}, "from 1 to 16"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
        ),
        ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key(s) ['draft_"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {
                "method": "draft_model",
                "model": "x",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2,
            },
            "speculative_config.prompt_lookup_max applies to method 'ngram' only",
        ),
    ],
)
def test_bad_configs_name_the_key(qwen3_dir: str, spec: object, message: str) -> None:
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        EngineArgs(model=qwen3_dir, speculative_config=spec)


def test_draft_models_that_cannot_serve_are_refused(qwen3_dir: str, tmp_path) -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model: no such directory"):
        resolve(qwen3_dir, {**spec, "model": str(tmp_path / "missing")})
    other_vocab = build_checkpoint(str(tmp_path / "vocab"), "qwen3")
    with open(os.path.join(other_vocab, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(other_vocab, "config.json"), "w") as f:
        json.dump({**config, "vocab_size": 500}, f)
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft's vocabulary \(500"):
        resolve(qwen3_dir, {**spec, "model": other_vocab})
    short = build_checkpoint(str(tmp_path / "short"), "qwen3", max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"the draft's context \(64 tokens\) is shorter"):
        resolve(qwen3_dir, {**spec, "model": short}, max_model_len=128)


def test_llm_and_the_command_line_take_it(qwen3_dir: str) -> None:
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(qwen3_dir, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(
        ["--model", qwen3_dir, "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}']
    )  # fmt: skip
    spec = engine_args_from(ns).create_engine_config().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 3)
    assert parser.parse_args(["--model", qwen3_dir]).speculative_config is None
