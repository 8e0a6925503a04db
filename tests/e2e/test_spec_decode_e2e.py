"""Speculative decoding across processes: `LLM` and `AsyncLLM` with worker processes (stop
strings, streams), an engine-core daemon started with `--speculative-config`, tensor
parallelism over gloo, and the real SmolLM2-135M-Instruct copying a text (n-gram drafts, and
a draft model of its first layers); the tokens are those without speculation (transformers'
greedy ones, or the same engine's)."""

from __future__ import annotations

import json
import os

import pytest
import uvloop

from minivllm import LLM, AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from minivllm.frontend.clients.mp_client import SyncMPClient
from minivllm.protocol.messages import UtilityMethod
from tests.e2e.daemon import Daemon
from tests.engine_core.test_spec_decode import loop_prompts
from tests.gguf_files import smollm2_gguf
from tests.hf_reference import hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
GREEDY_FIELDS = dict(temperature=0, max_tokens=20, ignore_eos=True)
GREEDY = SamplingParams(**GREEDY_FIELDS)


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_llm_stop_strings_as_without_speculation(qwen3_dir: str) -> None:
    """Over worker processes: the same texts, ids and stop reasons, with stop strings that
    steps of several tokens may complete in their middle."""
    prompts = token_prompts(loop_prompts())
    plain = LLM(qwen3_dir, dtype="float32")
    try:
        base = plain.generate(prompts, GREEDY, use_tqdm=False)
        tokenizer, stopping = plain.get_tokenizer(), []
        for out in base:  # stop at the text of each output's 9th and 10th tokens
            ids = list(out.outputs[0].token_ids)
            piece = tokenizer.decode(ids[:10])[len(tokenizer.decode(ids[:8])) :]
            stopping.append(SamplingParams(**GREEDY_FIELDS, stop=[piece] if piece else None))
        expected = plain.generate(prompts, stopping, use_tqdm=False)
    finally:
        plain.shutdown()
    spec = LLM(qwen3_dir, dtype="float32", speculative_config=NGRAM)
    try:
        outs = spec.generate(prompts, GREEDY, use_tqdm=False)
        stopped = spec.generate(prompts, stopping, use_tqdm=False)
        stats = spec.llm_engine.get_stats()
    finally:
        spec.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in base]
    assert stats["spec_num_accepted_tokens"] > 0
    assert sum(o.outputs[0].stop_reason is not None for o in expected) >= 3
    for got, want in zip(stopped, expected, strict=True):
        g, w = got.outputs[0], want.outputs[0]
        assert (g.text, list(g.token_ids), g.finish_reason, g.stop_reason) == (
            w.text, list(w.token_ids), w.finish_reason, w.stop_reason,
        )  # fmt: skip


def test_async_llm_streams_several_tokens_a_step(qwen3_dir: str) -> None:
    prompts = loop_prompts()[:3]
    expected = hf_greedy(qwen3_dir, prompts, 20)
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=qwen3_dir, dtype="float32", speculative_config=NGRAM)
    )
    params = SamplingParams(**GREEDY_FIELDS, output_kind=RequestOutputKind.DELTA)

    async def one(i: int) -> tuple[list[int], int]:
        tokens, most = [], 0
        async for out in llm.generate({"prompt_token_ids": prompts[i]}, params, f"r{i}"):
            new = out.outputs[0].token_ids
            tokens += new
            most = max(most, len(new))
        return tokens, most

    async def main():
        import asyncio

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        results = uvloop.run(main())
    finally:
        llm.shutdown()
    assert [tokens for tokens, _ in results] == expected
    assert max(most for _, most in results) > 1  # a verification's tokens came at once


def test_daemon_started_with_a_speculative_config(tiny_models: dict[str, str], tmp_path) -> None:
    path, draft = tiny_models["qwen3"], tiny_models["qwen3-untied"]
    prompts = loop_prompts()[:4]
    expected = hf_greedy(path, prompts, 20)
    spec = {"model": os.path.relpath(draft), "num_speculative_tokens": 2}  # relative: resolved
    daemon = Daemon(
        path, f"ipc://{tmp_path}/engine", str(tmp_path / "daemon.log"),
        "--dtype", "float32", "--speculative-config", json.dumps(spec),
    )  # fmt: skip
    try:
        daemon.wait_listening()
        llm = LLM.connect(daemon.address)
        try:
            outs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        client = SyncMPClient.connect(daemon.address)
        try:
            stats = client.call_utility(UtilityMethod.STATS)
        finally:
            client.shutdown()
    finally:
        daemon.stop()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert stats["spec_num_draft_tokens"] > 0
    assert "speculative decoding draft_model (k=2)" in daemon.log()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tensor_parallel_over_gloo(tiny_models: dict[str, str], method: str) -> None:
    path = tiny_models["qwen3"]
    prompts = loop_prompts()[:4]
    expected = hf_greedy(path, prompts, 20)
    spec = NGRAM
    if method == "draft_model":  # the draft is sharded over the same ranks
        spec = {"model": tiny_models["qwen3-untied"], "num_speculative_tokens": 2}
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, speculative_config=spec)
    try:
        outs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert stats["spec_num_draft_tokens"] > 0


