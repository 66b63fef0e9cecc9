"""Developer tool (GPU): the decode history launch with [16, P] score tiles (rows, `_paged_attention_kernel`)
against the transposed [P, N] tiles (columns, `triton_decode_history`), on the benchmark shapes, same process.

    PYTHONPATH=src python scripts/probe_history_columns.py 1x131072,32x32768 rows/1,rows/2,columns/1,columns/1/168

Each configuration is KERNEL/SPLIT_FACTOR[/MAXNREG[/STAGES]]: KERNEL rows or columns; the chosen history splits
times SPLIT_FACTOR; an optional register cap (0: none) and pipeline stages (default 3). rows takes
`choose_row_groups`' row groups. Three timings per configuration; the minimum is printed with the spread."""
import sys

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels import reference
from oscarkv.kernels.ops import choose_row_groups, choose_splits, window_split_count
from oscarkv.kernels.triton_attention import launch_attention

copy = copy_bandwidth_gbs(torch.device("cuda"))
print(f"copy bandwidth {copy:.0f} GB/s; {torch.cuda.get_device_name()}", flush=True)
configs = []
for text in sys.argv[2].split(","):
    parts = text.split("/")
    configs.append((parts[0], float(parts[1]) if len(parts) > 1 else 1.0, int(parts[2]) if len(parts) > 2 else 0,
                    int(parts[3]) if len(parts) > 3 else 3))
for shape in sys.argv[1].split(","):
    batch, context = (int(x) for x in shape.split("x"))
    case = decode_case(batch, context)
    layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
    nbytes = decode_bytes(case, context)
    scale = 128 ** -0.5
    expected = reference.attention_reference(layer, step, q, k, v, scale).float()
    chosen = choose_splits(layer, batch, 1, 32, context, q.device)
    wsplits = window_split_count(layer, batch, 1, 32, chosen, q.device)
    for kernel, factor, maxnreg, stages in configs:
        hist = max(1, round((chosen - wsplits) * factor))
        splits = hist + wsplits
        rg = choose_row_groups(layer, 1, 32, splits, wsplits, context) if kernel == "rows" else 1
        out = torch.empty_like(q)
        ws = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=q.device),
              torch.empty(batch, 32, splits, dtype=torch.float32, device=q.device))

        def fn(splits=splits, ws=ws, out=out, rg=rg, kernel=kernel, maxnreg=maxnreg, stages=stages):
            launch_attention(layer, step, q, k, v, out, scale, 0, splits, ws, window_splits=wsplits, row_groups=rg,
                             history_columns=kernel == "columns", maxnreg=maxnreg or None, num_stages=stages)

        fn()
        torch.cuda.synchronize()
        err = (out.float() - expected).abs().max().item()
        times = [_time_us(fn) for _ in range(3)]
        us = min(times)
        print(f"{shape:>9} {kernel:>7} rg={rg} splits={splits} ({hist}+{wsplits}) maxnreg={maxnreg} stages={stages}: "
              f"{us:7.1f} us (max {max(times):7.1f}) {nbytes / us / 1e3:6.0f} GB/s {100 * nbytes / us / 1e3 / copy:5.1f}%"
              f"  err {err:.1e}", flush=True)
