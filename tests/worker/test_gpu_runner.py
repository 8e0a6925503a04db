"""The GPU path end to end: bf16 against transformers, CUDA graphs against eager (Triton and
flash-attn), the Triton attention backend (KV stored by the rotary kernel) against the torch
reference (which stores it itself), the overlapped worker process against the in-process one.
Skipped without a CUDA device (see tests/conftest.py)."""

from __future__ import annotations

import gc
import logging
import random

import pytest
import torch

from minivllm.config import EngineArgs
from minivllm.engine_core.engine_core import EngineCore
from minivllm.protocol.messages import EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from tests.engine_groups import run_groups
from tests.hf_reference import hf_greedy
from tests.tiny_models import VOCAB_SIZE, build_checkpoint

pytestmark = pytest.mark.gpu

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small random Qwen3: 4 layers, head_dim 64 (the Triton kernels' tile sizes)."""
    return build_checkpoint(
        str(tmp_path_factory.mktemp("small") / "qwen3"),
        "qwen3",
        num_layers=4,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=512,
        max_position_embeddings=1024,
        seed=7,
    )


@pytest.fixture(scope="module")
def no_qk_norm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Small random Llama (GQA 4) and Qwen2 (q/k/v bias): rotary without a q/k norm."""
    root = tmp_path_factory.mktemp("no_qk_norm")
    common = dict(num_layers=2, hidden_size=256, intermediate_size=512, head_dim=64)
    return {
        "llama": build_checkpoint(
            str(root / "llama"), "llama", tie_word_embeddings=False, num_heads=8,
            num_kv_heads=2, max_position_embeddings=1024, seed=8, **common,
        ),
        "qwen2": build_checkpoint(
            str(root / "qwen2"), "qwen2", tie_word_embeddings=False, num_heads=4,
            num_kv_heads=2, max_position_embeddings=1024, seed=9, **common,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def window_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Small random models with 48-token sliding windows (head_dim 64): Gemma 3 with sliding
    and global layers, Mistral with every layer windowed."""
    root = tmp_path_factory.mktemp("windows")
    common = dict(
        hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
        max_position_embeddings=1024, sliding_window=48,
    )  # fmt: skip
    return {
        "gemma3": build_checkpoint(
            str(root / "gemma3"), "gemma3", num_layers=4, seed=10, query_pre_attn_scalar=64,
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"], **common,
        ),
        "mistral": build_checkpoint(
            str(root / "mistral"), "mistral", num_layers=2, tie_word_embeddings=False, seed=11,
            **common,
        ),
    }  # fmt: skip


def prompts(n: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[rng.randint(1, VOCAB_SIZE - 1) for _ in range(rng.randint(4, 200))] for _ in range(n)]
    return out + [out[0] + [5, 6, 7], out[1][:50]]  # prefix-cache hits too


def generate(path: str, prompt_ids: list[list[int]], params: SamplingParams, **kw) -> list:
    # a fixed KV budget: earlier engines of this process still hold cached memory
    args = EngineArgs(
        model=path, device="cuda", max_model_len=1024, **{"kv_cache_memory_bytes": 1 << 30, **kw}
    )
    core = EngineCore(args.create_engine_config())
    for i, p in enumerate(prompt_ids):
        core.add_request(EngineCoreRequest(str(i), p, params))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompt_ids))}
    while core.has_work():
        for outs in core.step().values():
            for o in outs.outputs:
                got[o.request_id] += o.new_token_ids
    core.shutdown()
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return [got[str(i)] for i in range(len(prompt_ids))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)


def test_bf16_top1_agrees_with_transformers(small_dir: str) -> None:
    """Teacher-forced: at each position the engine generated (bf16), transformers' fp32 top-1
    after the same prefix. A random model has near-ties that bf16 rounding alone flips, so
    agreement is counted where the fp32 top-1 leads the runner-up by more than bf16 noise
    (0.1 in logits); transformers' own bf16 run is held to the same bar as a reference."""
    from transformers import AutoModelForCausalLM

    ps = prompts()
    outs = generate(small_dir, ps, GREEDY, dtype="bfloat16", distributed_executor_backend="uni")
    hf = {
        dtype: AutoModelForCausalLM.from_pretrained(small_dir, dtype=dtype).cuda().eval()
        for dtype in (torch.bfloat16, torch.float32)
    }
    agree = hf_agree = decisive = 0
    with torch.no_grad():
        for p, out in zip(ps, outs, strict=True):
            assert len(out) == MAX_TOKENS
            ids = torch.tensor([p + out[:-1]], device="cuda")
            fp32 = hf[torch.float32](ids).logits[0, len(p) - 1 :].float()
            bf16 = hf[torch.bfloat16](ids).logits[0, len(p) - 1 :].argmax(-1).tolist()
            top2 = fp32.topk(2, dim=-1)
            margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
            for ours, theirs, best, margin in zip(
                out, bf16, top2.indices[:, 0].tolist(), margins, strict=True
            ):
                if margin > 0.1:
                    decisive += 1
                    agree += ours == best
                    hf_agree += theirs == best
    total = MAX_TOKENS * len(ps)
    assert decisive >= 0.5 * total, f"only {decisive}/{total} positions are decisive"
    assert agree >= 0.99 * decisive, (
        f"top-1 agreement {agree}/{decisive} decisive positions "
        f"(transformers bf16: {hf_agree}/{decisive})"
    )


def test_cuda_graphs_give_the_eager_tokens(small_dir: str) -> None:
    ps = prompts(seed=1)
    for params in (GREEDY, SAMPLED):
        kw = dict(dtype="bfloat16", distributed_executor_backend="uni")
        graphs = generate(small_dir, ps, params, **kw)
        eager = generate(small_dir, ps, params, enforce_eager=True, **kw)
        assert graphs == eager


