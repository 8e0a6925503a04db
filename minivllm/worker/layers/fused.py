"""The fused ops a decoder calls by name. Each computes what its name says and returns tensors;
each decides, here and nowhere else, whether one kernel does it all or the ops run one after
another, from the tensors and layers it is given (and the step's metadata).

| op | one kernel when | else |
|---|---|---|
| `rms_norm_linear` | one 16-bit row where Triton runs and an unbiased, unquantized projection the GEMV tiles: the GEMV adds the residual and norms its row in its prologue (ops/gemv.py); under TP, x a partial sum: `all_reduce_add_rms_norm`, then the projection | `add_rms_norm`, then the projection |
| `silu_mul_linear` | the same row and projection: the GEMV computes silu(gate) * up in its prologue | `silu_and_mul`, then the projection |
| `gelu_tanh_mul_linear` | the same, GELU-tanh(gate) * up in the GEMV's prologue (Gemma) | `gelu_tanh_and_mul`, then the projection |
| `norm_add_norm` | Triton runs (Gemma's norms): after the all-reduce under TP, one kernel norms x, adds the residual and norms the sum (ops/gemma_norm.py) | the all-reduce, then torch ops |
| `all_reduce_add_rms_norm` | TP > 1 and the symmetric-memory all-reduce takes the rows (`TPGroup.all_reduce_add_rms_norm`) | the all-reduce, then `add_rms_norm` |
| `qk_norm_rope_store_kv` | Triton runs and the backend stores with `store_kv_cache`, except on the step that computes the FP8 scales: the rotary kernel norms each head (Gemma's norm too), rotates and writes k and v into the cache | the rotary kernel (norm + rotation), then the backend's store |

Under TP a decoder's row-parallel projections leave their sum over the ranks to the norm
after them (`reduce_results=False`), which `rms_norm_linear` and `all_reduce_add_rms_norm`
do, fused with the residual add and the norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.worker.attention.layer import PagedAttention
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from minivllm.worker.layers.norm import GemmaRMSNorm, RMSNorm
from minivllm.worker.layers.rotary import RotaryEmbedding
from minivllm.worker.ops._triton import use_triton
from minivllm.worker.ops.activation import gelu_tanh_and_mul, silu_and_mul
from minivllm.worker.ops.gemma_norm import gemma_norm_add_norm, gemma_rms_norm
from minivllm.worker.ops.gemv import (
    gemv_gelu_tanh_mul,
    gemv_rms_norm,
    gemv_silu_mul,
    row_gemv_config,
)
from minivllm.worker.ops.norm import add_rms_norm
from minivllm.worker.ops.rotary import qk_norm_rope


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, tp: TPGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) with s = x summed over the TP ranks + residual (x alone without one)."""
    return tp.all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: RMSNorm,
    proj: ColumnParallelLinear,
    tp: TPGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(s)), s) with s = x summed over the TP ranks + residual: a pre-norm block's
    input projection and the new residual stream. x is a row-parallel projection's output
    (under TP each rank's partial sum); or, with residual None, the embeddings, whole on every
    rank already (s = x)."""
    if residual is not None and tp.size > 1:
        normed, residual = tp.all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)
        return proj(normed), residual
    w = proj.plain_weight
    cfg = row_gemv_config(x, w, x.shape[-1]) if proj.bias is None and w is not None else None
    if cfg is not None:
        if residual is None:
            return gemv_rms_norm(x, None, norm.weight, norm.eps, w, cfg), x
        if x.is_contiguous() and residual.is_contiguous():
            new_residual = torch.empty_like(x)
            y = gemv_rms_norm(x, residual, norm.weight, norm.eps, w, cfg, new_residual)
            return y, new_residual
    normed, residual = add_rms_norm(x, residual, norm.weight, norm.eps)
    return proj(normed), residual


def silu_mul_linear(gate_up: torch.Tensor, proj: RowParallelLinear) -> torch.Tensor:
    """proj(silu(gate) * up) for gate_up [T, 2I], gate then up: SwiGLU's down projection."""
    return _act_mul_linear(gate_up, proj, silu_and_mul, gemv_silu_mul)


def gelu_tanh_mul_linear(gate_up: torch.Tensor, proj: RowParallelLinear) -> torch.Tensor:
    """proj(gelu_tanh(gate) * up) for gate_up [T, 2I], gate then up: GeGLU's down projection."""
    return _act_mul_linear(gate_up, proj, gelu_tanh_and_mul, gemv_gelu_tanh_mul)


def _act_mul_linear(
    gate_up: torch.Tensor,
    proj: RowParallelLinear,
    act_and_mul: Callable[[torch.Tensor], torch.Tensor],
    gemv_act_mul: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """proj(act(gate) * up): one GEMV with the activation in its prologue where the GEMV
    takes the row, else the activation's kernel, then the projection."""
    w = proj.plain_weight
    cfg = None
    if proj.rank_bias is None and w is not None:
        cfg = row_gemv_config(gate_up, w, gate_up.shape[-1] // 2)
    if cfg is None:
        return proj(act_and_mul(gate_up))
    y = gemv_act_mul(gate_up, w, cfg)
    return proj.tp.all_reduce(y) if proj.reduce_results else y


def norm_add_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    post_norm: GemmaRMSNorm | None,
    norm: GemmaRMSNorm,
    tp: TPGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) with s = residual + post_norm(x summed over the TP ranks): Gemma's norm of
    a block's output, the residual add, and the norm of the next block's input. With
    residual None, x is the embeddings, whole on every rank: (norm(x), x)."""
    if residual is None:
        return gemma_rms_norm(x, norm.weight, norm.eps), x
    assert post_norm is not None
    return gemma_norm_add_norm(tp.all_reduce(x), residual, post_norm.weight, norm.weight, norm.eps)


def qk_norm_rope_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    rotary_emb: RotaryEmbedding,
    attn: PagedAttention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms each head of q and k (with q_norm and k_norm, Qwen3's or Gemma's; None: no
    norm), rotates them at `positions`, in place, and writes k and v into attn's KV cache.
    Returns q and k. q [T, heads, head_dim]; k and v [T, kv_heads, head_dim]: views into the
    qkv projection's output are fine."""
    if q_norm is None:
        q_w = k_w = None
        eps, apply_norm, offset = 0.0, False, False
    else:
        assert k_norm is not None
        q_w, k_w, eps, apply_norm = q_norm.weight, k_norm.weight, q_norm.eps, True
        offset = q_norm.weight_offset
    cos_sin = rotary_emb.cos_sin_cache
    if attn.rope_can_store_kv and use_triton(q):
        meta, kv_cache = attn.batch_and_cache()
        if not meta.compute_kv_scales:  # those come from the rotated keys, before the store
            qk_norm_rope(q, k, q_w, k_w, cos_sin, positions, eps, apply_norm,
                         v, kv_cache, meta.slot_mapping, attn.kv_scale, offset)  # fmt: skip
            return q, k
    qk_norm_rope(q, k, q_w, k_w, cos_sin, positions, eps, apply_norm, norm_offset=offset)
    attn.store_kv(k, v)
    return q, k
