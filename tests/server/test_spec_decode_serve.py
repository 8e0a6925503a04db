"""`minivllm serve --speculative-config JSON`: completions with n-gram speculation give
transformers' greedy tokens, and /metrics exports vLLM's spec-decode counters."""

from __future__ import annotations

import json
import re

import httpx

from minivllm.frontend.server.launch import ServerProcess
from tests.engine_core.test_spec_decode import loop_prompts
from tests.hf_reference import hf_greedy
from tests.server.conftest import server_env, stop_cleanly

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


def test_serve_with_ngram_speculation(qwen3_dir: str, tmp_path) -> None:
    prompts = loop_prompts()[:3]
    expected = hf_greedy(qwen3_dir, prompts, 16)
    argv = [qwen3_dir, "--dtype", "float32", "--served-model-name", "m"]
    argv += ["--speculative-config", json.dumps(NGRAM)]
    server = ServerProcess(argv, str(tmp_path / "server.log"), server_env(), startup_timeout=120)
    try:
        got = []
        for prompt in prompts:
            body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        stop_cleanly(server)
    assert got == expected
    drafts = re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert drafts is not None and float(drafts.group(1)) > 0, metrics
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{" in metrics
    assert 'position="2"' in metrics
