"""One step's inputs, staged in one pinned host buffer and copied to the device in one go.

Every per-step array (input ids, positions, slot mapping, query starts, sequence lengths,
sampling parameters, the block table rows) is a field of `StepViews`: a numpy view into a
preallocated host buffer (`StepBuffers.host`) and a tensor view into a device buffer of the
same layout (`StepBuffers.dev`). A step writes the host views with numpy and calls
`copy_to_device(rows)`: one non_blocking H2D copy instead of a tensor built from Python
lists per array (441 µs for five of them on an H100 host; 20 µs this way).

The device views never move, so a CUDA graph captured over them replays with whatever the
last copy put there. The block table comes last, so a step copies only the rows it uses.

On CUDA there are two host buffers, used in turn: the copy from one may still wait in the
stream (behind the previous step's kernels) while the host writes the next step into the
other; an event per buffer says when its last copy has left it. On the CPU the "device"
views are the host views themselves and the copy is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import numpy as np
import torch

from minivllm.worker.attention.metadata import AttentionMetadata

_ALIGN = 64  # bytes; every field starts aligned, so typed views of the byte buffer are legal

Array = TypeVar("Array", np.ndarray, torch.Tensor)


@dataclass(frozen=True, slots=True)
class StepViews(Generic[Array]):
    """The named views of one step buffer; S = max_num_seqs, T = max_num_batched_tokens,
    R = the most sampled rows (S, or S x (1 + k) with k draft tokens per request).
    Sequence-level fields, then token-level ones, the block table last (see _layout)."""

    query_start_loc: Array  # int32 [S + 1]
    seq_lens: Array  # int32 [S]
    decode_order: Array  # int32 [S]: decode rows, longest context first
    cascade_prefix_len: Array  # int32 [1]: tokens all decode rows share
    logits_indices: Array  # int64 [R]: the token rows whose hidden states are sampled
    # sampling parameters of the rows that sample, in logits order
    temperature: Array  # float32 [R]
    top_k: Array  # int32 [R]
    top_p: Array  # float32 [R]
    min_p: Array  # float32 [R]
    seeds: Array  # int64 [R]
    sample_positions: Array  # int64 [R]
    # written only in steps with penalties: the rows' requests' persistent-batch rows
    batch_rows: Array  # int64 [R]
    repetition_penalty: Array  # float32 [R]
    frequency_penalty: Array  # float32 [R]
    presence_penalty: Array  # float32 [R]
    # written only in steps that verify draft tokens: the draft each row checks (-1: none),
    # and where each row's token goes in the [requests, 1 + k] table of the step's tokens
    draft_ids: Array  # int64 [R]
    sample_slots: Array  # int64 [R]
    # input ids that are still on the device: input_ids[gather_dst] = prev[gather_src]
    gather_dst: Array  # int64 [S]
    gather_src: Array  # int64 [S]
    input_ids: Array  # int64 [T]
    positions: Array  # int64 [T]
    slot_mapping: Array  # int64 [T]; -1: store no KV (padding)
    block_table: Array  # int32 [S, max_blocks_per_seq]


HostViews = StepViews[np.ndarray]
DeviceViews = StepViews[torch.Tensor]


def _layout(s: int, t: int, b: int, r: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each StepViews field's dtype and shape, in buffer order."""
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    return {
        "query_start_loc": (i32, (s + 1,)),
        "seq_lens": (i32, (s,)),
        "decode_order": (i32, (s,)),
        "cascade_prefix_len": (i32, (1,)),
        "logits_indices": (i64, (r,)),
        "temperature": (f32, (r,)),
        "top_k": (i32, (r,)),
        "top_p": (f32, (r,)),
        "min_p": (f32, (r,)),
        "seeds": (i64, (r,)),
        "sample_positions": (i64, (r,)),
        "batch_rows": (i64, (r,)),
        "repetition_penalty": (f32, (r,)),
        "frequency_penalty": (f32, (r,)),
        "presence_penalty": (f32, (r,)),
        "draft_ids": (i64, (r,)),
        "sample_slots": (i64, (r,)),
        "gather_dst": (i64, (s,)),
        "gather_src": (i64, (s,)),
        "input_ids": (i64, (t,)),
        "positions": (i64, (t,)),
        "slot_mapping": (i64, (t,)),
        "block_table": (i32, (s, b)),
    }


