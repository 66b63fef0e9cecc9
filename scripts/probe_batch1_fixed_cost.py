"""Developer tool (GPU): a batch-1 decode step's attention as a fixed cost plus a cost per byte.

    PYTHONPATH=src:scripts python scripts/probe_batch1_fixed_cost.py [--contexts 65536,98304,131072,196608,262144]

From 64K on, batch 1 takes one history split per multiprocessor and KV head (`ops.choose_splits`), so the
launch plan is the same at every context here and only the pages per split grow. For each context it times,
as CUDA-graph replays, the production step (`ops.attend_step`, as `bench attention` does) and each of its
launches alone (history splits, window splits, combine; recorded from that same call, so with its register
cap and window plan), then fits time = fixed + bytes / bandwidth over the contexts by least squares. The
slope is the step's marginal bandwidth; the intercept is what a step costs whatever its length.
"""

from __future__ import annotations

import argparse

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels.ops import attend_step, choose_splits
from probe_decode_launches import recorded_launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="65536,98304,131072,196608,262144")
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name(device)}, copy bandwidth {copy:.0f} GB/s")
    points = []
    for context in (int(c) for c in args.contexts.split(",")):
        case = decode_case(1, context)
        layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
        splits = choose_splits(layer, 1, 1, 32, context, device)
        out = torch.empty_like(q)
        workspace = (torch.empty(1, 32, splits, 128, device=device), torch.empty(1, 32, splits, device=device))

        def step_fn():
            attend_step(layer, step, q, k, v, 128 ** -0.5, num_splits=splits, out=out, workspace=workspace,
                        validate=False)

        step_fn()
        parts = {}
        for name, kernel, grid, kargs, options in recorded_launches(step_fn):
            label = {1: "history", 2: "windows"}.get(options.get("REGIONS"), name)
            options = {key: value for key, value in options.items() if key != "launch_pdl"}  # alone: no overlap
            options.update({key: 0 for key in ("OVERLAP", "WAIT") if key in options})
            parts[label] = (lambda kernel=kernel, grid=grid, kargs=kargs, options=options:
                            kernel[grid](*kargs, **options))
        nbytes = decode_bytes(case, context)
        us = _time_us(step_fn)
        alone = {name: _time_us(fn) for name, fn in parts.items()}
        points.append((nbytes, us, alone))
        print(f"1x{context}: {splits} splits, {nbytes / 1e6:.1f} MB, step {us:.1f} us "
              f"({nbytes / us / 1e3 / copy:.1%} of copy); alone: "
              + ", ".join(f"{name} {t:.1f} us" for name, t in alone.items()))
        del case
        torch.cuda.empty_cache()
    for label, times in [("step", [p[1] for p in points])] + [
            (name, [p[2][name] for p in points]) for name in points[0][2]]:
        x = torch.tensor([p[0] for p in points], dtype=torch.float64)
        y = torch.tensor(times, dtype=torch.float64)
        slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
        fixed = y.mean() - slope * x.mean()
        residual = (y - fixed - slope * x).abs().max().item()
        marginal = 1 / slope.item() / 1e3 if slope > 0 else float("inf")
        print(f"fit {label:8s}: fixed {fixed.item():6.1f} us + bytes at {marginal:6.0f} GB/s "
              f"({marginal / copy:.1%} of copy); largest residual {residual:.1f} us")


if __name__ == "__main__":
    main()
