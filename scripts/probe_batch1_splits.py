"""Developer tool (GPU): one decode attention layer at batch 1 with the history splits forced, against the shipped
plan, in alternating rounds (CUDA graphs, best of the rounds), with each variant's error against the torch reference.

Why: a kernel that only reads a batch-1 step's history pages with the decode plan (132 one-warp programs per KV head,
one page a loop step) reaches 71% of the copy bandwidth at 1x128K on the H200, and 87% with twice the programs
(`scripts/probe_page_layout.py --plans`, docs/data/page-layout-plans-h200-s68.txt). The Gluon history kernel fits 16
programs a multiprocessor, but its split rule (`ops._gluon_history_splits`) keeps batch 1 at the Triton plan's 8.

`--stages` also varies the Gluon kernel's shared-memory slots of staged pages (`gluon_history.STAGES`, shipped 2).

    PYTHONPATH=src:scripts python scripts/probe_batch1_splits.py [--shapes 1x131072,1x100000] [--splits 198,264]
        [--stages 2,3] [--rounds 3] [--once]
"""

from __future__ import annotations

import argparse

import torch

from oscarkv.kernels import gluon_history, ops
from probe_history_splits_decode import forced_plan
from probe_window_plans import best_of_rounds, layer_case, step


def planned_step(case, out, batch: int, context: int, splits: int | None, stages: int):
    """(splits in all, step) of the layer's decode step whose batch-1 plans take `splits` history splits (None:
    shipped) and whose Gluon history kernel stages `stages` pages; both are in force while the step runs (its CUDA
    graph captures included)."""
    shipped, shipped_stages = ops._decode_plan, gluon_history.STAGES
    plan = shipped if splits is None else forced_plan(shipped, splits, small=True)

    def patched(fn):
        ops._decode_plan, gluon_history.STAGES = plan, stages
        try:
            return fn()
        finally:
            ops._decode_plan, gluon_history.STAGES = shipped, shipped_stages

    total = patched(lambda: ops.choose_splits(case.layer, batch, 1, 32, context, case.q.device, gluon=True))
    run = step(case, out, total)
    return total, lambda: patched(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x32768,1x65536,1x100000,1x131072")
    parser.add_argument("--splits", default="198,264", help="history splits per KV head to force (besides shipped)")
    parser.add_argument("--stages", default="2", help="gluon_history.STAGES values to try with every split count")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--once", action="store_true",
                        help="run each variant once, eagerly, untimed (for a profiler such as Nsight Compute)")
    args = parser.parse_args()
    variants = [(splits, int(stages)) for splits in [None] + [int(s) for s in args.splits.split(",") if s]
                for stages in args.stages.split(",")]
    print(torch.cuda.get_device_name())
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        case, _, _, ref, out = layer_case(shape)
        planned = [planned_step(case, out, batch, context, splits, stages) for splits, stages in variants]
        if args.once:
            for (splits, stages), (total, run) in zip(variants, planned):
                out.zero_()
                run()
                torch.cuda.synchronize()
                error = (out.float() - ref).abs().max().item()
                print(f"{shape} {splits or 'shipped'} history splits, {stages} stages: {total} splits in all, "
                      f"max abs error {error:.1e}", flush=True)
            continue
        results = best_of_rounds([run for _, run in planned], out, ref, args.rounds)
        for (splits, stages), (total, _), (us, error) in zip(variants, planned, results):
            name = ("shipped splits" if splits is None else f"{splits} history splits") + f", {stages} stages"
            print(f"{shape} {name:<30} {total:>4} splits in all  {us:7.1f} us  max abs error {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
