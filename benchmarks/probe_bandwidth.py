"""What the device's memory does for a copy, a pure read and a pure write.

The throughput floor is priced at the copy bandwidth (bytes read + written); decode
attention only reads. This says how far a read-only kernel can go past that price:
torch's sum (a reduction), and a Triton streaming read at a few tile sizes.

    python benchmarks/probe_bandwidth.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.frontend.bench.floor import measure_copy_bandwidth

GIB = 1 << 30


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, TILES: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * BLOCK * TILES
    for t in range(TILES):
        offs = base + t * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def timed_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    x = torch.randn(GIB, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    print(f"floor's own reading (copy, read + write): {measure_copy_bandwidth() / 1e12:.2f} TB/s")
    ms = timed_ms(lambda: y.copy_(x))
    print(f"copy 2 GiB -> 2 GiB: {2 * nbytes / ms / 1e9:.2f} TB/s (read + write)")
    ms = timed_ms(lambda: x.sum(dtype=torch.float32))
    print(f"torch sum (read only): {nbytes / ms / 1e9:.2f} TB/s")
    ms = timed_ms(lambda: y.fill_(1.0))
    print(f"fill (write only): {nbytes / ms / 1e9:.2f} TB/s")
    for block, tiles, warps in [(4096, 8, 4), (8192, 8, 8), (4096, 32, 4), (2048, 16, 4)]:
        programs = triton.cdiv(x.numel(), block * tiles)
        out = torch.empty(programs, dtype=torch.float32, device="cuda")

        def run(block=block, tiles=tiles, warps=warps, programs=programs, out=out):
            _read_kernel[(programs,)](x, out, x.numel(), BLOCK=block, TILES=tiles, num_warps=warps)

        ms = timed_ms(run)
        print(
            f"triton read BLOCK {block} x {tiles} tiles, {warps} warps: "
            f"{nbytes / ms / 1e9:.2f} TB/s"
        )


if __name__ == "__main__":
    main()