def test_two_engine_cores_add_up_their_counters(qwen3_dir: str) -> None:
    """Data parallelism: AsyncLLM's stream over two engine-cores that speculate, whose
    stats (per draft position too) add up to one engine's."""
    prompts = loop_prompts()[:6]
    expected = hf_greedy(qwen3_dir, prompts, 20)
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=qwen3_dir, dtype="float32", data_parallel_size=2, speculative_config=NGRAM)
    )

    async def one(i: int) -> list[int]:
        tokens: list[int] = []
        async for out in llm.generate({"prompt_token_ids": prompts[i]}, GREEDY, f"r{i}"):
            tokens = list(out.outputs[0].token_ids)
        return tokens

    async def main():
        import asyncio

        tokens = await asyncio.wait_for(asyncio.gather(*map(one, range(len(prompts)))), 240)
        return tokens, await llm.client.call_utility_async(UtilityMethod.STATS)

    try:
        got, stats = uvloop.run(main())
        balance = llm.client.balance()
    finally:
        llm.shutdown()
    assert got == expected
    assert all(b["requests"] > 0 for b in balance)  # both cores served
    per_pos = stats["spec_num_accepted_tokens_per_pos"]
    assert len(per_pos) == NGRAM["num_speculative_tokens"]
    assert sum(per_pos) == stats["spec_num_accepted_tokens"] > 0


TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores the keys and values "
    "of every token in fixed-size blocks."
)
DRAFT_LAYERS = 6  # of SmolLM2-135M's 30


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    """The real SmolLM2-135M-Instruct (Q4_1 GGUF), transformers' model of the same file, and
    a draft model: its first layers, its embedding and head, as an HF checkpoint."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    directory, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    draft = tmp_path_factory.mktemp("smollm2_draft")
    config = model.config.to_dict()
    config.update(num_hidden_layers=DRAFT_LAYERS, architectures=["LlamaForCausalLM"])
    (draft / "config.json").write_text(json.dumps(config))
    dropped = tuple(
        f"model.layers.{i}." for i in range(DRAFT_LAYERS, model.config.num_hidden_layers)
    )
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not k.startswith(dropped) and k != "lm_head.weight"  # tied to the embedding
    }
    save_file(state, str(draft / "model.safetensors"), metadata={"format": "pt"})
    return path, model, str(draft)


@pytest.mark.timeout(600)  # a real model on the CPU, and transformers' model of it
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_smollm2_copies_with_speculation_under_pressure(smollm2, method: str) -> None:
    """The real SmolLM2-135M-Instruct repeating a text, with n-gram drafts (accepted) or
    those of a draft model of its first 6 layers (some accepted, some rejected): the greedy
    tokens are transformers' on the same file, with the prompt chunked, requests preempted
    (a KV cache of 10 blocks for two requests of 7 each) and the second request's prompt
    served from the prefix cache."""
    import torch

    path, model, draft = smollm2
    messages = [
        [{"role": "user", "content": f"Repeat the following text exactly:\n\n{TEXT}"}],
        [{"role": "user", "content": f"Repeat the following text exactly:\n\n{TEXT} Twice."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=40)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}  # fmt: skip
    if method == "draft_model":
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    llm = LLM(
        path, dtype="float32", device="cpu", distributed_executor_backend="uni",
        speculative_config=spec, max_num_batched_tokens=32, num_gpu_blocks_override=10,
        max_model_len=160,
    )  # fmt: skip
    try:
        outs = llm.chat(messages, params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.shutdown()
    assert "quick brown fox" in outs[0].outputs[0].text
    accepted, drafted = stats["spec_num_accepted_tokens"], stats["spec_num_draft_tokens"]
    if method == "ngram":
        assert accepted >= 16, stats
    else:  # some drafts accepted, some rejected and rolled back
        assert 0 < accepted < drafted, stats
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats

    for out in outs:  # each ends at the file's EOS, <|im_end|>, the reference too
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        assert out.outputs[0].finish_reason == "stop"
        assert list(out.outputs[0].token_ids) == ref[0, ids.shape[1] :].tolist()