class StepBuffers:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        max_sample_rows: int | None = None,
    ) -> None:
        """`max_sample_rows`: the most rows a step samples (default: one per sequence)."""
        rows = max_sample_rows or max_num_seqs
        num_tokens = max(max_num_tokens, max_num_seqs)
        self.layout = _layout(max_num_seqs, num_tokens, max_blocks_per_seq, rows)
        assert list(self.layout) == [f.name for f in fields(StepViews)]
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, (dtype, shape) in self.layout.items():
            self.offsets[name] = offset
            nbytes = int(np.prod(shape)) * dtype.itemsize
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = offset
        self.block_size = block_size
        self.block_table_row_bytes = max_blocks_per_seq * 4
        self.device = device
        self.on_cuda = device.type == "cuda"
        num_host = 2 if self.on_cuda else 1
        self._host = [
            torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=self.on_cuda)
            for _ in range(num_host)
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * num_host  # after the last copy
        self._dev = (
            torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
            if self.on_cuda
            else self._host[0]
        )
        # numpy views of the host buffers: what a step writes with numpy
        self._host_views: list[HostViews] = [
            StepViews(**{name: v.numpy() for name, v in self._tensor_views(h).items()})
            for h in self._host
        ]
        self.dev: DeviceViews = StepViews(**self._tensor_views(self._dev))
        self._current = 0
        self.host: HostViews = self._host_views[0]

    def _tensor_views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, (dtype, shape) in self.layout.items():
            off = self.offsets[name]
            n = int(np.prod(shape)) * dtype.itemsize
            views[name] = buf[off : off + n].view(dtype).view(shape)
        return views

    def next_host(self) -> HostViews:
        """The host views to fill for the next step (waits only if its last copy is queued)."""
        if self.on_cuda:
            self._current = (self._current + 1) % len(self._host)
            event = self._copied[self._current]
            if event is not None:
                event.synchronize()
        self.host = self._host_views[self._current]
        return self.host

    def copy_to_device(self, num_block_rows: int) -> None:
        """Copy everything up to the first `num_block_rows` block-table rows, in one H2D copy."""
        if not self.on_cuda:
            return
        n = self.offsets["block_table"] + num_block_rows * self.block_table_row_bytes
        self._dev[:n].copy_(self._host[self._current][:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._current] = event

    def attention_metadata(
        self,
        num_tokens: int,
        num_seqs: int,
        num_decodes: int,
        max_query_len: int,
        max_seq_len: int,
        with_host_copies: bool = True,
        cascade: bool = False,
    ) -> AttentionMetadata:
        """The one way a step's `AttentionMetadata` is made: views of the device buffers'
        first `num_seqs` sequences and `num_tokens` tokens. `with_host_copies`: the host's
        query starts and sequence lengths too (for backends that loop on the CPU; a CUDA
        graph's capture has none: it reads every length on the device)."""
        d, h, n = self.dev, self.host, num_seqs
        return AttentionMetadata(
            num_tokens=num_tokens,
            num_seqs=n,
            num_decodes=num_decodes,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=d.query_start_loc[: n + 1],
            seq_lens=d.seq_lens[:n],
            block_table=d.block_table[:n],
            slot_mapping=d.slot_mapping[:num_tokens],
            block_size=self.block_size,
            query_start_loc_cpu=torch.from_numpy(h.query_start_loc[: n + 1])
            if with_host_copies
            else None,
            seq_lens_cpu=torch.from_numpy(h.seq_lens[:n]) if with_host_copies else None,
            decode_order=d.decode_order[:num_decodes] if self.on_cuda and num_decodes else None,
            cascade_prefix_len=d.cascade_prefix_len if cascade else None,
        )

    def one_prompt(self, token_ids: np.ndarray) -> AttentionMetadata:
        """Stage one whole prompt in KV blocks 0, 1, ... (profiling, measurements) and return
        its metadata."""
        n, num_blocks = len(token_ids), -(-len(token_ids) // self.block_size)
        h = self.next_host()
        h.query_start_loc[:2] = (0, n)
        h.seq_lens[0] = n
        h.input_ids[:n] = token_ids
        h.positions[:n] = np.arange(n)
        h.slot_mapping[:n] = np.arange(n)
        h.block_table[0, :num_blocks] = np.arange(num_blocks)
        self.copy_to_device(1)
        return self.attention_metadata(n, 1, 0, n, n)
