"""What every attention backend gets for one step.

The batch is flat: the scheduled tokens of all sequences, one after another, decode
sequences (one query token) first, then the rest. Sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`; its context is `seq_lens[i]` tokens whose KV
lives in the blocks `block_table[i, :ceil(seq_lens[i] / block_size)]`; its queries are the
last `q_len` positions of that context (causal inside the sequence).

The KV cache of one layer is a tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). Token t of the batch writes its key/value to flat slot
`slot_mapping[t] = block_id * block_size + offset` before attention reads the cache.

`decode_order` (optional; a backend may ignore it) lists the decode rows longest context
first: launching the longest work first keeps a GPU's last wave short when contexts differ.

`cascade_prefix_len` (optional; a backend may ignore it) says that the first P tokens of
every decode sequence live in the same blocks (those of block-table row 0), so attention may
read them once for all decode rows (cascade.py). `compute_kv_scales`: this step sets each
layer's FP8 KV scales from its keys and values before storing them (ops/kv_cache.py).

The engine builds it in one place, `StepBuffers.attention_metadata` (views of the step's
device buffers); tests of a backend build their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int  # scheduled tokens in the batch (rows of q), padding excluded
    num_seqs: int
    num_decodes: int  # sequences 0..num_decodes-1 have exactly one query token
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], on the device
    seq_lens: torch.Tensor  # int32 [num_seqs], on the device
    block_table: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], on the device
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the device; -1 = do not store
    block_size: int
    # host copies, for backends that loop on the CPU (the torch reference)
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    decode_order: torch.Tensor | None = None  # int32 [num_decodes], on the device
    cascade_prefix_len: torch.Tensor | None = None  # int32 [1], on the device
    compute_kv_scales: bool = False
