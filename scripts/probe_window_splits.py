"""Developer tool (GPU): decode kernel time against the number of window splits (programs per KV head that
share the BF16 sink and ring), history splits and row groups as chosen (docs/data/window-splits-h100.txt at batch 1,
docs/data/window-splits-batch-h100.txt at batch 8-64).

    PYTHONPATH=src python scripts/probe_window_splits.py 1x4096x9x3x64x64,1x32768x32x8x128x128 1,4,8,16/2

Each shape is BATCHxCONTEXTxQUERY_HEADSxKV_HEADSxHEAD_DIMxGROUP; each configuration SPLITS[/WARPS] (warps per
window program, default 4)."""
import sys

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels import reference
from oscarkv.kernels.ops import choose_row_groups, choose_splits, window_split_count
from oscarkv.kernels.triton_attention import launch_attention

configs = [tuple(int(x) for x in (c + "/4").split("/")[:2]) for c in sys.argv[2].split(",")]
for shape in sys.argv[1].split(","):
    batch, context, hq, hkv, d, group = (int(x) for x in shape.split("x"))
    case = decode_case(batch, context, query_heads=hq, kv_heads=hkv, head_dim=d, group=group)
    layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
    scale = d ** -0.5
    expected = reference.attention_reference(layer, step, q, k, v, scale).float()
    chosen = choose_splits(layer, batch, 1, hq, context, q.device)
    history = chosen - window_split_count(layer, batch, 1, hq, chosen, context, q.device)
    for wsplits, warps in configs:
        splits = history + wsplits
        out = torch.empty_like(q)
        ws = (torch.empty(batch, hq, splits, d, dtype=torch.float32, device=q.device),
              torch.empty(batch, hq, splits, dtype=torch.float32, device=q.device))

        groups = choose_row_groups(layer, 1, hq, splits, wsplits, context)

        def fn(splits=splits, ws=ws, out=out, wsplits=wsplits, warps=warps, groups=groups):
            launch_attention(layer, step, q, k, v, out, scale, 0, splits, ws, window_splits=wsplits,
                             window_warps=warps, row_groups=groups)

        fn()
        torch.cuda.synchronize()
        err = (out.float() - expected).abs().max().item()
        times = [_time_us(fn) for _ in range(3)]
        print(f"{shape:>22} splits {history}+{wsplits}, window warps {warps}, row groups {groups}: {min(times):7.1f} us "
              f"(max {max(times):7.1f})  err {err:.1e}", flush=True)
