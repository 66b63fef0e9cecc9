"""Developer tool (GPU): one decode attention layer at batch 1 with the history splits forced, against the shipped
plan, in alternating rounds (CUDA graphs, best of the rounds), with each variant's error against the torch reference.

Why: a kernel that only reads a batch-1 step's history pages with the decode plan (132 one-warp programs per KV head,
one page a loop step) reaches 71% of the copy bandwidth at 1x128K on the H200, and 87% with twice the programs
(`scripts/probe_page_layout.py --plans`, docs/data/page-layout-plans-h200-s68.txt). The Gluon history kernel fits 16
programs a multiprocessor, but its split rule (`ops._gluon_history_splits`) keeps batch 1 at the Triton plan's 8.

`--stages` also varies the Gluon kernel's shared-memory slots of staged pages (`gluon_history.STAGES`, shipped 2).

    PYTHONPATH=src python scripts/probe_batch1_splits.py [--shapes 1x131072,1x100000] [--splits 198,264] [--stages 2,3]
        [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels import gluon_history, ops, reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x32768,1x65536,1x100000,1x131072")
    parser.add_argument("--splits", default="198,264", help="history splits per KV head to force (besides shipped)")
    parser.add_argument("--stages", default="2", help="gluon_history.STAGES values to try with every split count")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    shipped, shipped_stages = ops._decode_plan, gluon_history.STAGES
    variants = [(splits, int(stages)) for splits in [None] + [int(s) for s in args.splits.split(",") if s]
                for stages in args.stages.split(",")]

    def forced(splits):
        def plan(layer, programs, max_context, sms, gluon=False):
            history, windows = shipped(layer, programs, max_context, sms, gluon)
            return (splits, windows) if programs <= ops.SMALL_BATCH_PROGRAMS else (history, windows)
        return plan

    print(torch.cuda.get_device_name(device))
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
        expected = reference.attention_reference(layer, step, q, k, v, 128 ** -0.5)
        best, errors, plans = {}, {}, {}
        for _ in range(args.rounds):
            for variant in variants:
                splits, gluon_history.STAGES = variant
                ops._decode_plan = shipped if splits is None else forced(splits)
                try:
                    total = ops.choose_splits(layer, batch, 1, q.shape[1], context, device, gluon=True)
                    out = torch.empty_like(q)
                    workspace = (torch.empty(batch, q.shape[1], total, 128, device=device),
                                 torch.empty(batch, q.shape[1], total, device=device))

                    def run():
                        ops.attend_step(layer, step, q, k, v, 128 ** -0.5, num_splits=total, out=out,
                                        workspace=workspace, validate=False)

                    run()
                    errors[variant] = (out.float() - expected).abs().max().item()
                    plans[variant] = total
                    us = _time_us(run)
                    best[variant] = min(best.get(variant, us), us)
                finally:
                    ops._decode_plan, gluon_history.STAGES = shipped, shipped_stages
        for variant in variants:
            splits, stages = variant
            name = ("shipped splits" if splits is None else f"{splits} history splits") + f", {stages} stages"
            print(f"{shape} {name:<30} {plans[variant]:>4} splits in all  {best[variant]:7.1f} us  "
                  f"max abs error {errors[variant]:.1e}", flush=True)


if __name__ == "__main__":
    main()
