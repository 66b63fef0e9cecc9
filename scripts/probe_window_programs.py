"""Developer tool (GPU): one-warp window programs beside the history programs, and the combine's channels.

A decode step's history launch fills each multiprocessor with about 8 one-warp programs (about 200
registers each); a four-warp window program (168 registers a thread) does not fit beside them, so the
window launch runs when history programs end. A one-warp window program reading 16-key blocks takes
about 167 registers and fits beside them (Triton 3.9's compile for sm_90). `ops.window_plan` takes it
where the history splits are long (`ops._one_warp_windows`), and the combine merges
`ops.COMBINE_CHANNELS` channels per program. This probe times, in the same process:

1. one attention layer (Qwen3 shapes, `bench attention`'s random cache): the plan as shipped; the plan
   before (four-warp window programs, one combine program per row); one-warp windows with several split
   counts; and a copy that moves the same bytes;
2. whole static decode steps (CUDA graphs, `bench decode`'s random model and cache): the plan as shipped
   against the plan before, alternating, three times each.

    PYTHONPATH=src python scripts/probe_window_programs.py [--model random:qwen3-4b] [--steps 48]

data/window-programs-h100.txt holds its runs.
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case, same_bytes_copy_us
from oscarkv.benchmarks.decode import decode_run, weight_bytes
from oscarkv.kernels import ops, reference
from oscarkv.kernels.ops import WindowPlan
from oscarkv.kernels.triton_attention import launch_attention

SHAPES = ((1, 32768), (1, 100000), (1, 131072), (32, 8192), (32, 32768))
STEPS = ((1, 100000), (1, 30000), (32, 32768))


@contextmanager
def plan_before():
    """The launch plan before the one-warp windows and the split combine (four-warp windows, 2 of them per
    sequence and KV head at batch 5-33, one combine program per row)."""
    saved = ops.ONE_WARP_WINDOW_BLOCK, ops.COMBINE_CHANNELS
    ops.ONE_WARP_WINDOW_BLOCK, ops.COMBINE_CHANNELS = None, 1 << 30
    try:
        yield
    finally:
        ops.ONE_WARP_WINDOW_BLOCK, ops.COMBINE_CHANNELS = saved


def layer_us(case, batch: int, context: int, plan: WindowPlan | None, combine: int | None) -> tuple[float, float]:
    """(µs, max abs error) of one decode layer; plan None: `ops.window_plan`'s; combine None: COMBINE_CHANNELS."""
    layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
    hq, d = q.shape[1], q.shape[2]
    scale = d ** -0.5
    chosen = ops.choose_splits(layer, batch, 1, hq, context, q.device)
    rule = ops.window_plan(layer, batch, 1, hq, chosen, context, q.device)
    plan = plan or rule
    splits = chosen - rule.splits + plan.splits
    groups = ops.choose_row_groups(layer, 1, hq, splits, plan.splits, context)
    out = torch.empty_like(q)
    work = (torch.empty(batch, hq, splits, d, dtype=torch.float32, device=q.device),
            torch.empty(batch, hq, splits, dtype=torch.float32, device=q.device))

    def fn():
        launch_attention(layer, step, q, k, v, out, scale, 0, splits, work, window_splits=plan.splits,
                         row_groups=groups, window_warps=plan.warps, window_block_n=plan.block_n,
                         combine_d_block=min(combine or ops.COMBINE_CHANNELS, d))

    fn()
    err = (out.float() - reference.attention_reference(layer, step, q, k, v, scale).float()).abs().max().item()
    return min(_time_us(fn) for _ in range(3)), err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-4b")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    for batch, context in SHAPES:
        case = decode_case(batch, context)
        nbytes = decode_bytes(case, context)
        with plan_before():
            before = ops.window_plan(case.layer, batch, 1, 32, ops.choose_splits(case.layer, batch, 1, 32, context,
                                                                                    device), context, device)
        variants = {"shipped": (None, None), "before": (before, 1 << 30)}
        for ws in ((4, 8, 16) if batch == 1 else (1, 2, 4)):
            variants[f"1 warp, {ws} splits"] = (WindowPlan(ws, 1, 16), None)
        for name, (plan, combine) in variants.items():
            us, err = layer_us(case, batch, context, plan, combine)
            print(f"{batch:3d}x{context:<7d} {name:24s} {us:8.1f} us  {nbytes / us / 1e3 / copy_gbs:6.1%} of copy BW  "
                  f"err {err:.1e}", flush=True)
        copy_us = same_bytes_copy_us(nbytes, device)
        print(f"{batch:3d}x{context:<7d} {'copy of the same bytes':24s} {copy_us:8.1f} us  "
              f"{nbytes / copy_us / 1e3 / copy_gbs:6.1%} of copy BW", flush=True)
        del case
        torch.cuda.empty_cache()
    from oscarkv.models import load_model

    model, _ = load_model(args.model, device="cuda", dtype=torch.bfloat16)
    weights = weight_bytes(model)
    for batch, context in STEPS:
        times = {"shipped": [], "before": []}
        for _ in range(3):
            times["shipped"].append(decode_run(model, "int2", batch, context, args.steps, weights, copy_gbs).step_ms)
            with plan_before():
                times["before"].append(decode_run(model, "int2", batch, context, args.steps, weights, copy_gbs).step_ms)
        print(f"whole step, INT2, batch {batch} x {context}: " + "; ".join(
            f"{n}: " + ", ".join(f"{t:.3f}" for t in ts) + " ms" for n, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
