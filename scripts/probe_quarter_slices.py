"""Developer tool (GPU): the head_dim-64 history read as quarter slices (forty-seventh session) against the byte
path before it, alternating in one process; then row groups and window plans on the new path.

    cp <the kernel file of the commit before>  src/oscarkv/kernels/triton_attention_before.py   # untracked
    PYTHONPATH=src python scripts/probe_quarter_slices.py [layer] [model] [extra]

`layer`: one layer of SmolLM2-135M's shape (9 query / 3 KV heads, head_dim 64, group 64), shipped plan, before
and after, with each one's max abs error against the torch reference. `model`: whole random SmolLM2-135M INT2
steps (CUDA graphs), before and after, with BF16 beside them. `extra`: on the new path, row groups 2 and 4 and
other window plans.
"""
from __future__ import annotations

import sys

import torch

from oscarkv.benchmarks.attention import _time_us, decode_case
from oscarkv.kernels import ops, reference, triton_attention as new, triton_attention_before as before
from oscarkv.kernels.ops import COMBINE_CHANNELS, WindowPlan

NEW_LAUNCH = new.launch_attention
HQ, HKV, D, G = 9, 3, 64, 64


def use(old: bool) -> None:
    new.launch_attention = before.launch_attention if old else NEW_LAUNCH


def layer_ab():
    from ab_decode import layer_ab as alternate
    for b, ctx in ((1, 1000), (1, 4000), (1, 32000), (8, 4000), (32, 4000), (128, 4000), (256, 4000), (64, 8000),
                   (16, 2000)):
        alternate(decode_case(b, ctx, query_heads=HQ, kv_heads=HKV, head_dim=D, group=G), HQ, ctx, use, "smol")
        torch.cuda.empty_cache()


def extra():
    """Row groups and window plans on the new path."""
    dev = torch.device("cuda")
    for b, ctx in ((1, 32000), (32, 4000), (128, 4000), (256, 4000)):
        case = decode_case(b, ctx, query_heads=HQ, kv_heads=HKV, head_dim=D, group=G)
        ref = reference.attention_reference(case.layer, case.step, case.q, case.k_new, case.v_new, D ** -0.5, 0)
        splits = ops.choose_splits(case.layer, b, 1, HQ, ctx, dev)
        shipped = ops.window_plan(case.layer, b, 1, HQ, splits, ctx, dev)
        out = torch.empty_like(case.q)
        res = []
        for name, rg, plan in (("shipped", 1, shipped), ("rg2", 2, shipped), ("rg4", 4, shipped),
                               ("W1/2/32", 1, WindowPlan(1, 2, 32)), ("W2/4/64", 1, WindowPlan(2)),
                               ("rg2 W1/2/32", 2, WindowPlan(1, 2, 32))):
            total = splits - shipped.splits + plan.splits
            ws = (torch.empty(b, HQ, total, D, dtype=torch.float32, device=dev),
                  torch.empty(b, HQ, total, dtype=torch.float32, device=dev))

            def step(total=total, ws=ws, rg=rg, plan=plan):
                new.launch_attention(case.layer, case.step, case.q, case.k_new, case.v_new, out, D ** -0.5, 0,
                                     total, ws, window_splits=plan.splits, window_warps=plan.warps,
                                     window_block_n=plan.block_n, row_groups=rg,
                                     combine_d_block=min(COMBINE_CHANNELS, D))
            try:
                step()
                err = (out.float() - ref.float()).abs().max().item()
                res.append(f"{name} {_time_us(step):6.1f}" + (f" ERR {err:.1e}" if err > 1e-2 else ""))
            except Exception as exc:  # noqa: BLE001 - reported, the others still run
                res.append(f"{name} fail {type(exc).__name__}")
        print(f"EXTRA {b}x{ctx} (h{splits - shipped.splits} {shipped}): " + " | ".join(res), flush=True)
        torch.cuda.empty_cache()


def model_ab():
    from ab_decode import model_ab as alternate
    alternate("random:smollm2-135m", ((1, 4000), (1, 7900), (8, 4000), (32, 4000), (256, 4000)), use)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    if "layer" in sys.argv:
        layer_ab()
    if "extra" in sys.argv:
        extra()
    if "model" in sys.argv:
        model_ab()
