"""Developer tool (GPU): the split combine's launch plan (channels per program, `ops.COMBINE_CHANNELS`, and warps,
`triton_attention.COMBINE_WARPS`), timed as whole CUDA-graph decode steps, the plans in turn in one process.
Qwen3-4B shape by default, random weights, batch 1, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_combine_plan.py [--contexts 100000] [--plans 32x4,16x4,32x8]
"""
import sys

sys.path.insert(0, "scripts")
from check_static_decode import ablation_arguments, sweep  # noqa: E402
from oscarkv.kernels import ops, triton_attention  # noqa: E402

args = ablation_arguments(plans="32x4,16x4,32x8")
shipped = ops.COMBINE_CHANNELS, triton_attention.COMBINE_WARPS


def using(channels: int, warps: int):
    def use():
        ops.COMBINE_CHANNELS, triton_attention.COMBINE_WARPS = channels, warps
    return use


sweep(args, {p: using(*map(int, p.split("x"))) for p in args.plans.split(",")})
ops.COMBINE_CHANNELS, triton_attention.COMBINE_WARPS = shipped
