"""The draft model of speculative decoding: a smaller model of the target's vocabulary, in
the same worker (sharded over the same tensor-parallel ranks), with a KV cache of its own.

Its cache has the target's blocks: the same block ids, block tables and slots, in tensors of
its own shape. It stays in step with the target's because the draft runs over every step's
tokens with the target's inputs and attention metadata (`forward`, right after the
target's forward: prompt chunks, decodes, verified drafts alike), so the draft's KV at every
computed position holds that position's token. After sampling, `propose` runs k one-token
passes from each sampling request's newest token (at the position its accepted tokens end
at, read on the device), writing the draft's KV a few slots ahead (the scheduler reserves
them: `num_lookahead_tokens`); the next step's `forward` writes over them.

Greedy requests draft the argmax; the others draw each draft from q = the draft's
distribution under the request's temperature and filters, with noise of their own, and keep
q for the rejection sampler of the step that verifies them (spec_decode/verification.py).
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.protocol.sampling_params import GREEDY_EPS
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.kv_cache_memory import KVCacheShape
from minivllm.worker.logits_processors import to_device
from minivllm.worker.ops.sampling import filtered_scores, sample
from minivllm.worker.sampler import SamplingMetadata
from minivllm.worker.spec_decode.verification import DraftProbs, Verification
from minivllm.worker.step_buffers import StepBuffers

# salts the request's seed for the draft's draws, apart from the target's noise
DRAFT_SALT = 0x2545F4914F6CDD1D


class DraftModel:
    def __init__(
        self, config: EngineConfig, device: torch.device, tp, kv_dtype: torch.dtype
    ) -> None:
        spec = config.speculative
        self.model_config = m = spec.draft
        self.k = spec.num_speculative_tokens
        self.device = device
        self.tp = tp
        self.block_size = bs = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.expert_parallel = config.parallel.enable_expert_parallel
        self.kv_shape = KVCacheShape(
            m.num_layers, bs, max(1, m.num_kv_heads // tp.size), m.head_dim, kv_dtype
        )
        from minivllm.worker.attention.selector import get_attention_backend

        self.attn_backend_name, self.attn_backend = get_attention_backend(
            device.type, block_size=bs, head_dim=m.head_dim, dtype=kv_dtype
        )
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None  # RunnerGraphs of the draft, when the runner captures graphs
        # req_id -> q [k, V] of its latest drafts (requests sampling at temperature > 0)
        self.draft_probs: dict[str, torch.Tensor] = {}

    def load_model(self) -> None:
        from minivllm.worker.model_loader import load_model

        self.model = load_model(
            self.model_config, self.device, self.tp, self.attn_backend,
            expert_parallel=self.expert_parallel,
        )  # fmt: skip

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.kv_shape.allocate(num_blocks, self.device)

    def forget(self, req_id: str) -> None:
        self.draft_probs.pop(req_id, None)

    # ------------------------------------------------------------------ the step's tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                graph: tuple[str, int] | None = None) -> None:  # fmt: skip
        """Run the draft over the target step's tokens (its KV of them into its cache):
        eagerly, or replaying the draft's graph of the kind and size the target replays."""
        if graph is not None:
            self.graphs.family(graph[0]).replay(graph[1])
            return
        n = meta.num_tokens
        self.model(input_ids[:n], positions[:n], self.kv_caches, meta)

    # ------------------------------------------------------------------ proposing

    def attach_probs(self, verification: Verification, req_ids: list[str], temperature) -> None:
        """Give a verification the q of each draft drawn at temperature > 0 (`req_ids`: the
        sampling requests, in row order; `temperature`: theirs, on the host)."""
        rows, probs, first = [], [], 0
        counts = verification.num_rows.tolist()
        for req_id, count, t in zip(req_ids, counts, temperature, strict=True):
            num_drafts = count - 1
            if num_drafts and t >= GREEDY_EPS:
                q = self.draft_probs.get(req_id)
                if q is None or len(q) < num_drafts:
                    raise RuntimeError(f"request {req_id}: drafts to verify but no q for them")
                rows.extend(range(first, first + num_drafts))
                probs.append(q[:num_drafts])
            first += count
        if rows:
            verification.draft_probs = DraftProbs(
                to_device(np.array(rows, dtype=np.int64), self.device), torch.cat(probs)
            )

    def propose(
        self,
        buffers: StepBuffers,
        batch: InputBatch,
        req_ids: list[str],
        meta: SamplingMetadata,
        first_rows: np.ndarray,
        last_tokens: torch.Tensor,
        num_tokens: torch.Tensor | None,
    ) -> torch.Tensor:
        """k drafts [n, k] for each of the step's sampling requests `req_ids` after its
        newest token `last_tokens` [n]: at the position of its first sampling row (of
        `meta`'s rows `first_rows`) plus its accepted drafts (`num_tokens` - 1, on the
        device; None: one token each). The passes run over the step buffers' device views
        (the target is done with them), so they replay the draft's decode graphs."""
        n, bs, device = len(req_ids), self.block_size, self.device
        states = [batch.requests[r] for r in req_ids]
        rows = np.fromiter((s.row for s in states), np.int64, n)
        num_blocks = np.fromiter((s.num_blocks for s in states), np.int64, n)
        # slots past the blocks a request holds (or the context) take no KV
        capacity = to_device(np.minimum(num_blocks * bs, self.max_model_len), device)
        first = to_device(first_rows, device)
        position = meta.positions.index_select(0, first)
        if num_tokens is not None:
            position = position + num_tokens - 1
        temperature = meta.temperature.index_select(0, first)
        seeds = meta.seeds.index_select(0, first) ^ DRAFT_SALT
        filters = [None if f is None else f.index_select(0, first) for f in meta.filters()]
        random = np.flatnonzero(batch.temperature[rows] >= GREEDY_EPS)
        rope_rows = None  # LongRoPE: long sequences read the rotary table's long rows
        if batch.long_rope_threshold is not None:
            rope_rows = to_device(batch.rope_row_offset[rows], device)
        d = buffers.dev
        d.block_table[:n].copy_(to_device(batch.block_table[rows], device), non_blocking=True)
        d.query_start_loc[: n + 1].copy_(torch.arange(n + 1, device=device))
        graphs, size = self._decode_graphs(n)
        d.decode_order[:size].copy_(torch.arange(size, device=device))
        if size > n:  # graph padding rows: no KV, no context
            d.slot_mapping[n:size].fill_(-1)
            d.seq_lens[n:size].zero_()
            d.input_ids[n:size].zero_()
            d.positions[n:size].zero_()
        attn = buffers.attention_metadata(n, n, n, 1, self.max_model_len)
        block_table = d.block_table[:n].long()
        drafts = torch.empty(n, self.k, dtype=torch.int64, device=device)
        probs, token = [], last_tokens
        for j in range(self.k):
            valid = position < capacity
            at = torch.where(valid, position, 0)
            block = block_table.gather(1, (at // bs)[:, None]).squeeze(1)
            d.input_ids[:n] = token
            d.positions[:n] = at if rope_rows is None else at + rope_rows
            d.slot_mapping[:n] = torch.where(valid, block * bs + at % bs, -1)
            d.seq_lens[:n] = torch.where(valid, at + 1, 0)
            if graphs is not None:
                hidden = graphs.replay(size)
            else:
                hidden = self.model(d.input_ids[:n], d.positions[:n], self.kv_caches, attn)
            logits = self.model.compute_logits(hidden[:n])
            position = position + 1
            token = sample(logits, temperature, *filters, seeds, position)
            drafts[:, j] = token
            if len(random):
                idx = to_device(random, device)
                picked = [None if f is None else f.index_select(0, idx) for f in filters]
                scores = filtered_scores(
                    logits.index_select(0, idx), temperature.index_select(0, idx), *picked
                )
                probs.append(scores.softmax(-1))
        for req_id in req_ids:
            self.draft_probs.pop(req_id, None)
        if probs:
            q = torch.stack(probs, dim=1)  # [random rows, k, V]
            for i, r in enumerate(random.tolist()):
                self.draft_probs[req_ids[r]] = q[i]
        return drafts

    def _decode_graphs(self, n: int):
        """The draft's decode graphs and the padded size for n rows, or (None, n)."""
        if self.graphs is None:
            return None, n
        size = self.graphs.decode.padded_size(n)
        return (None, n) if size is None else (self.graphs.decode, size)
