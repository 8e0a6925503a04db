"""An EngineConfig crosses process boundaries as msgpack (a Ray worker's config does): every
kind of config decodes to what was encoded, a draft model's included."""

from __future__ import annotations

import msgspec
import pytest

from minivllm.config import EngineArgs, EngineConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("spec", [None, "ngram", "draft"])
def test_engine_config_survives_msgpack(qwen3_dir: str, spec: str | None) -> None:
    speculative = {"ngram": NGRAM, "draft": {"model": qwen3_dir, "num_speculative_tokens": 2}}
    args = EngineArgs(model=qwen3_dir, speculative_config=speculative.get(spec or ""))
    config = args.create_engine_config()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert decoded == config
    if spec == "draft":
        assert decoded.speculative.draft.model == qwen3_dir
