"""Developer tool (GPU): the rate of tensor-core dots in one-warp Triton programs (mma.sync m16n8k16), the
instruction the decode kernel's history programs use (docs/data/mma-rate-h200.txt).

Each of PROGRAMS one-warp programs (default 1056: 8 per multiprocessor, as the history launch at 32x32K) holds a
[16, 128] and a [128, 64] operand in registers and runs ITERS dependent dots [16, 128] x [128, 64] into one
float32 accumulator (64 mma each: 8 independent column tiles, each a chain of 8 along K).

    PYTHONPATH=src python scripts/probe_mma_rate.py [PROGRAMS]
"""
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _dots(a_ptr, b_ptr, out_ptr, ITERS: tl.constexpr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    a = tl.load(a_ptr + tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :])
    b = tl.load(b_ptr + tl.arange(0, K)[:, None] * N + tl.arange(0, N)[None, :])
    acc = tl.zeros((M, N), dtype=tl.float32)
    for _ in range(ITERS):
        acc = tl.dot(a, b, acc)
    offsets = tl.program_id(0) * M * N + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(out_ptr + offsets, acc)


def rate(dtype: torch.dtype, programs: int, iters: int = 2000, m: int = 16, k: int = 128, n: int = 64) -> None:
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(k, n, device="cuda").to(dtype)
    out = torch.empty(programs, m, n, device="cuda")
    launch = lambda: _dots[(programs,)](a, b, out, iters, m, k, n, num_warps=1)  # noqa: E731
    launch()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(launch, warmup=5, rep=50)
    flops = 2 * m * n * k * iters * programs
    print(f"{str(dtype):16s} K={k} M={m} programs={programs} warps=1: {ms * 1e3:8.1f} us  "
          f"{flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 132 * 8
    for dt in (torch.float16, torch.bfloat16):
        rate(dt, count)
