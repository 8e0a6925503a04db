"""Runs one `SchedulerOutput` through the model and samples the next tokens."""

from __future__ import annotations

import logging

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.protocol.messages import ModelRunnerOutput, SchedulerOutput
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.input_batch import InputBatch, RequestState

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, tp) -> None:
        self.config = config
        self.device = device
        self.tp = tp
        self.dtype = _DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        max_len = config.model.max_model_len
        self.max_blocks_per_req = -(-max_len // self.block_size)
        self.batch = InputBatch(config.scheduler.max_num_seqs, max_len, self.max_blocks_per_req)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.attn_backend = self._make_attn_backend()

    # ------------------------------------------------------------------ setup

    def _make_attn_backend(self):
        from minivllm.worker.attention.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()

    def load_model(self) -> None:
        from minivllm.worker.model_loader import load_model

        self.model = load_model(self.config.model, self.device, self.tp, self.attn_backend)

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.config.model.num_kv_heads // self.tp.size)

    def kv_block_bytes(self) -> int:
        m = self.config.model
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * m.num_layers * self.block_size * self.num_local_kv_heads * m.head_dim * elem

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit: an override, a fixed byte budget, or the profiled free memory."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            num = cache.kv_cache_memory_bytes // self.kv_block_bytes()
            # no need to hold more than every sequence at full length
            cap = self.config.scheduler.max_num_seqs * self.max_blocks_per_req + 1
            return int(min(num, cap))
        return self._profile_num_blocks()

    def _profile_num_blocks(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - peak - used_by_others
        num = int(budget // self.kv_block_bytes())
        if num <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache: the model's peak use is {peak / 2**30:.2f} GiB "
                f"of {total / 2**30:.2f} GiB; raise gpu_memory_utilization"
            )
        return num

    def profile_run(self) -> None:
        """A worst-case forward (max_num_batched_tokens tokens) to measure peak activations."""
        n = max(
            1, min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        )
        num_blocks = -(-n // self.block_size)
        caches = self._allocate_kv(num_blocks)
        dev = self.device
        meta = AttentionMetadata(
            num_tokens=n,
            num_seqs=1,
            num_decodes=0,
            max_query_len=n,
            max_seq_len=n,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_table=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(n, dtype=torch.long, device=dev),
            block_size=self.block_size,
            query_start_loc_cpu=torch.tensor([0, n], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([n], dtype=torch.int32),
        )
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        pos = torch.arange(n, dtype=torch.long, device=dev)
        with torch.inference_mode():
            hidden = self.model(ids, pos, caches, meta)
            self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs :])
        del caches

    def _allocate_kv(self, num_blocks: int) -> list[torch.Tensor]:
        m = self.config.model
        shape = (2, num_blocks, self.block_size, self.num_local_kv_heads, m.head_dim)
        return [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(m.num_layers)
        ]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        self.kv_caches = self._allocate_kv(num_blocks)
        max_conc = num_blocks * self.block_size / m.max_model_len
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB); max concurrency at %d tokens per "
            "request: %.1fx",
            num_blocks,
            self.block_size,
            num_blocks * self.kv_block_bytes() / 2**30,
            m.max_model_len,
            max_conc,
        )

    # ------------------------------------------------------------------ step

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            self.batch.add(new)
        self.batch.update(so.scheduled_cached_reqs)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(step_id=so.step_id)
        states, q_lens = self._order(so)
        inputs = self._prepare_inputs(states, q_lens)
        hidden = self.model(
            inputs["input_ids"], inputs["positions"], self.kv_caches, inputs["meta"]
        )
        sample_idx = inputs["sample_idx"]
        req_ids = [s.req_id for s in states]
        if len(sample_idx) == 0:
            return ModelRunnerOutput(
                step_id=so.step_id, req_ids=req_ids, sampled_token_ids=[[] for _ in states]
            )
        logits = self.model.compute_logits(hidden[inputs["logits_indices"]])
        sampled = self._sample(logits, states, sample_idx, inputs["seq_lens_np"]).tolist()
        out: list[list[int]] = [[] for _ in states]
        for i, tok in zip(sample_idx, sampled, strict=True):
            self.batch.append_token(states[i], tok)
            out[i] = [tok]
        for s, q in zip(states, q_lens, strict=True):
            s.num_computed_tokens += q
        return ModelRunnerOutput(step_id=so.step_id, req_ids=req_ids, sampled_token_ids=out)

    def _order(self, so: SchedulerOutput) -> tuple[list[RequestState], np.ndarray]:
        """Scheduled requests with the single-token (decode) ones first."""
        reqs = self.batch.requests
        decodes, others = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            (decodes if n == 1 else others).append((reqs[req_id], n))
        ordered = decodes + others
        states = [s for s, _ in ordered]
        q_lens = np.fromiter((n for _, n in ordered), dtype=np.int64, count=len(ordered))
        self._num_decodes = len(decodes)
        return states, q_lens

    def _prepare_inputs(self, states: list[RequestState], q_lens: np.ndarray) -> dict:
        b = self.batch
        bs = self.block_size
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        computed = np.fromiter(
            (s.num_computed_tokens for s in states), dtype=np.int64, count=len(states)
        )
        num_tokens_known = np.fromiter((s.num_tokens for s in states), np.int64, len(states))
        cu = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        tok_rows = np.repeat(rows, q_lens)
        positions = np.repeat(computed, q_lens) + (np.arange(total) - np.repeat(cu[:-1], q_lens))
        input_ids = b.token_ids[tok_rows, positions]
        slots = b.block_table[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = computed + q_lens
        max_blocks = int(-(-seq_lens.max() // bs))
        block_table = b.block_table[rows, :max_blocks]
        samples = seq_lens >= num_tokens_known
        sample_idx = np.nonzero(samples)[0]
        dev = self.device
        qsl_cpu = torch.from_numpy(cu.astype(np.int32))
        sl_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        meta = AttentionMetadata(
            num_tokens=total,
            num_seqs=len(states),
            num_decodes=self._num_decodes,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens=sl_cpu.to(dev, non_blocking=True),
            block_table=torch.from_numpy(block_table).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            block_size=bs,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=sl_cpu,
        )
        return {
            "input_ids": torch.from_numpy(input_ids).to(dev, non_blocking=True),
            "positions": torch.from_numpy(positions).to(dev, non_blocking=True),
            "meta": meta,
            "logits_indices": torch.from_numpy(cu[1:][sample_idx] - 1).to(dev, non_blocking=True),
            "sample_idx": sample_idx.tolist(),
            "seq_lens_np": seq_lens,
        }

    def _sample(
        self, logits: torch.Tensor, states: list[RequestState], sample_idx: list[int], seq_lens
    ) -> torch.Tensor:
        from minivllm.worker.sampler import SamplingMetadata, sample

        b = self.batch
        rows = np.fromiter((states[i].row for i in sample_idx), np.int64, len(sample_idx))
        temp = b.temperature[rows]
        dev = self.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev, non_blocking=True)

        meta = SamplingMetadata(
            temperature=t(temp),
            top_k=t(b.top_k[rows]),
            top_p=t(b.top_p[rows]),
            min_p=t(b.min_p[rows]),
            seeds=t(b.seeds[rows]),
            positions=t(seq_lens[sample_idx]),
            all_greedy=bool((temp < 1e-5).all()),
            all_random=bool((temp >= 1e-5).all()),
        )
        return sample(logits.float(), meta)
