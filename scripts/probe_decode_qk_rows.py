"""Developer tool (GPU): the query/key launch with the step's cache write (`ops.decode_query_key_write`) at
several rows, timed alone in CUDA graphs, over launch plans (`triton_decode_qk.launch_plan` for more than one row:
rows per program x R_K columns x warps), beside the launch without the cache write (`ops.decode_query_key`).
Qwen3-4B shapes (32 query / 8 KV heads, D 128), one layer, a cache of about 32K tokens per sequence: a step whose
ring holds no page to flush (as 63 of 64 steps are), and one that flushes a page per sequence and KV head.

    PYTHONPATH=src python scripts/probe_decode_qk_rows.py [--batches 32,8] [--plans 16x32x4,16x64x4]
"""
from __future__ import annotations

import argparse

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels import ops, triton_decode_qk


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="32,8")
    parser.add_argument("--plans", default="16x32x4,16x64x4,16x128x4,16x32x2,16x64x8")
    args = parser.parse_args()
    shipped = triton_decode_qk.launch_plan
    gen = torch.Generator().manual_seed(0)
    cases = [(int(b), context) for b in args.batches.split(",") for context in (32778, 32768)]
    for batch, context in cases:  # 32768: the step's token ages a page out of the ring
        case = decode_case(batch, context)
        dev = case.q.device
        q, k, v = case.q, case.k_new, case.v_new
        cos, sin = (torch.randn(batch, 128, generator=gen).bfloat16().to(dev) for _ in range(2))
        rotation = torch.linalg.qr(torch.randn(128, 128, generator=gen))[0].to(dev)
        norm = (torch.ones(128, dtype=torch.bfloat16, device=dev), 1e-6)
        mean = torch.zeros(8, 128, device=dev)
        common = dict(q_norm=norm, k_norm=norm, key_mean=mean)

        def alone():
            ops.decode_query_key(q, k, cos, sin, rotation, rotate_keys=True, **common)

        def with_write():
            ops.decode_query_key_write(case.layer, case.step, q, k, v, cos, sin, rotation, clip_k=0.96, clip_v=0.92,
                                       **common)

        kind = "flush" if context % 64 == 0 else "no flush"
        line = [f"batch {batch}, {kind}: no cache write {_time_us(alone):5.1f} us"]
        for plan in args.plans.split(","):
            rows, columns, warps = (int(x) for x in plan.split("x"))
            triton_decode_qk.launch_plan = lambda r, d, p=(rows, columns, warps): p if r > 1 else shipped(r, d)
            line.append(f"{plan} {_time_us(with_write):5.1f}")
        triton_decode_qk.launch_plan = shipped
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
