"""Developer tool (GPU): the decode attention of a small model at batch 1 (SmolLM2-135M's shape: 9 query / 3 KV
heads, head_dim 64, group 64) under other launch plans: history warps, stages and splits, window programs (count,
warps, keys per block), the overlap of the launches; then per-launch durations (torch.profiler) and the BF16
dense attention over the same length. "default" is `ops.attend_step`'s plan. Written in the forty-fifth session
after the H200 timeline in docs/data/decode-timeline-h200-smollm2-s45.txt; its forty-sixth-session run (on main's
plan of then: four-warp history programs below four programs per multiprocessor) is section 1 of
docs/data/history-warps-h200.txt.

    PYTHONPATH=src python scripts/probe_small_model_windows.py [CONTEXT ...]
"""
from __future__ import annotations

import sys
import torch
from torch.profiler import profile, ProfilerActivity

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels.ops import COMBINE_CHANNELS, WindowPlan, attend_dense, choose_splits, window_plan
from oscarkv.kernels.triton_attention import launch_attention

HQ, HKV, D = 9, 3, 64


def run(case, history, plan, **kw):
    splits = history + plan.splits
    out = torch.empty_like(case.q)
    ws = (torch.empty(1, HQ, splits, D, dtype=torch.float32, device="cuda"),
          torch.empty(1, HQ, splits, dtype=torch.float32, device="cuda"))

    def step():
        launch_attention(case.layer, case.step, case.q, case.k_new, case.v_new, out, D ** -0.5, 0, splits, ws,
                         window_splits=plan.splits, window_warps=plan.warps, window_block_n=plan.block_n,
                         combine_d_block=min(COMBINE_CHANNELS, D), **kw)
    return step


def durations(fn, n=30):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ev.sort(key=lambda e: e.time_range.start)
    per = len(ev) // n
    out = []
    for j in range(per):
        xs = [ev[i * per + j] for i in range(n)]
        out.append((xs[0].name[:28], sorted(x.time_range.elapsed_us() for x in xs)[n // 2]))
    gaps = sorted(ev[i * per + per - 1].time_range.end - ev[i * per].time_range.start for i in range(n))[n // 2]
    return out, gaps


def main(contexts):
    print(torch.cuda.get_device_name(), flush=True)
    for ctx in contexts:
        case = decode_case(1, ctx, query_heads=HQ, kv_heads=HKV, head_dim=D, group=64)
        dev = torch.device("cuda")
        chosen = choose_splits(case.layer, 1, 1, HQ, ctx, dev)
        default = window_plan(case.layer, 1, 1, HQ, chosen, ctx, dev)
        history = chosen - default.splits
        print(f"== 1x{ctx}: history splits {history}, default {default}", flush=True)
        variants = [("default", history, default, {}),
                    ("no overlap", history, default, dict(overlap=False)),
                    ("window first", history, default, dict(window_first=True)),
                    ("history 1 warp", history, default, dict(num_warps=1)),
                    ("history 2 warps", history, default, dict(num_warps=2)),
                    ("hist stages 2", history, default, dict(num_stages=2)),
                    ("win 4", history, WindowPlan(4), {}),
                    ("win 16", history, WindowPlan(16), {}),
                    ("win 1", history, WindowPlan(1), {}),
                    ("win 8 1w b16", history, WindowPlan(8, 1, 16), {}),
                    ("win 16 1w b16", history, WindowPlan(16, 1, 16), {}),
                    ("win 8 2w", history, WindowPlan(8, 2), {}),
                    ("win 8 b32", history, WindowPlan(8, 4, 32), {}),
                    ("win 16 b32", history, WindowPlan(16, 4, 32), {}),
                    ("win 16 1w b32", history, WindowPlan(16, 1, 32), {}),
                    ("hist/2", max(1, history // 2), default, {}),
                    ("hist/4", max(1, history // 4), default, {}),
                    ("hist/2 1 warp", max(1, history // 2), default, dict(num_warps=1)),
                    ("no overlap 1 warp", history, default, dict(overlap=False, num_warps=1)),
                    ]
        for name, h, plan, kw in variants:
            try:
                fn = run(case, h, plan, **kw)
                fn()
                us = _time_us(fn)
                us2 = _time_us(fn)
            except Exception as exc:  # noqa: BLE001 - a plan that does not compile is reported and skipped
                print(f"  {name:20s} failed {type(exc).__name__}: {str(exc)[:150]}", flush=True)
                continue
            print(f"  {name:20s} h={h:3d} {plan}: {us:6.1f} {us2:6.1f} us", flush=True)
        for name, h, plan, kw in variants[:2] + variants[3:4] + variants[6:7]:
            try:
                d, span = durations(run(case, h, plan, **kw))
            except Exception as exc:  # noqa: BLE001
                print("  profile failed", exc)
                continue
            print(f"  profile {name}: span {span:.1f} us; " + ", ".join(f"{n} {u:.1f}" for n, u in d), flush=True)
        # the BF16 baseline's attention over a dense cache of the same length
        keys = torch.randn(1, HKV, ctx, D, device=dev, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        slots = torch.zeros(1, dtype=torch.int64, device=dev)
        lengths = torch.full((1,), ctx, dtype=torch.int64, device=dev)

        def f(q=case.q, keys=keys, values=values, slots=slots, lengths=lengths, ctx=ctx):
            return attend_dense(q, keys, values, slots, lengths, D ** -0.5, max_context=ctx)

        f()
        print(f"  bf16 dense attention: {_time_us(f):6.1f} us", flush=True)
        d, span = durations(f)
        print(f"  profile bf16 dense: span {span:.1f}; " + ", ".join(f"{n} {u:.1f}" for n, u in d), flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main([int(c) for c in sys.argv[1:]] or [4000])
