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

Speculative decoding: a request with draft tokens (`scheduled_spec_decode_tokens`) runs its
last token and the drafts, samples a row after each, and the sampler keeps the accepted
drafts and one more token (spec_decode/verification.py). Such a step first takes every
earlier step's tokens onto the host (the engine-core has them already, so this does not
wait): the rows after the drafts read the whole output on the host.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.protocol.messages import GrammarBitmask, SchedulerOutput
from minivllm.worker.async_output import AsyncModelRunnerOutput
from minivllm.worker.cuda_graphs import RunnerGraphs, static_forward
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
    StepInputs,
    order_requests,
    plan_forward,
    prepare_sampling,
    write_in_flight,
    write_token_inputs,
)
from minivllm.worker.triton_compiles import build_ahead

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
        spec = config.speculative
        # the most rows a step samples: each request's last token and its drafts
        self.max_sample_rows = max_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
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
            self.max_sample_rows,
        )
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        from minivllm.worker.attention.selector import get_attention_backend

        self.attn_backend_name, self.attn_backend = get_attention_backend(
            device.type, block_size=self.block_size, head_dim=m.head_dim, dtype=self.kv_shape.dtype
        )
        self.drafter = None  # speculative decoding's draft model
        if spec is not None and spec.method == "draft_model":
            from minivllm.worker.spec_decode.draft_model import DraftModel

            self.drafter = DraftModel(config, device, tp, self.dtype)
        self.use_graphs = (
            device.type == "cuda"
            and not config.device.enforce_eager
            and self.attn_backend_name in _GRAPH_SAFE_BACKENDS
            and (self.drafter is None or self.drafter.attn_backend_name == self.attn_backend_name)
        )
        # windowed layers attend their own window only: cascade needs a layer without one
        self.cascade = (
            self.attn_backend_name == "triton"
            and not config.model.disable_cascade_attn
            and config.model.kv_sliding_window is None
        )
        # steps of a few short prompts (a batch-1 TTFT) replay graphs too: the Triton prefill
        # kernel's grid is fixed by the padded shape; other backends run prompts eagerly
        prefill_graphs = self.attn_backend_name == "triton"
        # steps of requests verifying draft tokens replay graphs of 1 + k tokens per request
        self.verify_width = 1 + spec.num_speculative_tokens if spec is not None else 0
        self.graphs = RunnerGraphs(max_seqs, self.cascade, prefill_graphs, self.verify_width)
        # FP8 scales wait for the first prefill unless the checkpoint has them (load_model)
        self._calculate_kv_scales = False
        self.sampler = Sampler(config.model.logprobs_mode)
        self.processors = LogitsProcessors(max_seqs, config.model.vocab_size, device)
        self.grammar_bitmasks: GrammarBitmasks | None = None  # with the first structured step
        self._executed: ExecutedStep | None = None  # launched, not sampled yet
        # sampled steps whose sampled ids have not been applied to the host token ids yet
        self._pending: deque[tuple[AsyncModelRunnerOutput, list[RequestState]]] = deque()
        self.startup_s: dict[str, float] = {}  # seconds per phase of initialize_kv_cache

    def load_model(self) -> None:
        from minivllm.worker.model_loader import load_model

        self.model = load_model(
            self.config.model, self.device, self.tp, self.attn_backend,
            expert_parallel=self.config.parallel.enable_expert_parallel,
        )  # fmt: skip
        if self.drafter is not None:
            self.drafter.load_model()
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
        # the prompt path's Triton kernels, built side by side (the graphs build theirs)
        build_ahead([partial(self.profile_run, sample=False)])
        cache = self.config.cache
        block_bytes = self.kv_shape.block_bytes
        if self.drafter is not None:  # the draft's cache has the same blocks
            block_bytes += self.drafter.kv_shape.block_bytes
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            num = cache.kv_cache_memory_bytes // block_bytes
            # no need to hold more than every sequence at full length
            cap = self.config.scheduler.max_num_seqs * self.max_blocks_per_req + 1
            return int(min(num, cap))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        reserve = _GRAPH_RESERVE if self.use_graphs else 0.0
        utilization = cache.gpu_memory_utilization
        return profiled_num_blocks(block_bytes, self.device, utilization, reserve)

    @torch.inference_mode()
    def profile_run(self, sample: bool = True) -> None:
        """A worst-case forward (max_num_batched_tokens tokens) and a sample of max_num_seqs
        rows, to measure peak activations (`sample=False`: the forwards only)."""
        sched = self.config.scheduler
        n = max(1, min(sched.max_num_batched_tokens, self.config.model.max_model_len))
        caches = self.kv_shape.allocate(-(-n // self.block_size), self.device)
        meta = self.buffers.one_prompt(np.zeros(n, dtype=np.int64))
        d = self.buffers.dev
        hidden = self.model(d.input_ids[:n], d.positions[:n], caches, meta)
        if sample:
            rows = min(n, self.max_sample_rows)
            logits = self.model.compute_logits(hidden[-rows:])
            self.sampler(logits, SamplingMetadata.from_buffers(self.buffers, rows))
        del caches
        if self.drafter is not None:
            caches = self.drafter.kv_shape.allocate(-(-n // self.block_size), self.device)
            self.drafter.model(d.input_ids[:n], d.positions[:n], caches, meta)
            del caches

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, capture the decode graphs over it, warm the allocator."""
        start = time.perf_counter()
        m = self.config.model
        self.kv_caches = self.kv_shape.allocate(num_blocks, self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)
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
        self.startup_s["KV cache"] = time.perf_counter() - start
        start = time.perf_counter()
        if self.use_graphs:
            sched, max_len = self.config.scheduler, m.max_model_len
            with torch.inference_mode():
                forward = static_forward(self.model, self.kv_caches, self.buffers, max_len)
                self.graphs.capture(
                    forward, self.buffers.dev, sched.max_num_seqs, sched.max_num_batched_tokens
                )
                if self.drafter is not None:  # its own graphs of every kind, in the same pool
                    drafter = self.drafter
                    drafter.graphs = self.graphs.like()
                    forward = static_forward(
                        drafter.model, drafter.kv_caches, self.buffers, max_len
                    )
                    drafter.graphs.capture(
                        forward, self.buffers.dev, sched.max_num_seqs,
                        sched.max_num_batched_tokens, self.graphs.decode.pool,
                    )  # fmt: skip
            self.startup_s["CUDA graphs"] = time.perf_counter() - start
        elif self.device.type == "cuda":
            why = (
                "enforce_eager"
                if self.config.device.enforce_eager
                else f"the {self.attn_backend_name} attention backend reads device data on the host"
            )
            logger.info("CUDA graphs off (%s)", why)
        if self.device.type == "cuda":
            start = time.perf_counter()
            # fill the caching allocator with a full-size step's activations now: the first
            # long prefill steps of a run otherwise cudaMalloc them, which stalls the stream
            self.profile_run()
            self.startup_s["warm-up"] = time.perf_counter() - start

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
        self._apply_older_outputs(keep_newest=not so.scheduled_spec_decode_tokens)
        step.inputs = inputs = self._prepare_inputs(so)
        step.req_ids = [s.req_id for s in inputs.requests]
        if self.drafter is not None and inputs.sampling is not None:
            self._attach_draft_probs(step)
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
        if self.drafter is not None:  # the draft's KV of the same tokens
            plan, d = inputs.plan, self.buffers.dev
            graph = None if plan.graphs is None else (plan.graphs.name, plan.num_tokens)
            self.drafter.forward(d.input_ids, d.positions, inputs.attn, graph)

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
        verification = sampling.verification
        if step.logits is None:
            m = sampling.metadata
            drawn = self.model.lm_head.draw(step.hidden, m.temperature, m.seeds, m.positions)
            result = SamplerOutput.of(drawn, verification)
        else:
            result = self.sampler(step.logits, sampling.metadata, grammar, verification)
        drafts = None
        if self.drafter is not None:
            num_tokens = None if result.verified is None else result.verified.num_tokens
            drafts = self.drafter.propose(
                self.buffers, self.batch, [s.req_id for s in sampled_states], sampling.metadata,
                np.cumsum(sampling.num_rows) - sampling.num_rows, result.sampled, num_tokens,
            )  # fmt: skip
        out = AsyncModelRunnerOutput(
            step.step_id, step.req_ids, sampling.req_idx, result, step.prompt_logprobs,
            None if verification is None else sampling.num_rows, drafts,
        )  # fmt: skip
        num_rows_each = sampling.num_rows.tolist()  # (Python ints: this runs per request)
        for j, (s, num_rows) in enumerate(zip(sampled_states, num_rows_each, strict=True)):
            if num_rows > 1:
                s.unsettled = True  # how many tokens it got: the next diff says
            else:
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
        verification = step.sampling.verification
        return (
            self.tp.size > 1
            and not step.structured_req_ids
            and not step.sampling.metadata.needs_whole_rows
            and (verification is None or verification.draft_probs is None)
        )

    def _attach_draft_probs(self, step: ExecutedStep) -> None:
        """The draft distributions of the drafts the step verifies (drawn at temperature > 0)."""
        verification = step.sampling.verification
        if verification is not None:
            states = step.sampling_requests
            temperature = self.batch.temperature[[s.row for s in states]].tolist()
            self.drafter.attach_probs(verification, [s.req_id for s in states], temperature)

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
                self.max_sample_rows, self.config.model.vocab_size, self.device
            )
        counts = step.sampling.num_rows.tolist()
        firsts = np.cumsum([0, *counts[:-1]]).tolist()
        sample_rows = {s.req_id: (f, c) for s, f, c in zip(sampled, firsts, counts, strict=True)}
        return self.grammar_bitmasks.stage_step(
            msg, step.step_id, step.structured_req_ids, sample_rows
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            state = self.batch.remove(req_id)
            if state is not None:
                self.processors.remove(state.row)
            if self.drafter is not None:
                self.drafter.forget(req_id)
        for new in so.scheduled_new_reqs:
            row = self.batch.add(new).row
            self.processors.add(
                row, new.sampling_params, new.token_ids, new.num_prompt_tokens,
                new.min_tokens_stop_ids,
            )  # fmt: skip
        self.batch.update(so.scheduled_cached_reqs)
        for req_id, draft_ids in so.scheduled_spec_decode_tokens.items():
            self.batch.write_drafts(self.batch.requests[req_id], draft_ids)

    def _apply_older_outputs(self, keep_newest: bool = True) -> None:
        """Write the sampled ids of every launched step but the newest (`keep_newest`) into
        the host token ids. Those steps ran before the newest one, so this seldom waits; the
        newest one's ids are read on the device by the step about to launch."""
        while len(self._pending) > keep_newest:
            out, states = self._pending.popleft()
            for s, tokens in zip(states, out.token_ids(), strict=True):
                # a request that finished or was preempted since has a new state (or none)
                if self.batch.requests.get(s.req_id) is s:
                    for tok in tokens:
                        self.batch.append_host_token(s, tok)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """The step's inputs, in the step buffers on the device (phases: step_inputs.py)."""
        sched = order_requests(so, self.batch)
        # the first step with prompt tokens sets the FP8 scales (eagerly: its graph has none)
        compute_kv_scales = self._calculate_kv_scales and sched.num_decodes < sched.num_seqs
        if compute_kv_scales:
            self._calculate_kv_scales = False
        graphs = self.graphs if self.use_graphs else None
        plan = plan_forward(so, sched, graphs, self.cascade, self.block_size, compute_kv_scales)
        h = self.buffers.next_host()
        write_token_inputs(h, sched, plan, self.batch, self.block_size, self.buffers.on_cuda)
        sampling = prepare_sampling(sched, self.batch, self.processors, self.buffers)
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
