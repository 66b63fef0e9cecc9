"""Developer tool (GPU): one decode layer through `ops.attend_step`, its history launch capped by the rule
(`ops.history_registers`) and uncapped, alternating in one process.

    PYTHONPATH=src python scripts/probe_history_registers.py [--shapes 1x131072,32x8192] [--rounds 3]

Prints per shape the rule's cap, the times of both (µs, CUDA graphs, best of the rounds and all rounds),
the fraction of the measured copy bandwidth and the outputs' max abs difference from the torch reference.
"""

from __future__ import annotations

import argparse

import torch

from oscarkv.benchmarks.attention import _time_us, copy_bandwidth_gbs, decode_bytes, decode_case
from oscarkv.kernels import ops, reference

SHAPES = "1x8192,1x32768,1x65536,1x100000,1x131072,4x32768,8x32768,16x32768,32x8192,32x32768,64x4096,64x8192"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {copy:.0f} GB/s")
    for shape in args.shapes.split(","):
        print(probe_shape(shape, copy, args.rounds), flush=True)
        torch.cuda.empty_cache()


def probe_shape(shape: str, copy: float, rounds: int) -> str:
    device = torch.device("cuda")
    rule = ops.history_registers
    batch, context = (int(x) for x in shape.split("x"))
    case = decode_case(batch, context)
    layer, step, q, k, v = case.layer, case.step, case.q, case.k_new, case.v_new
    scale = 128 ** -0.5
    splits = ops.choose_splits(layer, batch, 1, 32, context, device)
    plan = ops.window_plan(layer, batch, 1, 32, splits, context, device)
    groups = ops.choose_row_groups(layer, 1, 32, splits, plan.splits, context)
    cap = rule(layer, batch, 1, 32, splits, plan, groups, device)
    out = torch.empty_like(q)
    workspace = (torch.empty(batch, 32, splits, 128, dtype=torch.float32, device=device),
                 torch.empty(batch, 32, splits, dtype=torch.float32, device=device))
    expected = reference.attention_reference(layer, step, q, k, v, scale)

    def run(capped: bool) -> None:
        ops.history_registers = rule if capped else (lambda *a, **kw: None)
        try:
            ops.attend_step(layer, step, q, k, v, scale, num_splits=splits, out=out, workspace=workspace,
                            validate=False)
        finally:
            ops.history_registers = rule

    times: dict[bool, list[float]] = {False: [], True: []}
    errors = {}
    for capped in (False, True):
        run(capped)
        errors[capped] = (out.float() - expected).abs().max().item()
    for _ in range(rounds):
        for capped in (False, True):
            times[capped].append(_time_us(lambda capped=capped: run(capped)))
    nbytes = decode_bytes(case, context)
    line = [f"{shape:>9} splits {splits:3d} (windows {plan.splits}, {plan.warps} warps, groups {groups}) cap {cap}"]
    for capped, label in ((False, "uncapped"), (True, "rule")):
        best = min(times[capped])
        line.append(f"{label} {best:7.1f} us {nbytes / best / 1e3 / copy:5.1%} "
                    f"[{', '.join(f'{t:.1f}' for t in times[capped])}] err {errors[capped]:.1e}")
    return "  ".join(line)


if __name__ == "__main__":
    main()
