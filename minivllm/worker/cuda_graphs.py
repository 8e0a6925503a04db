"""CUDA graphs of the whole forward (embedding, every layer, attention, final norm).

The graphs read their inputs from the runner's persistent device buffers (`StepBuffers`),
so a replay costs one launch (5 µs for ~300 kernels) instead of ~300 launches, each of
which costs the host 10-40 µs (an eager 512-token prefill of Qwen3-0.6B on an H100: 2 ms
of kernels behind 22 ms of launches).

- A pure-decode step of n sequences replays the graph of the smallest captured batch size
  B >= n (plain, or cascade when its rows share a prefix). Rows n..B-1 are padding: slot -1
  (their keys/values are stored nowhere) and sequence length 0 (the decode kernel reads no
  keys for them and writes zeros).
- A step of only prompts -- at most `PREFILL_GRAPH_SEQS` of them, `total` tokens in all --
  replays the prefill graph of the smallest captured token count T >= total. Tokens
  total..T-1 are padding (slot -1, belonging to no sequence: attention never computes them,
  and no row of the GEMMs or norms mixes with another); sequences n.. have no query
  tokens, so their attention programs return at once. The prefill kernel's grid is fixed
  by T and the sequence count, not by this step's prompt lengths.
- With speculative decoding, a step of n sequences of at most 1 + k tokens each (decodes
  and requests verifying up to k draft tokens, or short prompt chunks) replays the verify
  graph of the smallest captured batch size B >= n, keyed by its B x (1 + k) tokens: every
  sequence goes through the prefill kernel (its grid fixed by B and 1 + k); the tokens past
  the step's are padding, and sequences n.. have none, as in a prefill graph.
Any other step (mixed decodes and prompts, or longer) runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from functools import partial

import torch

from minivllm.worker.step_buffers import DeviceViews, StepBuffers
from minivllm.worker.triton_compiles import build_ahead

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


PREFILL_GRAPH_SEQS = 4  # prompts per prompt-only step that a prefill graph covers
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)  # token counts of the prefill graphs


def prefill_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """The prefill graphs' token counts that a step may schedule."""
    return [t for t in PREFILL_GRAPH_TOKENS if t <= max_num_batched_tokens]


