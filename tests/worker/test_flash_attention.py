"""The flash-attn backend against the torch reference, through a stand-in `flash_attn` module.

flash-attn needs a CUDA device, so the stand-in implements its two paged entry points in
plain torch as their docstrings define them (paged gather through `block_table`, lengths
from `cache_seqlens` / `cu_seqlens_k`, causal mask aligned to the bottom right, GQA by kv
head `h // (num_heads // num_kv_heads)`, `softmax_scale`) and asserts the input checks of
flash_api.cpp (int32 offsets and tables, fp16/bf16, pages a multiple of 256, one table row per
sequence). Agreement with the reference therefore tests the arguments the backend passes.
"""

from __future__ import annotations

import logging
import sys
import types
import zlib

import pytest
import torch

from minivllm.worker.attention.flash_attention import (
    FlashAttentionBackend,
    flash_attn_unsupported_reason,
)
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.selector import get_attention_backend
from minivllm.worker.attention.torch_attention import TorchAttentionBackend
from tests.attention_step import attend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32
SCALE = 0.3  # not the 1/sqrt(head_dim) default, so a dropped softmax_scale shows


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
):
    """q [q_len, H, D] against k, v [k_len, Hk, D]; causal aligned to the bottom right;
    `window_size` (left, right): the keys each query sees around its own (-1: no bound)."""
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    k = k.float().repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.float().repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:
        keep = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
        scores = scores.masked_fill(~keep, float("-inf"))
    left, right = window_size
    assert right in (-1, 0) and left >= -1
    if left >= 0:
        query_pos = torch.arange(k_len - q_len, k_len)[:, None]
        scores = scores.masked_fill(torch.arange(k_len)[None, :] < query_pos - left, float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # a fully masked row gives zeros
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _check_paged(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, batch: int):
    assert q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
    assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert q.shape[-2] % k_cache.shape[-2] == 0
    assert block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert block_table.shape[0] == batch


def _gather(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    return cache[table_row.long()].flatten(0, 1)[:length]


def _flash_attn_with_kvcache(
    q, k_cache, v_cache, *, cache_seqlens, block_table, softmax_scale=None, causal=False,
    window_size=(-1, -1),
):  # fmt: skip
    _check_paged(q, k_cache, block_table, q.shape[0])
    assert cache_seqlens.dtype == torch.int32
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for b, length in enumerate(cache_seqlens.tolist()):
        keys = _gather(k_cache, block_table[b], length)
        values = _gather(v_cache, block_table[b], length)
        out[b] = _attend(q[b], keys, values, scale, causal, window_size)
    return out


def _flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
    softmax_scale=None, causal=False, block_table=None, window_size=(-1, -1),
):  # fmt: skip
    assert block_table is not None  # the backend always reads the paged cache
    _check_paged(q, k, block_table, len(cu_seqlens_q) - 1)
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert len(cu_seqlens_k) == len(cu_seqlens_q) and int(cu_seqlens_q[-1]) == q.shape[0]
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    starts, key_ends = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts) - 1):
        q_len, k_len = starts[b + 1] - starts[b], key_ends[b + 1] - key_ends[b]
        assert q_len <= max_seqlen_q and k_len <= max_seqlen_k
        keys, values = _gather(k, block_table[b], k_len), _gather(v, block_table[b], k_len)
        rows = slice(starts[b], starts[b + 1])
        out[rows] = _attend(q[rows], keys, values, scale, causal, window_size)
    return out


@pytest.fixture
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("flash_attn")
    module.flash_attn_with_kvcache = _flash_attn_with_kvcache
    module.flash_attn_varlen_func = _flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


