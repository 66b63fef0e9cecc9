"""Developer tool (GPU): launch plans of the batch-1 query/key launch (`triton_decode_qk.launch_plan`: R_K columns
per program and warps), timed as whole CUDA-graph decode steps, the plans in turn in one process
(docs/data/decode-qk-plan-h100.txt). Qwen3-4B shape by default, random weights, batch 1, INT2 (Hadamard).

    PYTHONPATH=src:scripts python scripts/probe_decode_qk_plan.py [--contexts 100000] [--plans 32x4,16x1,8x1]
"""
import sys

sys.path.insert(0, "scripts")
from check_static_decode import ablation_arguments, sweep  # noqa: E402
from oscarkv.kernels import triton_decode_qk  # noqa: E402

args = ablation_arguments(plans="32x4,16x1")
shipped = triton_decode_qk.launch_plan


def using(columns: int, warps: int):
    def plan(rows: int, d: int) -> tuple[int, int, int]:
        return (1, min(d, columns), warps) if rows == 1 else shipped(rows, d)

    def use():
        triton_decode_qk.launch_plan = plan
    return use


sweep(args, {p: using(*map(int, p.split("x"))) for p in args.plans.split(",")})
triton_decode_qk.launch_plan = shipped
