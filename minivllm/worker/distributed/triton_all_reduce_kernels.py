"""The Triton kernels of `triton_all_reduce.py` (whose docstring explains the protocol): the
peers' meeting on epoch flags, the one-shot all-reduce, and the one-shot all-reduce fused with
the residual add and RMSNorm."""

from __future__ import annotations

from minivllm.worker.ops._triton import tl, triton
from minivllm.worker.ops.norm import add_residual, rms_scale, row_rstd


@triton.jit
def _meet_peers(flag_table, my_flags, row, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Signal flags[row + RANK] = epoch on every peer, wait until flags[row + peer] >= epoch
    here for every peer; then the whole program goes on (the caller's debug_barrier)."""
    tl.inline_asm_elementwise(
        """
        {
        .reg .u32 %t, %v;
        .reg .u64 %a;
        .reg .pred %p;
        mov.u32 %t, %tid.x;
        setp.ge.u32 %p, %t, $5;
        @%p bra skip;
        setp.eq.u32 %p, %t, $6;
        @%p bra skip;
        mul.wide.u32 %a, %t, 8;
        add.u64 %a, %a, $1;
        ld.global.u64 %a, [%a];
        add.u64 %a, %a, $2;
        st.release.sys.global.u32 [%a], $4;
        mul.wide.u32 %a, %t, 4;
        add.u64 %a, %a, $3;
        wait:
        ld.acquire.sys.global.u32 %v, [%a];
        sub.s32 %v, %v, $4;
        setp.lt.s32 %p, %v, 0;
        @%p bra wait;
        skip:
        mov.u32 $0, 0;
        }
        """,
        "=r,l,l,l,r,r,r",
        [
            flag_table.to(tl.int64),
            (row + RANK).to(tl.int64) * 4,  # byte offset of this rank's flag on the peer
            my_flags.to(tl.int64) + row.to(tl.int64) * 4,  # this program's flags here
            epoch,
            epoch * 0 + WORLD,
            epoch * 0 + RANK,
        ],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit(do_not_specialize=["num_vectors"])
def _one_shot_kernel(
    x_ptr,  # this rank's input
    out_ptr,
    bufs,  # WORLD tensors: each rank's data area (regions 0 and 1 of REGION elements)
    flag_table,  # device address of WORLD addresses: each rank's flags
    my_flags,  # device address of this rank's flags
    epochs,  # int32[MAX_BLOCKS]: calls run so far, per program (this rank only)
    num_vectors,  # 16-byte vectors in the message
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    REGION: tl.constexpr,
    SLICE: tl.constexpr,
    VECTOR: tl.constexpr,  # elements per 16 bytes
):
    pid = tl.program_id(0)
    epoch = tl.load(epochs + pid) + 1
    numel = num_vectors * VECTOR
    num_slices = tl.cdiv(numel, SLICE)
    cols = tl.arange(0, SLICE)
    region = (epoch & 1) * REGION
    for s in range(pid, num_slices, MAX_BLOCKS):
        offs = s * SLICE + cols
        mask = offs < numel
        tl.store(bufs[RANK] + region + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's copy precedes the release below
    _meet_peers(flag_table, my_flags, pid * WORLD, epoch, RANK, WORLD)
    tl.debug_barrier()  # the acquiring threads' view passes to the whole program
    for s in range(pid, num_slices, MAX_BLOCKS):
        offs = s * SLICE + cols
        mask = offs < numel
        acc = tl.zeros([SLICE], tl.float32)
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            else:  # .cg: straight from the peer, never a stale L1 line
                peer = tl.load(bufs[r] + region + offs, mask=mask, cache_modifier=".cg")
                acc += peer.to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(epochs + pid, epoch)


@triton.jit(do_not_specialize=["num_rows"])
def _one_shot_add_rms_norm_kernel(
    x_ptr,  # [num_rows, n_cols]: this rank's part of the sum
    res_ptr,  # [num_rows, n_cols]: the residual (read when HAS_RESIDUAL)
    w_ptr,  # [n_cols]: the norm's weight
    out_ptr,  # [num_rows, n_cols]: rms_norm(s) * weight
    new_res_ptr,  # [num_rows, n_cols]: s, the sum over the ranks (+ residual)
    bufs,  # WORLD tensors: each rank's data area (the lanes start at LANES)
    flag_table,  # device address of WORLD addresses: each rank's flags
    my_flags,  # device address of this rank's flags
    epochs,  # int32[MAX_BLOCKS]: this kernel's calls run so far, per program (this rank only)
    num_rows,
    n_cols,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    MAX_BLOCKS: tl.constexpr,
    LANES: tl.constexpr,  # where region 2 (lanes of the even epochs) starts, in elements
    LANE: tl.constexpr,  # elements per lane; region 3 (odd epochs) follows region 2
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    pid = tl.program_id(0)
    epoch = tl.load(epochs + pid) + 1
    region = LANES + (epoch & 1) * (WORLD * MAX_BLOCKS * LANE)  # lanes by (sender, program)
    sent = region + (RANK * MAX_BLOCKS + pid) * LANE  # this program's lane on every peer
    my_rows = tl.cdiv(num_rows - pid, MAX_BLOCKS)  # rows pid, pid + MAX_BLOCKS, ...
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    for j in range(my_rows):  # push: stores to the peers' memory, nothing waits on them here
        x = tl.load(x_ptr + (pid + j * MAX_BLOCKS) * n_cols + cols, mask=mask)
        for r in tl.static_range(WORLD):
            if r != RANK:
                tl.store(bufs[r] + sent + j * n_cols + cols, x, mask=mask)
    tl.debug_barrier()  # every thread's stores precede the release below
    _meet_peers(flag_table, my_flags, (MAX_BLOCKS + pid) * WORLD, epoch, RANK, WORLD)
    tl.debug_barrier()  # the acquiring threads' view passes to the whole program
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for j in range(my_rows):
        row = (pid + j * MAX_BLOCKS) * n_cols
        acc = tl.zeros([BLOCK], tl.float32)  # the plain kernel's sum, bit for bit
        for r in tl.static_range(WORLD):
            if r == RANK:
                acc += tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
            else:  # what peer r pushed here; .cg: never a stale L1 line
                got = bufs[RANK] + region + (r * MAX_BLOCKS + pid) * LANE + j * n_cols + cols
                acc += tl.load(got, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        # from here ops/norm.py's kernel, step for step (its helpers)
        s = acc.to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            s = add_residual(s, tl.load(res_ptr + row + cols, mask=mask, other=0.0))
        tl.store(new_res_ptr + row + cols, s, mask=mask)
        y = rms_scale(s, row_rstd(s, n_cols, eps), w)
        tl.store(out_ptr + row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(epochs + pid, epoch)
