"""Developer tool (GPU): sweep the decode kernel's launch parameters on the benchmark shapes.

    PYTHONPATH=src python scripts/tune_attention.py [--shapes 1x131072,32x32768] [--quick] [--row-groups 1,2] \
        [--registers none,168] [--splits "1x131072=136,202"] [--windows 16:1:16] [--block-m 8,16]

Prints one line per configuration (time in µs, achieved GB/s, fraction of the measured
copy bandwidth) and the best per shape. The cache is filled as in `oscarkv bench attention`.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels import reference
from oscarkv.kernels.ops import COMBINE_CHANNELS, WindowPlan, choose_row_groups, choose_splits, window_plan
from oscarkv.kernels.triton_attention import launch_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x131072,32x32768,1x32768")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--registers", default="none,168,128", help="register caps to try (none: no cap)")
    parser.add_argument("--stages", default="2,3", help="pipeline stages to try")
    parser.add_argument("--row-groups", default="auto", help="pages per softmax step to try (auto: the chosen)")
    parser.add_argument("--windows", default="auto",
                        help="window programs per (sequence, KV head) as SPLITS:WARPS:KEYS, e.g. 16:1:16 "
                             "(auto: `ops.window_plan` for the split count)")
    parser.add_argument("--block-m", default="16", help="query rows per program to try (8 or 16)")
    parser.add_argument("--splits", default=None,
                        help="total splits to try per shape, e.g. 1x131072=66,132;32x32768=3,5,10 "
                             "(default: the chosen count and half of it)")
    args = parser.parse_args()
    copy = copy_bandwidth_gbs(torch.device("cuda"))
    print(f"copy bandwidth {copy:.0f} GB/s")
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
        nbytes = decode_bytes(case, context)
        scale = 128 ** -0.5
        expected = reference.attention_reference(layer, step, q, k, v, scale)
        chosen = choose_splits(layer, batch, 1, 32, context, q.device)
        split_options = sorted({chosen, max(2, chosen // 2)})
        if args.splits:
            given = dict(item.split("=") for item in args.splits.split(";"))
            if shape in given:
                split_options = sorted(int(x) for x in given[shape].split(","))
        caps = [None if r == "none" else int(r) for r in args.registers.split(",")]
        groups = [None] if args.row_groups == "auto" else [int(x) for x in args.row_groups.split(",")]
        grid = itertools.product(caps, [int(x) for x in args.stages.split(",")], split_options, groups,
                                 [int(x) for x in args.block_m.split(",")])
        if args.quick:
            grid = itertools.product((None,), (2,), split_options[:1], (None,), (16,))
        results = []
        for maxnreg, stages, splits, row_groups, block_m in grid:
            separate, warps = True, 1
            out = torch.empty_like(q)
            ws = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=q.device),
                  torch.empty(batch, 32, splits, dtype=torch.float32, device=q.device))
            plan = window_plan(layer, batch, 1, 32, splits, context, q.device)  # as `ops.attend_step` launches
            if args.windows != "auto":
                plan = WindowPlan(*(int(x) for x in args.windows.split(":")))
            if row_groups is None:
                row_groups = choose_row_groups(layer, 1, 32, splits, plan.splits, context)

            def fn(separate=separate, warps=warps, stages=stages, splits=splits, out=out, ws=ws, maxnreg=maxnreg,
                   plan=plan, row_groups=row_groups, block_m=block_m):
                launch_attention(layer, step, q, k, v, out, scale, 0, splits, ws, separate_windows=separate,
                                 num_warps=warps, num_stages=stages, maxnreg=maxnreg, window_splits=plan.splits,
                                 window_warps=plan.warps, window_block_n=plan.block_n, row_groups=row_groups,
                                 combine_d_block=min(COMBINE_CHANNELS, 128), block_m=block_m)

            try:
                fn()
                err = (out.float() - expected).abs().max().item()
                us = _time_us(fn)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"{shape} r{maxnreg} s{stages} sp{splits} g{row_groups} m{block_m}: "
                      f"failed {type(exc).__name__}: {exc}"[:200])
                continue
            gbs = nbytes / us / 1e3
            results.append((us, maxnreg or 0, warps, stages, splits, row_groups, block_m, err))
            print(f"{shape} r{maxnreg} s{stages} sp{splits} g{row_groups} m{block_m} "
                  f"w{plan.splits}:{plan.warps}:{plan.block_n}: {us:8.1f} us {gbs:7.0f} GB/s "
                  f"{gbs / copy:5.1%} err {err:.1e}", flush=True)
        best = min(results)
        print(f"BEST {shape}: {best[0]:.1f} us ({nbytes / best[0] / 1e3 / copy:.1%} of copy) "
              f"maxnreg={best[1]} warps={best[2]} stages={best[3]} splits={best[4]} row_groups={best[5]} "
              f"block_m={best[6]} err={best[7]:.1e}")
        del case, layer, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
