"""The device path of logprobs and logits processing (Triton kernels, CUDA graphs, async
scheduling) against transformers and the definitions, on a GPU. Skipped without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.frontend.test_logits_processing import penalized
from tests.hf_reference import hf_logits, parity_prompts
from tests.worker import test_gpu_runner

pytestmark = pytest.mark.gpu
small_dir = test_gpu_runner.small_dir  # the fixture: a small Qwen3 the Triton kernels take


def run(path: str, params: list[SamplingParams], **kw) -> list:
    llm = LLM(path, device="cuda", kv_cache_memory_bytes=1 << 30, **kw)
    try:
        prompts = [{"prompt_token_ids": p} for p in parity_prompts()[: len(params)]]
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
        gc.collect()
        torch.cuda.empty_cache()


def test_logprobs_on_the_device_match_transformers(small_dir: str) -> None:
    """float32: logprobs and prompt logprobs equal log_softmax of transformers' logits."""
    plain = SamplingParams(temperature=0, max_tokens=12, logprobs=5, prompt_logprobs=3)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=12, logprobs=2, ignore_eos=True)
    outs = run(small_dir, [plain, sampled, plain, SamplingParams(max_tokens=12)], dtype="float32")
    for prompt, out in zip(parity_prompts(), outs[:3], strict=False):
        c = out.outputs[0]
        ref = hf_logits(small_dir, prompt + c.token_ids).log_softmax(-1)
        for pos, (entry, token) in enumerate(zip(c.logprobs, c.token_ids, strict=True)):
            row = ref[len(prompt) - 1 + pos]
            assert next(iter(entry)) == token
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t].item()) < 2e-3
        if out.prompt_logprobs is not None:
            for pos, entry in enumerate(out.prompt_logprobs[1:]):
                assert next(iter(entry)) == prompt[pos + 1]
                for t, lp in entry.items():
                    assert abs(lp.logprob - ref[pos, t].item()) < 2e-3
    assert outs[3].outputs[0].logprobs is None


def test_bf16_logprobs_are_the_log_softmax_of_the_engines_logits(small_dir: str) -> None:
    """bfloat16: a bf16 model's logits differ from float32 transformers' by more than any
    logprob tolerance, so the kernels are checked against their own definition: the
    top-k, rank and logprob of each greedy step equal the torch log_softmax of the raw
    logits the same engine returns for the whole vocabulary (logprobs=-1, raw_logits)."""
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    outs = run(small_dir, [SamplingParams(logprobs=5, **greedy)] * 3, dtype="bfloat16")
    raw = run(
        small_dir,
        [SamplingParams(logprobs=-1, **greedy)] * 3,
        dtype="bfloat16",
        logprobs_mode="raw_logits",
        max_logprobs=-1,
    )
    for out, full in zip(outs, raw, strict=True):
        assert out.outputs[0].token_ids == full.outputs[0].token_ids
        for entry, logits_entry in zip(
            out.outputs[0].logprobs, full.outputs[0].logprobs, strict=True
        ):
            ids = torch.tensor(sorted(logits_entry))
            logits = torch.tensor([logits_entry[i].logprob for i in ids.tolist()])
            ref = dict(zip(ids.tolist(), logits.log_softmax(-1).tolist(), strict=True))
            order = sorted(ref, key=ref.get, reverse=True)
            for t, lp in entry.items():
                assert abs(lp.logprob - ref[t]) < 2e-2, (t, lp.logprob, ref[t])
                # ranks agree up to ties within the tolerance
                better = sum(v > ref[t] + 2e-2 for v in ref.values())
                assert better + 1 <= lp.rank <= 1 + sum(v > ref[t] - 2e-2 for v in ref.values())
            # greedy: the sampled token is the most likely one, up to near ties
            chosen = next(iter(entry))
            assert ref[chosen] >= ref[order[0]] - 2e-2


def test_processing_on_the_device_follows_the_definitions(small_dir: str) -> None:
    """Penalties, bias, bad tokens and allowed ids, batched with different settings per
    request, in float32 with processed logprobs: greedy tokens and logprobs as defined."""
    settings = [
        dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.3),
        dict(repetition_penalty=1.5, logit_bias={7: 2.0}),
        dict(frequency_penalty=1.0),
        dict(),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True, **s)
        for s in settings
    ]
    outs = run(small_dir, params, dtype="float32", logprobs_mode="processed_logprobs")
    for prompt, p, out in zip(parity_prompts(), params, outs, strict=False):
        tokens = out.outputs[0].token_ids
        logits = hf_logits(small_dir, prompt + tokens)[len(prompt) - 1 : -1]
        for step, (entry, row) in enumerate(zip(out.outputs[0].logprobs, logits, strict=True)):
            ref = penalized(row, prompt, tokens[:step], p).log_softmax(-1)
            for t, lp in entry.items():
                assert abs(lp.logprob - ref[t].item()) < 2e-3
    allowed = SamplingParams(temperature=1.0, max_tokens=30, allowed_token_ids=[5, 9], seed=2)
    assert set(run(small_dir, [allowed])[0].outputs[0].token_ids) <= {5, 9}