def _step(seqs: list[tuple[int, int]], page: int, pad_rows: int, seed: int):
    """Random inputs for one step: seqs are (query_len, seq_len), decodes first. The cache
    holds each sequence's prefix (and garbage elsewhere); q/k/v hold its last query_len tokens."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    widths = [-(-seq_len // page) for _, seq_len in seqs]
    num_blocks = sum(widths) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(w)] for w in widths]
    cache = torch.randn(2, num_blocks, page, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    flat = cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)
    qs, ks, vs, slots, starts = [], [], [], [], [0]
    for (q_len, seq_len), table in zip(seqs, tables, strict=True):
        pos = torch.arange(seq_len)
        seq_slots = torch.tensor(table)[pos // page] * page + pos % page
        kv = torch.randn(2, seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        prefix = seq_len - q_len
        flat[:, seq_slots[:prefix]] = kv[:, :prefix]
        ks.append(kv[0, prefix:])
        vs.append(kv[1, prefix:])
        qs.append(torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype))
        slots += seq_slots[prefix:].tolist()
        starts.append(starts[-1] + q_len)
    qs.append(torch.randn(pad_rows, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype))
    ks.append(torch.randn(pad_rows, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
    vs.append(torch.randn(pad_rows, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype))
    seq_lens = [seq_len for _, seq_len in seqs]
    meta = AttentionMetadata(
        num_tokens=starts[-1],
        num_seqs=len(seqs),
        num_decodes=next((i for i, (q_len, _) in enumerate(seqs) if q_len != 1), len(seqs)),
        max_query_len=max(q_len for q_len, _ in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(
            [t + [0] * (max(widths) - len(t)) for t in tables], dtype=torch.int32
        ),
        slot_mapping=torch.tensor(slots + [-1] * pad_rows, dtype=torch.int64),
        block_size=page,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta


CASES = {
    "decode": [(1, 300), (1, 17), (1, 513), (1, 256)],
    "prefill": [(40, 40), (300, 300)],
    "chunked_prefill_with_cached_prefix": [(64, 600), (5, 261), (1, 90)],  # last: one token
    "mixed": [(1, 270), (1, 5), (30, 30), (100, 380)],
}


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
@pytest.mark.parametrize("page", [256, 512])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_reference(fake_flash_attn, case: str, page: int, window: int | None) -> None:
    q, k, v, cache, meta = _step(CASES[case], page, pad_rows=2, seed=zlib.crc32(case.encode()))
    ref_cache = cache.clone()
    out = attend(FlashAttentionBackend(), q, k, v, cache, meta, SCALE, sliding_window=window)
    expected = attend(TorchAttentionBackend(), q, k, v, ref_cache, meta, SCALE, None, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)  # same KV stored
    assert not out[meta.num_tokens :].any()  # padding rows


def test_unsupported_reasons(fake_flash_attn, monkeypatch: pytest.MonkeyPatch) -> None:
    bf16 = torch.bfloat16
    assert flash_attn_unsupported_reason(256, 128, bf16) is None
    assert flash_attn_unsupported_reason(512, 64, torch.float16) is None
    assert "block_size 16 is not a multiple of flash-attn's 256" in (
        flash_attn_unsupported_reason(16, 128, bf16) or ""
    )
    assert "head_dim 264" in (flash_attn_unsupported_reason(256, 264, bf16) or "")
    assert "head_dim 100" in (flash_attn_unsupported_reason(256, 100, bf16) or "")
    assert "torch.float32" in (flash_attn_unsupported_reason(256, 128, torch.float32) or "")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if not installed
    assert flash_attn_unsupported_reason(256, 128, bf16) == "flash-attn not installed"


def _select(device: str, block_size: int, dtype: torch.dtype = torch.bfloat16):
    return get_attention_backend(device, block_size=block_size, head_dim=128, dtype=dtype)


def test_selector_prefers_flash_attn_on_cuda_when_it_can_run(
    fake_flash_attn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.INFO, logger="minivllm.worker.attention.selector"):
        name, backend = _select("cuda", 256)
        assert name == "flash-attn" and isinstance(backend, FlashAttentionBackend)
        assert _select("cuda", 16)[0] == "triton"
        assert _select("cpu", 256)[0] == "cpu"
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("attention backend: flash-attn")
    assert lines[1] == "attention backend: triton; " + flash_attn_unsupported_reason(
        16, 128, torch.bfloat16
    )
    assert "block_size 16 is not a multiple of flash-attn's 256-token pages" in lines[1]
    assert lines[2] == "attention backend: cpu; cpu device"


def test_selector_falls_back_to_triton_without_flash_attn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with caplog.at_level(logging.INFO, logger="minivllm.worker.attention.selector"):
        assert _select("cuda", 256)[0] == "triton"
    assert caplog.records[-1].getMessage() == "attention backend: triton; flash-attn not installed"


def test_forcing_flash_attn_names_the_problem(
    fake_flash_attn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "flash-attn")
    assert _select("cuda", 256)[0] == "flash-attn"
    with pytest.raises(ValueError, match="flash-attn cannot run: block_size 16 is not a multiple"):
        _select("cuda", 16)
    with pytest.raises(ValueError, match="float16 or bfloat16, not torch.float32"):
        _select("cuda", 256, torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA device, not cpu"):
        _select("cpu", 256)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ValueError, match="flash-attn cannot run: flash-attn not installed"):
        _select("cuda", 256)
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="must be one of"):
        _select("cuda", 256)
