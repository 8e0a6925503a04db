"""Runs a step in vLLM's two calls: `execute_model(scheduler_output)` launches its forward,
`sample_tokens(grammar_bitmask)` samples it.

`execute_model` applies the scheduler's diffs to the persistent `InputBatch`; builds the
step's `StepInputs` (step_inputs.py: written into the pinned `StepBuffers` with numpy and
copied to the device in one go; the input ids of tokens still in flight from the previous
step are gathered on the device); runs the model (a CUDA graph replay, or eagerly) and the
LM head over the rows that sample. `sample_tokens` applies the step's grammar bitmask, if it
has structured outputs, samples on the device and starts a non_blocking copy of the sampled
ids back. Nothing on this path waits for the GPU, so with async scheduling the host prepares
step N+1 while the GPU runs step N; and the engine-core fills a step's grammar bitmask while
the GPU runs its forward. A step without structured outputs needs no bitmask: the worker
makes both calls at once.
"""

from __future__ import annotations

import logging
from collections import deque

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.protocol.messages import GrammarBitmask, SchedulerOutput
from minivllm.worker.async_output import AsyncModelRunnerOutput
from minivllm.worker.attention.cascade import use_cascade
from minivllm.worker.cuda_graphs import RunnerGraphs
from minivllm.worker.grammar_bitmask import GrammarBitmasks, GrammarMask
from minivllm.worker.input_batch import InputBatch, RequestState
from minivllm.worker.kv_cache_memory import KVCacheShape, profiled_num_blocks
from minivllm.worker.logits_processors import LogitsProcessors
from minivllm.worker.ops.kv_cache import cache_dtype
from minivllm.worker.prompt_logprobs import compute_prompt_logprobs
from minivllm.worker.sampler import Sampler, SamplerOutput, SamplingMetadata
from minivllm.worker.step_buffers import StepBuffers
from minivllm.worker.step_inputs import (
    ExecutedStep,
    ForwardPlan,
    SamplingInputs,
    ScheduledBatch,
    StepInputs,
    order_requests,
    write_in_flight,
    write_logits_rows,
    write_token_inputs,
)

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
        self.long_rope_threshold = config.scheduler.long_rope_threshold
        self.batch = InputBatch(
            max_seqs, max_len, self.max_blocks_per_req, self.long_rope_threshold
        )
        self.buffers = StepBuffers(
            max_seqs,
            config.scheduler.max_num_batched_tokens,
            self.max_blocks_per_req,
            self.block_size,
            device,
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
        # steps of a few short prompts (a batch-1 TTFT) replay graphs too: the Triton prefill
        # kernel's grid is fixed by the padded shape; other backends run prompts eagerly
        self.cascade = self.attn_backend_name == "triton" and not config.model.disable_cascade_attn
        self.graphs = RunnerGraphs(max_seqs, self.cascade, self.attn_backend_name == "triton")
        # FP8 scales wait for the first prefill unless the checkpoint has them (load_model)
        self._calculate_kv_scales = False
        self.sampler = Sampler(config.model.logprobs_mode)
        self.processors = LogitsProcessors(max_seqs, config.model.vocab_size, device)
        self.grammar_bitmasks: GrammarBitmasks | None = None  # with the first structured step
        self._executed: ExecutedStep | None = None  # launched, not sampled yet
        # sampled steps whose sampled ids have not been applied to the host token ids yet
        self._pending: deque[tuple[AsyncModelRunnerOutput, list[RequestState]]] = deque()

    def load_model(self) -> None:
        from minivllm.worker.model_loader import load_model

        self.model = load_model(
            self.config.model, self.device, self.tp, self.attn_backend,
            expert_parallel=self.config.parallel.enable_expert_parallel,
        )  # fmt: skip
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
        caches = self.kv_shape.allocate(-(-n // self.block_size), self.device)
        meta = self.buffers.one_prompt(np.zeros(n, dtype=np.int64))
        d = self.buffers.dev
        hidden = self.model(d.input_ids[:n], d.positions[:n], caches, meta)
        rows = min(n, sched.max_num_seqs)
        logits = self.model.compute_logits(hidden[-rows:])
        self.sampler(logits, SamplingMetadata.from_buffers(self.buffers, rows))
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
        """The forward of a step of this shape over the static device buffers, as a graph
        captures it: every length is read on the device, only the shapes are fixed."""
        meta = self.buffers.attention_metadata(
            num_tokens,
            num_seqs,
            num_decodes,
            max_query_len=1 if num_decodes else num_tokens,
            max_seq_len=self.config.model.max_model_len,
            with_host_copies=False,
            cascade=cascade,
        )
        d = self.buffers.dev
        return self.model(d.input_ids[:num_tokens], d.positions[:num_tokens], self.kv_caches, meta)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        """Launch one step: its forward and the LM head over the rows that sample. The step
        waits for `sample_tokens`, which must come before the next one."""
        if self._executed is not None:
            raise RuntimeError(
                f"step {so.step_id} came before step {self._executed.step_id} was sampled"
            )
        self._update_states(so)
        step = ExecutedStep(so.step_id, [], so.structured_output_req_ids)
        self._executed = step
        if so.total_num_scheduled_tokens == 0:
            return
        self._apply_older_outputs()
        step.inputs = inputs = self._prepare_inputs(so)
        step.req_ids = [s.req_id for s in inputs.requests]
        hidden = self._forward(inputs)
        if self.batch.num_prompt_logprobs:
            step.prompt_logprobs = compute_prompt_logprobs(
                self.model, hidden, inputs.requests, inputs.attn.query_start_loc_cpu,
                self.batch, self.config,
            )  # fmt: skip
        if inputs.sampling is not None:
            # a new tensor: a graph's output is overwritten by its next replay
            step.hidden = hidden.index_select(0, inputs.sampling.logits_indices)
            if not self._draws_on_lm_head(step):
                # queued now, ahead of the wait for a grammar bitmask
                step.logits = self.model.compute_logits(step.hidden)

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_bitmask: GrammarBitmask | None = None
    ) -> AsyncModelRunnerOutput:
        """Sample the step `execute_model` launched; `grammar_bitmask` is that step's, if it
        has structured outputs. The output's `get()` waits for the sampled ids."""
        step, self._executed = self._executed, None
        if step is None:
            raise RuntimeError("sample_tokens without a step: execute_model launches one")
        sampling, sampled_states = step.sampling, step.sampling_requests
        grammar = self._stage_grammar(step, grammar_bitmask, sampled_states)
        if sampling is None:
            return AsyncModelRunnerOutput(
                step.step_id, step.req_ids, [], None, step.prompt_logprobs
            )
        if step.logits is None:
            m = sampling.metadata
            result = SamplerOutput(
                self.model.lm_head.draw(step.hidden, m.temperature, m.seeds, m.positions)
            )
        else:
            result = self.sampler(step.logits, sampling.metadata, grammar)
        out = AsyncModelRunnerOutput(
            step.step_id, step.req_ids, sampling.req_idx, result, step.prompt_logprobs
        )
        for j, s in enumerate(sampled_states):
            s.num_tokens += 1
            s.last_sample = (out, j)
        self._pending.append((out, sampled_states))
        return out

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The final hidden states of the step's tokens (padding rows included)."""
        plan = inputs.plan
        if plan.graphs is not None:
            return plan.graphs.replay(plan.num_tokens)
        d, n = self.buffers.dev, inputs.attn.num_tokens
        return self.model(d.input_ids[:n], d.positions[:n], self.kv_caches, inputs.attn)

    def _draws_on_lm_head(self, step: ExecutedStep) -> bool:
        """Whether each rank draws on its slice of the vocabulary (tensor parallelism, and no
        row needs more of its logits than the best token: no gather, no sampler)."""
        return (
            self.tp.size > 1
            and not step.structured_req_ids
            and not step.sampling.metadata.needs_whole_rows
        )

    def _stage_grammar(
        self, step: ExecutedStep, msg: GrammarBitmask | None, sampled: list[RequestState]
    ) -> GrammarMask | None:
        """The step's grammar bitmask on the device (None without structured outputs)."""
        if (msg is None) != (not step.structured_req_ids):
            raise RuntimeError(
                f"step {step.step_id} has {len(step.structured_req_ids)} structured-output "
                f"requests; sample_tokens got {'no' if msg is None else 'a'} grammar bitmask"
            )
        if msg is None:
            return None
        if self.grammar_bitmasks is None:
            self.grammar_bitmasks = GrammarBitmasks(
                self.config.scheduler.max_num_seqs, self.config.model.vocab_size, self.device
            )
        sample_rows = {s.req_id: j for j, s in enumerate(sampled)}
        return self.grammar_bitmasks.stage_step(
            msg, step.step_id, step.structured_req_ids, sample_rows
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            state = self.batch.remove(req_id)
            if state is not None:
                self.processors.remove(state.row)
        for new in so.scheduled_new_reqs:
            row = self.batch.add(new).row
            self.processors.add(
                row, new.sampling_params, new.token_ids, new.num_prompt_tokens,
                new.min_tokens_stop_ids,
            )  # fmt: skip
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

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """The step's inputs, in the step buffers on the device (phases: step_inputs.py)."""
        sched = order_requests(so, self.batch)
        plan = self._plan_forward(so, sched)
        h = self.buffers.next_host()
        write_token_inputs(h, sched, plan, self.batch, self.block_size, self.buffers.on_cuda)
        sampling = self._prepare_sampling(sched)
        latest = self._pending[-1][0] if self._pending else None
        num_in_flight = write_in_flight(h, sched, latest)
        self.buffers.copy_to_device(plan.num_seqs)
        if num_in_flight:
            d = self.buffers.dev
            prev = latest.sampled.index_select(0, d.gather_src[:num_in_flight])
            d.input_ids.index_copy_(0, d.gather_dst[:num_in_flight], prev)
        attn = self.buffers.attention_metadata(
            sched.total,
            sched.num_seqs,
            sched.num_decodes,
            max_query_len=int(sched.query_lens.max()),
            max_seq_len=int(sched.seq_lens.max()),
            cascade=bool(plan.cascade_prefix_len),
        )
        attn.compute_kv_scales = plan.compute_kv_scales
        return StepInputs(sched.requests, attn, plan, sampling)

    def _plan_forward(self, so: SchedulerOutput, sched: ScheduledBatch) -> ForwardPlan:
        """A CUDA graph replay and its padded sizes, or an eager forward."""
        n, nd = sched.num_seqs, sched.num_decodes
        cascade = self._cascade_prefix_len(so, sched.computed[:nd], mixed=nd < n)
        # the first step with prompt tokens sets the FP8 scales (eagerly: its graph has none)
        compute_kv_scales = self._calculate_kv_scales and nd < n
        if compute_kv_scales:
            self._calculate_kv_scales = False
        graphs, num_tokens, num_seqs = None, sched.total, n
        if self.use_graphs and not compute_kv_scales:
            graphs, num_tokens, num_seqs = self.graphs.pick(n, nd, sched.total, bool(cascade))
        return ForwardPlan(graphs, num_tokens, num_seqs, cascade, compute_kv_scales)

    def _prepare_sampling(self, sched: ScheduledBatch) -> SamplingInputs | None:
        """The logits rows and sampling parameters of the requests that sample."""
        req_idx = write_logits_rows(self.buffers.host, sched)
        if not len(req_idx):
            return None
        metadata = SamplingMetadata.prepare(
            self.batch, self.processors, self.buffers, sched.rows[req_idx], sched.seq_lens[req_idx]
        )
        logits_indices = self.buffers.dev.logits_indices[: len(req_idx)]
        return SamplingInputs(req_idx.tolist(), logits_indices, metadata)

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
