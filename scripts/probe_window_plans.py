"""Developer tool (GPU): one layer's decode step (`ops.attend_step`) over window plans, the history splits of the
shipped plan, the window programs merging the splits (`triton_attention.merges_in_windows`, allowed here up to 8
window splits); the shipped plan first (marked *), then the others, alternating, best of three CUDA-graph timings,
µs and the max abs error against the reference. Qwen3 shapes (32 query / 8 KV heads, D 128).

    PYTHONPATH=src python scripts/probe_window_plans.py 32x32768,64x8192 1/1/16,1/2/32,2/4/64

A plan is splits/warps/keys per block (`ops.WindowPlan`)."""
import sys

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels import gluon_history, reference, triton_attention
from oscarkv.kernels.ops import WindowPlan, attend_step, choose_splits, window_plan

triton_attention.MAX_MERGE_WINDOW_SPLITS = 8
PLANS = [WindowPlan(*(int(x) for x in p.split("/"))) for p in sys.argv[2].split(",")]
copy = copy_bandwidth_gbs(torch.device("cuda"))
for spec in sys.argv[1].split(","):
    batch, context = (int(x) for x in spec.split("x"))
    case = decode_case(batch, context)
    gluon = gluon_history.takes(case.layer, case.step, 32, 0, case.q.device)
    splits = choose_splits(case.layer, batch, 1, 32, context, case.q.device, gluon=gluon)
    shipped = window_plan(case.layer, batch, 1, 32, splits, context, case.q.device, gluon=gluon)
    history = splits - shipped.splits
    ref = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5).float()
    out = torch.zeros_like(case.q)
    plans = [shipped] + [p for p in PLANS if p != shipped]

    def make(plan):
        n = history + plan.splits
        work = (torch.empty(batch, 32, n, 128, dtype=torch.float32, device="cuda"),
                torch.empty(batch, 32, n, dtype=torch.float32, device="cuda"))
        return lambda: attend_step(case.layer, case.step, case.q, case.k_new, case.v_new, 128 ** -0.5, num_splits=n,
                                   out=out, workspace=work, validate=False, window_splits=plan)

    fns = [make(p) for p in plans]
    times = [[] for _ in plans]
    errs = [0.0] * len(plans)
    for rnd in range(3):
        for i, fn in enumerate(fns):
            out.zero_()
            fn(); torch.cuda.synchronize()
            errs[i] = (out.float() - ref).abs().max().item()
            times[i].append(_time_us(fn))
    nbytes = decode_bytes(case, context)
    print(f"{spec:>10} history {history:3d}: " + "  ".join(
        f"{p.splits}/{p.warps}/{p.block_n or 64}{'*' if j == 0 else ''} {min(t):6.1f} ({err:.0e})"
        for j, (p, t, err) in enumerate(zip(plans, times, errs))), flush=True)
    case = None
    torch.cuda.empty_cache()
