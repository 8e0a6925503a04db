"""Runs one `SchedulerOutput` through the model and samples the next tokens.

One step: apply the scheduler's diffs to the persistent `InputBatch`; write the step's inputs
into the pinned `StepBuffers` with numpy and copy them to the device in one go; fill the input
ids of tokens still in flight from the previous step's sampled ids on the device; run the
model (a CUDA graph replay for a pure-decode step); sample on the device; start a
non_blocking copy of the sampled ids back. Nothing on this path waits for the GPU, so with
async scheduling the host prepares step N+1 while the GPU runs step N.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.protocol.messages import GrammarBitmask, SchedulerOutput
from minivllm.worker.async_output import AsyncModelRunnerOutput
from minivllm.worker.attention.cascade import use_cascade
from minivllm.worker.attention.metadata import AttentionMetadata, one_prompt_metadata
from minivllm.worker.cuda_graphs import RunnerGraphs, StepGraphs, step_metadata
from minivllm.worker.grammar_bitmask import GrammarBitmasks
from minivllm.worker.input_batch import InputBatch, RequestState
from minivllm.worker.kv_cache_memory import KVCacheShape, profiled_num_blocks
from minivllm.worker.logits_processors import LogitsProcessors
from minivllm.worker.ops.kv_cache import cache_dtype
from minivllm.worker.prompt_logprobs import compute_prompt_logprobs
from minivllm.worker.sampler import Sampler, SamplingMetadata
from minivllm.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV sizing leaves this share of the GPU to the CUDA graphs' memory pool (captured later)
_GRAPH_RESERVE = 0.01
# attention backends that never read device data on the host, so a decode step can be captured
_GRAPH_SAFE_BACKENDS = ("triton", "flash-attn")


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, tp) -> None:
        self.config = config
        self.device = device
        self.tp = tp
        self.dtype = _DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        m = config.model
        self.kv_shape = KVCacheShape(
            m.num_layers,
            self.block_size,
            max(1, m.num_kv_heads // tp.size),
            m.head_dim,
            cache_dtype(config.cache.kv_cache_dtype, self.dtype),
        )
        max_len = config.model.max_model_len
        self.max_blocks_per_req = -(-max_len // self.block_size)
        max_seqs = config.scheduler.max_num_seqs
        self.batch = InputBatch(max_seqs, max_len, self.max_blocks_per_req)
        self.buffers = StepBuffers(
            max_seqs, config.scheduler.max_num_batched_tokens, self.max_blocks_per_req, device
        )
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        from minivllm.worker.attention.selector import get_attention_backend

        self.attn_backend_name, self.attn_backend = get_attention_backend(
            device.type, block_size=self.block_size, head_dim=m.head_dim, dtype=self.kv_shape.dtype
        )
        self.use_graphs = (
            device.type == "cuda"
            and not config.device.enforce_eager
            and self.attn_backend_name in _GRAPH_SAFE_BACKENDS
        )
        # windowed layers attend their own window only: cascade needs a layer without one
        self.cascade = (
            self.attn_backend_name == "triton"
            and not config.model.disable_cascade_attn
            and config.model.kv_sliding_window is None
        )
        # steps of a few short prompts (a batch-1 TTFT) replay graphs too: the Triton prefill
        # kernel's grid is fixed by the padded shape; other backends run prompts eagerly
        self.graphs = RunnerGraphs(max_seqs, self.cascade, self.attn_backend_name == "triton")
        # FP8 scales wait for the first prefill unless the checkpoint has them (load_model)
        self._calculate_kv_scales = False
        self.sampler = Sampler(tp.size, config.model.logprobs_mode)
        self.processors = LogitsProcessors(max_seqs, config.model.vocab_size, device)
        self.grammar_bitmasks: GrammarBitmasks | None = None  # with the first structured step
        # launched steps whose sampled ids have not been applied to the host token ids yet
        self._pending: deque[tuple[AsyncModelRunnerOutput, list[RequestState]]] = deque()

    def load_model(self) -> None:
        from minivllm.worker.model_loader import load_model

        self.model = load_model(self.config.model, self.device, self.tp, self.attn_backend)
        cache = self.config.cache
        if cache.fp8_kv:
            from_checkpoint = getattr(self.model, "has_kv_scales", False)
            self._calculate_kv_scales = cache.calculate_kv_scales and not from_checkpoint
            source = "the checkpoint" if from_checkpoint else "the first prefill"
            if not (from_checkpoint or self._calculate_kv_scales):
                source = "1.0 (none in the checkpoint; calculate_kv_scales is off)"
            logger.info("FP8 KV cache: per-layer k/v scales from %s", source)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit: an override, a fixed byte budget, or the profiled free memory."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            num = cache.kv_cache_memory_bytes // self.kv_shape.block_bytes
            # no need to hold more than every sequence at full length
            cap = self.config.scheduler.max_num_seqs * self.max_blocks_per_req + 1
            return int(min(num, cap))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        reserve = _GRAPH_RESERVE if self.use_graphs else 0.0
        utilization = cache.gpu_memory_utilization
        return profiled_num_blocks(self.kv_shape, self.device, utilization, reserve)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A worst-case forward (max_num_batched_tokens tokens) and a sample of max_num_seqs
        rows, to measure peak activations."""
        sched = self.config.scheduler
        n = max(1, min(sched.max_num_batched_tokens, self.config.model.max_model_len))
        dev = self.device
        caches = self.kv_shape.allocate(-(-n // self.block_size), dev)
        meta = one_prompt_metadata(n, self.block_size, dev)
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        pos = torch.arange(n, dtype=torch.long, device=dev)
        hidden = self.model(ids, pos, caches, meta)
        rows = min(n, sched.max_num_seqs)
        logits = self.model.compute_logits(hidden[-rows:])
        self.sampler.sample_logits(logits, SamplingMetadata.from_buffers(self.buffers, rows))
        del caches

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, capture the decode graphs over it, warm the allocator."""
        m = self.config.model
        self.kv_caches = self.kv_shape.allocate(num_blocks, self.device)
        max_conc = num_blocks * self.block_size / m.max_model_len
        logger.info(
            "KV cache: %d blocks of %d tokens (%s, %.2f GiB); max concurrency at %d tokens "
            "per request: %.1fx",
            num_blocks,
            self.block_size,
            str(self.kv_shape.dtype).removeprefix("torch."),
            num_blocks * self.kv_shape.block_bytes / 2**30,
            m.max_model_len,
            max_conc,
        )
        if self.use_graphs:
            sched = self.config.scheduler
            with torch.inference_mode():
                self.graphs.capture(
                    self._static_forward, self.buffers.dev, sched.max_num_seqs,
                    sched.max_num_batched_tokens,
                )  # fmt: skip
        elif self.device.type == "cuda":
            why = (
                "enforce_eager"
                if self.config.device.enforce_eager
                else f"the {self.attn_backend_name} attention backend reads device data on the host"
            )
            logger.info("CUDA graphs off (%s)", why)
        if self.device.type == "cuda":
            # fill the caching allocator with a full-size step's activations now: the first
            # long prefill steps of a run otherwise cudaMalloc them, which stalls the stream
            self.profile_run()

    def _static_forward(
        self, num_tokens: int, num_seqs: int, num_decodes: int, cascade: bool = False
    ) -> torch.Tensor:
        """The forward of a step of this shape over the static device buffers."""
        d, max_len = self.buffers.dev, self.config.model.max_model_len
        meta = step_metadata(
            d, num_tokens, num_seqs, num_decodes, self.block_size, max_len, cascade
        )
        return self.model(d.input_ids[:num_tokens], d.positions[:num_tokens], self.kv_caches, meta)

    @torch.inference_mode()
    def execute_model_async(
        self, so: SchedulerOutput, bitmask: Callable[[], GrammarBitmask] | None = None
    ) -> AsyncModelRunnerOutput:
        """Launch one step; its output's `get()` waits for the sampled ids. A step with
        structured outputs calls `bitmask` for its grammar bitmask (which may wait for it)
        once its forward is launched."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return AsyncModelRunnerOutput(so.step_id, [], [], None)
        self._apply_older_outputs()
        states, sample_idx, meta, replay, sampling = self._prepare_inputs(so)
        d = self.buffers.dev
        if replay is not None:
            graphs, size = replay
            hidden = graphs.replay(size)
        else:
            n = meta.num_tokens
            hidden = self.model(d.input_ids[:n], d.positions[:n], self.kv_caches, meta)
        req_ids = [s.req_id for s in states]
        prompt_logprobs = None
        if self.batch.num_prompt_logprobs:
            prompt_logprobs = compute_prompt_logprobs(
                self.model, hidden, states, meta.query_start_loc_cpu, self.batch, self.config
            )
        if not sample_idx:
            return AsyncModelRunnerOutput(so.step_id, req_ids, [], None, prompt_logprobs)
        ns = len(sample_idx)
        sampled_states = [states[i] for i in sample_idx]
        rows = hidden.index_select(0, d.logits_indices[:ns])
        grammar = None
        if so.structured_output_req_ids:
            if self.grammar_bitmasks is None:
                self.grammar_bitmasks = GrammarBitmasks(
                    self.config.scheduler.max_num_seqs, self.config.model.vocab_size, self.device
                )
            sample_rows = {s.req_id: j for j, s in enumerate(sampled_states)}
            grammar = self.grammar_bitmasks.waiter(
                bitmask, so.step_id, so.structured_output_req_ids, sample_rows
            )
        result = self.sampler(self.model, rows, sampling, grammar)
        out = AsyncModelRunnerOutput(so.step_id, req_ids, sample_idx, result, prompt_logprobs)
        for j, s in enumerate(sampled_states):
            s.num_tokens += 1
            s.last_sample = (out, j)
        self._pending.append((out, sampled_states))
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            state = self.batch.remove(req_id)
            if state is not None:
                self.processors.remove(state.row)
        for new in so.scheduled_new_reqs:
            row = self.batch.add(new).row
            self.processors.add(row, new.sampling_params, new.token_ids, new.num_prompt_tokens)
        self.batch.update(so.scheduled_cached_reqs)

    def _apply_older_outputs(self) -> None:
        """Write the sampled ids of every launched step but the newest into the host token
        ids. Those steps ran before the newest one, so this seldom waits; the newest one's
        ids are read on the device by the step about to launch."""
        while len(self._pending) > 1:
            out, states = self._pending.popleft()
            for s, tok in zip(states, out.token_ids(), strict=True):
                # a request that finished or was preempted since has a new state (or none)
                if self.batch.requests.get(s.req_id) is s:
                    self.batch.append_host_token(s, tok)

    def _prepare_inputs(
        self, so: SchedulerOutput
    ) -> tuple[
        list[RequestState], list[int], AttentionMetadata, tuple[StepGraphs, int] | None,
        SamplingMetadata,
    ]:  # fmt: skip
        """Fill and copy the step buffers. Returns the scheduled requests (single-token ones
        first), the indices of those that sample, the attention metadata, the CUDA graphs
        and size to replay (None: run eagerly) and the sampling rows' metadata."""
        reqs = self.batch.requests
        decodes, others, other_lens = [], [], []
        for req_id, q in so.num_scheduled_tokens.items():
            if q == 1:
                decodes.append(reqs[req_id])
            else:
                others.append(reqs[req_id])
                other_lens.append(q)
        states = decodes + others
        n, nd = len(states), len(decodes)
        q_lens = np.ones(n, dtype=np.int64)
        q_lens[nd:] = other_lens
        rows = np.fromiter((s.row for s in states), np.int64, n)
        computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, n)
        num_tokens = np.fromiter((s.num_tokens for s in states), np.int64, n)
        num_host = np.fromiter((s.num_host_tokens for s in states), np.int64, n)
        seq_lens = computed + q_lens
        total = int(so.total_num_scheduled_tokens)
        cascade = self._cascade_prefix_len(so, computed[:nd], mixed=nd < n)
        # the first step with prompt tokens sets the FP8 scales (eagerly: its graph has none)
        compute_kv_scales = self._calculate_kv_scales and nd < n
        graphs, pad_tokens, pad_seqs = None, total, n
        if self.use_graphs and not compute_kv_scales:
            graphs, pad_tokens, pad_seqs = self.graphs.pick(n, nd, total, bool(cascade))

        h = self.buffers.next_host()
        bs, b = self.block_size, self.batch
        cu = h.query_start_loc[: n + 1]
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1:])
        if nd == n:
            tok_rows, positions = rows, computed
        else:
            tok_rows = np.repeat(rows, q_lens)
            starts = np.repeat(computed - cu[:-1], q_lens)
            positions = starts + np.arange(total)
        h.positions[:total] = positions
        h.input_ids[:total] = b.token_ids[tok_rows, positions]
        h.slot_mapping[:total] = b.block_table[tok_rows, positions // bs] * bs + positions % bs
        h.seq_lens[:n] = seq_lens
        h.cascade_prefix_len[0] = cascade
        if graphs is not None:  # padding tokens store no KV; padding rows have no context
            h.input_ids[total:pad_tokens] = 0
            h.positions[total:pad_tokens] = 0
            h.slot_mapping[total:pad_tokens] = -1
            h.seq_lens[n:pad_seqs] = 0
            h.query_start_loc[n + 1 : pad_seqs + 1] = total
        if self.buffers.on_cuda and nd:
            # the attention kernels start the longest contexts first (padding rows last)
            h.decode_order[:nd] = np.argsort(-seq_lens[:nd], kind="stable")
            h.decode_order[nd:pad_seqs] = np.arange(nd, pad_seqs)
        width = -(-int(seq_lens.max()) // bs)
        h.block_table[:n, :width] = b.block_table[rows, :width]

        # a request samples once this step has computed every token it has
        sample_idx = np.flatnonzero(seq_lens >= num_tokens)
        ns = len(sample_idx)
        h.logits_indices[:ns] = cu[1:][sample_idx] - 1
        sampling = SamplingMetadata.prepare(
            b, self.processors, self.buffers, rows[sample_idx], seq_lens[sample_idx]
        )

        # the last input token of a decoding request may be the newest step's sample, which
        # only the device has yet: gather it there instead of waiting for it
        in_flight = np.flatnonzero(seq_lens > num_host)
        latest = self._pending[-1][0] if self._pending else None
        for g, i in enumerate(in_flight.tolist()):
            out, j = states[i].last_sample
            assert out is latest, "an in-flight token of an older step was not applied"
            h.gather_src[g] = j
        h.gather_dst[: len(in_flight)] = cu[1:][in_flight] - 1

        self.buffers.copy_to_device(pad_seqs)
        d = self.buffers.dev
        if len(in_flight):
            g = len(in_flight)
            prev = latest.sampled.index_select(0, d.gather_src[:g])
            d.input_ids.index_copy_(0, d.gather_dst[:g], prev)
        meta = AttentionMetadata(
            num_tokens=total,
            num_seqs=n,
            num_decodes=nd,
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=d.query_start_loc[: n + 1],
            seq_lens=d.seq_lens[:n],
            block_table=d.block_table[:n],
            slot_mapping=d.slot_mapping[:total],
            block_size=bs,
            query_start_loc_cpu=torch.from_numpy(cu),
            seq_lens_cpu=torch.from_numpy(h.seq_lens[:n]),
            decode_order=d.decode_order[:nd] if self.buffers.on_cuda and nd else None,
            cascade_prefix_len=d.cascade_prefix_len if cascade else None,
        )
        if compute_kv_scales:
            meta.compute_kv_scales, self._calculate_kv_scales = True, False
        replay = (graphs, pad_tokens) if graphs is not None else None
        return states, sample_idx.tolist(), meta, replay, sampling

    def _cascade_prefix_len(
        self, so: SchedulerOutput, computed: np.ndarray, mixed: bool = False
    ) -> int:
        """Tokens at the head of every decode row's context that cascade attention should
        read once this step (0: attend as usual). The blocks held by every running request
        are whole, cached and computed; the prefix stops at the shortest decode context.
        With CUDA graphs only pure-decode steps (graph replays) use it: a step with prompt
        tokens is rare, and would compile kernel variants for its decode count mid-run."""
        if not (self.cascade and so.num_common_prefix_blocks and len(computed)):
            return 0
        if mixed and self.use_graphs:
            return 0
        bs = self.block_size
        prefix_len = min(so.num_common_prefix_blocks * bs, int(computed.min()) // bs * bs)
        return prefix_len if use_cascade(len(computed), prefix_len) else 0
