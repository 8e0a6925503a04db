"""Triton paged attention against a dense float64 reference.

On a CUDA machine the cases run directly (`gpu` marker). On CPU they run through the Triton
interpreter in a subprocess, since TRITON_INTERPRET must be set before triton is imported.
A case may run with an FP8 cache (`:fp8`: the reference attends the dequantized cache, and
the stored bytes must equal the torch quantization's). Cascade cases share their first P
tokens' blocks between all decode sequences and run the cascade kernels; the reference is
plain attention.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted

if TYPE_CHECKING:
    from minivllm.worker.attention.metadata import AttentionMetadata

# name -> (seqs as (query_len, seq_len), num_heads, num_kv_heads, head_dim, block_size, splits)
CASES: dict[str, tuple] = {
    "decode": ([(1, 37), (1, 16), (1, 100), (1, 1)], 4, 2, 64, 16, 1),
    "decode_split": ([(1, 37), (1, 200), (1, 5), (1, 0)], 4, 2, 64, 16, 4),
    "decode_split_auto_gqa8": ([(1, 77), (1, 130)], 8, 1, 64, 16, None),
    "decode_gqa3_d128": ([(1, 45), (1, 129)], 6, 2, 128, 16, 3),
    "prefill": ([(20, 20), (70, 70)], 4, 2, 64, 16, None),
    "prefill_prefix": ([(9, 41), (33, 97), (1, 18)], 4, 4, 64, 16, None),  # last: q_len 1
    "mixed_block32": ([(1, 50), (1, 33), (40, 40), (17, 81)], 8, 2, 64, 32, 2),
    # decodes, a chunk over a cached prefix, then two whole prompts
    "mixed_fresh": ([(1, 50), (1, 133), (17, 81), (40, 40), (25, 25)], 4, 2, 64, 16, None),
    # cascade: the decodes share their first 48 (or 32) tokens; a padded decode row (seq_len
    # 0); prompts that share nothing; 20 decodes fill two query tiles of the prefix kernel
    "cascade": ([(1, 50), (1, 133), (1, 49), (1, 0)], 4, 2, 64, 16, 48),
    "cascade_mixed": ([(1, 70), (1, 33), (17, 81), (40, 40)], 8, 2, 64, 32, 32),
    "cascade_many": ([(1, 40 + 7 * i) for i in range(20)], 4, 2, 64, 16, 32),
}


@dataclass
class PagedBatch:
    """A case's step in float64 on the CPU: the KV cache (garbage, each sequence's cached
    prefix written into its blocks), the step's q, k, v and slot mapping (two padded rows at
    the end, slot -1), and each sequence's query and whole keys and values (the reference's)."""

    seqs: list[tuple[int, int]]
    num_decodes: int  # the leading sequences with one query token, as the runner orders them
    shared: int  # tokens of the prefix the decodes share (cascade cases), else 0
    block_table: torch.Tensor
    cache: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    qs: list[torch.Tensor]
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]


def paged_batch(name: str) -> PagedBatch:
    seqs, num_heads, num_kv_heads, head_dim, block_size, splits = CASES[name]
    shared = splits if name.startswith("cascade") else 0
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    num_decodes = next((i for i, (q_len, _) in enumerate(seqs) if q_len != 1), len(seqs))
    max_blocks = max(-(-s // block_size) for _, s in seqs) + 1
    num_blocks = len(seqs) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = perm[: len(seqs) * max_blocks].view(len(seqs), max_blocks).to(torch.int32)
    shared_blocks = shared // block_size
    block_table[:num_decodes, :shared_blocks] = block_table[0, :shared_blocks]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    cache = rand(2, num_blocks, block_size, num_kv_heads, head_dim)
    shared_k, shared_v = rand(shared, num_kv_heads, head_dim), rand(shared, num_kv_heads, head_dim)
    qs, ks, vs, slots, full_k, full_v = [], [], [], [], [], []
    for i, (q_len, seq_len) in enumerate(seqs):
        kf, vf = rand(seq_len, num_kv_heads, head_dim), rand(seq_len, num_kv_heads, head_dim)
        if i < num_decodes and seq_len:  # the same keys in the same blocks
            kf[:shared], vf[:shared] = shared_k, shared_v
        full_k.append(kf)
        full_v.append(vf)
        pos = torch.arange(seq_len)
        slot = block_table[i, pos // block_size].long() * block_size + pos % block_size
        prefix = seq_len - q_len if seq_len else 0
        flat = cache.view(2, -1, num_kv_heads, head_dim)
        flat[0, slot[:prefix]] = kf[:prefix]
        flat[1, slot[:prefix]] = vf[:prefix]
        n_new = min(q_len, seq_len)
        qs.append(rand(q_len, num_heads, head_dim))
        ks.append(torch.cat([kf[prefix:], rand(q_len - n_new, num_kv_heads, head_dim)]))
        vs.append(torch.cat([vf[prefix:], rand(q_len - n_new, num_kv_heads, head_dim)]))
        slots.append(torch.cat([slot[prefix:], torch.full((q_len - n_new,), -1)]))
    pad = 2  # padded rows, as in a CUDA graph batch: slot -1
    return PagedBatch(
        seqs,
        num_decodes,
        shared,
        block_table,
        cache,
        q=torch.cat(qs + [rand(pad, num_heads, head_dim)]),
        k=torch.cat(ks + [rand(pad, num_kv_heads, head_dim)]),
        v=torch.cat(vs + [rand(pad, num_kv_heads, head_dim)]),
        slot_mapping=torch.cat(slots + [torch.full((pad,), -1)]),
        qs=qs,
        full_k=full_k,
        full_v=full_v,
    )


def batch_metadata(name: str, batch: PagedBatch, device: str) -> AttentionMetadata:
    from minivllm.worker.attention.metadata import AttentionMetadata

    seqs, num_decodes, shared = batch.seqs, batch.num_decodes, batch.shared
    q_lens = torch.tensor([q_len for q_len, _ in seqs])
    return AttentionMetadata(
        num_tokens=int(q_lens.sum()),
        num_seqs=len(seqs),
        num_decodes=num_decodes,
        max_query_len=int(q_lens.max()),
        max_seq_len=max(s for _, s in seqs),
        query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32).to(device),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device),
        block_table=batch.block_table.to(device),
        slot_mapping=batch.slot_mapping.to(device),
        block_size=CASES[name][4],
        query_start_loc_cpu=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32),
        # longest context first, as the runner orders decodes ("decode" keeps batch order)
        decode_order=None
        if name == "decode"
        else torch.tensor([s for _, s in seqs[:num_decodes]])
        .argsort(descending=True)
        .to(torch.int32)
        .to(device),
        cascade_prefix_len=torch.tensor([shared], dtype=torch.int32, device=device)
        if shared
        else None,
    )


def check_case(name: str, device: str, dtype: torch.dtype, fp8: bool = False) -> None:
    from minivllm.worker.attention.triton_attention import TritonAttentionBackend
    from minivllm.worker.ops.kv_cache import FP8, dequantize, quantize
    from tests.attention_step import attend

    _, num_heads, num_kv_heads, head_dim, _, splits = CASES[name]
    batch = paged_batch(name)
    # an FP8 cache: scales that put the values well inside e4m3's range, one saturating
    kv_scale = torch.tensor([0.02, 0.006], device=device) if fp8 else None
    cache_dtype = FP8 if fp8 else dtype

    def stored_as(x: torch.Tensor, i: int) -> torch.Tensor:
        """x as the cache holds it, read back in float64 (the reference's inputs)."""
        x = x.to(dtype)  # the kernels see the model's dtype first
        if not fp8:
            return x.double()
        return dequantize(quantize(x, kv_scale[i].cpu(), FP8), kv_scale[i].cpu(), torch.float64)

    cache = torch.stack([stored_as(batch.cache[i], i) for i in range(2)])
    expected_cache = cache.clone().view(2, -1, num_kv_heads, head_dim)
    slot_mapping, k, v = batch.slot_mapping, batch.k, batch.v
    stored = slot_mapping >= 0
    expected_cache[0, slot_mapping[stored]] = stored_as(k[stored], 0)
    expected_cache[1, slot_mapping[stored]] = stored_as(v[stored], 1)

    scale = head_dim**-0.5
    dev = {"dtype": dtype, "device": device}
    scales = kv_scale.cpu() if fp8 else torch.ones(2)
    kv_cache = torch.stack([quantize(cache[i], scales[i], cache_dtype) for i in range(2)])
    kv_cache = kv_cache.to(device)
    out = attend(
        TritonAttentionBackend(num_splits=None if batch.shared else splits),
        batch.q.to(**dev),
        k.to(**dev),
        v.to(**dev),
        kv_cache,
        batch_metadata(name, batch, device),
        scale,
        kv_scale,
    )

    got_cache = kv_cache.view(2, -1, num_kv_heads, head_dim).cpu()
    got_cache = torch.stack([dequantize(got_cache[i], scales[i], torch.float64) for i in range(2)])
    torch.testing.assert_close(got_cache, expected_cache, atol=0, rtol=0)
    row = 0
    for i, (q_len, seq_len) in enumerate(batch.seqs):
        got = out[row : row + q_len].double().cpu()
        row += q_len
        if seq_len == 0:  # a padded decode row
            assert torch.all(got == 0), name
            continue
        # round inputs the way the kernel sees them
        kf = stored_as(batch.full_k[i], 0).repeat_interleave(num_heads // num_kv_heads, dim=1)
        vf = stored_as(batch.full_v[i], 1).repeat_interleave(num_heads // num_kv_heads, dim=1)
        ref = _causal_attention(batch.qs[i].to(dtype).double(), kf, vf, scale)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(
            got, ref, atol=tol, rtol=tol, msg=lambda m, i=i: f"{name} {i}: {m}"
        )


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense attention of the last len(q) positions of a sequence over all len(k) of it."""
    q_len, seq_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@needs_triton
@pytest.mark.parametrize(
    "names",
    [["decode", "decode_split", "decode_split_auto_gqa8", "decode_gqa3_d128"],
     ["prefill", "prefill_prefix", "mixed_block32", "mixed_fresh"],
     ["decode_split:fp8", "mixed_block32:fp8", "mixed_fresh:fp8"],
     ["cascade", "cascade_mixed:fp8", "cascade_many"]],
    ids=["decode", "prefill", "fp8", "cascade"],
)  # fmt: skip
def test_triton_attention_interpreted(names: list[str]) -> None:
    run_interpreted(__file__, *names)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_attention_gpu(name: str, dtype: torch.dtype) -> None:
    check_case(name, "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_attention_fp8_gpu(name: str, dtype: torch.dtype) -> None:
    check_case(name, "cuda", dtype, fp8=True)


if __name__ == "__main__":  # the interpreted run: python this_file.py CASE[:fp8]...
    for arg in sys.argv[1:]:
        case, _, mode = arg.partition(":")
        check_case(case, "cpu", torch.float32, fp8=mode == "fp8")
        print("ok", arg)
