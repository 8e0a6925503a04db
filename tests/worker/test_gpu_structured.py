"""Structured outputs on a GPU: the bitmask staged through pinned memory, applied by the
Triton kernel inside steps that replay CUDA graphs, with async scheduling; every output
follows its grammar and the free requests beside them sample what they sample alone.
Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.structured_cases import check_text, constraints, grammar_accepts
from tests.tiny_models import VOCAB_SIZE
from tests.worker import test_gpu_runner

pytestmark = pytest.mark.gpu
small_dir = test_gpu_runner.small_dir  # the fixture: a small Qwen3 the Triton kernels take


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_structured_outputs_on_the_device(small_dir: str, dtype: str) -> None:
    llm = LLM(small_dir, device="cuda", dtype=dtype, kv_cache_memory_bytes=1 << 30)
    try:
        free = [
            SamplingParams(temperature=1.0, seed=50 + i, max_tokens=32, ignore_eos=True)
            for i in range(4)
        ]
        prompts = [f"Free text {i}" for i in range(4)]
        alone = llm.generate(prompts, free, use_tqdm=False)
        kinds = list(constraints().items()) * 8
        constrained = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs=so)
            for i, (_, so) in enumerate(kinds)
        ]
        outs = llm.generate(prompts + ["Hello"] * len(kinds), free + constrained, use_tqdm=False)
    finally:
        llm.shutdown()
        gc.collect()
        torch.cuda.empty_cache()
    if dtype == "float32":  # bf16 logits may differ in the last bit with the batch's shape
        for want, got in zip(alone, outs, strict=False):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
    finished = 0
    for (kind, so), out in zip(kinds, outs[4:], strict=True):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            check_text(kind, c.text)
            finished += 1
        else:  # cut by max_tokens inside the structure: a valid prefix
            assert c.finish_reason == "length" and grammar_accepts(
                small_dir, VOCAB_SIZE, so, c.token_ids
            )
    assert finished >= len(kinds) // 2
