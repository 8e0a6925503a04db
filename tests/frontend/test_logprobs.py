"""Logprobs and prompt logprobs in vLLM's shape, equal to transformers' log_softmax.

Each position is a dict holding the chosen token first (with its rank: how many tokens have
a logprob at least as high) and then the top-k with ranks 1..k, as vLLM returns it.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, Logprob, SamplingParams
from tests.hf_reference import hf_logits, parity_prompts

TOL = 1e-4


@pytest.fixture(scope="module")
def llm(qwen3_dir: str):
    llm = LLM(qwen3_dir, dtype="float32", distributed_executor_backend="uni")
    yield llm
    llm.shutdown()


def check_positions(entries, ref_logits: torch.Tensor, chosen: list[int], k: int, tok) -> None:
    """entries: one dict per position; ref_logits: transformers' logits of those positions."""
    assert len(entries) == len(chosen) == len(ref_logits)
    for entry, logits, token in zip(entries, ref_logits, chosen, strict=True):
        ref = logits.log_softmax(-1)
        top = ref.topk(k).indices.tolist()
        assert list(entry) == list(dict.fromkeys([token, *top]))  # the chosen token first
        assert all(isinstance(v, Logprob) for v in entry.values())
        for t, lp in entry.items():
            assert abs(lp.logprob - ref[t].item()) < TOL
            text = tok.decode([t])
            if not text.endswith("\ufffd"):  # else completed with the tokens before, as vLLM
                assert lp.decoded_token == text
        for rank, t in enumerate(top, 1):
            assert entry[t].rank == rank
        if token not in top:
            assert entry[token].rank == int((ref >= ref[token]).sum())


def test_logprobs_and_prompt_logprobs_equal_transformers(llm: LLM, qwen3_dir: str) -> None:
    prompts = parity_prompts()[:4]
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=2, ignore_eos=True)
    params = [greedy, sampled, greedy, sampled]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, param, out in zip(prompts, params, outs, strict=True):
        completion = out.outputs[0]
        seq = prompt + completion.token_ids
        logits = hf_logits(qwen3_dir, seq)
        outputs_ref = logits[len(prompt) - 1 : len(seq) - 1]
        check_positions(completion.logprobs, outputs_ref, completion.token_ids, param.logprobs, tok)
        chosen = outputs_ref.log_softmax(-1).gather(1, torch.tensor(completion.token_ids)[:, None])
        assert abs(completion.cumulative_logprob - chosen.sum().item()) < 1e-3
        if param.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            ref = logits[: len(prompt) - 1]
            check_positions(out.prompt_logprobs[1:], ref, prompt[1:], param.prompt_logprobs, tok)


def test_logprobs_zero_and_the_whole_vocabulary(qwen3_dir: str) -> None:
    llm = LLM(qwen3_dir, dtype="float32", distributed_executor_backend="uni", max_logprobs=-1)
    try:
        prompt = parity_prompts()[0]
        params = SamplingParams(temperature=0, max_tokens=2, logprobs=0, prompt_logprobs=-1)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert all(len(entry) == 1 for entry in out.outputs[0].logprobs)  # only the sampled one
    vocab = hf_logits(qwen3_dir, prompt).shape[-1]
    assert all(len(entry) == vocab for entry in out.prompt_logprobs[1:])
    ranks = sorted(lp.rank for t, lp in out.prompt_logprobs[1].items() if t != prompt[1])
    assert ranks[:3] == [1, 2, 3]


def test_requests_without_logprobs_get_none(llm: LLM) -> None:
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_n_completions_each_carry_their_logprobs(llm: LLM, qwen3_dir: str) -> None:
    prompt = parity_prompts()[1]
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5, logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert [next(iter(e)) for e in c.logprobs] == c.token_ids
        ref = hf_logits(qwen3_dir, prompt + c.token_ids)[len(prompt) - 1 : -1].log_softmax(-1)
        expected = ref.gather(1, torch.tensor(c.token_ids)[:, None]).sum().item()
        assert abs(c.cumulative_logprob - expected) < 1e-3


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param(dict(max_num_batched_tokens=16), id="chunked-prefill"),
        pytest.param(
            dict(num_gpu_blocks_override=24, block_size=4, max_model_len=96), id="preemption"
        ),
    ],
)
def test_prompt_logprobs_survive_chunks_prefix_hits_and_preemption(
    qwen3_dir: str, engine_kwargs: dict
) -> None:
    """A chunked prompt's logprobs arrive whole; a prompt whose prefix is cached still has
    every position (it is recomputed); a preempted request's arrive once."""
    prompts = parity_prompts()
    llm = LLM(qwen3_dir, dtype="float32", distributed_executor_backend="uni", **engine_kwargs)
    try:
        warm = llm.generate({"prompt_token_ids": prompts[6]}, SamplingParams(max_tokens=1))
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.core.stats()
    finally:
        llm.shutdown()
    assert warm[0].outputs[0].token_ids
    if "num_gpu_blocks_override" in engine_kwargs:
        assert stats["num_preemptions"] >= 1
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        seq = prompt + out.outputs[0].token_ids
        logits = hf_logits(qwen3_dir, seq)
        assert out.num_cached_tokens == 0
        check_positions(out.prompt_logprobs[1:], logits[: len(prompt) - 1], prompt[1:], 2, tok)
        completion = out.outputs[0]
        check_positions(
            completion.logprobs, logits[len(prompt) - 1 : -1], completion.token_ids, 2, tok
        )
