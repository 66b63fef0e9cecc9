"""Developer tool (GPU, Triton >= 3.6): the Gluon history kernel with each one-warp program reading a slice of T
tokens of every page of its split (`token_tile_history_kernel`: T = 64 / QUARTERS) instead of whole pages, against
the shipped kernel, in the decode step (`probe_score_chains.compare_shapes`: errors against the torch reference and
alternating CUDA-graph timings).

    PYTHONPATH=src:scripts python scripts/probe_token_tiles.py [SHAPES] [--plans 2:1,4:1] [--stages 2,3] [--rounds 3]

A plan Q:F: Q token slices (QUARTERS) of F x H / Q page splits per (sequence, KV head), H the shipped plan's history
splits (at batch 1 on the H200: 132 programs of whole pages), so about F x H one-warp history programs.

Why: at batch 1 each multiprocessor holds 8 one-warp programs, each a serial chain of whole pages, and more, shorter
splits were slower; token slices give more warps a multiprocessor with the same page ranges. The loop costs more
instructions a page in all (compiled for sm_90: 292 SASS instructions a page slice at T = 16, 447 at T = 32, against
the shipped 723 a page).
Found: correct and slower at every plan, the more so the thinner the slice (1x128K: shipped 32.1 us, T = 32 35.1 and
35.7, T = 16 47.6 and 41.4; 32x32K: 205.8 against 220.7-308.2; docs/data/token-tiles-h200-s73.txt).
"""

from __future__ import annotations

import argparse

import torch

from probe_score_chains import WithKeywords, compare_shapes


def splits_for(case, quarters: int, page_splits: int) -> int:
    """Splits in all (window splits + quarters x page_splits) for `attend_step`, where the window plan of that count
    leaves exactly quarters x page_splits history splits (the smallest such count at or above the target)."""
    from oscarkv.kernels.ops import window_plan

    batch = case.q.shape[0]
    context = case.step.block_table.shape[1] * case.layer.layout.page_size
    for windows in range(1, 9):
        n = windows + quarters * page_splits
        plan = window_plan(case.layer, batch, 1, 32, n, context, case.q.device, gluon=True)
        if plan.splits == windows:
            return n
    raise SystemExit(f"no window plan leaves {quarters} x {page_splits} history splits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="?", default="1x131072,1x100000,8x32768,32x32768")
    parser.add_argument("--plans", default="2:1,2:2,4:1,4:2",
                        help="QUARTERS:FACTOR,...: QUARTERS token slices of FACTOR x (the shipped history splits) / "
                             "QUARTERS page splits")
    parser.add_argument("--stages", default="2", help="staged page slices, e.g. 2,3")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from oscarkv.kernels import gluon_history, gluon_history_kernel
    from oscarkv.kernels.ops import choose_splits, window_plan

    from token_tile_history_kernel import history_kernel

    def variants(case, spec):
        batch, context = (int(x) for x in spec.split("x"))
        shipped_splits = choose_splits(case.layer, batch, 1, 32, context, case.q.device, gluon=True)
        history = shipped_splits - window_plan(case.layer, batch, 1, 32, shipped_splits, context, case.q.device,
                                               gluon=True).splits
        found = {"shipped": (gluon_history_kernel.history_kernel, gluon_history.STAGES)}
        for plan in args.plans.split(","):
            quarters, factor = (int(x) for x in plan.split(":"))
            page_splits = max(1, round(factor * history / quarters))
            n = splits_for(case, quarters, page_splits)
            for stages in (int(s) for s in args.stages.split(",")):
                found[f"T={64 // quarters} {quarters}x{page_splits} s{stages}"] = (
                    WithKeywords(history_kernel, QUARTERS=quarters), stages, n, 128)
        return found

    compare_shapes(args.shapes, variants, args.rounds)


if __name__ == "__main__":
    main()
