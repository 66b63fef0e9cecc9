"""Developer tool (GPU): the decode attention of a small model at batch 1 (SmolLM2-135M's shape: 9 query / 3 KV
heads, head_dim 64, group 64) against the window programs' plan. Written in the forty-fifth session after the
H200 timeline in docs/data/decode-timeline-h200-smollm2-s45.txt; checked in the CPU interpreter, not yet run on a
GPU (no device time was left).

The history splits stay as `choose_splits` takes them; only the window programs change (count, warps, keys per
block), through `ops.attend_step` as the decode path calls it.

    PYTHONPATH=src python scripts/probe_small_model_windows.py [CONTEXT ...]
"""
from __future__ import annotations

import sys

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels.ops import WindowPlan, attend_step, choose_splits, window_plan

PLANS = [None, WindowPlan(4), WindowPlan(16), WindowPlan(1), WindowPlan(8, 1, 16), WindowPlan(16, 1, 16)]


def main(contexts: list[int]) -> None:
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    for context in contexts:
        case = decode_case(1, context, query_heads=9, kv_heads=3, head_dim=64, group=64)
        chosen = choose_splits(case.layer, 1, 1, 9, context, device)
        default = window_plan(case.layer, 1, 1, 9, chosen, context, device)
        history = chosen - default.splits
        for plan in PLANS:
            plan = plan or default
            splits = history + plan.splits
            out = torch.empty_like(case.q)
            workspace = (torch.empty(1, 9, splits, 64, dtype=torch.float32, device=device),
                         torch.empty(1, 9, splits, dtype=torch.float32, device=device))

            def step(splits=splits, plan=plan, out=out, workspace=workspace, case=case):
                attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 64 ** -0.5, num_splits=splits,
                            window_splits=plan, out=out, workspace=workspace, validate=False)

            try:
                step()
                us = _time_us(step)
            except Exception as exc:  # noqa: BLE001 - a plan that does not compile is reported and skipped
                print(f"1x{context} history {history} {plan}: failed {type(exc).__name__}: {str(exc)[:120]}")
                continue
            mark = " (chosen)" if plan == default else ""
            print(f"1x{context} history {history} {plan}{mark}: {us:7.1f} us", flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1:]] or [4000])