class StepGraphs:
    """The graphs of one kind of step, keyed by their padded size (decode: rows; prefill:
    tokens)."""

    def __init__(self, name: str = "decode") -> None:
        self.name = name
        self.pool: object = None
        self.sizes: list[int] = []
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def capture(
        self,
        forward: Callable[[int], torch.Tensor],
        sizes: list[int],
        pool: object = None,
        warm_up: bool = True,
    ) -> None:
        """Capture `forward(B)` (the forward of size B over the static buffers) for each
        size; the largest first, so the smaller ones reuse its memory pool (or `pool`, that
        of other graphs: only one graph runs at a time). `warm_up=False`: every kernel the
        forwards launch is built and loaded already (`build_ahead`)."""
        start = time.monotonic()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for size in sorted(sizes, reverse=True):
            if warm_up:
                forward(size)  # Triton compiles and loads its kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = forward(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.sizes = sorted(sizes)
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured %d CUDA graphs for %s sizes %s in %.1f s, using %.2f GiB",
            len(sizes),
            self.name,
            _ranges(self.sizes),
            time.monotonic() - start,
            used / 2**30,
        )

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size >= n, or None when n is larger than all of them."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size`; returns its output (hidden states [tokens, hidden]),
        which the next replay of a graph of the same pool overwrites."""
        graph, out = self._graphs[size]
        graph.replay()
        return out


def static_forward(
    model: torch.nn.Module, kv_caches: list[torch.Tensor], buffers: StepBuffers, max_len: int
) -> Callable[..., torch.Tensor]:
    """`forward(num_tokens, num_seqs, num_decodes, cascade, max_query_len)`: the forward of
    `model` (the target, or a draft model) over the static device buffers for a step of that
    shape, as a graph captures it: every length is read on the device, only the shapes are
    fixed."""
    d = buffers.dev

    def forward(
        num_tokens: int,
        num_seqs: int,
        num_decodes: int,
        cascade: bool = False,
        max_query_len: int | None = None,
    ) -> torch.Tensor:
        meta = buffers.attention_metadata(
            num_tokens,
            num_seqs,
            num_decodes,
            max_query_len=max_query_len or (1 if num_decodes else num_tokens),
            max_seq_len=max_len,
            with_host_copies=False,
            cascade=cascade,
        )
        return model(d.input_ids[:num_tokens], d.positions[:num_tokens], kv_caches, meta)

    return forward


class RunnerGraphs:
    """Every graph a model runner replays, and which one a step's shape takes. `forward`
    (num_tokens, num_seqs, num_decodes, cascade) runs the model over the static buffers."""

    def __init__(
        self, max_num_seqs: int, cascade: bool, prefill: bool, verify_width: int = 0
    ) -> None:
        """`verify_width`: 1 + the draft tokens a request verifies per step (0: none)."""
        self._args = (max_num_seqs, cascade, prefill, verify_width)
        self.decode = StepGraphs()
        # decode steps whose rows share a cached prefix attend it once (attention/cascade.py);
        # their graphs are captured for fewer sizes (padding rows cost little at those sizes)
        self.cascade = StepGraphs("cascade decode")
        self.prefill = StepGraphs("prefill")  # none captured: prompts run eagerly
        # keyed by token count: B sequences of up to verify_width tokens, B x verify_width
        self.verify = StepGraphs("verify")
        self.with_cascade, self.with_prefill = cascade, prefill
        self.prefill_seqs = min(PREFILL_GRAPH_SEQS, max_num_seqs)
        self.verify_width = verify_width if prefill else 0

    def capture(
        self,
        forward: Callable[..., torch.Tensor],
        d: DeviceViews,
        max_num_seqs: int,
        max_tokens: int,
        pool: object = None,
    ) -> None:
        """Capture every graph over the device views `d`, which hold what padding holds at
        replay: no KV slot, no context, no query tokens; in the memory pool `pool` (that of
        other graphs, which never run at the same time), or a new one."""
        d.slot_mapping.fill_(-1)
        d.seq_lens.zero_()
        d.decode_order.copy_(torch.arange(d.decode_order.numel(), dtype=torch.int32))
        d.input_ids.zero_()
        d.positions.zero_()
        d.cascade_prefix_len.zero_()
        d.query_start_loc.zero_()
        plan = self._plan(forward, max_num_seqs, max_tokens)
        # every Triton kernel variant of every graph, built side by side; these forwards
        # then also stand for each capture's warm-up (cuBLAS and the allocator see each shape)
        built = build_ahead(partial(run, size) for _, run, sizes in plan for size in sizes)
        for graphs, run, sizes in plan:
            graphs.capture(run, sizes, pool, warm_up=not built)
            pool = graphs.pool  # one step runs at a time: every graph shares one pool

    def _plan(
        self, forward: Callable[..., torch.Tensor], max_num_seqs: int, max_tokens: int
    ) -> list[tuple[StepGraphs, Callable[[int], torch.Tensor], list[int]]]:
        """(graphs, their forward of a size, their sizes) of each kind of graph."""
        sizes = capture_sizes(min(max_num_seqs, max_tokens))
        plan = [(self.decode, lambda b: forward(b, b, b), sizes)]
        if self.with_cascade:
            cascade_sizes = [s for s in sizes if s & (s - 1) == 0 and s >= 8] or sizes[-1:]
            if cascade_sizes[-1] != sizes[-1]:
                cascade_sizes.append(sizes[-1])
            plan.append((self.cascade, lambda b: forward(b, b, b, True), cascade_sizes))
        if self.with_prefill:
            prefill = lambda t: forward(t, self.prefill_seqs, 0)  # noqa: E731
            plan.append((self.prefill, prefill, prefill_capture_sizes(max_tokens)))
        width = self.verify_width
        verify_sizes = [b * width for b in sizes if b * width <= max_tokens]
        if width and verify_sizes:
            verify = lambda t: forward(t, t // width, 0, False, width)  # noqa: E731
            plan.append((self.verify, verify, verify_sizes))
        return plan

    def like(self) -> RunnerGraphs:
        """Graphs of the same kinds, none captured yet (a draft model's)."""
        return RunnerGraphs(*self._args)

    def family(self, name: str) -> StepGraphs:
        """The graphs of one kind of step, by `StepGraphs.name`."""
        families = (self.decode, self.cascade, self.prefill, self.verify)
        return next(g for g in families if g.name == name)

    def pick(
        self, n: int, nd: int, total: int, cascade: bool, max_query_len: int = 1
    ) -> tuple[StepGraphs | None, int, int]:
        """The graphs that run a step of n sequences (nd of them decodes, `total` tokens, at
        most `max_query_len` per sequence), with its padded token and sequence counts;
        (None, total, n): run it eagerly."""
        if nd == n:
            graphs = self.cascade if cascade else self.decode
            size = graphs.padded_size(n)
            if size is not None:
                return graphs, size, size
        if max_query_len <= self.verify_width:
            size = self.verify.padded_size(n * self.verify_width)
            if size is not None:
                return self.verify, size, size // self.verify_width
        elif nd == 0 and n <= self.prefill_seqs:
            size = self.prefill.padded_size(total)
            if size is not None:
                return self.prefill, size, self.prefill_seqs
        return None, total, n


def _ranges(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return str(sizes)
    return f"[{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}]"
