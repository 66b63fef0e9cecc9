"""Developer tool (GPU): decode kernel time against row groups (pages per softmax step), pipeline stages and
history splits, on the benchmark shapes (docs/data/row-groups-h100.txt).

    PYTHONPATH=src python scripts/probe_row_groups.py 1x131072,32x32768 1/3/1,2/3/1,2/3/2

Each configuration is RG/STAGES/DIVISOR[/WARPS]: the chosen history splits are divided by DIVISOR; WARPS
per history program (default 1)."""
import sys

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels import reference
from oscarkv.kernels.ops import choose_splits, window_split_count
from oscarkv.kernels.triton_attention import launch_attention

copy = copy_bandwidth_gbs(torch.device("cuda"))
print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
configs = [tuple(int(x) for x in (c + "/1").split("/")[:4]) for c in sys.argv[2].split(",")]  # rg/stages/div[/warps]
for shape in sys.argv[1].split(","):
    batch, context = (int(x) for x in shape.split("x"))
    case = decode_case(batch, context)
    layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
    nbytes = decode_bytes(case, context)
    scale = 128 ** -0.5
    expected = reference.attention_reference(layer, step, q, k, v, scale).float()
    chosen = choose_splits(layer, batch, 1, 32, context, q.device)
    wsplits = window_split_count(layer, batch, 1, 32, chosen, context, q.device)
    for rg, stages, div, warps in configs:
        hist = max(1, (chosen - wsplits) // div)
        splits = hist + wsplits
        out = torch.empty_like(q)
        ws = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=q.device),
              torch.empty(batch, 32, splits, dtype=torch.float32, device=q.device))
        def fn(splits=splits, ws=ws, out=out, stages=stages, warps=warps, rg=rg):
            launch_attention(layer, step, q, k, v, out, scale, 0, splits, ws, num_stages=stages, num_warps=warps,
                             window_splits=wsplits, row_groups=rg)

        fn()
        torch.cuda.synchronize()
        err = (out.float() - expected).abs().max().item()
        us = min(_time_us(fn) for _ in range(3))
        print(f"{shape:>9} rg={rg} stages={stages} warps={warps} splits={splits} ({hist}+{wsplits}): {us:7.1f} us "
              f"{nbytes/us/1e3:6.0f} GB/s {100*nbytes/us/1e3/copy:5.1f}%  err {err:.1e}", flush=True)
