"""Developer tool (GPU): the write path's times for an A/B of two checkouts in alternating fresh processes.

Prints one line per case for the `oscarkv` on PYTHONPATH: the prompt write of `oscarkv bench attention` (a 32K-token
prompt, 8 KV heads, D 128, one layer) and the write of one decode step at 1 x 32K and 32 x 8K, timed with CUDA graphs:
at a length where a page ages out of the ring (a flush, once in 64 steps) and at one where none does.

    for i in 1 2; do PYTHONPATH=old/src python scripts/probe_write_ab.py before; \\
                     PYTHONPATH=src python scripts/probe_write_ab.py after; done
"""

from __future__ import annotations

import sys

import torch

from oscarkv.benchmarks.attention import _time_us, bench_write, decode_case
from oscarkv.kernels.ops import rotation_pieces, write_step


def decode_write_us(batch: int, context: int) -> float:
    case = decode_case(batch, context)
    head_dim = case.k_new.shape[-1]
    gen = torch.Generator().manual_seed(1)
    rotation, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))
    rotation = rotation.float().cuda()
    mean = torch.randn(case.k_new.shape[1], head_dim, generator=gen).cuda()
    pieces = rotation_pieces(rotation, mean)
    return _time_us(lambda: write_step(case.layer, case.step, case.k_new, case.v_new, rotation, mean, 0.96, 0.92,
                                       validate=False, pieces=pieces))


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this checkout"
    prompt = bench_write()
    print(f"{label}: prompt write {prompt.microseconds:.1f} us ({prompt.bandwidth_fraction:.1%} of copy); decode "
          f"write with a flush 1x32K {decode_write_us(1, 32768):.2f} us, 32x8K {decode_write_us(32, 8192):.2f} us; "
          f"without 1x32K {decode_write_us(1, 32768 + 32):.2f} us, 32x8K {decode_write_us(32, 8192 + 32):.2f} us",
          flush=True)

if __name__ == "__main__":
    main()
