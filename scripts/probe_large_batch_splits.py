"""Developer tool (GPU): decode attention at batches whose (sequence, KV head) pairs exceed one resident wave of
history programs, against the number of splits (docs/data/large-batch-splits-h200.txt).

One layer, 32 query / 8 KV heads, D 128, group 128 (`oscarkv bench attention`'s case), through `ops.attend_step`
with a fixed split count (history splits + window splits; the window plan, row groups and register cap follow
from it as in the decode path). The first count's output is the yardstick of the others (same stored contents).

    PYTHONPATH=src python scripts/probe_large_batch_splits.py 182x32768=2,3,4,5,6 256x8192=2,3,4 ...
"""
from __future__ import annotations

import sys

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels.ops import attend_step, choose_splits


def main(specs: list[str]) -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s", flush=True)
    for spec in specs:
        shape, _, given = spec.partition("=")
        batch, context = (int(x) for x in shape.split("x"))
        case = decode_case(batch, context)
        nbytes = decode_bytes(case, context)
        chosen = choose_splits(case.layer, batch, 1, 32, context, device)
        options = sorted({chosen, *(int(x) for x in given.split(",") if x)})
        first = None
        for splits in options:
            out = torch.empty_like(case.q)
            workspace = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=device),
                         torch.empty(batch, 32, splits, dtype=torch.float32, device=device))

            def step(splits=splits, out=out, workspace=workspace, case=case):
                attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=splits,
                            out=out, workspace=workspace, validate=False)

            step()
            gap = 0.0 if first is None else (out.float() - first).abs().max().item()
            first = out.float() if first is None else first
            us = _time_us(step)
            mark = " (chosen)" if splits == chosen else ""
            print(f"{shape} splits {splits}{mark}: {us:8.1f} us  {nbytes / us / 1e3 / copy:6.1%} of copy  "
                  f"max gap to splits {options[0]}: {gap:.1e}", flush=True)
        del case, first
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
