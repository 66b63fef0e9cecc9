"""Developer probe (GPU): the Triton RMSNorm on a prompt's rows, one row a program against tiles of several rows.

A Qwen3-4B prompt chunk of T tokens normalizes [T, 2560] rows twice a layer (with the residual add) and its queries'
and keys' heads as [T·32, 128] and [T·8, 128] rows. Times each launch plan (rows a program, warps) over --launches
launches with CUDA events, best of --rounds rounds with the plans interleaved, and prints µs a launch and GB/s moved
(reads and writes); several rows a program sum in another order, so their outputs may differ from one row's by an ulp:

    PYTHONPATH=src python scripts/probe_norm_rows.py [--tokens 2048] [--launches 200] [--rounds 3]
"""
from __future__ import annotations

import argparse

import torch
import triton

from oscarkv.kernels import triton_norm


def time_us(fn, launches: int) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / launches * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    t = args.tokens
    print(f"{torch.cuda.get_device_name()}, bfloat16, {t}-token chunk")
    for m, n, residual in ((t, 2560, True), (t * 32, 128, False), (t * 8, 128, False)):
        x, r = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
        out, summed = torch.empty_like(x), torch.empty_like(x)
        extra = (r, summed) if residual else (x, out)
        moved = x.numel() * 2 * (4 if residual else 2)
        block = triton.next_power_of_2(n)
        reference = None
        plans = [(1, triton_norm.norm_warps(n))] + [(tile // block, warps) for tile in (1024, 2048, 4096, 8192)
                                                    for warps in (4, 8) if tile // block > 1]
        best, same = {}, {}
        for _ in range(args.rounds):  # plans interleaved, best of the rounds
            for rows, warps in plans:
                def launch(rows=rows, warps=warps):
                    triton_norm._rms_norm_kernel[(triton.cdiv(m, rows),)](
                        x, w, out, n, 1e-6, *extra, m, BLOCK=block, OVERLAP=False, RESIDUAL=residual, ROWS=rows,
                        num_warps=warps)
                us = time_us(launch, args.launches)
                if reference is None:
                    reference = out.clone()
                best[rows, warps] = min(best.get((rows, warps), us), us)
                same[rows, warps] = torch.equal(out, reference)
        shipped = triton_norm.norm_plan(m, n)
        for (rows, warps), us in best.items():
            print(f"  [{m:6d}, {n:4d}]{' +residual' if residual else '          '} rows {rows:3d} warps {warps}: "
                  f"{us:7.2f} us  {moved / us / 1e3:7.0f} GB/s  {'same as one row' if same[rows, warps] else 'differs'}"
                  f"{'  <- norm_plan' if (rows, warps) == shipped else ''}")


if __name__ == "__main__":
    main()