def prompt_by_prompt(
    path: str, groups: list[list[list[int]]], params: SamplingParams, dtype: str, **kw
):
    """Each group of prompts run alone (its first step carries only its prompts), in turn;
    the tokens, and the token counts of the prefill graphs replayed."""
    args = EngineArgs(
        model=path, device="cuda", max_model_len=1024, kv_cache_memory_bytes=1 << 30,
        dtype=dtype, distributed_executor_backend="uni", **kw,
    )  # fmt: skip
    core = EngineCore(args.create_engine_config())
    prefill = core.executor.worker.model_runner.graphs.prefill
    replay, replayed = prefill.replay, []
    prefill.replay = lambda size: replayed.append(size) or replay(size)
    tokens = run_groups(core, groups, params)
    core.shutdown()
    del core
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replayed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_graphs_give_the_eager_tokens(small_dir: str, dtype: str) -> None:
    """Prompt-only steps of <= 512 tokens and <= 4 prompts replay a prefill graph (the
    batch-1 TTFT path), prompts partly served from the prefix cache too."""
    rng = random.Random(5)
    ps = [[rng.randint(1, VOCAB_SIZE - 1) for _ in range(n)] for n in (5, 17, 100, 300, 512)]
    longer = [rng.randint(1, VOCAB_SIZE - 1) for _ in range(700)]  # past the largest graph
    groups = (
        [[p] for p in ps]
        + [
            [ps[3] + [9, 8, 7]],  # 288 tokens cached, the rest computed
            [ps[0] + ps[1], ps[2][:60], ps[4][:200]],  # three prompts in one step
            [longer],
        ]
    )
    for params in (GREEDY, SAMPLED):
        graphs, replayed = prompt_by_prompt(small_dir, groups, params, dtype)
        eager, none = prompt_by_prompt(small_dir, groups, params, dtype, enforce_eager=True)
        assert graphs == eager
        assert none == []
        # the fresh prompts by their length, then the two groups with cached prefixes
        assert replayed[:5] == [16, 32, 128, 512, 512] and len(replayed) == 7, replayed


def test_flash_attn_decode_graphs_give_the_eager_tokens(
    small_dir: str, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("flash_attn")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "flash-attn")
    ps = prompts(seed=4)
    kw = dict(dtype="bfloat16", distributed_executor_backend="uni", block_size=256)
    for params in (GREEDY, SAMPLED):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="minivllm.worker.cuda_graphs"):
            graphs = generate(small_dir, ps, params, **kw)
        assert any("captured" in r.getMessage() for r in caplog.records)
        eager = generate(small_dir, ps, params, enforce_eager=True, **kw)
        assert graphs == eager


def test_triton_and_torch_attention_agree(small_dir: str, monkeypatch) -> None:
    ps = prompts(n=8, seed=2)
    kw = dict(dtype="float32", distributed_executor_backend="uni", enforce_eager=True)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "torch")
    torch_out = generate(small_dir, ps, GREEDY, **kw)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    triton_out = generate(small_dir, ps, GREEDY, **kw)
    assert triton_out == torch_out
    assert triton_out == hf_greedy(small_dir, ps, MAX_TOKENS)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_models_without_qk_norm_match_transformers(
    no_qk_norm_dirs: dict[str, str], arch: str, monkeypatch
) -> None:
    """The rotary kernel stores their KV too (Triton backend, decode graphs and eager prefill)."""
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    path, ps = no_qk_norm_dirs[arch], prompts(n=8, seed=5)
    out = generate(path, ps, GREEDY, dtype="float32", distributed_executor_backend="uni")
    assert out == hf_greedy(path, ps, MAX_TOKENS)


def test_overlapped_worker_process_gives_the_in_process_tokens(small_dir: str) -> None:
    ps = prompts(seed=3)
    kw = dict(dtype="bfloat16", max_num_seqs=8)  # fewer slots than requests: they queue
    for params in (GREEDY, SAMPLED):
        overlapped = generate(small_dir, ps, params, distributed_executor_backend="mp", **kw)
        in_process = generate(small_dir, ps, params, distributed_executor_backend="uni", **kw)
        assert overlapped == in_process


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_windows_match_transformers(window_dirs: dict[str, str], arch: str) -> None:
    """fp32 through the Triton kernels with CUDA graphs (decode, cascade where a layer has
    no window, prefill graphs), prompts of up to 200 tokens against 48-token windows; for
    Mistral also in a cache smaller than the sequences, the blocks behind the window freed."""
    path, ps = window_dirs[arch], prompts(n=12, seed=6)
    want = hf_greedy(path, ps, MAX_TOKENS)
    kw = dict(dtype="float32", distributed_executor_backend="uni")
    assert generate(path, ps, GREEDY, **kw) == want
    if arch == "mistral":
        small = dict(num_gpu_blocks_override=24, block_size=16, max_num_batched_tokens=128)
        assert sum(len(p) + MAX_TOKENS for p in ps) > 4 * 24 * 16  # the cache holds 384
        assert generate(path, ps, GREEDY, **small, **kw) == want


def test_gemma3_bf16_graphs_give_the_eager_tokens(window_dirs: dict[str, str]) -> None:
    """bf16: Gemma's norm kernels, the GELU activation and the GEMV's GELU prologue (the
    last request decodes alone) in CUDA graphs against eager."""
    ps = prompts(n=6, seed=7)
    for params in (GREEDY, SAMPLED):
        kw = dict(dtype="bfloat16", distributed_executor_backend="uni")
        graphs = generate(window_dirs["gemma3"], ps, params, **kw)
        eager = generate(window_dirs["gemma3"], ps, params, enforce_eager=True, **kw)
        assert graphs == eager
