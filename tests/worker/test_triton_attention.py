"""Triton paged attention against a dense float64 reference.

On a CUDA machine the cases run directly (`gpu` marker). On CPU they run through the Triton
interpreter in a subprocess, since TRITON_INTERPRET must be set before triton is imported.
A case may run with an FP8 cache (`:fp8`: the reference attends the dequantized cache, and
the stored bytes must equal the torch quantization's). Cascade cases share their first P
tokens' blocks between all decode sequences and run the cascade kernels; the reference is
plain attention. Window cases (`WINDOWS`) attend over a sliding window; the block-table
entries wholly behind each sequence's window point at a block of NaNs, as blocks the
engine-core freed would hold anything: a kernel that read one would return NaN.
"""

from __future__ import annotations

import sys
import zlib

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted

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
    # sliding windows (WINDOWS): decodes past and within the window, split-KV; prefill tiles
    # whose rows start their windows in different key tiles; a cascade step, which a
    # windowed layer attends without the shared prefix
    "window_decode": ([(1, 100), (1, 7), (1, 33), (1, 0)], 4, 2, 64, 16, 1),
    "window_decode_split": ([(1, 300), (1, 24), (1, 129)], 8, 2, 64, 16, 4),
    "window_prefill": ([(70, 70), (33, 97), (1, 18), (50, 200)], 4, 2, 64, 16, None),
    "window_mixed": ([(1, 50), (1, 133), (17, 81), (40, 40)], 8, 2, 64, 32, 2),
    "window_cascade": ([(1, 90), (1, 133), (1, 70)], 4, 2, 64, 16, 48),
    # Gemma 3 1B's geometry: head_dim 256, 4 query heads on 1 KV head, a 512-token window
    "window_gemma3_1b": ([(1, 700), (1, 300), (1, 513), (40, 600)], 4, 1, 256, 16, None),
}
WINDOWS = {
    "window_decode": 24,
    "window_decode_split": 40,
    "window_prefill": 21,
    "window_mixed": 37,
    "window_cascade": 17,
    "window_gemma3_1b": 512,
}


