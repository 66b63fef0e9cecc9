"""Developer tool (GPU): one-warp window programs that fit beside the history programs.

A decode step's history launch fills each multiprocessor with 8 one-warp programs (about 200 registers
each); a four-warp window program (168 registers a thread) does not fit beside them, so the window
launch runs when history programs end, in the step's tail. A one-warp window program reading 16-key
blocks takes about 167 registers and fits beside them (Triton 3.9's compile for sm_90). This probe
times, in the same process:

1. one attention layer (Qwen3 shapes, `bench attention`'s random cache): the launch plan as shipped
   against one-warp windows with several window-split counts, and the combine with 32 channels per
   program; with the time of a copy that moves the same bytes;
2. whole static decode steps (CUDA graphs, `bench decode`'s random model and cache), the shipped plan
   against the best one-warp plan of part 1, alternating, three times each.

    PYTHONPATH=src python scripts/probe_window_programs.py [--model random:qwen3-4b]
"""
from __future__ import annotations

import argparse

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case, same_bytes_copy_us
from oscarkv.benchmarks.decode import decode_run, weight_bytes
from oscarkv.kernels import ops, reference
from oscarkv.kernels.triton_attention import launch_attention

SHAPES = ((1, 32768), (1, 100000), (1, 131072), (32, 8192), (32, 32768))


def layer_variants(batch: int) -> dict[str, dict]:
    """name -> (window splits or None for the rule, window warps, window block, combine channels)."""
    shipped = dict(ws=None, warps=4, block=None, combine=None)
    out = {"shipped": shipped}
    for ws in ((4, 8, 16) if batch == 1 else (1, 2, 4)):
        out[f"1 warp, {ws} splits"] = dict(ws=ws, warps=1, block=16, combine=None)
    out["shipped, combine 32"] = dict(shipped, combine=32)
    return out


def time_layer(case, batch: int, context: int, variant: dict) -> tuple[float, float]:
    layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
    hq, d = q.shape[1], q.shape[2]
    scale = d ** -0.5
    chosen = ops.choose_splits(layer, batch, 1, hq, context, q.device)
    rule_ws = ops.window_split_count(layer, batch, 1, hq, chosen, q.device)
    ws = variant["ws"] or rule_ws
    splits = chosen - rule_ws + ws
    groups = ops.choose_row_groups(layer, 1, hq, splits, ws, context)
    out = torch.empty_like(q)
    work = (torch.empty(batch, hq, splits, d, dtype=torch.float32, device=q.device),
            torch.empty(batch, hq, splits, dtype=torch.float32, device=q.device))

    def fn():
        launch_attention(layer, step, q, k, v, out, scale, 0, splits, work, window_splits=ws, row_groups=groups,
                         window_warps=variant["warps"], window_block_n=variant["block"],
                         combine_d_block=variant["combine"])

    fn()
    err = (out.float() - reference.attention_reference(layer, step, q, k, v, scale).float()).abs().max().item()
    times = [_time_us(fn) for _ in range(3)]
    return min(times), err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-4b")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    best = {}
    for batch, context in SHAPES:
        case = decode_case(batch, context)
        nbytes = decode_bytes(case, context)
        copy_us = same_bytes_copy_us(nbytes, device)
        row = {}
        for name, variant in layer_variants(batch).items():
            us, err = time_layer(case, batch, context, variant)
            row[name] = us
            print(f"{batch:3d}x{context:<7d} {name:24s} {us:8.1f} us  {nbytes / us / 1e3 / copy_gbs:6.1%} of copy BW  "
                  f"err {err:.1e}", flush=True)
            torch.cuda.empty_cache()
        print(f"{batch:3d}x{context:<7d} {'copy of the same bytes':24s} {copy_us:8.1f} us  "
              f"{nbytes / copy_us / 1e3 / copy_gbs:6.1%} of copy BW", flush=True)
        del case
        torch.cuda.empty_cache()
        one_warp = {n: t for n, t in row.items() if n.startswith("1 warp")}
        best[batch] = min(one_warp, key=one_warp.get)
    # whole steps: the shipped plan against the best one-warp plan of the longest context of each batch
    model, _ = load_model(args.model)
    weights = weight_bytes(model)
    saved = (ops.WINDOW_WARPS, ops.WINDOW_BLOCK_N, ops.SMALL_BATCH_WINDOW_SPLITS, ops.MID_BATCH_WINDOW_SPLITS,
             ops.SMALL_BATCH_WINDOW_PROGRAMS)

    def use(name: str, batch: int) -> None:
        ops.WINDOW_WARPS, ops.WINDOW_BLOCK_N, ops.SMALL_BATCH_WINDOW_SPLITS, ops.MID_BATCH_WINDOW_SPLITS, \
            ops.SMALL_BATCH_WINDOW_PROGRAMS = saved
        if name != "shipped":
            ws = layer_variants(batch)[name]["ws"]
            ops.WINDOW_WARPS, ops.WINDOW_BLOCK_N = 1, 16
            ops.SMALL_BATCH_WINDOW_SPLITS, ops.SMALL_BATCH_WINDOW_PROGRAMS = ws, 0  # batch 1: ws per KV head
            ops.MID_BATCH_WINDOW_SPLITS = ws

    for batch, context in ((1, 100000), (1, 30000), (32, 32768)):
        names = ("shipped", best[batch])
        times = {n: [] for n in names}
        for _ in range(3):
            for name in names:
                use(name, batch)
                times[name].append(decode_run(model, "int2", batch, context, args.steps, weights, copy_gbs).step_ms)
        use("shipped", batch)
        print(f"whole step, INT2, batch {batch} x {context}: " + "; ".join(
            f"{n}: " + ", ".join(f"{t:.3f}" for t in ts) + " ms" for n, ts in times.items()), flush=True)


def load_model(name: str):
    from oscarkv.models import load_model as load

    return load(name, device="cuda", dtype=torch.bfloat16)


if __name__ == "__main__":
    main()