def check_case(name: str, device: str, dtype: torch.dtype, fp8: bool = False) -> None:
    from minivllm.worker.attention.triton_attention import TritonAttentionBackend
    from minivllm.worker.ops.kv_cache import FP8, dequantize, quantize
    from tests.attention_step import attend

    seqs, num_heads, num_kv_heads, head_dim, block_size, splits = CASES[name]
    window = WINDOWS.get(name)
    shared = splits if "cascade" in name else 0  # tokens of the shared prefix
    splits = None if shared else splits
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    # a "decode" here is any leading sequence with one query token (as the runner orders them)
    num_decodes = next((i for i, (q_len, _) in enumerate(seqs) if q_len != 1), len(seqs))
    max_blocks = max(-(-s // block_size) for _, s in seqs) + 1
    num_blocks = len(seqs) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = perm[: len(seqs) * max_blocks].view(len(seqs), max_blocks).to(torch.int32)
    shared_blocks = shared // block_size
    block_table[:num_decodes, :shared_blocks] = block_table[0, :shared_blocks]
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(*shape, generator=gen, dtype=torch.float64)  # garbage everywhere
    step = _write_sequences(seqs, num_decodes, shared, num_heads, block_table, cache, gen)
    q, k, v, slot_mapping = step["q"], step["k"], step["v"], step["slot_mapping"]

    # an FP8 cache: scales that put the values well inside e4m3's range, one saturating
    kv_scale = torch.tensor([0.02, 0.006], device=device) if fp8 else None
    cache_dtype = FP8 if fp8 else dtype

    def stored_as(x: torch.Tensor, i: int) -> torch.Tensor:
        """x as the cache holds it, read back in float64 (the reference's inputs)."""
        x = x.to(dtype)  # the kernels see the model's dtype first
        if not fp8:
            return x.double()
        return dequantize(quantize(x, kv_scale[i].cpu(), FP8), kv_scale[i].cpu(), torch.float64)

    cache = torch.stack([stored_as(cache[i], i) for i in range(2)])
    if window is not None:  # blocks behind each window: freed, and now anything (NaN)
        freed = int(perm[-1])  # a block no sequence holds
        cache[:, freed] = float("nan")
        for i, (q_len, seq_len) in enumerate(seqs):
            block_table[i, : max(0, seq_len - q_len - window + 1) // block_size] = freed
    expected_cache = cache.clone().view(2, -1, num_kv_heads, head_dim)
    stored = slot_mapping >= 0
    expected_cache[0, slot_mapping[stored]] = stored_as(k[stored], 0)
    expected_cache[1, slot_mapping[stored]] = stored_as(v[stored], 1)

    meta = _metadata(name, seqs, num_decodes, shared, block_table, slot_mapping, device)
    scale = head_dim**-0.5
    dev = {"dtype": dtype, "device": device}
    scales = kv_scale.cpu() if fp8 else torch.ones(2)
    kv_cache = torch.stack([quantize(cache[i], scales[i], cache_dtype) for i in range(2)])
    kv_cache = kv_cache.to(device)
    backend = TritonAttentionBackend(num_splits=splits)
    out = attend(
        backend, q.to(**dev), k.to(**dev), v.to(**dev), kv_cache, meta, scale,
        kv_scale, window,
    )  # fmt: skip

    got_cache = kv_cache.view(2, -1, num_kv_heads, head_dim).cpu()
    got_cache = torch.stack([dequantize(got_cache[i], scales[i], torch.float64) for i in range(2)])
    torch.testing.assert_close(got_cache, expected_cache, atol=0, rtol=0, equal_nan=True)
    full_k = [stored_as(kf, 0) for kf in step["full_k"]]
    full_v = [stored_as(vf, 1) for vf in step["full_v"]]
    qs = [qi.to(dtype).double() for qi in step["qs"]]  # rounded as the kernel sees them
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    _check_outputs(name, out.double().cpu(), seqs, qs, full_k, full_v, scale, window, tol)


def _metadata(
    name: str,
    seqs: list[tuple[int, int]],
    num_decodes: int,
    shared: int,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    device: str,
):
    from minivllm.worker.attention.metadata import AttentionMetadata

    q_lens = torch.tensor([q_len for q_len, _ in seqs])
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32)
    # longest context first, as the runner orders decodes ("decode" keeps batch order)
    decode_lens = torch.tensor([s for _, s in seqs[:num_decodes]])
    decode_order = None if name == "decode" else decode_lens.argsort(descending=True)
    return AttentionMetadata(
        num_tokens=int(q_lens.sum()),
        num_seqs=len(seqs),
        num_decodes=num_decodes,
        max_query_len=int(q_lens.max()),
        max_seq_len=max(s for _, s in seqs),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device),
        block_size=int(CASES[name][4]),
        query_start_loc_cpu=query_start_loc,
        decode_order=None if decode_order is None else decode_order.to(torch.int32).to(device),
        cascade_prefix_len=(
            torch.tensor([shared], dtype=torch.int32, device=device) if shared else None
        ),
    )


def _check_outputs(
    name: str,
    out: torch.Tensor,
    seqs: list[tuple[int, int]],
    qs: list[torch.Tensor],
    full_k: list[torch.Tensor],
    full_v: list[torch.Tensor],
    scale: float,
    window: int | None,
    tol: float,
) -> None:
    """Each sequence's rows against dense causal attention (over its window) in float64; a
    padded decode row (seq_len 0) is zeros."""
    _, num_heads, num_kv_heads, *_ = CASES[name]
    gqa = num_heads // num_kv_heads
    row = 0
    for i, (q_len, seq_len) in enumerate(seqs):
        got = out[row : row + q_len]
        row += q_len
        if seq_len == 0:
            assert torch.all(got == 0), name
            continue
        kf = full_k[i].repeat_interleave(gqa, dim=1)
        vf = full_v[i].repeat_interleave(gqa, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs[i], kf) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        hidden = key_pos > q_pos
        if window is not None:
            hidden |= key_pos <= q_pos - window
        ref = torch.einsum(
            "hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), vf
        )
        torch.testing.assert_close(
            got, ref, atol=tol, rtol=tol, msg=lambda m, i=i: f"{name} {i}: {m}"
        )


def _write_sequences(
    seqs: list[tuple[int, int]],
    num_decodes: int,
    shared: int,
    num_heads: int,
    block_table: torch.Tensor,
    cache: torch.Tensor,
    gen: torch.Generator,
) -> dict:
    """Each sequence's keys and values (the decodes' first `shared` alike), its cached prefix
    written into `cache`, and the step's inputs: its new tokens' q, k, v and slots, then two
    padded rows (slot -1) as in a CUDA graph batch; a query token past its sequence
    (a padded decode row, seq_len 0) stores nothing either."""
    _, _, block_size, num_kv_heads, head_dim = cache.shape

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    shared_k, shared_v = rand(shared, num_kv_heads, head_dim), rand(shared, num_kv_heads, head_dim)
    out: dict[str, list] = {n: [] for n in ("qs", "ks", "vs", "slots", "full_k", "full_v")}
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    for i, (q_len, seq_len) in enumerate(seqs):
        kf, vf = rand(seq_len, num_kv_heads, head_dim), rand(seq_len, num_kv_heads, head_dim)
        if i < num_decodes and seq_len:  # the same keys in the same blocks
            kf[:shared], vf[:shared] = shared_k, shared_v
        out["full_k"].append(kf)
        out["full_v"].append(vf)
        pos = torch.arange(seq_len)
        slot = block_table[i, pos // block_size].long() * block_size + pos % block_size
        prefix = seq_len - q_len if seq_len else 0
        flat[0, slot[:prefix]] = kf[:prefix]
        flat[1, slot[:prefix]] = vf[:prefix]
        n_new = min(q_len, seq_len)
        out["qs"].append(rand(q_len, num_heads, head_dim))
        out["ks"].append(torch.cat([kf[prefix:], rand(q_len - n_new, num_kv_heads, head_dim)]))
        out["vs"].append(torch.cat([vf[prefix:], rand(q_len - n_new, num_kv_heads, head_dim)]))
        out["slots"].append(torch.cat([slot[prefix:], torch.full((q_len - n_new,), -1)]))
    pad = 2
    return {
        **out,
        "q": torch.cat(out["qs"] + [rand(pad, num_heads, head_dim)]),
        "k": torch.cat(out["ks"] + [rand(pad, num_kv_heads, head_dim)]),
        "v": torch.cat(out["vs"] + [rand(pad, num_kv_heads, head_dim)]),
        "slot_mapping": torch.cat(out["slots"] + [torch.full((pad,), -1)]),
    }


@needs_triton
@pytest.mark.parametrize(
    "names",
    [["decode", "decode_split", "decode_split_auto_gqa8", "decode_gqa3_d128"],
     ["prefill", "prefill_prefix", "mixed_block32", "mixed_fresh"],
     ["decode_split:fp8", "mixed_block32:fp8", "mixed_fresh:fp8"],
     ["cascade", "cascade_mixed:fp8", "cascade_many"],
     ["window_decode", "window_decode_split", "window_prefill", "window_mixed:fp8",
      "window_cascade", "window_gemma3_1b"]],
    ids=["decode", "prefill", "fp8", "cascade", "window"],
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
